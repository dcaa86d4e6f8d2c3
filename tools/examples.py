"""Example graphs shared by the command line, the benchmarks and the tests."""
from __future__ import annotations

import torch

from .. import Graph
from ..tasks import TASK_TYPES

# packed bytes of quantized weights (uint8 inputs) are random below it: any float16 or fp8 they make is finite
PACKED_BYTE_BOUND = 0x3C
INDEX_BOUND = 40  # the examples' integer inputs are indices (tokens, positions): any value below it is valid
# every_task_type's examples in this many kernels, for the compile tests: a kernel's compile time grows faster
# than its tiles (on this 2-core VM, one kernel of every tile took 69 s for sm_90 and 61 s for gfx942; five, 21
# and 17 s in all)
EVERY_TASK_PARTS = 5


def every_task_type(part: int = 0, parts: int = 1) -> Graph:
    """A small graph whose kernel has every task type of the library and every variant of its tile in
    it: the examples the task types registered (each once; a family's types may share one), each
    in a scope named after its first type, their results the graph's outputs. With ``parts`` > 1, part
    ``part`` of them: examples part, part + parts, ... (the parts together hold every one)."""
    if not (0 <= part < parts):
        raise ValueError(f"part {part!r} of {parts!r}: need 0 <= part < parts")
    g = Graph(world_size=1, rank=0)
    examples = {}
    for task_type in TASK_TYPES.values():
        examples.setdefault(task_type.example, task_type.name)
    for example, name in list(examples.items())[part::parts]:
        with g.scope(name):
            for i, result in enumerate(example(g)):
                g.output(f"{name}.{i}", result)
    return g


def example_inputs(g: Graph, seed: int = 0) -> dict[str, torch.Tensor]:
    """Values for every input of ``every_task_type()``: random normal floats; packed bytes (uint8) random
    below PACKED_BYTE_BOUND; other integers are indices counting down from INDEX_BOUND - 1, the largest
    valid one (an attention over it takes more than one step of its partial tile), element by element:
    distinct within an input, so that a block table's rows hold pages of their own (two rows appending
    into one page would race, as no real table does)."""
    gen = torch.Generator().manual_seed(seed)

    def indices(shape) -> torch.Tensor:
        count = torch.Size(shape).numel()
        return (INDEX_BOUND - 1 - torch.arange(count) % INDEX_BOUND).reshape(shape)

    return {name: (torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) if t.dtype.is_floating_point
                   else torch.randint(0, PACKED_BYTE_BOUND, t.shape, generator=gen, dtype=t.dtype)
                   if t.dtype == torch.uint8 else indices(t.shape).to(t.dtype))
            for name, t in g.inputs.items()}


def mlp_block(hidden: int = 128, intermediate: int = 320, batch: int = 1, dtype=torch.float32) -> Graph:
    """RMSNorm -> gate/up projections -> SiLU-mul -> down projection -> residual (a Llama MLP block)."""
    g = Graph(world_size=1, rank=0)
    x = g.input("x", (batch, hidden), dtype)
    norm = g.input("norm", (hidden,), dtype)
    gate = g.input("gate", (intermediate, hidden), dtype)
    up = g.input("up", (intermediate, hidden), dtype)
    down = g.input("down", (hidden, intermediate), dtype)
    h = g.rms_norm(x, norm, 1e-6)
    act = g.silu_mul(g.linear(h, gate), g.linear(h, up))
    g.output("y", g.add(x, g.linear(act, down)))
    return g


def across_nodes(world_size: int = 4, ranks_per_node: int = 2, dtype=torch.bfloat16) -> Graph:
    """Rank 0's view of a tensor-parallel block over nodes: a linear, then every collective across the
    nodes (hierarchical all-reduce, all-gather, reduce-scatter): the kernel whose put tiles and signals
    reach ranks of other nodes, for ``megakernel aot --transport nvshmem``."""
    g = Graph(world_size=world_size, rank=0, ranks_per_node=ranks_per_node)
    x = g.input("x", (1, 256), dtype)
    w = g.input("w", (512, 256), dtype)
    y = g.linear(x, w)
    g.output("all_reduce", g.all_reduce(y))
    g.output("all_gather", g.all_gather(y, dim=1))
    g.output("reduce_scatter", g.reduce_scatter(y, dim=1))
    return g
