"""Task types are declared by their module alone: the tile's signature, the registration."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

import megakernel as mk
from megakernel.tasks import TASK_TYPES, TaskType
from megakernel.tools.examples import every_task_type

# Two task types written as a user would, outside the package: a compute tile and a communication tile.
SCALED_COPY = '''
import torch
import triton
import triton.language as tl

from megakernel.device import heap_ptr
from megakernel.tasks.common import TaskType


@triton.jit
def scaled_copy_tile(base, out, x, cols, SCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    c = tl.arange(0, BLOCK_N)
    v = tl.load(heap_ptr(base, x, tl.float32) + c, mask=c < cols)
    tl.store(heap_ptr(base, out, tl.float32) + c, v * SCALE, mask=c < cols)


def _reference(heap, task):
    x = heap.tensor(task.x, torch.float32, 1, task.cols, task.cols)
    heap.tensor(task.out, torch.float32, 1, task.cols, task.cols).copy_(x * task.SCALE)


def scaled_copy(g, x, scale):
    out = g.new_tensor(x.shape, x.dtype)
    opcode = g.opcode(SCALED_COPY, SCALE=float(scale), BLOCK_N=triton.next_power_of_2(x.cols))
    g.add_task(opcode, out=out.addr(0, 0), x=x.addr(0, 0), cols=x.cols, reads=(x.region(0, 1, 0, x.cols),),
               writes=(out.region(0, 1, 0, x.cols),), bytes=8 * x.cols, flops=x.cols)
    return out


def _example(g):
    return (g.scaled_copy(g.input("scaled_copy.x", (24,), torch.float32), 3.0),)


SCALED_COPY = TaskType("scaled_copy", scaled_copy_tile, _reference, _example)
TASK_TYPES = (SCALED_COPY,)
OPS = {"scaled_copy": scaled_copy}
'''

PUT_NEGATED = '''
import torch
import triton
import triton.language as tl

from megakernel.device import heap_ptr, peer_ptr
from megakernel.tasks.common import TaskType


@triton.jit
def put_negated_tile(base, bases, dst, src, peer, cols, BLOCK_N: tl.constexpr):
    c = tl.arange(0, BLOCK_N)
    v = tl.load(heap_ptr(base, src, tl.float32) + c, mask=c < cols)
    tl.store(peer_ptr(bases, peer, dst, tl.float32) + c, -v, mask=c < cols)


def _reference(heap, task, peers):
    x = heap.tensor(task.src, torch.float32, 1, task.cols, task.cols)
    peers[task.peer].tensor(task.dst, torch.float32, 1, task.cols, task.cols).copy_(-x)


def put_negated(g, x, to_rank, into):
    opcode = g.opcode(PUT_NEGATED, BLOCK_N=triton.next_power_of_2(x.cols))
    target = into.region(0, 1, 0, x.cols)
    local = to_rank == g.rank
    g.add_task(opcode, dst=into.addr(0, 0), src=x.addr(0, 0), peer=to_rank, cols=x.cols,
               reads=(x.region(0, 1, 0, x.cols),), writes=(target,) if local else (),
               remote=() if local else ((to_rank, target),), bytes=8 * x.cols, flops=0)
    return into


def _example(g):
    x = g.input("put_negated.x", (24,), torch.float32)
    return (g.put_negated(x, 0, g.new_tensor((24,), torch.float32)),)


PUT_NEGATED = TaskType("put_negated", put_negated_tile, _reference, _example)
TASK_TYPES = (PUT_NEGATED,)
OPS = {"put_negated": put_negated}
'''

# Runs with the two modules in the library: every use of a task type reads it from its module.
USER_SCRIPT = '''
import json, sys
import torch
import megakernel as mk
from megakernel.aot import compile_kernel
from megakernel.heap import HeapView
from megakernel.reference import execute
from megakernel.scheduler import ARG0, disassemble
from megakernel.tools.examples import every_task_type

g = mk.Graph()
x = g.input("x", (24,), torch.float32)
g.output("y", g.scaled_copy(g.add(x, x), 3.0))
g.output("z", g.put_negated(x, 0, g.new_tensor((24,), torch.float32)))
value = torch.randn(24, generator=torch.Generator().manual_seed(3))
with mk.Megakernel(g, workers=2, backend="cpu", trace=True) as kernel:
    kernel.bind({"x": value})
    kernel.poison()
    heap = kernel.heap.clone()
    out = kernel.run()
    execute(kernel.tables, heap)
    reference = {name: HeapView(heap).tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride).reshape(t.shape)
                 for name, t in g.outputs.items()}
    comm = sorted({s.task_type for s in kernel.trace.spans if s.comm})
    listing = disassemble(kernel.tables)
types = {s.task_type for s in every_task_type().specs}
row = ARG0 + max(map(len, g.tasks.args))
registers = {target: compile_kernel(g.specs, target, row).registers for target in sys.argv[1:]}
print(json.dumps(dict(
    y=out["y"].tolist(), z=out["z"].tolist(), expected_y=(6 * value.double()).tolist(),
    expected_z=(-value).tolist(), reference_equal=all(torch.equal(out[n], reference[n]) for n in out),
    comm=comm, every_task_type="scaled_copy" in types and "put_negated" in types,
    listing="scaled_copy" in listing and "out=" in listing and "peer=0" in listing, registers=registers)))
'''


def test_a_new_task_type_is_one_module(tmp_path):
    """A compute and a communication type, each one module outside the package, registered through
    MEGAKERNEL_TASK_MODULES: graph ops, kernel (cpu backend), reference executor, disassembler, trace
    categories, the every-task-type kernel and the GPU compilers all take them with no other edit."""
    (tmp_path / "user_scaled_copy.py").write_text(textwrap.dedent(SCALED_COPY))
    (tmp_path / "user_put_negated.py").write_text(textwrap.dedent(PUT_NEGATED))
    env = dict(os.environ, MEGAKERNEL_TASK_MODULES="user_scaled_copy, user_put_negated",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", USER_SCRIPT, "sm_90", "gfx942"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert torch.allclose(torch.tensor(result["y"]), torch.tensor(result["expected_y"]).float(), rtol=1e-6)
    assert torch.equal(torch.tensor(result["z"]), torch.tensor(result["expected_z"]).float())
    assert result["reference_equal"] and result["every_task_type"] and result["listing"]
    assert result["comm"] == ["put_negated"]
    assert all(r > 0 for r in result["registers"].values()) and set(result["registers"]) == {"sm_90", "gfx942"}


@triton.jit
def _scale_tile(base, out, x, cols, SCALE: tl.constexpr):
    pass


@triton.jit
def _send_tile(base, bases, dst, peer, BLOCK: tl.constexpr):
    pass


def _nothing(*args):
    return ()


def test_the_signature_declares_the_row():
    compute = TaskType("scale", _scale_tile, _nothing, _nothing)
    assert compute.arg_names == ("out", "x", "cols") and compute.constexpr_names == ("SCALE",)
    assert not compute.needs_peers
    comm = TaskType("send", _send_tile, _nothing, _nothing)
    assert comm.arg_names == ("dst", "peer") and comm.constexpr_names == ("BLOCK",) and comm.needs_peers
    assert [name for name, t in TASK_TYPES.items() if t.needs_peers] == ["put", "routed_put"]


@triton.jit
def _no_base(heap, out):
    pass


@triton.jit
def _reserved_word(base, reads):
    pass


def test_bad_declarations_are_refused():
    with pytest.raises(TypeError, match="must start with base"):
        TaskType("bad", _no_base, _nothing, _nothing)
    with pytest.raises(TypeError, match="'reads' is a keyword of Graph.add_task"):
        TaskType("bad", _reserved_word, _nothing, _nothing)


def test_builders_pass_words_by_name():
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (1, 8), torch.float32)
    opcode = g.opcode(TASK_TYPES["embedding"], DTYPE=torch.float32, BLOCK_N=8)
    region = dict(reads=(), writes=(x.region(0, 1, 0, 8),), bytes=0, flops=0)
    words = dict(out=0, table=0, token=0, rows=1, cols=8, table_stride=8)
    with pytest.raises(mk.GraphError, match="task type embedding: missing argument word 'cols'"):
        g.add_task(opcode, **region, **{k: v for k, v in words.items() if k != "cols"})
    with pytest.raises(mk.GraphError, match="task type embedding: unknown argument word 'colour'"):
        g.add_task(opcode, **region, **words, colour=1)
    with pytest.raises(mk.GraphError, match="task type embedding: missing constexpr 'BLOCK_N'"):
        g.opcode(TASK_TYPES["embedding"], DTYPE=torch.float32)
    with pytest.raises(mk.GraphError, match="task type embedding: unknown constexpr 'EPS'"):
        g.opcode(TASK_TYPES["embedding"], DTYPE=torch.float32, BLOCK_N=8, EPS=1.0)
    g.add_task(opcode, **region, **words)
    assert g.tasks.args[-1] == (0, 0, 0, 1, 8, 8)


def test_every_task_type_comes_from_the_registry():
    assert {spec.task_type for spec in every_task_type().specs} == set(TASK_TYPES)
