"""What every task type shares: its declaration, the tiling of 2-D ops, tile-shaped loads and stores,
the 16-byte alignment decision.

A task type is an opcode's meaning, declared once by its tile's signature::

    @triton.jit
    def rms_norm_tile(base, out, x, w, rows, cols, out_stride, x_stride, segments,
                      EPS: tl.constexpr, X_DTYPE: tl.constexpr, ...):

``base`` is this rank's heap (int64 address). More context parameters may follow it: ``bases``
(the table of every rank's heap base, for a remote store: the tile is a communication tile),
``NETWORK_PUT`` (a constexpr: the kernel's network transport's put, ``shmem.put_rows``, or None) and
``status`` (the worker's status record, for ``device.checked_index``: a tile that reads an index
from the heap bounds it). The plain parameters after them are the argument words of the task's table row, in order: code generation loads them, builders pass them
by name (``g.add_task(opcode, out=..., x=..., ...)``, or ``g.add_tasks`` for a run of tiles with a list per
word that changes along it), the disassembler prints them by name. The
``tl.constexpr`` parameters are the compile-time constants of an opcode; names ending in ``DTYPE``
hold a dtype name ("float32", "bfloat16", "float16", "int64"). Argument words arrive as int64 (heap
offsets need it); a tile divides by a count only as int32 (``n.to(tl.int32)``): a 64-bit division is
a subroutine call on NVIDIA, and the registers live across the call spill.

The registration adds the torch ``reference`` of the same tile, which reads every word and constant
as an attribute of its ``task`` argument, and an ``example``: ops that use every variant of the tile,
from which the kernel with every task type is built (``tools.examples.every_task_type``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, heap_ptr

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64",
          torch.uint8: "uint8"}  # uint8: the packed bytes of quantized weights (tasks.quantized)
CONTEXT_PARAMS = ("base", "bases", "NETWORK_PUT", "status")     # what a tile may take before its words
BUILDER_KEYWORDS = ("reads", "writes", "bytes", "flops", "remote")  # Graph.add_task's own keywords
VECTOR_BYTES = 16  # the widest load of a thread: one ld.global.v4 (CUDA) / global_load_dwordx4 (AMD)


@dataclass(frozen=True)
class TaskType:
    """A task type: its name, its tile (whose signature declares the row, see the module docstring),
    the torch ``reference(heap, task[, peers])`` of the tile, and an ``example(g)`` that builds ops using
    every variant of the tile and returns the tensors to output (integer inputs it makes are indices,
    valid for any value below ``tools.examples.INDEX_BOUND``)."""

    name: str
    tile: Any                                     # triton.JITFunction
    reference: Callable[..., None]
    example: Callable[[Any], tuple]
    context: tuple[str, ...] = field(init=False)          # the context parameters the tile takes
    arg_names: tuple[str, ...] = field(init=False)        # the row's argument words, in order
    constexpr_names: tuple[str, ...] = field(init=False)  # an opcode's compile-time constants

    def __post_init__(self):
        params = list(inspect.signature(self.tile.fn).parameters.values())
        context = [p.name for p in params if p.name in CONTEXT_PARAMS]
        if [p.name for p in params[:len(context)]] != context or context != sorted(context, key=CONTEXT_PARAMS.index) \
                or context[:1] != ["base"]:
            raise TypeError(f"task type {self.name}: its tile must start with base, then bases, NETWORK_PUT and "
                            f"status if it takes them, got ({', '.join(p.name for p in params[:3])})")
        rest = params[len(context):]
        is_constexpr = [p for p in rest if "constexpr" in str(p.annotation)]  # as Triton reads it
        words = tuple(p.name for p in rest if p not in is_constexpr)
        clash = sorted(set(words) & set(BUILDER_KEYWORDS))
        if clash:
            raise TypeError(f"task type {self.name}: argument word {clash[0]!r} is a keyword of Graph.add_task")
        object.__setattr__(self, "context", tuple(context))
        object.__setattr__(self, "arg_names", words)
        object.__setattr__(self, "constexpr_names", tuple(p.name for p in is_constexpr))

    @property
    def needs_peers(self) -> bool:
        """A communication tile: it takes ``bases``, to store into other ranks' heaps."""
        return "bases" in self.context


def require_float(g, op: str, **tensors) -> None:
    """Refuse integer tensors in an op whose tiles compute in float32 (an int64 above 2**24 would not
    survive the trip)."""
    for name, t in tensors.items():
        g.require(t.dtype.is_floating_point, f"{op}: {name} is {t.dtype}; {op} takes floating-point tensors only")


def row_positions(g, op: str, pos, rows: int) -> list[tuple[int, tuple]]:
    """Per batch row, the heap offset of its position and the region read: ``pos`` is one int64 element
    (every row at that position) or one per row (``[rows]``: sequences at positions of their own; -1
    marks a row that holds no sequence, ``device.row_position``)."""
    g.require(pos.dtype == torch.int64 and pos.shape in ((1,), (1, 1), (rows,)),
              f"{op}: pos must be one int64 element or one per row ({rows},), got {pos.shape} {pos.dtype}")
    flat = pos.block()
    per_row = flat.cols == rows and rows > 1
    return [(flat.addr(0, r if per_row else 0), flat.region(0, 1, r if per_row else 0, 1)) for r in range(rows)]


@dataclass(frozen=True)
class PositionRun:
    """A tile's run of rows ``row .. row + rows`` and where their positions are: ``pos``, the heap offset of
    the first's, ``pos_step`` bytes from one to the next (0: one position for every row), ``region`` read."""

    row: int
    rows: int
    pos: int
    pos_step: int
    region: tuple


def position_runs(g, op: str, pos, rows: int) -> list[PositionRun]:
    """The runs of rows, each a tile's, of an op over ``rows`` batch rows at positions ``pos``
    (``row_positions``): a row each, or with ``Graph.few_tiles`` up to ``parallelism`` even runs."""
    positions = row_positions(g, op, pos, rows)
    per_row = rows > 1 and positions[1][0] != positions[0][0]
    size = ceil_div(rows, g.parallelism) if g.few_tiles else 1
    flat = pos.block()
    return [PositionRun(r0, min(size, rows - r0), positions[r0][0], 8 * per_row,
                        flat.region(0, 1, r0, min(size, rows - r0)) if per_row else positions[r0][1])
            for r0 in range(0, rows, size)]


def routed_rows(x, experts):
    """Per (token b, slot s) of a routed linear (``experts`` [tokens, slots]), in order: ``(b, s, row,
    x_row)``, with ``row = b * slots + s`` the output row and ``x_row`` the input row it reads (``x`` has a
    row per slot, or one per token that its every slot reads)."""
    tokens, slots = experts.rows, experts.cols
    for b in range(tokens):
        for s in range(slots):
            row = b * slots + s
            yield b, s, row, row if x.rows == tokens * slots else b


def heap_index(heap, offset: int, bound: int) -> int:
    """The int64 index at heap ``offset``, for a reference tile, as ``heap`` bounds it
    (``HeapView.checked_index``: the oracle refuses an index out of [0, bound), the torch backend clamps
    and reports it as the kernel does)."""
    return heap.checked_index(heap.word(offset), bound, f"heap offset {offset}")


def token_row(heap, task) -> int:
    """The table row an ``embedding`` task (quantized or not) looks up: ``*token``."""
    return heap_index(heap, task.token, task.rows)


def history_row(heap, task) -> int:
    """The table row an ``embedding_at`` task (quantized or not) looks up: ``history[*pos]``, row 0 for a row of
    no sequence."""
    if heap.word(task.pos) == NO_SEQUENCE.value:
        return 0
    return heap_index(heap, task.history + 8 * heap_index(heap, task.pos, task.history_cols), task.rows)


# oneDNN's matrix multiply over a weight laid out for it once (what vLLM's CPU linears run): on one core it
# streams SmolLM2's weights ~1.8x as fast as ``F.linear`` at 8 rows, ~1.2x at one (bench/torch_backend.py --one-core)
ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_BF16 = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
# the fewest rows ``linear_rows`` multiplies (x's first row repeated where it has fewer): oneDNN streams a
# weight fastest at 3 to 6 rows, ~1.3x as fast as at 1, 2 or 8 (float32 on one Zen 4 core:
# bench/torch_backend.py --one-core)
FEWEST_ROWS = 4


def linear_rows(heap, key: tuple, x: torch.Tensor, y: torch.Tensor, sources: tuple[torch.Tensor, ...],
                weight: Callable[[], torch.Tensor], w_dtype: torch.dtype, pos: list[int] | None = None) -> None:
    """``y[:] = x @ w.T`` for a reference tile, accumulated in float32 and rounded once to y's dtype, as the
    tiles compute it; ``w = weight()`` [n, k] of ``w_dtype``, made from the heap views ``sources``. Laid out
    for oneDNN as a weight derived from them, named by ``key`` (``HeapView.derived``: a torch backend's
    worker keeps it). bfloat16 x, w and y multiply as such (oneDNN accumulates in float32), everything else
    in float32. A torch built without oneDNN, or a worker with no room left to keep the weight, multiplies
    ``weight()`` as it is at every call.

    ``pos``, the positions of x's rows where the tile has them (``live_rows``): a row at NO_SEQUENCE holds
    no sequence, its y row is zero. Only the rows that hold one are multiplied, at least FEWEST_ROWS of
    them (x's first rows, or the live ones gathered and the first repeated). Never one alone: oneDNN sums
    one row in another order (at K >= 1536 in float32); from two rows on a row's result is the same bits
    whichever rows are beside it, so a sequence's results do not depend on the others in its batch, nor on
    the batch's size (tests/test_torch_backend.py)."""
    dtype = torch.bfloat16 if x.dtype == y.dtype == w_dtype == torch.bfloat16 and ONEDNN_BF16 else torch.float32
    rows = x.shape[0]
    hint = max(rows, FEWEST_ROWS)  # the rows oneDNN lays the weight out for; it multiplies any number
    key = (*key, "onednn", hint, dtype)
    laid_out = ONEDNN and heap.keeps(key, sources, y.shape[1] * x.shape[1] * dtype.itemsize)
    packed = laid_out and heap.derived(key, sources,
                                       lambda: torch.ops.mkldnn._reorder_linear_weight(weight().to(dtype), hint))

    def product(xs: torch.Tensor) -> torch.Tensor:
        if laid_out:
            return torch.ops.mkldnn._linear_pointwise(xs.to(dtype), packed, None, "none", [], "")
        return xs.float() @ weight().float().T

    live = range(rows) if pos is None else [r for r, p in enumerate(pos) if p != NO_SEQUENCE.value]
    count = len(live)
    if not count:
        y.zero_()
        return
    first, width = live[-1] == count - 1, max(count, FEWEST_ROWS)  # first: the live rows are x's first
    if first and width <= rows:
        xs = x[:width]  # a view
    else:
        index = torch.tensor(live)
        xs = x.index_select(0, torch.cat([index, index[:1].expand(width - count)]))
    if count < rows:  # the rows of no sequence zeroed first: after the product has streamed the weight
        (y[count:] if first else y).zero_()  # through the caches, a torch call costs several times as much
    out = product(xs)[:count]
    if first:
        y[:count].copy_(out)
    else:
        y.index_copy_(0, index, out.to(y.dtype))


@triton.jit
def live_rows(base, pos, rows, m, BY_POS: tl.constexpr):
    """Which of ``rows`` (row indices of a tile's x, any shape) are below m and hold a sequence: with BY_POS,
    those whose position (the int64 at heap offset ``pos`` + 8 * row) is not NO_SEQUENCE; without, all
    below m. A tile zeroes the others' output rows (``linear_rows`` is its reference)."""
    inside = rows < m
    if BY_POS:
        inside = inside & (tl.load(heap_ptr(base, pos, tl.int64) + rows, mask=inside, other=NO_SEQUENCE)
                           != NO_SEQUENCE)
    return inside


def ceil_div(a: int, b: int) -> int:
    """``triton.cdiv`` for builders: Triton's is a constexpr function, and each host call of it costs
    ~14 µs, which the builders of a graph of a million tiles would pay a hundred thousand times."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for builders (the same cost as ``ceil_div`` saves)."""
    return 1 << (n - 1).bit_length()


def vector_aligned(*byte_counts: int) -> bool:
    """The host's ALIGNED decision: every one of ``byte_counts`` (heap offsets, row strides, lengths, in
    bytes) is a whole number of VECTOR_BYTES, so that every row a tile reads starts on a vector and it
    may load 16-byte vectors (``row_offsets``)."""
    return all(count % VECTOR_BYTES == 0 for count in byte_counts)


@dataclass(frozen=True)
class Tiling:
    """Blocks of at most BLOCK_ELEMENTS elements (at most MAX_BLOCK_ROWS rows high) covering ``rows x
    cols``: the tiling of elementwise, reduction and copy ops, a tile per block; or, with ``parts``
    (``Graph.few_tiles``: the graph's parallelism), at most that many tiles of whole blocks, which the
    tile loops over (``many_blocks``). Iterating gives each tile's (row, rows, col, cols)."""

    rows: int
    cols: int
    parts: int = 0

    BLOCK_ELEMENTS = 1024
    MAX_BLOCK_ROWS = 8

    @classmethod
    def of(cls, g, rows: int, cols: int) -> "Tiling":
        """The tiling of ``rows x cols`` in graph ``g``."""
        return cls(rows, cols, g.parallelism if g.few_tiles else 0)

    @property
    def block_m(self) -> int:
        return min(triton.next_power_of_2(self.rows), self.MAX_BLOCK_ROWS)

    @property
    def block_n(self) -> int:
        return min(triton.next_power_of_2(self.cols), self.BLOCK_ELEMENTS // self.block_m)

    @property
    def tile_shape(self) -> tuple[int, int]:
        """A tile's rows and columns: a block's, or with ``parts`` whole blocks in at most that many tiles
        (rows first: the row groups, then the columns of each among the parts left)."""
        if not self.parts:
            return self.block_m, self.block_n
        row_blocks, col_blocks = ceil_div(self.rows, self.block_m), ceil_div(self.cols, self.block_n)
        row_groups = min(self.parts, row_blocks)
        col_groups = min(col_blocks, max(1, self.parts // row_groups))
        return self.block_m * ceil_div(row_blocks, row_groups), self.block_n * ceil_div(col_blocks, col_groups)

    @property
    def many_blocks(self) -> bool:
        """Whether a tile spans more than one block (its tile loops over them: a ``MANY_BLOCKS`` constexpr,
        so that a GPU's tiles of one block carry no loop and none of its registers)."""
        return self.tile_shape != (self.block_m, self.block_n)

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        tile_m, tile_n = self.tile_shape
        for r0 in range(0, self.rows, tile_m):
            for c0 in range(0, self.cols, tile_n):
                yield r0, min(tile_m, self.rows - r0), c0, min(tile_n, self.cols - c0)


@triton.jit
def block_at(t, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row, column) of block ``t`` of a tile ``cols`` wide, row-major, blocks of BLOCK_M x BLOCK_N: a tile
    of ``Tiling`` walks ``t`` over ``block_count`` (one block on a GPU, whose tiles are one each). int32
    division: a 64-bit one is a subroutine call on NVIDIA."""
    column_blocks = tl.cdiv(cols.to(tl.int32), BLOCK_N)
    return t // column_blocks * BLOCK_M, t % column_blocks * BLOCK_N


@triton.jit
def block_count(rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The BLOCK_M x BLOCK_N blocks of a ``rows x cols`` tile."""
    return tl.cdiv(rows.to(tl.int32), BLOCK_M) * tl.cdiv(cols.to(tl.int32), BLOCK_N)


# Read by triton at import, as here: under the interpreter (the cpu backend's workers) every jit function runs
# as Python, and two of its conversions differ from the compiler's (``rounded``, ``dot``).
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """float32 ``x`` as ``DTYPE``, rounded to nearest even on every backend.

    The compiler rounds to nearest even (``cvt.rn`` on NVIDIA, a rounding of bit 16 on gfx942,
    ``v_cvt_pk_bf16_f32`` on gfx950); the interpreter converts float32 to bfloat16 by truncation, a bias
    of up to one bfloat16 ulp per store that compounds through a model. Under it the bits are rounded
    first, a few integer operations.
    """
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(DTYPE)


@triton.jit
def dot(a, b):
    """``a @ b`` ([M, K] x [K, N], each dimension at least 16), accumulated in float32.

    Operands of one 16-bit float type are multiplied as they are: on tensor cores, whose products are
    exact, few registers per thread. Under the interpreter, whose bfloat16 ``tl.dot`` multiplies the raw
    bit patterns (triton issue 11584, "not supported yet"), they are widened to float32 first: the same
    products. Any other pair is multiplied in IEEE float32 (FMA: whole operand rows per thread, many
    registers; the default precision would round float32 to tf32 on NVIDIA).
    """
    if a.dtype == b.dtype and a.dtype.is_floating() and a.dtype.primitive_bitwidth == 16:
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def row_offsets(rows, stride, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """``rows * stride``, in elements of DTYPE. ALIGNED (the host checked that every row starts at a
    multiple of 16 bytes): the compiler is told so, which lets a tile load 16-byte vectors. The hint must
    be on the product, a value this function makes, and on every dimension: triton drops one on an
    argument word (3.6 also on a helper's return value and on a dimension of size 1)."""
    offsets = rows * stride
    if ALIGNED:
        offsets = tl.multiple_of(offsets, [128 // DTYPE.primitive_bitwidth] * max(1, len(offsets.shape)))
    return offsets


@triton.jit
def copy_row(base, dst, src, cols, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy ``cols`` contiguous elements from heap offset ``src`` to ``dst``, BLOCK_N at a time."""
    c = tl.arange(0, BLOCK_N)
    for c0 in range(0, cols, BLOCK_N):
        v = tl.load(heap_ptr(base, src, DTYPE) + c0 + c, mask=c0 + c < cols)
        tl.store(heap_ptr(base, dst, DTYPE) + c0 + c, v, mask=c0 + c < cols)


@triton.jit
def load_block(ptr, row_stride, rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``rows x cols`` tile at typed pointer ``ptr`` as a float32 ``BLOCK_M x BLOCK_N`` block (0
    outside)."""
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    return tl.load(ptr + r * row_stride + c, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)


@triton.jit
def store_block(ptr, row_stride, rows, cols, block, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the valid ``rows x cols`` part of a float32 ``BLOCK_M x BLOCK_N`` block at typed pointer
    ``ptr`` (this rank's heap, ``heap_ptr``, or a peer's, ``peer_ptr``), rounded to its element type."""
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    tl.store(ptr + r * row_stride + c, rounded(block, ptr.dtype.element_ty), mask=(r < rows) & (c < cols))

