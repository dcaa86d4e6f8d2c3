"""Communication tiles and the collectives built from them, all at tile granularity.

A put tile loads a block of a local tensor and stores it into the same-offset buffer of a peer's
heap (the heap is symmetric; what peers write is in its comm area, ``layout``), then the protocol
loop releases the peer's event. Collectives are
graphs of put tiles and fixed-order sum tiles, so a consumer tile waits only for the tiles it reads
and communication overlaps computation inside the one launch. Every reduction adds contributions
in a fixed order (on one node rank order 0, 1, ...), so every rank gets a bitwise identical result.

Across nodes (``Graph.topology``) the collectives know where the network is: every byte crosses it once.
An all-reduce sums inside each node first (a reduce-scatter), exchanges each rank's shard with the ranks of
the same place on the other nodes, and gathers inside the node; its sum goes over the node's ranks in
order, then over the nodes in order, the same order on every rank (so every rank holds the same bits, a
rounding away from one node's rank-order sum). An all-gather sends a rank's block to its counterparts of
the other nodes, which hand it on inside theirs; a reduce-scatter sums each owner's chunk inside every
node, then sends the node's sum to its owner.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr, peer_ptr
from ..errors import is_int
from .common import TaskType, Tiling, load_block, require_float, store_block
from .reduction import sum_slices

ONE_SHOT_MAX_BYTES = 64 * 1024  # above this, all_reduce is a reduce-scatter then an all-gather


@triton.jit
def put_tile(base, bases, NETWORK_PUT: tl.constexpr,
             dst, src,                # heap offsets: dst on rank peer, src here
             peer,                    # the rank that receives the block
             rows, cols,              # the block: rows x cols <= BLOCK_M x BLOCK_N
             dst_stride, src_stride,  # row strides, in elements
             DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy a local block to the same-shaped block at ``dst`` on rank ``peer``: stores into its mapped heap,
    or, with a network transport (``NETWORK_PUT``, ``shmem.put_rows``), its puts to a peer of another node
    (whose base is 0: not mapped)."""
    if NETWORK_PUT is not None:
        if tl.load(bases + peer) == 0:
            NETWORK_PUT(base, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE)
        else:
            copy_block(base, bases, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE, BLOCK_M, BLOCK_N)
    else:
        copy_block(base, bases, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE, BLOCK_M, BLOCK_N)


@triton.jit
def copy_block(base, bases, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``put_tile`` through memory: a load of the block here, a store into the peer's mapped heap."""
    block = load_block(heap_ptr(base, src, DTYPE), src_stride, rows, cols, BLOCK_M, BLOCK_N)
    store_block(peer_ptr(bases, peer, dst, DTYPE), dst_stride, rows, cols, block, BLOCK_M, BLOCK_N)


def _reference(heap, task, peers) -> None:
    block = heap.tensor(task.src, task.DTYPE, task.rows, task.cols, task.src_stride)
    peers[task.peer].tensor(task.dst, task.DTYPE, task.rows, task.cols, task.dst_stride).copy_(block)


def put_tiles(g, src, dst_rank: int, dst) -> None:
    """Tiles copying ``src`` (this rank) into ``dst`` (a same-shaped view) on ``dst_rank``."""
    tiling = Tiling(src.rows, src.cols)
    opcode = g.opcode(PUT, DTYPE=src.dtype, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n)
    local = dst_rank == g.rank
    for r0, m, c0, n in tiling:
        target = dst.region(r0, m, c0, n)
        g.add_task(opcode, dst=dst.addr(r0, c0), src=src.addr(r0, c0), peer=dst_rank, rows=m, cols=n,
                   dst_stride=dst.row_stride, src_stride=src.row_stride,
                   reads=(src.region(r0, m, c0, n),), writes=(target,) if local else (),
                   remote=() if local else ((dst_rank, target),), bytes=2 * m * n * src.element_size, flops=0)


def _check_rank(g, op: str, rank: int) -> None:
    g.require(is_int(rank) and 0 <= rank < g.world_size,
              f"{op}: rank {rank!r} is outside world size {g.world_size}")


def put(g, x, to_rank: int, into):
    """Store ``x`` into ``into`` on rank ``to_rank``; returns ``into`` (what peers put into this rank).
    ``into`` is a communication buffer (``g.new_tensor(..., comm=True)``) unless every rank puts into
    itself."""
    _check_rank(g, "put", to_rank)
    require_float(g, "put", x=x)
    g.require(x.shape == into.shape and x.dtype == into.dtype,
              f"put: x is {x.shape} {x.dtype} but into is {into.shape} {into.dtype}")
    g.require(to_rank == g.rank or into.buffer.comm,
              f"put: into ({into.buffer.name!r}) is written by rank {g.rank} on rank {to_rank}: it must be a "
              f"communication buffer, made with new_tensor(..., comm=True)")
    put_tiles(g, x.block(), to_rank, into.block())
    return into


def _column_chunks(cols: int, world: int) -> list[tuple[int, int]]:
    return [(r * cols // world, (r + 1) * cols // world) for r in range(world)]


def all_reduce(g, x, algorithm: str | None = None):
    """Sum of ``x`` over ranks, on every rank. ``algorithm``: "one_shot" (every rank sends its whole
    tensor to every rank), "two_shot" (reduce-scatter then all-gather), "hierarchical" (inside the node,
    across nodes, inside the node), or None: hierarchical across nodes, else by size."""
    world, me = g.world_size, g.rank
    require_float(g, "all_reduce", x=x)
    if algorithm is None and g.topology.node_count > 1:
        algorithm = "hierarchical"
    if algorithm is None:
        algorithm = "one_shot" if x.rows * x.cols * x.element_size <= ONE_SHOT_MAX_BYTES else "two_shot"
    g.require(algorithm in ("one_shot", "two_shot", "hierarchical"), f"all_reduce: unknown algorithm {algorithm!r}")
    if algorithm == "hierarchical":
        return _hierarchical_all_reduce(g, x)
    src = x.block()
    rows, cols = src.rows, src.cols
    stage = g.new_tensor((world * rows, cols), x.dtype, comm=True)  # slot s holds rank s's contribution
    out = g.new_tensor(x.shape, x.dtype, comm=algorithm == "two_shot")  # two-shot: peers gather into it
    if algorithm == "one_shot":
        for dst in range(world):
            put_tiles(g, src, dst, stage.block(me * rows, rows))
        g.phase("all_reduce.sum")
        sum_slices(g, out.block(), stage, world, rows)
        return out
    chunks = _column_chunks(cols, world)
    for owner, (c0, c1) in enumerate(chunks):
        if c1 > c0:
            put_tiles(g, src.block(0, rows, c0, c1 - c0), owner, stage.block(me * rows, rows, c0, c1 - c0))
    g.phase("all_reduce.sum")
    c0, c1 = chunks[me]
    if c1 > c0:
        sum_slices(g, out.block(0, rows, c0, c1 - c0), stage.block(0, world * rows, c0, c1 - c0), world, rows)
    g.phase("all_reduce.gather")
    if c1 > c0:
        mine = out.block(0, rows, c0, c1 - c0)
        for dst in range(world):
            if dst != me:
                put_tiles(g, mine, dst, mine)
    return out


def _places(g) -> tuple[list[int], int, list[list[int]]]:
    """This rank's node's ranks, its place among them, and every node's ranks (nodes of equal size)."""
    topology = g.topology
    nodes = [topology.node_ranks(n) for n in range(topology.node_count)]
    mine = nodes[topology.nodes[g.rank]]
    return mine, mine.index(g.rank), nodes


def _hierarchical_all_reduce(g, x):
    """``all_reduce`` across nodes: shard ``l`` of the columns summed on the node's rank ``l``, then over the
    nodes by the ranks of place ``l`` (one shard each way per pair of nodes), then gathered in the node."""
    local, place, nodes = _places(g)
    node = g.topology.nodes[g.rank]
    src = x.block()
    rows, cols = src.rows, src.cols
    chunks = _column_chunks(cols, len(local))
    stage = g.new_tensor((len(local) * rows, cols), x.dtype, comm=True)  # slot l: the node's rank l's contribution
    cross = g.new_tensor((len(nodes) * rows, cols), x.dtype, comm=True)  # slot n: node n's sum
    out = g.new_tensor(x.shape, x.dtype, comm=True)
    for owner, (c0, c1) in zip(local, chunks):
        if c1 > c0:
            put_tiles(g, src.block(0, rows, c0, c1 - c0), owner, stage.block(place * rows, rows, c0, c1 - c0))
    c0, c1 = chunks[place]
    shard = c1 - c0  # this rank's columns
    g.phase("all_reduce.node_sum")
    if shard:
        sum_slices(g, cross.block(node * rows, rows, c0, shard), stage.block(0, len(local) * rows, c0, shard),
                   len(local), rows)
    g.phase("all_reduce.nodes")
    if shard:
        mine = cross.block(node * rows, rows, c0, shard)
        for other, ranks in enumerate(nodes):
            if other != node:
                put_tiles(g, mine, ranks[place], mine)
    g.phase("all_reduce.sum")
    if shard:
        sum_slices(g, out.block(0, rows, c0, shard), cross.block(0, len(nodes) * rows, c0, shard), len(nodes), rows)
    g.phase("all_reduce.gather")
    if shard:
        for peer in local:
            if peer != g.rank:
                put_tiles(g, out.block(0, rows, c0, shard), peer, out.block(0, rows, c0, shard))
    return out


def _along_rows(g, op: str, x, dim: int) -> bool:
    """Refuse a bad ``dim`` or ``x`` for a collective along ``dim``; whether ``dim`` is the rows of x's 2-D
    view (else it is its columns)."""
    g.require(dim in range(x.ndim), f"{op}: dim {dim} is out of range for shape {x.shape}")
    require_float(g, op, x=x)
    return x.ndim == 2 and dim == 0


def _chunk(t, i: int, size: int, along_rows: bool):
    """Chunk ``i`` of ``size`` rows (``along_rows``) or columns of the 2-D view ``t``."""
    return t.block(i * size, size) if along_rows else t.block(0, t.rows, i * size, size)


def _resized(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else s for d, s in enumerate(shape))


def all_gather(g, x, dim: int = 0):
    """Concatenation of every rank's ``x`` along ``dim``, in rank order, on every rank."""
    along_rows = _along_rows(g, "all_gather", x, dim)
    size = x.shape[dim]
    out = g.new_tensor(_resized(x.shape, dim, g.world_size * size), x.dtype, comm=True)
    slot = _chunk(out.block(), g.rank, size, along_rows)
    if g.topology.node_count == 1:
        for dst in range(g.world_size):
            put_tiles(g, x.block(), dst, slot)
        return out
    local, place, nodes = _places(g)  # to this place on every node, then on inside each node
    for ranks in nodes:
        put_tiles(g, x.block(), ranks[place], slot)
    g.phase("all_gather.node")
    for ranks in nodes:
        held = _chunk(out.block(), ranks[place], size, along_rows)
        for peer in local:
            if peer != g.rank:
                put_tiles(g, held, peer, held)
    return out


def reduce_scatter(g, x, dim: int = 0):
    """This rank's chunk (chunk ``rank`` of ``world`` along ``dim``) of the sum of ``x`` over ranks."""
    world, me = g.world_size, g.rank
    along_rows = _along_rows(g, "reduce_scatter", x, dim)
    g.require(x.shape[dim] % world == 0,
              f"reduce_scatter: dim {dim} of shape {x.shape} does not split into {world} equal chunks")
    size = x.shape[dim] // world
    chunks = [_chunk(x.block(), owner, size, along_rows) for owner in range(world)]
    chunk_rows, chunk_cols = chunks[0].rows, chunks[0].cols
    out = g.new_tensor(_resized(x.shape, dim, size), x.dtype)
    if g.topology.node_count == 1:
        stage = g.new_tensor((world * chunk_rows, chunk_cols), x.dtype, comm=True)  # slot s holds rank s's chunk
        for owner, chunk in enumerate(chunks):
            put_tiles(g, chunk, owner, stage.block(me * chunk_rows, chunk_rows))
        g.phase("reduce_scatter.sum")
        sum_slices(g, out.block(), stage, world, chunk_rows)
        return out
    local, place, nodes = _places(g)
    node, per_node = g.topology.nodes[me], len(local)
    # on the node's rank of place k: slot (n, l) holds the node's rank l's chunk for node n's rank of place k
    stage = g.new_tensor((len(nodes) * per_node * chunk_rows, chunk_cols), x.dtype, comm=True)
    cross = g.new_tensor((len(nodes) * chunk_rows, chunk_cols), x.dtype, comm=True)  # slot n: node n's sum of my chunk
    for k, peer in enumerate(local):
        for n, ranks in enumerate(nodes):
            put_tiles(g, chunks[ranks[k]], peer, stage.block((n * per_node + place) * chunk_rows, chunk_rows))
    g.phase("reduce_scatter.node_sum")
    # this node's sum of the chunk of node n's rank of my place: into my own slot of cross for my node,
    # else into slot n of a buffer of sums to send (its slot of my node stays unused)
    sums = g.new_tensor((len(nodes) * chunk_rows, chunk_cols), x.dtype)
    for n in range(len(nodes)):
        into = cross if n == node else sums
        sum_slices(g, into.block(n * chunk_rows, chunk_rows),
                   stage.block(n * per_node * chunk_rows, per_node * chunk_rows), per_node, chunk_rows)
    g.phase("reduce_scatter.nodes")
    for n, ranks in enumerate(nodes):
        if n != node:
            put_tiles(g, sums.block(n * chunk_rows, chunk_rows), ranks[place], cross.block(node * chunk_rows, chunk_rows))
    g.phase("reduce_scatter.sum")
    sum_slices(g, out.block(), cross, len(nodes), chunk_rows)
    return out


def _example(g):
    """An all-reduce (put tiles into this rank itself, in a world of one, then the sum)."""
    return (g.all_reduce(g.input("put.x", (20, 40), torch.float32)),)


PUT = TaskType("put", put_tile, _reference, _example)
TASK_TYPES = (PUT,)
OPS = {"put": put, "all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}
