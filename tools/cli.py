"""The ``megakernel`` command line."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path

from ..aot import TARGETS, compile_kernel, unsupported_reason
from ..codegen import TRANSPORTS
from ..image import load
from ..launcher import RankError
from ..models.serving_config import POSITIVE, SERVER, ServingConfig
from ..occupancy import LIMITS, programs_per_unit
from ..reference import execute
from ..scheduler import disassemble
from ..trace import Trace
from .demo import QUESTION, main as demo
from .dot import RenderError, TooManyNodes, render, select, task_dag, to_dot
from .examples import across_nodes, every_task_type
from .plot import plot_timeline


def _disasm(args) -> int:
    image = load(args.file, heap=args.execute)
    print(disassemble(image.tables))
    if args.execute:
        if image.heap is None:
            print("--execute needs a kernel image (.npz from Megakernel.save_image), not a bare table",
                  file=sys.stderr)
            return 2
        if image.tables.world_size > 1:
            print(f"--execute runs one rank's image; this is rank {image.tables.rank} of "
                  f"{image.tables.world_size}, whose tiles store into the other ranks' heaps", file=sys.stderr)
            return 2
        execute(image.tables, image.heap)
        print("\nreference execution:")
        for name in image.outputs:
            value = image.output(name).double()
            print(f"  {name}: shape {tuple(value.shape)}, sum {value.sum().item():.6g}, "
                  f"first {value.flatten()[:4].tolist()}")
    return 0


def _aot(args) -> int:
    network = args.transport != "memory"  # built for NVIDIA only (codegen.TRANSPORTS)
    # a transport changes the comm tiles and signals alone: its kernel is the collectives across nodes
    graph = across_nodes() if network else every_task_type()
    targets = args.target or [t for t in TARGETS if not network or TARGETS[t].backend == "cuda"]
    for target in targets:
        reason = unsupported_reason(target)
        if reason is None and network and TARGETS[target].backend != "cuda":
            reason = f"the {args.transport} transport is built for NVIDIA targets; rocSHMEM's bitcode is not on PyPI"
        if reason is not None:
            print(f"{target}: not supported ({reason})")
            continue
        compiled = compile_kernel(graph.specs, target, row_words=32, protocol=args.protocol, transport=args.transport)
        limits = LIMITS[target]
        per_unit = programs_per_unit(limits, compiled.resources)
        print(f"{target}: {compiled.binary} {compiled.size} bytes, {compiled.registers} registers "
              f"({compiled.spilled} bytes spilled), {compiled.shared} bytes shared, {len(graph.specs)} opcodes; "
              f"{per_unit} programs per {limits.unit}, at most {per_unit * limits.units} workers on {limits.name}")
        if args.asm:
            path = Path(args.asm)
            if len(targets) > 1:  # one file per target: kernel.s -> kernel.sm_90.s
                path = path.with_name(f"{path.stem}.{target}{path.suffix}")
            path.write_text(compiled.assembly)
            print(f"  assembly ({'PTX' if compiled.binary == 'cubin' else 'AMDGCN'}): {path}")
    return 0


def _trace_summary(args: argparse.Namespace) -> int:
    print(Trace.load(args.file).summary(top=args.top))
    return 0


def _trace_plot(args: argparse.Namespace) -> int:
    if find_spec("matplotlib") is None:
        print("megakernel trace plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    print(f"wrote {plot_timeline(Trace.load(args.file), args.output)}")
    return 0


def _graph(args: argparse.Namespace) -> int:
    dag = task_dag([load(f, heap=False).tables for f in args.files])
    keep = select(dag, args.op, args.layer)
    if not keep:
        names = sorted({info.op for info in dag.tasks.values() if info.op})
        print(f"megakernel graph: no task matches the filters; op names: {', '.join(names[:12])}"
              f"{', ...' if len(names) > 12 else ''}", file=sys.stderr)
        return 2
    try:
        dot = to_dot(dag, keep, args.max_nodes)
    except TooManyNodes as error:
        print(f"megakernel graph: {error}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(dot)
        return 0
    try:
        render(dot, Path(args.output))
    except RenderError as error:
        print(f"megakernel graph: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megakernel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("disasm", help="print a kernel's queue tables; --execute runs the reference executor")
    p.add_argument("file", help="a kernel image (.npz from Megakernel.save_image) or a serialized table")
    p.add_argument("--execute", action="store_true", help="run the tables with the torch reference executor")
    p.set_defaults(run=_disasm)
    p = sub.add_parser("aot", help="compile a megakernel with every task type for GPU targets, without a GPU")
    p.add_argument("--target", action="append", choices=["sm_90", "sm_100", "gfx942", "gfx950"])
    p.add_argument("--asm", metavar="FILE", help="write the assembly (PTX / AMDGCN) there; with several targets "
                                                 "one file each (kernel.s -> kernel.sm_90.s)")
    p.add_argument("--protocol", choices=["poll", "spin"], help="the wait/signal protocol (default: poll where "
                                                                "this Triton has tl.atomic_poll)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default="memory",
                   help="how puts and signals reach ranks of other nodes; nvshmem: the kernel of the collectives across "
                        "nodes (tools.examples.across_nodes) linked with NVSHMEM's device library (pip install "
                        "nvidia-nvshmem-cu12; NVIDIA targets)")
    p.set_defaults(run=_aot)
    p = sub.add_parser("demo", help="the main job: SmolLM2 answering a question through the megakernel beside "
                                    "transformers (torch backend); --tensor-parallel: a random Llama over ranks on the "
                                    "cpu backend (the Triton tiles under the interpreter)")
    p.add_argument("--question", default=QUESTION, help="what SmolLM2 is asked")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="a random Llama, tensor-parallel over --ranks ranks, its trace and kernel image in --out")
    p.add_argument("--ranks", type=_count, default=2, help="with --tensor-parallel: ranks")
    p.add_argument("--workers", type=_count, default=None,
                   help="workers per rank (default: the backend's; 1 with --tensor-parallel)")
    p.add_argument("--tokens", type=_count, default=None,
                   help="tokens to generate (default: 32 for SmolLM2, 12 with --tensor-parallel)")
    p.add_argument("--backend", choices=["cpu", "torch"], default=None,
                   help="cpu: the Triton tiles under the interpreter; torch: each tile as torch code (fast). Default: "
                        "torch for SmolLM2, cpu with --tensor-parallel")
    p.add_argument("--out", default="megakernel-demo", help="with --tensor-parallel: folder for the trace and the "
                                                            "kernel image")
    p.set_defaults(run=demo)
    _add_serve_command(sub)
    _add_trace_commands(sub)
    _add_graph_command(sub)
    args = parser.parse_args(argv)
    command = " ".join(filter(None, [args.command, getattr(args, "trace_command", None)]))
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling of it (serve's, once it serves)
        print(f"megakernel {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a file that is not what it claims, an error of the library: one line
        where = ""
        if isinstance(error, RankError):  # the rank's own error, without its traceback
            where, error = f"rank {error.rank}: ", error.error
        print(f"megakernel {command}: {where}{type(error).__name__}: {error}", file=sys.stderr)
        return 1


def _count(text: str) -> int:
    """An argument that must be a positive int."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _serve(args: argparse.Namespace) -> int:
    for package in ("fastapi", "uvicorn"):
        if find_spec(package) is None:
            print(f"megakernel serve needs {package}: pip install 'megakernel[serve]'", file=sys.stderr)
            return 2
    from .serve import Options, serve

    path = Path(args.model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        print(f"megakernel serve: {args.model}: not a checkpoint directory or a .gguf file", file=sys.stderr)
        return 2
    serving = {f.name for f in fields(ServingConfig)}
    options = {name: value for name, value in vars(args).items() if name not in ("command", "run", *serving)}
    serve(Options(**options, serving=ServingConfig(**{name: getattr(args, name) for name in serving})))
    return 0


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (completions, chat, streaming)")
    p.add_argument("model", help="a checkpoint directory (save_pretrained's layout) or a GGUF file")
    p.add_argument("--tp", type=_count, default=1, help="tensor-parallel ranks (processes)")
    p.add_argument("--ranks-per-node", type=_count, help="the --tp ranks on nodes of this many, reaching the other "
                                                         "nodes through the transport (default: one node)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--backend", choices=["auto", "cpu", "torch", "cuda", "hip"], default="auto",
                   help="auto: the GPU if there is one, else torch (each tile as torch code: fast on a CPU); cpu: "
                        "the Triton interpreter (the tiles' own code, slow)")
    for f in fields(ServingConfig):  # the server's defaults: SERVER's (models.serving_config says why they differ)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(getattr(SERVER, f.name), bool):
            p.add_argument(flag, action="store_true", default=getattr(SERVER, f.name), help=f.metadata["help"])
        else:
            p.add_argument(flag, type=_count if f.name in POSITIVE else int, default=getattr(SERVER, f.name),
                           help=f.metadata["help"])
    p.add_argument("--steps-per-launch", type=_count, default=4, help="decode steps per launch at most")
    p.add_argument("--workers", type=_count, help="workers per rank (default: the backend's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the weights and activations in this float dtype (auto: as the checkpoint stores them)")
    p.add_argument("--dequantize", action="store_true", help="a GGUF file's weights as float32 (for the torch "
                                                             "backend, which unpacks quantized weights every step)")
    p.add_argument("--name", help="the model's id in the API (default: the file's stem or the folder's name)")
    p.add_argument("--max-request-bytes", type=_count, default=4 << 20,
                   help="a larger request body is refused (413) before it is read whole")
    p.add_argument("--max-connections", type=_count, default=512,
                   help="connections at once; past them a request is refused (503)")
    p.add_argument("--idle-timeout", type=_seconds, default=10.0,
                   help="seconds a connection may take to send a request's headers, or pause in its body")
    p.set_defaults(run=_serve)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def _add_trace_commands(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="read a trace (Trace.save, or the partial trace of a hang report)")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    p = commands.add_parser("summary", help="time per op, per worker, the critical path and the longest waits")
    p.add_argument("file", help="a trace .json")
    p.add_argument("--top", type=_count, default=5, help="how many critical-path tasks and waits to list")
    p.set_defaults(run=_trace_summary)
    p = commands.add_parser("plot", help="a Gantt chart: one row per worker, grouped per rank")
    p.add_argument("file", help="a trace .json")
    p.add_argument("-o", "--output", default="timeline.png", help="image file (.png, .svg, .pdf)")
    p.set_defaults(run=_trace_plot)


def _add_graph_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graph", help="the task DAG of kernel images as DOT (SVG/PNG with Graphviz's dot), "
                                     "critical path in red")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="kernel images (.npz from Megakernel.save_image) or serialized tables; one per rank "
                        "joins the ranks by their cross-rank edges")
    p.add_argument("-o", "--output", help="a .dot file, or .svg/.png/.pdf (needs dot); default: DOT on stdout")
    p.add_argument("--op", help="only tasks whose op name contains this")
    p.add_argument("--layer", type=int, help="only tasks of ops in scope layerN (op names like layerN/linear)")
    p.add_argument("--max-nodes", type=_count, default=5000, help="refuse to draw more tasks than this")
    p.set_defaults(run=_graph)


if __name__ == "__main__":
    sys.exit(main())
