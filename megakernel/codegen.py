"""Code generation: the persistent kernel for the task types a graph uses, cached by content hash.

The protocol loop is hand-written (``device.persistent_loop``); what a graph changes is only the
dispatch from opcode to tile function: each branch loads the row's argument words the tile's
signature declares and passes them, with the opcode's compile-time constants, by name. The generated
module is written once to ``<cache>/mk_<hash>.py`` (readable, importable by worker processes) and
reused by every kernel with the same specs and target. A cache file is trusted only as far as its
name: its content must hash to it, or it is written again (``kernel_path``) or refused
(``load_kernel``), and the cache folder must be writable by this user alone (``files.private_dir``).
"""
from __future__ import annotations

import hashlib
import linecache
import os
import sys
import threading
import types
from pathlib import Path

from . import device
from .device import CLOCKS, FENCES, PROTOCOLS
from .errors import BackendError, GraphError
from .files import private_dir, replace_with
from .layout import HeapLayout
from .scheduler import Spec
from .tasks import TASK_TYPES

TARGETS = tuple(CLOCKS)  # "interpreter", "cuda", "hip"
# How a kernel reaches its peers: by memory (mapped heaps; a host transport's shadows, ``transport``), or
# through a network library's device calls for the peers of other nodes (``shmem``): target -> its import
TRANSPORTS = {"memory": dict.fromkeys(TARGETS, ""),
              "nvshmem": {"cuda": "from megakernel.shmem import put_rows as network_put, signal as network_signal"}}
# Every argument is an int64, whatever its value (Triton would type a small int as int32), and none
# is specialised (a launch of 1 step must not compile another kernel): one compiled kernel serves every launch.
KERNEL_ARGS = ("bases_addr", "rank", "worker", "steps", "timeout_ns", *HeapLayout.offset_names())


def cache_dir() -> Path:
    root = os.environ.get("MEGAKERNEL_CACHE_DIR") or Path.home() / ".cache" / "megakernel"
    return Path(root) / "kernels"


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:24]


def _verified_source(path: Path) -> str | None:
    """The file's text if it hashes to its name (``mk_<digest>.py``), else None."""
    try:
        source = path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return source if path.stem == f"mk_{_digest(source)}" else None


def _constexpr_source(name: str, value) -> str:
    if name.endswith("DTYPE"):
        return f"tl.{value}"
    return repr(value)


def kernel_source(specs: list[Spec], target: str, protocol: str | None = None, transport: str = "memory") -> str:
    """The kernel module for ``specs`` on ``target``, with the wait/signal ``protocol``
    (``device.PROTOCOLS``; by default ``device.protocol()``), reaching peers through ``transport``
    (``TRANSPORTS``)."""
    protocol = device.protocol(protocol)
    if target not in CLOCKS:
        raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    if target not in TRANSPORTS.get(transport, {}):
        raise BackendError(f"transport {transport!r} is not built for target {target!r}; transports: " + "; ".join(
            f"{name} ({', '.join(targets)})" for name, targets in TRANSPORTS.items()))
    tiles = sorted({(TASK_TYPES[s.task_type].tile.fn.__module__, TASK_TYPES[s.task_type].tile.fn.__name__)
                    for s in specs})
    imports = "\n".join(f"from {module} import {name}" for module, name in tiles)
    branches = []
    for opcode, spec in enumerate(specs):
        task_type = TASK_TYPES[spec.task_type]
        if spec.arg_names != task_type.arg_names:  # tables made before the tile's signature changed
            raise GraphError(f"opcode {opcode} ({spec.label}) has argument words {', '.join(spec.arg_names)}; the "
                             f"tile of {spec.task_type} now takes {', '.join(task_type.arg_names)}")
        words = [f"{name}=tl.load(args + {i})" for i, name in enumerate(spec.arg_names)]
        consts = [f"{k}={_constexpr_source(k, v)}" for k, v in spec.constexprs]
        keyword = "if" if opcode == 0 else "elif"
        context = ["NETWORK" if name == "NETWORK_PUT" else name for name in task_type.context]
        call = f"{task_type.tile.fn.__name__}({', '.join([*context, *words, *consts])})"
        branches.append(f"    {keyword} opcode == {opcode}:\n        {call}")
    dispatch = "\n".join(branches) or "    pass"
    opcodes = "\n".join(f"    {opcode}: {spec.label}" for opcode, spec in enumerate(specs))
    params = ", ".join(f"{a}: tl.int64" for a in KERNEL_ARGS)
    loop_args = ", ".join(f"{a}=worker + tl.program_id(0)" if a == "worker" else f"{a}={a}" for a in KERNEL_ARGS)
    network = ("network_put", "network_signal") if transport != "memory" else ("None", "None")
    return f'''"""Persistent megakernel for target {target!r}, protocol {protocol!r}, transport {transport!r}, generated by megakernel.codegen; do not edit.

Opcodes:
{opcodes}
"""
import triton
import triton.language as tl

from megakernel.device import persistent_loop, {CLOCKS[target]}, {FENCES[target]}, {PROTOCOLS[protocol]}
{TRANSPORTS[transport][target]}
{imports}


@triton.jit
def run_tile(opcode, base, bases, status, args, NETWORK: tl.constexpr):
{dispatch}


@triton.jit(do_not_specialize={list(KERNEL_ARGS)!r})
def megakernel({params}, ROW: tl.constexpr, TRACE: tl.constexpr):
    """Program ``p`` of a launch is worker ``worker + p``: a GPU launches every worker in one grid with
    ``worker = 0``; the cpu backend runs each worker as its own grid of one."""
    persistent_loop({loop_args}, ROW=ROW, RUN_TILE=run_tile, CLOCK={CLOCKS[target]}, FENCE={FENCES[target]},
                    WAIT={PROTOCOLS[protocol]}, SCOPED_SIGNALS={protocol == "poll"},
                    RELAXED_ADDS={protocol == "poll" and target != "interpreter"}, TRACE=TRACE,
                    NETWORK_PUT={network[0]}, NETWORK_SIGNAL={network[1]})
'''


_lock = threading.Lock()  # virtual ranks (threads) write and import the same module at the same moment


def kernel_path(specs: list[Spec], target: str, protocol: str | None = None, transport: str = "memory") -> Path:
    """Write (once) and return the path of the generated kernel module for these specs, target, protocol and
    transport."""
    source = kernel_source(specs, target, protocol, transport)
    folder = private_dir(cache_dir())
    path = folder / f"mk_{_digest(source)}.py"
    with _lock:
        if _verified_source(path) != source:  # missing, truncated or changed: (re)write it whole
            replace_with(path, source)          # other processes writing the same source are harmless
    return path


def load_kernel(path: str | Path):
    """Import a generated kernel module by path, its content checked against its name (no bytecode cache
    is read or written); returns its ``megakernel`` function."""
    path = Path(path)
    name = path.stem
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            source = _verified_source(private_dir(path.parent) / path.name)
            if source is None:
                raise BackendError(f"kernel cache file {path} does not hash to its name: it changed after it was "
                                   f"written; remove it (the next kernel writes it again)")
            # triton reads the source of the module's functions through linecache: the verified text
            linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
            module = types.ModuleType(name)
            module.__file__ = str(path)
            sys.modules[name] = module
            try:
                exec(compile(source, str(path), "exec"), module.__dict__)
            except BaseException:
                del sys.modules[name]
                raise
    return module.megakernel
