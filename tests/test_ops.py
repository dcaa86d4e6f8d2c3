"""Every op against torch in float64, at shapes that are and are not multiples of the tiles."""
import collections

import pytest
import torch

import megakernel as mk
from megakernel.tasks.attention import BLOCK_S, split_size
from megakernel.tasks.linear import MIN_SPLIT_BLOCKS

from helpers import assert_close, random_inputs, run_checked, tolerance


def _rms(x, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("op", ["add", "mul", "silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("shape", [(1, 7), (9, 1000), (3, 1025), (17,)])
def test_elementwise(op, shape):
    g = mk.Graph()
    a, b = g.input("a", shape, torch.float32), g.input("b", shape, torch.float32)
    g.output("y", getattr(g, op)(a, b))
    inputs = random_inputs(g, seed=len(shape) + shape[0])
    out = run_checked(g, inputs)["y"]
    x, y = inputs["a"].double(), inputs["b"].double()
    expected = {"add": x + y, "mul": x * y, "silu_mul": torch.nn.functional.silu(x) * y,
                "gelu_tanh_mul": torch.nn.functional.gelu(x, approximate="tanh") * y}[op]
    assert out.shape == expected.shape
    assert_close(out, expected, tolerance(torch.float32), op)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_bfloat16_results_are_rounded_to_nearest_like_torch(op):
    """One rounding of the float32 result, to nearest even: bitwise what torch computes (the interpreter
    alone would truncate)."""
    g = mk.Graph()
    a, b = g.input("a", (4, 300), torch.bfloat16), g.input("b", (4, 300), torch.bfloat16)
    g.output("y", getattr(g, op)(a, b))
    inputs = random_inputs(g, seed=9)
    out = run_checked(g, inputs)["y"]
    assert torch.equal(out, getattr(torch, op)(inputs["a"], inputs["b"]))


def test_elementwise_on_views_writes_only_the_view():
    g = mk.Graph()
    a = g.input("a", (5, 300), torch.float32)
    b = g.input("b", (4, 40), torch.float32)
    y = g.add(a[1:, 250:290], b)
    g.output("y", y)
    g.output("row", g.mul(a[2], a[3]))
    inputs = random_inputs(g, seed=3)
    out = run_checked(g, inputs)
    assert_close(out["y"], inputs["a"][1:, 250:290].double() + inputs["b"].double(), 1e-6, "view add")
    assert out["row"].shape == (300,)
    assert_close(out["row"], inputs["a"][2].double() * inputs["a"][3].double(), 1e-6, "row mul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (6, 1500), (100,)])
def test_rms_norm(shape, dtype):
    g = mk.Graph()
    x = g.input("x", shape, dtype)
    w = g.input("w", (shape[-1],), dtype)
    g.output("y", g.rms_norm(x, w, 1e-5))
    inputs = random_inputs(g, seed=shape[-1])
    out = run_checked(g, inputs)["y"]
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, _rms(inputs["x"], inputs["w"], 1e-5), tolerance(dtype), "rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_unit_offset_rounds_once_like_gemma(dtype):
    g = mk.Graph()
    x, w = g.input("x", (3, 100), dtype), g.input("w", (100,), dtype)
    g.output("y", g.rms_norm(x, w, 1e-6, unit_offset=True))
    inputs = random_inputs(g, seed=4)
    out = run_checked(g, inputs)["y"]
    v = inputs["x"].float()
    gemma = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + inputs["w"].float())).to(dtype)
    assert torch.allclose(out.float(), gemma.float(), rtol=tolerance(dtype), atol=tolerance(dtype))
    assert_close(out, _rms(inputs["x"], 1 + inputs["w"].double(), 1e-6), tolerance(dtype), "unit-offset rms_norm")


@pytest.mark.parametrize("m,k,n,split_k", [
    (1, 64, 32, 1), (1, 300, 33, 1), (3, 100, 70, 2), (2, 129, 65, 3),  # GEMV tiles
    (16, 40, 50, 1), (20, 96, 40, 2), (33, 65, 17, 3),                  # tl.dot tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(m, k, n, split_k, dtype):
    g = mk.Graph()
    x = g.input("x", (m, k), dtype)
    w = g.input("w", (n, k), dtype)
    g.output("y", g.linear(x, w, split_k=split_k))
    inputs = random_inputs(g, seed=m * 1000 + k)
    out = run_checked(g, inputs, workers=3)["y"]
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, inputs["x"].double() @ inputs["w"].double().T, tolerance(dtype), "linear")


@pytest.mark.parametrize("m", [2, 20])
def test_linear_is_told_aligned_only_when_its_rows_and_k_are_whole_16_byte_vectors(m):
    """Views of 128-column rows (256 bytes, aligned): K of 96 bfloat16 columns is six 16-byte vectors, K of
    100 is not (its last vector would read 4 columns past k), and a view from column 4 starts 8 bytes in.
    GEMV (2 rows) and ``tl.dot`` (20) tiles alike."""
    for cols, aligned in ((slice(0, 96), True), (slice(0, 100), False), (slice(4, 100), False)):
        g = mk.Graph()
        x, w = g.input("x", (m, 128), torch.bfloat16), g.input("w", (40, 128), torch.bfloat16)
        g.linear(x[:, cols], w[:, cols])
        (spec,) = _linear_specs(g)
        assert spec["ALIGNED"] == aligned and spec["USE_DOT"] == (m >= 16), cols


def _linear_specs(g):
    return [dict(s.constexprs) for s in g.specs if s.task_type == "linear"]


def _tasks_of(g, task_type):
    return sum(g.specs[op].task_type == task_type for op in g.tasks.opcode)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("k,n,x_dtype,w_dtype", [
    (1000, 70, torch.float32, torch.float32),    # K not a whole number of blocks: masked last block
    (1024, 45, torch.bfloat16, torch.bfloat16),  # whole blocks, a partial last step, 45 = 11 x 4 + 1 rows
    (1500, 40, torch.float32, torch.bfloat16),   # bfloat16 weights under a float32 stream
])
def test_gemv_tiles(m, k, n, x_dtype, w_dtype):
    """The GEMV tiles at shapes that are not multiples of their blocks, against float64."""
    g = mk.Graph()
    x = g.input("x", (m, k), x_dtype)
    w = g.input("w", (n, k), w_dtype)
    g.output("y", g.linear(x, w))
    (spec,) = _linear_specs(g)
    assert spec["BLOCK_M"] == (1 if m == 1 else 8 if m == 5 else 2) and not spec["USE_DOT"]
    assert spec["EVEN_K"] == (k % spec["BLOCK_K"] == 0)
    assert spec["ALIGNED"] == (k * x_dtype.itemsize % 16 == 0 and k * w_dtype.itemsize % 16 == 0)
    assert _tasks_of(g, "linear") == -(-n // 32)  # parallelism 1: 32 rows of w per tile, as ever
    inputs = random_inputs(g, seed=m * 7919 + k + n)
    out = run_checked(g, inputs, workers=2)["y"]
    assert out.dtype == x_dtype and out.shape == (m, n)
    assert_close(out, inputs["x"].double() @ inputs["w"].double().T, tolerance(x_dtype), "gemv")


@pytest.mark.parametrize("m,dtype,parallelism", [
    (1, torch.float32, 30), (2, torch.bfloat16, 15), (5, torch.float32, 15),  # as many workers as 1500 allows
])
def test_linear_splits_k_for_parallelism(m, dtype, parallelism):
    """split_k=None: with fewer output tiles than the workers the graph is meant for, K is cut into
    whole blocks (at least MIN_SPLIT_BLOCKS each) until every worker has a tile; a fixed-order sum
    tile adds the partials."""
    k, n = 1500, 40
    g = mk.Graph(parallelism=parallelism)
    x = g.input("x", (m, k), dtype)
    w = g.input("w", (n, k), dtype)
    g.output("y", g.linear(x, w))
    (spec,) = _linear_specs(g)
    block_k = spec["BLOCK_K"]
    splits = _tasks_of(g, "linear") // -(-n // spec["BLOCK_N"])
    assert splits > 1 and _tasks_of(g, "linear") >= parallelism and _tasks_of(g, "sum_slices") >= 1
    assert not spec["EVEN_K"]  # 1500 is not a whole number of blocks: only the last range has a partial block
    ranges = sorted({(t[1] - g.inputs["x"].addr(0, 0)) // x.element_size for op, t in zip(g.tasks.opcode, g.tasks.args)
                     if g.specs[op].task_type == "linear"})
    assert len(ranges) == splits and all(k0 % block_k == 0 for k0 in ranges)
    assert all(b - a >= MIN_SPLIT_BLOCKS * block_k for a, b in zip(ranges, ranges[1:]))
    inputs = random_inputs(g, seed=m + 31)
    out = run_checked(g, inputs, workers=3)["y"]
    assert_close(out, inputs["x"].double() @ inputs["w"].double().T, tolerance(dtype), "auto split-K")


def test_linear_tiling_follows_parallelism():
    """Parallelism 1 keeps one tile per 32 rows and no split; more workers than output blocks split K
    (an explicit split_k still wins); enough output blocks share rows out evenly, without a split."""
    def build(parallelism, m=1, n=64, k=2048, split_k=None):
        g = mk.Graph(parallelism=parallelism)
        g.linear(g.input("x", (m, k), torch.bfloat16), g.input("w", (n, k), torch.bfloat16), split_k=split_k)
        return _tasks_of(g, "linear"), _tasks_of(g, "sum_slices")

    assert build(1) == (2, 0)
    assert build(1, split_k=2) == (4, 1)
    assert build(64, split_k=3) == (48, 1)      # 16 blocks of 4 rows x 3 ranges
    assert build(64) == (32, 1)                 # 16 blocks x 2 ranges: K = 4 blocks, at least 2 per range
    assert build(8, n=4096) == (8, 0)           # 1024 blocks of 4 rows over 8 workers: 8 tiles of 512 rows
    assert build(33, n=640) == (32, 0)          # 160 blocks: 32 tiles of 5 beat 33 uneven ones and a second wave


def test_linear_of_slices():
    g = mk.Graph()
    h = g.input("h", (2, 200), torch.float32)
    w = g.input("w", (90, 200), torch.float32)
    y = g.linear(h[:, :150], w[10:, 50:])
    g.output("y", y)
    inputs = random_inputs(g, seed=11)
    out = run_checked(g, inputs)["y"]
    assert_close(out, inputs["h"][:, :150].double() @ inputs["w"][10:, 50:].double().T, 1e-5, "sliced linear")


@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (3, torch.bfloat16), (5, torch.float32), (20, torch.float32)])
def test_linear_rows_that_hold_no_sequence_are_zero(m, dtype):
    """``pos``: a row at -1 holds no sequence; its output row is zero whatever x holds there (NaN here),
    the others are x @ w.T. GEMV tiles of one row and of several, ``tl.dot`` tiles, a split K."""
    g = mk.Graph()
    x, w = g.input("x", (m, 100), dtype), g.input("w", (70, 100), dtype)
    pos = g.input("pos", (m,), torch.int64)
    g.output("y", g.linear(x, w, pos=pos))
    g.output("split", g.linear(x, w, split_k=2, pos=pos))
    inputs = random_inputs(g, seed=m)
    inputs["pos"] = torch.where(torch.arange(m) % 3 == 1, -1, torch.arange(m) + 4) if m > 1 else torch.tensor([-1])
    dead = inputs["pos"] < 0
    inputs["x"][dead] = float("nan")
    out = run_checked(g, inputs, workers=3)
    expected = inputs["x"].double() @ inputs["w"].double().T
    expected[dead] = 0
    for name in ("y", "split"):
        assert torch.equal(out[name][dead], torch.zeros_like(out[name][dead])), name
        assert_close(out[name], expected, tolerance(dtype), name)


def test_linear_refuses_positions_that_are_not_one_per_row():
    g = mk.Graph()
    x, w = g.input("x", (3, 16), torch.float32), g.input("w", (8, 16), torch.float32)
    for pos in (g.input("p2", (2,), torch.int64), g.input("pf", (3,), torch.float32)):
        with pytest.raises(mk.GraphError, match="a position per row of x"):
            g.linear(x, w, pos=pos)


def test_rms_norm_with_weight_of_another_dtype():
    g = mk.Graph()
    x = g.input("x", (1, 64), torch.float32)
    w = g.input("w", (64,), torch.bfloat16)
    y = g.rms_norm(x, w)  # mixed norm weight dtype is allowed: the weight is upcast
    g.output("y", y)
    inputs = random_inputs(g, seed=5)
    out = run_checked(g, inputs)["y"]
    assert_close(out, _rms(inputs["x"], inputs["w"], 1e-6), 1e-5, "mixed-dtype rms_norm")


def _attention_reference(q, k_cache, v_cache, pos, batch, head_dim):
    """Softmax attention in float64 of every query head over cache rows 0 ..= pos of its batch row."""
    heads, kv_heads = q.shape[1] // head_dim, k_cache.shape[1] // head_dim
    max_seq = k_cache.shape[0] // batch
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            cols = slice(h // (heads // kv_heads) * head_dim, (h // (heads // kv_heads) + 1) * head_dim)
            keys = k_cache[b * max_seq:b * max_seq + pos + 1, cols].double()
            values = v_cache[b * max_seq:b * max_seq + pos + 1, cols].double()
            scores = keys @ q[b, h * head_dim:(h + 1) * head_dim].double() / head_dim ** 0.5
            out[b, h * head_dim:(h + 1) * head_dim] = torch.softmax(scores, 0) @ values
    return out


@pytest.mark.parametrize("dtype,batch,heads,kv_heads,head_dim,max_seq,parallelism,positions", [
    (torch.float32, 1, 4, 2, 64, 100, 1, (0, 63, 64, 99)),       # splits of 64 (parallelism 1)
    (torch.bfloat16, 1, 8, 2, 64, 100, 16, (31, 32, 70)),        # splits as short as they go (BLOCK_S), 8 < 16 tiles
    (torch.float32, 2, 2, 1, 18, 75, 6, (5, 40)),                # 2 rows x 3 splits of 32 = 6; 72-byte rows: no vectors
])
def test_decode_attention_splits(dtype, batch, heads, kv_heads, head_dim, max_seq, parallelism, positions):
    """Split-KV attention with the splits parallelism asks for, at positions inside and at the edges of
    splits; one kernel serves every position (the position is a device scalar)."""
    g = mk.Graph(parallelism=parallelism)
    q = g.input("q", (batch, heads * head_dim), dtype)
    k_cache = g.input("k", (batch * max_seq, kv_heads * head_dim), dtype)
    v_cache = g.input("v", (batch * max_seq, kv_heads * head_dim), dtype)
    pos = g.input("pos", (1,), torch.int64)
    g.output("y", g.decode_attention(q, k_cache, v_cache, pos, batch, head_dim))
    split = split_size(batch * kv_heads, max_seq, parallelism)
    assert split == (64 if parallelism == 1 else BLOCK_S)
    partials = _tasks_of(g, "attention_partial")
    assert partials == batch * kv_heads * -(-max_seq // split)
    assert partials >= parallelism or split == BLOCK_S
    assert _tasks_of(g, "attention_combine") == batch * heads
    spec = next(dict(s.constexprs) for s in g.specs if s.task_type == "attention_partial")
    assert spec["ALIGNED"] == (head_dim * dtype.itemsize % 16 == 0)
    inputs = random_inputs(g, seed=max_seq + parallelism)
    with mk.Megakernel(g, workers=2) as kernel:
        for p in positions:
            inputs["pos"] = torch.tensor([p])
            out = run_checked(g, inputs, kernel=kernel)["y"]
            expected = _attention_reference(inputs["q"], inputs["k"], inputs["v"], p, batch, head_dim)
            assert_close(out, expected, tolerance(dtype), f"attention at position {p}")


@pytest.mark.parametrize("dtype,batch,heads,kv_heads,head_dim,parallelism", [
    (torch.float32, 3, 4, 2, 64, 1),     # one tile: every row, both KV heads
    (torch.bfloat16, 1, 6, 3, 32, 4),    # one row: its KV heads in three tiles
    (torch.float32, 3, 2, 1, 18, 2),     # runs of two rows and one; 72-byte rows: no vectors
])
def test_decode_attention_in_whole_rows(dtype, batch, heads, kv_heads, head_dim, parallelism):
    """``whole_rows`` (the torch backend's default): a tile per run of rows and KV heads attends every position
    of its rows, normalised, with no partials; a row of no sequence gets zeros; sliding windows too."""
    max_seq = 70
    g = mk.Graph(parallelism=parallelism, few_tiles=True)
    q = g.input("q", (batch, heads * head_dim), dtype)
    k_cache = g.input("k", (batch * max_seq, kv_heads * head_dim), dtype)
    v_cache = g.input("v", (batch * max_seq, kv_heads * head_dim), dtype)
    pos = g.input("pos", (batch,), torch.int64)
    g.output("y", g.decode_attention(q, k_cache, v_cache, pos, batch, head_dim))
    g.output("w", g.decode_attention(q, k_cache, v_cache, pos, batch, head_dim, window=20))
    runs = -(-batch // -(-batch // parallelism))
    assert _tasks_of(g, "attention_rows") == 2 * runs * min(kv_heads, -(-parallelism // runs))
    assert _tasks_of(g, "attention_partial") == _tasks_of(g, "attention_combine") == 0
    inputs = random_inputs(g, seed=batch + parallelism)
    with mk.Megakernel(g, workers=2) as kernel:
        for positions in ([0, 69, 33][:batch], [40, -1, 5][:batch]):
            inputs["pos"] = torch.tensor(positions)
            out = run_checked(g, inputs, kernel=kernel)
            for b, p in enumerate(positions):
                for name, window in (("y", max_seq), ("w", 20)):
                    if p < 0:
                        assert torch.equal(out[name][b], torch.zeros(heads * head_dim, dtype=dtype))
                        continue
                    rows = slice(b * max_seq + max(0, p + 1 - window), b * max_seq + p + 1)
                    expected = _attention_reference(inputs["q"][b:b + 1], inputs["k"][rows], inputs["v"][rows],
                                                    rows.stop - rows.start - 1, 1, head_dim)
                    assert_close(out[name][b:b + 1], expected, tolerance(dtype), f"{name}, row {b} at {p}")


def _rope64(x, inv_freq, positions, head_dim):
    """Llama's rotate-half RoPE in float64, row r at ``positions[r]``."""
    angle = positions.double()[:, None] * inv_freq.double()[None, :]        # [rows, half]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    heads = x.double().view(x.shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    return (heads * cos[:, None] + rotated * sin[:, None]).reshape(x.shape)


@pytest.mark.interpreter  # the tiles' block loops, on the interpreter and as the torch references
@pytest.mark.parametrize("parallelism", [1, 3])
def test_few_tiles_cut_each_op_into_a_tile_per_worker_that_loops_over_its_blocks(parallelism):
    """``Graph.few_tiles`` (the torch backend's graphs): each op is at most ``parallelism`` tiles, each
    walking every block it covers (elementwise over row and column blocks, ``tl.dot`` linears over
    BLOCK_M x BLOCK_N blocks, the sum of split-K partials, RoPE and cache appends over rows at positions
    of their own), and computes what float64 torch does."""
    g = mk.Graph(parallelism=parallelism, few_tiles=True)
    a, b = g.input("a", (9, 1000), torch.float32), g.input("b", (9, 1000), torch.float32)
    x1, x40 = g.input("x1", (1, 96), torch.float32), g.input("x40", (40, 50), torch.float32)
    w, w50 = g.input("w", (70, 96), torch.float32), g.input("w50", (70, 50), torch.float32)
    norm_w = g.input("norm_w", (1000,), torch.float32)
    q, pos = g.input("q", (5, 4 * 16), torch.float32), g.input("pos", (5,), torch.int64)
    inv_freq = g.input("inv_freq", (8,), torch.float32)
    cache = g.input("cache", (5 * 12, 4 * 16), torch.float32)
    g.output("silu_mul", g.silu_mul(a, b))
    g.output("norm", g.rms_norm(a, norm_w, 1e-5))
    g.output("gemv", g.linear(x1, w))
    g.output("dot", g.linear(x40, w50))
    g.output("split", g.linear(x1, w, split_k=2))
    rotated = g.rope(q, inv_freq, pos, 16)
    g.output("rope", rotated)
    g.output("cache", g.kv_append(cache, rotated, pos, 5))
    tiles = collections.Counter(g.specs[op].task_type for op in g.tasks.opcode)
    assert tiles == {"binary": min(parallelism, 2),  # 9 rows: two blocks of 8 rows, each whole columns
                     "rms_norm": parallelism, "linear": 4 * parallelism,  # two K-ranges of p tiles for split-K
                     "sum_slices": 1,  # one block: 70 columns
                     "rope": parallelism, "kv_append": parallelism}
    inputs = random_inputs(g, seed=parallelism)
    positions = torch.tensor([3, 0, 11, 7, 5])
    inputs.update(pos=positions, inv_freq=1.0 / 10000 ** (torch.arange(8) / 8))
    out = run_checked(g, inputs)
    f64 = {name: t.double() for name, t in inputs.items()}
    assert_close(out["silu_mul"], torch.nn.functional.silu(f64["a"]) * f64["b"], 1e-5, "silu_mul")
    assert_close(out["norm"], _rms(inputs["a"], inputs["norm_w"], 1e-5), 1e-5, "rms_norm")
    assert_close(out["gemv"], f64["x1"] @ f64["w"].T, 1e-5, "gemv")
    assert_close(out["dot"], f64["x40"] @ f64["w50"].T, 1e-5, "dot")
    assert_close(out["split"], f64["x1"] @ f64["w"].T, 1e-5, "split-K")
    expected = _rope64(inputs["q"], inputs["inv_freq"], positions, 16)
    assert_close(out["rope"], expected, 1e-5, "rope")
    appended = inputs["cache"].double().clone()
    for row, p in enumerate(positions.tolist()):
        appended[row * 12 + p] = expected[row]
    assert_close(out["cache"], appended, 1e-5, "kv_append")
