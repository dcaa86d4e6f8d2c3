"""The ``megakernel`` command line."""
from __future__ import annotations

import argparse
import sys


def _disasm(args) -> int:
    from ..image import load
    from ..reference import execute
    from ..scheduler import disassemble

    image = load(args.file)
    print(disassemble(image.tables))
    if args.execute:
        if image.heap is None:
            print("--execute needs a kernel image (.npz from Megakernel.save_image), not a bare table",
                  file=sys.stderr)
            return 2
        execute(image.tables, image.heap)
        print("\nreference execution:")
        for name in image.outputs:
            value = image.output(name).double()
            print(f"  {name}: shape {tuple(value.shape)}, sum {value.sum().item():.6g}, "
                  f"first {value.flatten()[:4].tolist()}")
    return 0


def _aot(args) -> int:
    from ..aot import TARGETS, compile_kernel
    from .examples import every_task_type

    graph = every_task_type()
    for target in args.target or list(TARGETS):
        compiled = compile_kernel(graph.specs, target, row_words=32)
        print(f"{target}: {compiled.binary} {compiled.size} bytes, {compiled.shared} bytes shared, "
              f"{len(graph.specs)} opcodes")
    return 0


def _demo(args) -> int:
    from .demo import main as demo
    return demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megakernel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("disasm", help="print a kernel's queue tables; --execute runs the reference executor")
    p.add_argument("file", help="a kernel image (.npz from Megakernel.save_image) or a serialized table")
    p.add_argument("--execute", action="store_true", help="run the tables with the torch reference executor")
    p.set_defaults(run=_disasm)
    p = sub.add_parser("aot", help="compile a megakernel with every task type for GPU targets, without a GPU")
    p.add_argument("--target", action="append", choices=["sm_90", "gfx942"])
    p.set_defaults(run=_aot)
    p = sub.add_parser("demo", help="the main job: build, schedule and run a model block on the cpu backend")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="megakernel-demo", help="folder for the kernel image and generated source")
    p.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
