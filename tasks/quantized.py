"""Weights kept in a quantized format on the heap (``tasks.formats``), dequantized in registers by the tiles
that read them.

Each element is rebuilt as its format defines it, in float32, by integer operations on the loaded bytes
and IEEE multiplications (the FP8 byte is decoded from its bits, not by a hardware conversion): the same
value on every target, the interpreter included, and the value gguf's (and so transformers') own
dequantization gives. ``formats.dequantize`` is the torch version, the references' and the tests'.

A split across ranks or across K cuts at whole blocks of the packed bytes (FP8 anywhere: its bytes are
independent elements): a tile's K-range starts on a block.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..device import checked_index, heap_ptr, row_position
from ..errors import is_count
from .common import (TaskType, ceil_div, dot, heap_index, history_row, linear_rows, live_rows, next_power_of_2,
                     require_float, rounded, routed_rows, row_offsets, row_positions, token_row, vector_aligned)
from .formats import (FORMATS, FORMATS_BY_CODE, FP8_BLOCK, FP8_SCALE_BLOCK, Q4_K, Q8_0, Format, Quantized, dequantize,
                      quantized_input)
from .reduction import sum_slices


@triton.jit
def _f16_at(p):
    """The float16 at byte pointer ``p`` (2-byte aligned: every block starts on an even byte), as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bits (int32 0..255) as float32, from the bits: sign, 4 exponent bits (bias 7), 3 of
    mantissa; exponent 0 subnormal, 0x7F / 0xFF NaN, no infinities."""
    sign = (byte & 0x80) << 24
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2**-9
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _q4_k_value(block, j, q):
    """(d * scale_j) * q - dmin * min_j: the value of nibble ``q`` of sub-block ``j`` of the Q4_K block at
    byte pointer ``block`` (its 6-bit scale and minimum unpacked from the 12 bytes after d and dmin)."""
    low, mid, high = _byte(block + 4 + j % 4), _byte(block + 8 + j % 4), _byte(block + 12 + j % 4)
    scale = tl.where(j < 4, low & 63, (high & 15) | ((low >> 2) & 48))
    minimum = tl.where(j < 4, mid & 63, (high >> 4) | ((mid >> 2) & 48))
    return (_f16_at(block) * scale.to(tl.float32)) * q.to(tl.float32) - _f16_at(block + 2) * minimum.to(tl.float32)


@triton.jit
def dequantized(base, w, scales, rows, cols, w_stride, scales_stride, scale_offset, FORMAT: tl.constexpr):
    """Elements (``rows``, ``cols``) of the weight at heap offset ``w`` (packed rows of ``w_stride`` bytes;
    ``scales``: its float32 scales, FP8 only; ``scale_offset``: fp8_block's, see ``Quantized``), as float32. ``rows`` and ``cols`` broadcast to the block
    wanted ([BLOCK_N, 1] and [1, BLOCK_K]) and must be inside the weight."""
    row = heap_ptr(base, w, tl.uint8) + rows.to(tl.int64) * w_stride
    if FORMAT == 1:    # q8_0: d, 32 int8
        block = row + cols // 32 * 34
        value = _f16_at(block) * tl.load((block + 2 + cols % 32).to(tl.pointer_type(tl.int8))).to(tl.float32)
    elif FORMAT == 2:  # q4_0: d, 16 bytes of two nibbles (element i low, i + 16 high)
        block = row + cols // 32 * 18
        i = cols % 32
        q = (_byte(block + 2 + i % 16) >> (i // 16 * 4)) & 15
        value = _f16_at(block) * (q - 8).to(tl.float32)
    elif FORMAT == 3:  # q4_1: d, m, 16 bytes of nibbles
        block = row + cols // 32 * 20
        i = cols % 32
        q = (_byte(block + 4 + i % 16) >> (i // 16 * 4)) & 15
        value = _f16_at(block) * q.to(tl.float32) + _f16_at(block + 2)
    elif FORMAT == 4:  # q4_k: d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles
        block = row + cols // 256 * 144
        i = cols % 256
        j = i // 32  # sub-block
        q = (_byte(block + 16 + j // 2 * 32 + i % 32) >> (j % 2 * 4)) & 15
        value = _q4_k_value(block, j, q)
    elif FORMAT == 5:  # q6_k: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
        block = row + cols // 256 * 210
        i = cols % 256
        half, r = i // 128, i % 128
        low = (_byte(block + half * 64 + r % 64) >> (r // 64 * 4)) & 15
        high = (_byte(block + 128 + half * 32 + r % 32) >> (r // 32 * 2)) & 3
        scale = tl.load((block + 192 + i // 16).to(tl.pointer_type(tl.int8))).to(tl.float32)
        value = (_f16_at(block + 208) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    else:              # fp8 e4m3 and a float32 scale per row (6) or per row and 128 columns (7)
        scale_ptr = heap_ptr(base, scales, tl.float32)
        if FORMAT == 6:
            scale = tl.load(scale_ptr + rows)
        else:
            scale = tl.load(scale_ptr + rows * scales_stride + (cols + scale_offset) // 128)
        value = _e4m3(_byte(row + cols)) * scale
    return value


@triton.jit
def dequantized_block(base, w, scales, rows, kc, k_end, w_stride, scales_stride, scale_offset, FORMAT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: columns ``kc ..`` of rows ``rows`` ([BLOCK_N, 1]) of the weight, 0 from
    ``k_end`` on. ``ALIGNED`` (the host checked: every packed row and the tile's first byte 16-byte
    aligned, k_end - kc and scale_offset whole numbers of BLOCK_K; VECTOR_BLOCKS): FP8 rows are loaded as 16-byte
    vectors of 16 elements, a Q4_K super-block's 128 bytes of nibbles as 16-byte vectors of 32 elements;
    each element of the other formats, and of these when not aligned, is gathered from its block
    (``dequantized``)."""
    rk = tl.arange(0, BLOCK_K)[None, :]
    if ALIGNED:  # fp8 or q4_k (VECTOR_BLOCKS)
        # the pointer made and hinted here, not by heap_ptr: triton 3.6 drops a hint put on a helper's return
        row = tl.multiple_of((base + w).to(tl.pointer_type(tl.uint8)), 16) + row_offsets(rows.to(tl.int64),
                                                                                         w_stride, tl.uint8, True)
    if ALIGNED and FORMAT >= 6:  # fp8: a byte per element
        value = _e4m3(tl.load(row + kc // 16 * 16 + rk).to(tl.int32))  # kc // 16 * 16: kc, provably 16-aligned
        scale_ptr = heap_ptr(base, scales, tl.float32)
        if FORMAT == 6:
            value = value * tl.load(scale_ptr + rows)
        else:  # BLOCK_K columns from a multiple of BLOCK_K (scale_offset one too): one scale block
            value = value * tl.load(scale_ptr + rows * scales_stride + (kc + scale_offset) // 128)
    elif ALIGNED and FORMAT == 4:  # q4_k: columns kc .. kc + 256 are a super-block
        tl.static_assert(BLOCK_K == 256, "the aligned Q4_K block is a super-block")
        block = (row + kc // 256 * 144)[:, :, None]  # [BLOCK_N, 1, 1]
        runs = tl.load(block + 16 + tl.arange(0, 128)[None, None, :]).to(tl.int32)  # 4 runs of 32 bytes
        runs = tl.reshape(runs, (BLOCK_N, 4, 32))
        # run p holds sub-block 2p in its low nibbles, 2p + 1 in its high ones
        q = tl.reshape(tl.permute(tl.join(runs & 15, runs >> 4), (0, 1, 3, 2)), (BLOCK_N, 8, 32))
        value = tl.reshape(_q4_k_value(block, tl.arange(0, 8)[None, :, None], q), (BLOCK_N, BLOCK_K))
    else:
        cols = kc + rk
        value = dequantized(base, w, scales, rows, tl.minimum(cols, k_end - 1), w_stride, scales_stride,
                            scale_offset, FORMAT)
        value = tl.where(cols < k_end, value, 0.0)
    return value


@triton.jit
def _quantized_rows(base, y, x, w, scales, pos, row0, k0, m, n, k, y_stride, x_stride, w_stride, scales_stride,
                    scale_offset, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, ALIGNED: tl.constexpr,
                    BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ W[row0:row0 + n, k0:k0 + k].T`` (see ``quantized_linear_tile``); m, n and k
    int32 (a count divides as int32 only: common's docstring)."""
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    rm = tl.arange(0, BLOCK_M)[None, :]
    live = live_rows(base, pos, rm, m, BY_POS)
    x_ptr = heap_ptr(base, x, X_DTYPE)
    for r0 in range(0, n, BLOCK_N):
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed: y[i, r0 + j] is acc[j, i]
        rows = row0 + tl.minimum(r0 + rn, n - 1)
        for c0 in range(0, k, BLOCK_K):
            cols = c0 + rk
            b = dequantized_block(base, w, scales, rows, k0 + c0, k0 + k, w_stride, scales_stride, scale_offset, FORMAT,
                         BLOCK_N, BLOCK_K, ALIGNED)
            if USE_DOT:
                a = tl.load(x_ptr + rm * x_stride + tl.trans(cols), mask=(rm < m) & (tl.trans(cols) < k), other=0.0)
                acc += dot(b, a)  # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]
            else:
                for i in range(0, m):
                    a = tl.load(x_ptr + i * x_stride + cols, mask=cols < k, other=0.0).to(tl.float32)
                    acc = tl.where(rm == i, acc + tl.sum(b * a, axis=1)[:, None], acc)
        rows_out = r0 + rn
        tl.store(heap_ptr(base, y, Y_DTYPE) + rm * y_stride + rows_out, rounded(tl.where(live, acc, 0.0), Y_DTYPE),
                 mask=(rows_out < n) & (rm < m))


@triton.jit
def quantized_linear_tile(base,
                          y, x, w, scales,      # heap offsets: y's and x's first elements, w's and its scales' whole
                          pos,                  # BY_POS: heap offset of the int64 position of x's first row
                          row0, k0,             # w's first row and column this tile reads
                          m, n, k,              # y is m x n, x m x k; w rows row0.., columns k0..
                          y_stride, x_stride,   # row strides, in elements
                          w_stride,             # bytes from one packed row of w to the next
                          scales_stride,        # fp8_block: scales per row of scales
                          scale_offset,         # fp8_block: columns of the first scale block before w's
                          X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, FORMAT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                          ALIGNED: tl.constexpr, BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ W[row0:row0 + n, k0:k0 + k].T``, W dequantized (``dequantized``) in
    registers, float32 accumulation; m <= BLOCK_M, any n (BLOCK_N rows of W at a time), k0 a whole
    number of the format's blocks. Rows past n re-read row n - 1, columns past k are masked. ``USE_DOT``
    (BLOCK_M >= 16: prefill rows): the products by ``tl.dot`` in IEEE float32 (the dequantized weights
    are float32), otherwise reduced per row of x. ``ALIGNED``: see ``dequantized_block``. ``BY_POS``: a row
    of x at NO_SEQUENCE holds no sequence and its y row is zero (``live_rows``, as ``linear_tile``)."""
    _quantized_rows(base, y, x, w, scales, pos, row0, k0, m.to(tl.int32), n.to(tl.int32), k.to(tl.int32), y_stride,
                    x_stride, w_stride, scales_stride, scale_offset, X_DTYPE, Y_DTYPE, FORMAT, BLOCK_M, BLOCK_N,
                    BLOCK_K, USE_DOT, ALIGNED, BY_POS)


@triton.jit
def quantized_expert_linear_tile(base, status,
                                 y, x, w, scales,  # heap offsets: the output row, the input row, the stacked weight's
                                 expert,           # heap offset of the int64 expert index
                                 count,            # the number of experts
                                 expert_rows,      # rows of w per expert
                                 row0, n, k,       # the tile is rows row0 .. row0 + n of the expert's, k long
                                 w_stride, scales_stride, scale_offset,
                                 X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, FORMAT: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """``y[0, :n] = x[0, :k] @ W_e[row0:row0 + n].T`` for the expert ``e`` read from the heap (outside
    [0, count): expert 0, reported), W_e the rows of expert e in the stacked quantized weight."""
    e = checked_index(status, tl.load(heap_ptr(base, expert, tl.int64)), count)
    _quantized_rows(base, y, x, w, scales, 0, e * expert_rows + row0, 0, 1, n.to(tl.int32), k.to(tl.int32), n, k,
                    w_stride, scales_stride, scale_offset, X_DTYPE, Y_DTYPE, FORMAT, 1, BLOCK_N, BLOCK_K, False,
                    ALIGNED, False)


def unpacking(heap, format: Format, w: int, w_stride: int, scales: int, scales_stride: int, scale_offset: int,
              rows: int, cols: int, row0: int, col0: int) -> tuple[tuple, tuple[torch.Tensor, ...], Callable]:
    """How to unpack the weight at heap offset ``w`` from row ``row0``, column ``col0`` (a block's): a name
    for it, the heap views it is made from (packed bytes, scales) and what makes it, float32 [rows, cols]."""
    data = heap.tensor(w + row0 * w_stride + format.row_bytes(col0), torch.uint8, rows, format.row_bytes(cols),
                       w_stride)
    key = ("dequantized", format.code, w, w_stride, scales, scales_stride, scale_offset, rows, cols, row0, col0)
    if format.scales == "channel":
        scales = heap.tensor(scales, torch.float32, 1, row0 + rows, row0 + rows)[0]
    elif format.scales == "block":
        scales = heap.tensor(scales, torch.float32, row0 + rows, ceil_div(scale_offset + col0 + cols, FP8_SCALE_BLOCK),
                             scales_stride)
    sources = (data,) if format.scales is None else (data, scales)
    return key, sources, lambda: dequantize(format, data, cols, scales, row0, col0, scale_offset)


def unpacked_weight(heap, format: Format, w: int, w_stride: int, scales: int, scales_stride: int, scale_offset: int,
                    rows: int, cols: int, row0: int, col0: int) -> torch.Tensor:
    """float32 [rows, cols]: the weight ``unpacking`` names, unpacked where the heap keeps what tiles derive
    (``HeapView.derived``: a torch backend's worker unpacks a tile's weights once, not at every step, and
    again if they change)."""
    return heap.derived(*unpacking(heap, format, w, w_stride, scales, scales_stride, scale_offset, rows, cols, row0,
                                   col0))


def _expert_linear_reference(heap, task) -> None:
    e = heap_index(heap, task.expert, task.count)
    linear_rows(heap, *_rows_and_weight(heap, task, 1, task.k, task.n, e * task.expert_rows + task.row0, 0))


def _linear_reference(heap, task) -> None:
    linear_rows(heap, *_rows_and_weight(heap, task, task.m, task.x_stride, task.y_stride, task.row0, task.k0),
                heap.words(task.pos, task.m, 8) if task.BY_POS else None)


def _rows_and_weight(heap, task, m: int, x_stride: int, y_stride: int, row0: int, col0: int) -> tuple:
    """``linear_rows``' arguments after the heap for a quantized linear tile of ``m`` rows of x and y, its
    weight's rows from ``row0``, columns from ``col0`` (unpacked, then laid out for the CPU, once)."""
    key, sources, make = unpacking(heap, FORMATS_BY_CODE[task.FORMAT], task.w, task.w_stride, task.scales,
                                   task.scales_stride, task.scale_offset, task.n, task.k, row0, col0)
    x = heap.tensor(task.x, task.X_DTYPE, m, task.k, x_stride)
    y = heap.tensor(task.y, task.Y_DTYPE, m, task.n, y_stride)
    return key, x, y, sources, make, torch.float32


SPLIT_COLUMNS = 256  # K-ranges (split_k) start on multiples of it: a whole number of every format's blocks
BLOCK_N, BLOCK_K = 16, 64  # the block of w a tile dequantizes at a time: 8 elements per thread
# ... on the vector paths, 2 KiB of packed bytes, 16 per thread (one 16-byte vector each): FP8 32 rows x 64
# columns, Q4_K 16 rows x a super-block (128 bytes of nibbles)
VECTOR_BLOCKS = {"fp8_channel": (32, 64), "fp8_block": (32, 64), "q4_k": (16, 256)}
TILE_ROWS = 64       # rows of w per tile (with ``Graph.few_tiles``: a worker's share)
MAX_BLOCK_M = 16     # rows of x per tile
DOT_MIN_M = 16       # from this many rows of x a tile multiplies with tl.dot
EMBEDDING_BLOCK_N = 256


def linear(g, x, w: Quantized, split_k: int | None = None, out=None, pos=None):
    """``x [M, K] @ w.T -> [M, N]`` for a quantized ``w`` [N, K] (see ``tasks.linear.linear``), into ``out``
    (an [M, N] view) when given; K-ranges (``split_k``) start on multiples of SPLIT_COLUMNS columns; ``pos``,
    the positions of x's rows (checked by ``tasks.linear.linear``): a row at -1 is zero, not computed."""
    require_float(g, "linear", x=x)
    g.require(w.data.graph is g, "linear: the quantized weight belongs to another graph")
    g.require(x.ndim == 2 and x.cols == w.cols, f"linear: x has shape {x.shape} but w has shape {w.shape}; "
                                                f"expected w of shape (N, {x.cols})")
    m_total, n_total, k_total = x.rows, w.rows, w.cols
    blocks = ceil_div(k_total, SPLIT_COLUMNS)
    splits = 1 if split_k is None else split_k
    g.require(isinstance(splits, int) and 1 <= splits <= blocks,
              f"linear: split_k of a quantized weight must be None or an integer in [1, {blocks}] (whole blocks "
              f"of {SPLIT_COLUMNS} columns), got {split_k!r}")
    bounds = [min(k_total, blocks * s // splits * SPLIT_COLUMNS) for s in range(splits + 1)]
    k_ranges = [(k0, k1 - k0) for k0, k1 in zip(bounds, bounds[1:])]
    y = out if out is not None else g.new_tensor((m_total, n_total), x.dtype)
    g.require(y.shape == (m_total, n_total) and y.dtype == x.dtype,
              f"linear: out is {y.shape} {y.dtype}, expected {(m_total, n_total)} {x.dtype}")
    target = y if splits == 1 else g.new_tensor((splits * m_total, n_total), torch.float32)
    block_m = min(next_power_of_2(m_total), MAX_BLOCK_M)
    block_n, block_k, aligned = tile_blocks(w, [k0 for k0, _ in k_ranges], [k for _, k in k_ranges])
    opcode = g.opcode(QUANTIZED_LINEAR, X_DTYPE=x.dtype, Y_DTYPE=target.dtype, FORMAT=w.format.code,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=block_m >= DOT_MIN_M, ALIGNED=aligned,
                      BY_POS=pos is not None)
    f, data, scales = w.format, w.data, w.scales
    words = scale_words(w)
    tile_rows = ceil_div(n_total, g.parallelism) if g.few_tiles else TILE_ROWS  # a tile takes any n
    for s, (k0, k) in enumerate(k_ranges):
        byte0, nbytes = f.row_bytes(k0), f.row_bytes(k)
        for r0 in range(0, m_total, block_m):
            m = min(block_m, m_total - r0)
            row = s * m_total + r0
            for c0 in range(0, n_total, tile_rows):
                n = min(tile_rows, n_total - c0)
                scale_reads, scale_bytes = (), 0
                if f.scales is not None:  # a float32 per row, or per row and 128 columns
                    first = (w.scale_offset + k0) // FP8_SCALE_BLOCK
                    per_row = 1 if f.scales == "channel" else ceil_div(w.scale_offset + k0 + k, FP8_SCALE_BLOCK) - first
                    scale_reads, scale_bytes = (scales.region(0, 1, c0, n) if f.scales == "channel" else
                                                scales.region(c0, n, first, per_row),), 4 * n * per_row
                g.add_task(opcode, y=target.addr(row, c0), x=x.addr(r0, k0), w=data.addr(0, 0),
                           pos=0 if pos is None else pos.block().addr(0, r0), row0=c0, k0=k0,
                           m=m, n=n, k=k, y_stride=target.row_stride, x_stride=x.row_stride,
                           w_stride=data.row_stride, **words,
                           reads=(x.region(r0, m, k0, k), data.region(c0, n, byte0, nbytes), *scale_reads,
                                  *(() if pos is None else (pos.block().region(0, 1, r0, m),))),
                           writes=(target.region(row, m, c0, n),),
                           bytes=m * k * x.element_size + n * nbytes + scale_bytes + m * n * target.element_size,
                           flops=2 * m * n * k)
    if splits > 1:
        sum_slices(g, y, target, splits, m_total)
    return y


def tile_blocks(w: Quantized, starts: list[int], lengths: list[int]) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCK_K, ALIGNED) of tiles reading columns ``start .. start + length`` of ``w``: its
    format's vector path (``dequantized_block``, VECTOR_BLOCKS) when its rows and every start's byte are 16-byte
    aligned and every length and its scale offset whole BLOCK_K steps; else the gathered one."""
    f = w.format
    block_n, block_k = VECTOR_BLOCKS.get(f.name, (BLOCK_N, BLOCK_K))
    aligned = f.name in VECTOR_BLOCKS and all(k % block_k == 0 for k in (*lengths, w.scale_offset)) and \
        vector_aligned(w.data.addr(0, 0), w.data.row_stride, *(f.row_bytes(k0) for k0 in starts))
    return (block_n, block_k, True) if aligned else (BLOCK_N, BLOCK_K, False)


def scale_words(w: Quantized) -> dict:
    scales = w.scales
    return {"scales": scales.addr(0, 0) if scales is not None else 0,
            "scales_stride": scales.row_stride if scales is not None else 0, "scale_offset": w.scale_offset}


def expert_rows(g, x, w: Quantized, experts, count: int):
    """``tasks.moe.expert_rows`` of a quantized stacked weight ``w [count * n, K]``: each (token, slot) row
    streams its chosen expert's packed rows, dequantized in the tiles."""
    tokens, slots = experts.rows, experts.cols
    g.require(w.data.graph is g, "expert_rows: the quantized weight belongs to another graph")
    g.require(experts.ndim == 2 and experts.dtype == torch.int64,
              f"expert_rows: experts must be int64 [tokens, slots], got {experts.shape} {experts.dtype}")
    require_float(g, "expert_rows", x=x)
    g.require(x.ndim == 2 and x.cols == w.cols and x.rows in (tokens, tokens * slots) and is_count(count)
              and w.rows % count == 0, f"expert_rows: x {x.shape}, a quantized w {w.shape} and {count!r} experts "
                                       f"do not fit (see tasks.moe.expert_rows)")
    n_total, k_total = w.rows // count, w.cols
    y = g.new_tensor((tokens * slots, n_total), x.dtype)
    block_n, block_k, aligned = tile_blocks(w, [0], [k_total])
    opcode = g.opcode(QUANTIZED_EXPERT_LINEAR, X_DTYPE=x.dtype, Y_DTYPE=y.dtype, FORMAT=w.format.code, BLOCK_N=block_n,
                      BLOCK_K=block_k, ALIGNED=aligned)
    whole = (w.data.region(0, w.rows, 0, w.data.cols),) + \
        ((w.scales.region(0, w.scales.rows, 0, w.scales.cols),) if w.scales is not None else ())
    row_bytes = w.data.cols + 4 * (w.scales.cols if w.format.scales == "block" else w.scales is not None)
    for b, s, row, x_row in routed_rows(x, experts):
        for c0 in range(0, n_total, TILE_ROWS):
            n = min(TILE_ROWS, n_total - c0)
            g.add_task(opcode, y=y.addr(row, c0), x=x.addr(x_row, 0), w=w.data.addr(0, 0), expert=experts.addr(b, s),
                       count=count, expert_rows=n_total, row0=c0, n=n, k=k_total, w_stride=w.data.row_stride,
                       **scale_words(w), reads=(x.region(x_row, 1, 0, k_total), experts.region(b, 1, s, 1), *whole),
                       writes=(y.region(row, 1, c0, n),),
                       bytes=k_total * x.element_size + n * row_bytes + n * y.element_size, flops=2 * n * k_total)
    return y


# -- the embedding lookup of a quantized table ----------------------------------------------------------------

@triton.jit
def _dequantized_row(base, out, table, scales, row, cols, table_stride, scales_stride, scale_offset,
                     OUT_DTYPE: tl.constexpr,
                     FORMAT: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[:cols] = row ``row`` of the quantized table, BLOCK_N elements at a time."""
    c = tl.arange(0, BLOCK_N)
    for c0 in range(0, cols, BLOCK_N):
        at = c0 + c
        value = dequantized(base, table, scales, row, tl.minimum(at, cols - 1), table_stride, scales_stride,
                            scale_offset, FORMAT)
        tl.store(heap_ptr(base, out, OUT_DTYPE) + at, rounded(value, OUT_DTYPE), mask=at < cols)


@triton.jit
def quantized_embedding_tile(base, status,
                             out, table, scales,   # heap offsets: the output row, the packed table, its scales
                             token,                # heap offset of the int64 token id
                             rows, cols,           # the table's shape, in elements
                             table_stride,         # bytes between packed rows
                             scales_stride, scale_offset,
                             OUT_DTYPE: tl.constexpr, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row ``*token`` of the quantized table, dequantized, to the output row (out of range: row 0, reported)."""
    row = checked_index(status, tl.load(heap_ptr(base, token, tl.int64)), rows)
    _dequantized_row(base, out, table, scales, row, cols, table_stride, scales_stride, scale_offset, OUT_DTYPE, FORMAT,
                     BLOCK_N)


@triton.jit
def quantized_embedding_at_tile(base, status,
                                out, table, scales,   # heap offsets: the output row, the packed table, its scales
                                history,              # heap offset of the batch row's int64 token history
                                pos,                  # heap offset of the int64 position
                                history_cols,         # positions of the history
                                rows, cols,           # the table's shape, in elements
                                table_stride,         # bytes between packed rows
                                scales_stride, scale_offset,
                                OUT_DTYPE: tl.constexpr, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row ``history[*pos]`` of the quantized table, dequantized, to the output row (as ``embedding_at``)."""
    at = row_position(status, heap_ptr(base, pos, tl.int64), history_cols)
    token = tl.load(heap_ptr(base, history, tl.int64) + tl.maximum(at, 0))
    row = checked_index(status, tl.where(at < 0, 0, token), rows)
    _dequantized_row(base, out, table, scales, row, cols, table_stride, scales_stride, scale_offset, OUT_DTYPE, FORMAT,
                     BLOCK_N)


def _copy_row(heap, task, row: int) -> None:
    value = unpacked_weight(heap, FORMATS_BY_CODE[task.FORMAT], task.table, task.table_stride, task.scales,
                    task.scales_stride, task.scale_offset, 1, task.cols, row, 0)
    heap.tensor(task.out, task.OUT_DTYPE, 1, task.cols, task.cols).copy_(value)


def _embedding_reference(heap, task) -> None:
    _copy_row(heap, task, token_row(heap, task))


def _embedding_at_reference(heap, task) -> None:
    _copy_row(heap, task, history_row(heap, task))


def embedding(g, tokens, table: Quantized, pos=None):
    """``tasks.embedding.embedding`` of a quantized table: rows dequantized into ``table.dtype``."""
    g.require(table.data.graph is g, "embedding: the quantized table belongs to another graph")
    block_n = min(next_power_of_2(table.cols), EMBEDDING_BLOCK_N)
    scales = table.scales
    words = dict(table=table.data.addr(0, 0), rows=table.rows, cols=table.cols, table_stride=table.data.row_stride,
                 **scale_words(table))
    table_reads = (table.data.region(0, table.rows, 0, table.data.cols),)
    if scales is not None:
        table_reads += (scales.region(0, scales.rows, 0, scales.cols),)
    cost = dict(bytes=table.data.cols + table.cols * 4, flops=table.cols)
    consts = dict(OUT_DTYPE=table.dtype, FORMAT=table.format.code, BLOCK_N=block_n)
    if pos is None:
        g.require(tokens.ndim == 1 and tokens.dtype == torch.int64,
                  f"embedding: tokens must be 1-D int64, got {tokens.shape} {tokens.dtype}")
        out = g.new_tensor((tokens.cols, table.cols), table.dtype)
        opcode = g.opcode(QUANTIZED_EMBEDDING, **consts)
        for b in range(tokens.cols):
            g.add_task(opcode, out=out.addr(b, 0), token=tokens.addr(0, b), **words,
                       reads=(tokens.region(0, 1, b, 1), *table_reads), writes=(out.region(b, 1, 0, table.cols),),
                       **cost)
        return out
    g.require(tokens.ndim == 2 and tokens.dtype == torch.int64,
              f"embedding: a history must be 2-D int64 [batch, positions], got {tokens.shape} {tokens.dtype}")
    out = g.new_tensor((tokens.rows, table.cols), table.dtype)
    opcode = g.opcode(QUANTIZED_EMBEDDING_AT, **consts)
    for b, (position, position_region) in enumerate(row_positions(g, "embedding", pos, tokens.rows)):
        g.add_task(opcode, out=out.addr(b, 0), history=tokens.addr(b, 0), pos=position, history_cols=tokens.cols,
                   **words, reads=(tokens.region(b, 1, 0, tokens.cols), position_region, *table_reads),
                   writes=(out.region(b, 1, 0, table.cols),), **cost)
    return out


def every_format(g) -> tuple:
    """A one-row linear in every format, each its own dequantization in the kernel (the gathered path, and
    the 16-byte vector path for FP8 and Q4_K), for the ahead-of-time compiles of every format (the
    kernel with every task type holds the tile variants in fewer formats: ``_example``)."""
    results = []
    for format in FORMATS.values():
        # 544: a last step of 32 of BLOCK_K's columns (gathered); FP8 and Q4_K at 512: 16-byte vectors
        cols = 544 if format.block == 32 else 512
        w = quantized_input(g, f"quantized.{format.name}", (136, cols), format, torch.float32)
        results.append(g.linear(g.input(f"quantized.{format.name}.x", (1, cols), torch.float32), w))
    return tuple(results)


def _example(g):
    """Each tile's variants, in four formats: a one-row Q4_K linear (its vector path), a three-row split-K
    with positions and a ``tl.dot`` Q8_0 linear (gathered, a last step of 32 columns), an MoE whose experts are FP8 with
    block scales (gate/up: the vector path; down, 40 columns: gathered; grouped by expert, and a pass per slot), and Q8_0 embedding lookups. Every format goes
    through every tile in ``tests/test_quantized.py``, and compiles in ``every_format``'s kernel."""
    x1 = g.input("quantized.x1", (1, 512), torch.float32)
    x3 = g.input("quantized.x3", (3, 544), torch.bfloat16)
    x20 = g.input("quantized.x20", (20, 544), torch.bfloat16)  # tl.dot tiles: 16 rows of x, then 4
    w = quantized_input(g, "quantized.q8_0", (40, 544), Q8_0, torch.bfloat16)
    results = [g.linear(x1, quantized_input(g, "quantized.q4_k", (136, 512), Q4_K, torch.float32)),
               g.linear(x3, w, split_k=2, pos=g.input("quantized.x3.pos", (3,), torch.int64)), g.linear(x20, w)]
    x_moe = g.input("quantized.moe.x", (2, 64), torch.bfloat16)  # top-2 of 4 experts
    router = g.input("quantized.moe.router", (4, 64), torch.bfloat16)
    gate_up = quantized_input(g, "quantized.moe.gate_up", (4 * 80, 64), FP8_BLOCK, torch.bfloat16)
    results.append(g.moe_mlp(x_moe, router, gate_up,
                             quantized_input(g, "quantized.moe.down", (4 * 64, 40), FP8_BLOCK, torch.bfloat16),
                             2, True, torch.float32))
    results.append(g.expert_rows(x_moe, gate_up, g.route(g.linear(x_moe, router), 2, True)[0], 4))  # a pass per slot
    table = quantized_input(g, "quantized.table", (50, 544), Q8_0, torch.bfloat16)
    results += [g.embedding(g.input("quantized.tokens", (2,), torch.int64), table),
                g.embedding(g.input("quantized.history", (2, 45), torch.int64), table,
                            pos=g.input("quantized.pos", (1,), torch.int64))]
    return tuple(results)


QUANTIZED_LINEAR = TaskType("quantized_linear", quantized_linear_tile, _linear_reference, _example)
QUANTIZED_EXPERT_LINEAR = TaskType("quantized_expert_linear", quantized_expert_linear_tile, _expert_linear_reference,
                                   _example)
QUANTIZED_EMBEDDING = TaskType("quantized_embedding", quantized_embedding_tile, _embedding_reference, _example)
QUANTIZED_EMBEDDING_AT = TaskType("quantized_embedding_at", quantized_embedding_at_tile, _embedding_at_reference,
                                  _example)
TASK_TYPES = (QUANTIZED_LINEAR, QUANTIZED_EXPERT_LINEAR, QUANTIZED_EMBEDDING, QUANTIZED_EMBEDDING_AT)
OPS = {}
