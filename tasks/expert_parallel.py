"""Expert parallelism: each rank holds some experts of a sparse MLP whole, and the ranks' parts of its sum
are combined on the device.

Which experts a rank holds is fixed when the graph is built (``Held.balanced``: consecutive ids, the
ranks' counts differing by at most one, stacked with zero experts after them so that every rank's heap has
one shape). Which rows travel is not: it is read from the router's table mid-step. ``combine`` keeps the
graph static all the same: every rank puts to every rank (``routed_put``: the rows of the tokens that
chose one of its experts, or none), so each receiver counts a fixed number of arrivals; ``routed_sum``
then adds, per token, the rows of the ranks it chose, in rank order: the same bits on every rank, whatever
arrives first. The experts' own tiles are ``moe``'s (``grouped_experts(..., expert_parallel=True)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device import heap_ptr, peer_ptr
from ..errors import is_count
from .common import TaskType, Tiling, load_block, next_power_of_2, require_float, store_block


@dataclass(frozen=True)
class Held:
    """The experts a rank serves: the router's ids ``first .. first + count``, stacked in its expert weights
    in that order, then zero experts up to ``stacked`` (under expert parallelism every rank's weights have
    one shape; no router picks a zero expert: it serves no id)."""

    first: int
    count: int
    stacked: int

    @classmethod
    def every(cls, experts: int) -> "Held":
        """All of them: a rank of tensor parallelism (each expert's share of columns) or a world of one."""
        return cls(0, experts, experts)

    @classmethod
    def balanced(cls, experts: int, rank: int, world: int) -> "Held":
        """Rank ``rank``'s experts under expert parallelism: consecutive ids, the ranks' counts differing by
        at most one (``expert_ranks``)."""
        first = rank * experts // world
        return cls(first, (rank + 1) * experts // world - first, -(-experts // world))


def expert_ranks(experts: int, world: int) -> tuple[int, ...]:
    """The rank that holds each expert under expert parallelism (``Held.balanced``)."""
    return tuple(((e + 1) * world - 1) // experts for e in range(experts))


def held_experts(g, op: str, count: int, expert_parallel: bool) -> Held:
    """The experts of ``count`` this rank serves in ``op``: all of them, or its own under expert parallelism."""
    g.require(isinstance(expert_parallel, bool), f"{op}: expert_parallel must be True or False, got {expert_parallel!r}")
    g.require(is_count(count) and (not expert_parallel or g.world_size <= count),
              f"{op}: {count!r} experts cannot be held whole by {g.world_size} ranks (at most one rank per expert)")
    return Held.balanced(count, g.rank, g.world_size) if expert_parallel else Held.every(count)


@triton.jit
def _chose(base, experts, rows, experts_stride, first, held, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_S: tl.constexpr):
    """int32 [BLOCK_M]: 1 where token i < rows chose one of the experts ``first .. first + held`` (its SLOTS
    ids in row i of the router's table from ``experts``), else 0."""
    rm = tl.arange(0, BLOCK_M)[:, None]
    rs = tl.arange(0, BLOCK_S)[None, :]
    ids = tl.load(heap_ptr(base, experts, tl.int64) + rm * experts_stride + rs, mask=(rm < rows) & (rs < SLOTS),
                  other=-1)
    return tl.max(((ids >= first) & (ids < first + held)).to(tl.int32), axis=1)


@triton.jit
def routed_put_tile(base, bases, NETWORK_PUT: tl.constexpr,
                    dst, src,            # heap offsets: the block's first row on rank peer, here
                    experts,             # heap offset of the block's first token's row of the router's table
                    peer,                # the rank that receives the rows
                    rows, cols,          # the block: rows tokens x cols columns <= BLOCK_M x BLOCK_N
                    first, held,         # this rank's experts: ids first .. first + held
                    dst_stride, src_stride, experts_stride,
                    DTYPE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """The rows of a ``rows x cols`` block whose token chose one of this rank's experts, stored into the
    same rows at ``dst`` on rank ``peer``; the other rows are not sent (none, where no token did). Through a
    network transport (a peer of another node, ``NETWORK_PUT``) the whole block."""
    if NETWORK_PUT is not None:
        if tl.load(bases + peer) == 0:
            NETWORK_PUT(base, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE)
        else:
            _put_chosen_rows(base, bases, dst, src, experts, peer, rows, cols, first, held, dst_stride, src_stride,
                             experts_stride, DTYPE, SLOTS, BLOCK_M, BLOCK_N, BLOCK_S)
    else:
        _put_chosen_rows(base, bases, dst, src, experts, peer, rows, cols, first, held, dst_stride, src_stride,
                         experts_stride, DTYPE, SLOTS, BLOCK_M, BLOCK_N, BLOCK_S)


@triton.jit
def _put_chosen_rows(base, bases, dst, src, experts, peer, rows, cols, first, held, dst_stride, src_stride,
                     experts_stride, DTYPE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """``routed_put_tile`` through memory: a masked load here, a masked store into the peer's mapped heap."""
    rm = tl.arange(0, BLOCK_M)[:, None]
    rn = tl.arange(0, BLOCK_N)[None, :]
    sent = (_chose(base, experts, rows, experts_stride, first, held, SLOTS, BLOCK_M, BLOCK_S)[:, None] > 0) \
        & (rn < cols)
    block = tl.load(heap_ptr(base, src, DTYPE) + rm * src_stride + rn, mask=sent)
    tl.store(peer_ptr(bases, peer, dst, DTYPE) + rm * dst_stride + rn, block, mask=sent)


def _routed_put_reference(heap, task, peers) -> None:
    ids = heap.tensor(task.experts, torch.int64, task.rows, task.SLOTS, task.experts_stride)
    sent = ((ids >= task.first) & (ids < task.first + task.held)).any(dim=1)
    block = heap.tensor(task.src, task.DTYPE, task.rows, task.cols, task.src_stride)
    peers[task.peer].tensor(task.dst, task.DTYPE, task.rows, task.cols, task.dst_stride)[sent] = block[sent]


@triton.jit
def routed_sum_tile(base,
                    out, stage,          # heap offsets: the token's output tile; its tile in rank 0's slot
                    experts,             # heap offset of the token's SLOTS experts
                    cols, count, world,  # the tile's columns; experts and ranks (``Held.balanced``)
                    slot_stride,         # elements from one rank's slot of stage to the next
                    DTYPE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """``out = sum_r stage[r]`` in rank order over the ranks r that hold one of the token's experts (the
    others sent nothing), in float32."""
    count, world = count.to(tl.int32), world.to(tl.int32)
    acc = tl.zeros((1, BLOCK_N), tl.float32)
    for r in range(0, world):
        first = r * count // world
        chose = tl.sum(_chose(base, experts, 1, SLOTS, first, (r + 1) * count // world - first, SLOTS, 1, BLOCK_S),
                       axis=0)
        if chose > 0:
            acc += load_block(heap_ptr(base, stage, DTYPE) + r * slot_stride, cols, 1, cols, 1, BLOCK_N)
    store_block(heap_ptr(base, out, DTYPE), cols, 1, cols, acc, 1, BLOCK_N)


def _routed_sum_reference(heap, task) -> None:
    ids = heap.tensor(task.experts, torch.int64, 1, task.SLOTS, task.SLOTS)[0]
    size = getattr(torch, task.DTYPE).itemsize
    acc = torch.zeros(1, task.cols)
    for r in range(task.world):
        held = Held.balanced(task.count, r, task.world)
        if ((ids >= held.first) & (ids < held.first + held.count)).any():
            acc = acc + heap.tensor(task.stage + r * task.slot_stride * size, task.DTYPE, 1, task.cols,
                                    task.cols).float()
    heap.tensor(task.out, task.DTYPE, 1, task.cols, task.cols).copy_(acc)


def combine(g, part, experts, count: int):
    """The sum over the ranks of ``part [tokens, n]``, each rank's part of a sparse MLP under expert
    parallelism (``Held.balanced``: each rank holds its experts whole), on every rank. A rank puts a
    token's row into every rank only where the token chose one of its experts: which rows travel depends on
    the router, the puts and their arrivals do not (every rank puts to every rank, rows or none, so every
    fan-in is fixed). Each rank adds, per token, the rows of the ranks it chose, in rank order: bitwise the
    same on every rank, whatever arrives first."""
    world, me = g.world_size, g.rank
    require_float(g, "combine", part=part)
    tokens, slots = experts.rows, experts.cols
    g.require(part.ndim == 2 and part.rows == tokens and experts.dtype == torch.int64,
              f"combine: part {part.shape} must have a row per token of the router's experts {experts.shape}")
    held = held_experts(g, "combine", count, True)
    stage = g.new_tensor((world * tokens, part.cols), part.dtype, comm=True)  # slot r: rank r's part
    out = g.new_tensor(part.shape, part.dtype)
    tiling = Tiling(tokens, part.cols)
    block_s = next_power_of_2(slots)
    put = g.opcode(ROUTED_PUT, DTYPE=part.dtype, SLOTS=slots, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n,
                   BLOCK_S=block_s)
    for dst in range(world):
        for r0, m, c0, n in tiling:
            target = stage.region(me * tokens + r0, m, c0, n)
            g.add_task(put, dst=stage.addr(me * tokens + r0, c0), src=part.addr(r0, c0), experts=experts.addr(r0, 0),
                       peer=dst, rows=m, cols=n, first=held.first, held=held.count,
                       dst_stride=stage.row_stride, src_stride=part.row_stride, experts_stride=experts.row_stride,
                       reads=(part.region(r0, m, c0, n), experts.region(r0, m, 0, slots)),
                       writes=(target,) if dst == me else (), remote=() if dst == me else ((dst, target),),
                       bytes=2 * m * n * part.element_size, flops=0)
    g.phase("combine.sum")
    columns = Tiling(1, part.cols)
    total = g.opcode(ROUTED_SUM, DTYPE=part.dtype, SLOTS=slots, BLOCK_N=columns.block_n, BLOCK_S=block_s)
    for b in range(tokens):
        for _, _, c0, n in columns:
            g.add_task(total, out=out.addr(b, c0), stage=stage.addr(b, c0), experts=experts.addr(b, 0), cols=n,
                       count=count, world=world, slot_stride=tokens * stage.row_stride,
                       reads=(stage.region(0, world * tokens, c0, n), experts.region(b, 1, 0, slots)),
                       writes=(out.region(b, 1, c0, n),), bytes=(world + 1) * n * part.element_size,
                       flops=world * n)
    return out


def _example(g):
    """Two tokens' parts, top-3 of 5 experts, combined in a world of one (every expert this rank's: put
    into itself)."""
    part = g.input("ep.part", (2, 64), torch.bfloat16)
    return (g.combine(part, g.input("ep.experts", (2, 3), torch.int64), 5),)


ROUTED_PUT = TaskType("routed_put", routed_put_tile, _routed_put_reference, _example)
ROUTED_SUM = TaskType("routed_sum", routed_sum_tile, _routed_sum_reference, _example)
TASK_TYPES = (ROUTED_PUT, ROUTED_SUM)
OPS = {"combine": combine}
