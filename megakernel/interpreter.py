"""What the Triton interpreter of an older Triton needs to run this project's tiles with today's numpy.

Triton 3.6's interpreter (the GPU image's Triton) turns a scalar tensor into a Python int, where a tile
meets ``range`` or ``int`` (``for s in range(first, first + count)``), by ``int(array)`` of a
one-element array of one dimension, which numpy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars"); Triton 3.9 squeezes the array first. ``use_squeezed_index`` gives the
older interpreter 3.9's conversion, once, at import of ``megakernel.device``: nothing changes where
the interpreter already squeezes, and compiled kernels never see it.
"""
from __future__ import annotations

import inspect

from triton.runtime import interpreter


def use_squeezed_index() -> None:
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezed_index", False) or "squeeze()" in inspect.getsource(patch):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezed_index = True
    interpreter._patch_lang_tensor = patched
