"""Ahead-of-time compilation of a generated megakernel for a GPU target, without a GPU.

The interpreter accepts code the compiler rejects (``break``, recursion, plain-Python calls), so
every kernel is also compiled for NVIDIA and AMD targets on the host: ``triton.compile`` on an
``ASTSource`` gives PTX/cubin or AMDGCN/hsaco.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import codegen
from .scheduler import Spec

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
}


@dataclass
class Compiled:
    target: str
    binary: str          # "cubin" or "hsaco"
    size: int            # bytes of the binary
    shared: int          # bytes of shared memory (LDS) per program


def compile_kernel(specs: list[Spec], target: str, row_words: int, trace: bool = False) -> Compiled:
    """Compile the megakernel for ``specs`` for ``target`` (a key of ``TARGETS``), with or without tracing."""
    gpu = TARGETS[target]
    kernel = codegen.load_kernel(codegen.kernel_path(specs, gpu.backend))
    signature = {name: "i64" for name in codegen.KERNEL_ARGS}
    signature.update(ROW="constexpr", TRACE="constexpr")
    source = ASTSource(fn=kernel, signature=signature, constexprs={"ROW": row_words, "TRACE": trace})
    compiled = triton.compile(source, target=gpu)
    binary = "cubin" if gpu.backend == "cuda" else "hsaco"
    return Compiled(target, binary, len(compiled.asm[binary]), compiled.metadata.shared)
