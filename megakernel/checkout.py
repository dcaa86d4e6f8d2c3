"""A checkout used without an install: its ``tasks/``, ``scheduler/`` and ``tools/`` as this package's.

An install maps those folders to ``megakernel.tasks``, ``megakernel.scheduler`` and
``megakernel.tools`` (pyproject's ``package-dir``). Where only the tree is at hand (the GPU image:
no registry, the working tree copied, nothing installed), ``megakernel`` is found on ``sys.path``
(the repository root) and the three are found here, by the same mapping: a finder placed before the
others, so that they come from the checkout ``megakernel`` came from, even where another copy is
installed (an editable install's finder would map them to its own checkout).
"""
from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = {f"megakernel.{folder}": folder for folder in ("tasks", "scheduler", "tools")}  # pyproject's package-dir


class CheckoutFinder:
    """``megakernel.tasks`` -> ``ROOT/tasks`` (and so on); every other name is another finder's."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        if name not in SUBPACKAGES:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])


def use_checkout() -> None:
    """Find the subpackages in the checkout this package was imported from, if it was (once)."""
    is_checkout = (ROOT / "pyproject.toml").is_file() and all((ROOT / f / "__init__.py").is_file()
                                                             for f in SUBPACKAGES.values())
    if is_checkout and CheckoutFinder not in sys.meta_path:
        sys.meta_path.insert(0, CheckoutFinder)
