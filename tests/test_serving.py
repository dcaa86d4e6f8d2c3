"""Serving: sequences at positions of their own in the rows of one batch, joining and leaving (continuous
batching), their KV cache in pages of a pool, their prompts prefilled in chunks, each generating what it
would alone (``transformers.generate``)."""
import collections
import functools

import pytest
import torch

import megakernel as mk
from megakernel.heap import HeapView
from megakernel.serving import KVCacheFull, from_hf
from megakernel.reference import execute

from helpers import assert_close, tolerance
from test_decode import hf_model

# continuous batching and prefill end to end: on the torch backend (the tiles are proven
# under the interpreter: test_ops, test_task_types), but for the tests marked interpreter
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_backend")]


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(100 + length))


def _alone(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    ids = prompt.reshape(1, -1)
    with torch.no_grad():  # the mask explicit: a prompt token equal to the pad id is not padding
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0]


def _many(model, lengths, new, page_size, prefill_chunk):
    m = from_hf(model, max_seq_len=24, max_batch=2, page_size=page_size, prefill_chunk=prefill_chunk, workers=1)
    try:
        return m.generate([_prompt(n) for n in lengths], new), m.kernel.launches
    finally:
        m.close()


# launches: without prefill rows, one per sequence end (the waiting prompt joins as the first one leaves);
# with them, one per prefill chunk too (a launch prefills up to prefill_chunk prompt positions)
@pytest.mark.parametrize("world, page_size, prefill_chunk, launches", [(1, 4, 8, 6), (1, 16, 0, 3), (2, 4, 16, 5),
                                                                       (2, 16, 8, 6)])
def test_prompts_of_different_lengths_generate_what_each_would_alone(world, page_size, prefill_chunk, launches):
    """Prompts of 1, 7 and 20 tokens through 2 slots (the third waits for a free one), KV in pages, prompts
    prefilled in chunks or read a token per step: each exactly as alone."""
    model = hf_model("qwen3", kv_heads=2, layers=1)
    lengths, new = (1, 7, 20), 3
    job = functools.partial(_many, model, lengths, new, page_size, prefill_chunk)
    results = mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]
    for rank, (outputs, made) in enumerate(results):
        for length, out in zip(lengths, outputs):
            assert torch.equal(out, _alone(model, _prompt(length), new)), f"prompt of {length}, rank {rank} of {world}"
        assert made == launches


def test_sequences_join_others_mid_generation_and_reuse_a_freed_slot_and_its_pages():
    model = hf_model("llama", layers=1)
    m = from_hf(model, max_seq_len=16, max_batch=3, page_size=4, prefill_chunk=4, workers=1)
    try:
        a, b = m.add(_prompt(4), 6), m.add(_prompt(2), 2)
        tokens = {a: [], b: []}

        def step():
            for sequence, made in m.step().items():
                tokens[sequence] += made

        step()  # a's prompt but its last token prefilled (a block of chunk rows is one sequence's), a's token
        assert len(tokens[a]) == 1 and tokens[b] == []
        step()  # then b's, while a makes its second token
        assert len(tokens[a]) == 2 and len(tokens[b]) == 1
        c = m.add(_prompt(5), 4)  # joins while a and b are mid-generation
        tokens[c] = []
        b_pages = list(m.pool.held[1])
        step()  # b has its 2 tokens: its slot and pages are free again; c prefilled, its first token
        assert m.slots[1] is None and b in m.finished and m.pool.held[1] == [] and len(tokens[c]) == 1
        d = m.add(_prompt(3), 3)  # joins a and c mid-generation, in b's old slot, on b's old pages
        assert m.slots[1].id == d
        tokens[d] = []
        while any(m.slots):
            step()
            if len(tokens[d]) == 1:  # d's prompt is in its pages now
                assert set(m.pool.held[1]) & set(b_pages), "d took none of b's freed pages"
        for sequence, (length, new) in {a: (4, 6), b: (2, 2), c: (5, 4), d: (3, 3)}.items():
            expected = _alone(model, _prompt(length), new)
            assert tokens[sequence] == expected[length:].tolist(), f"sequence {sequence}"
            assert torch.equal(m.finished[sequence], expected)
        assert len(m.pool.free) == m.pool.pages
    finally:
        m.close()


def test_prefill_of_a_long_prompt_gives_the_last_positions_logits():
    """A 20-token prompt in chunks of 8 (8 + 8 + 3 positions, the last in its batch row): three launches,
    after which the logits are transformers' at the last position (float32, within 1e-4)."""
    model = hf_model("qwen3", kv_heads=2, layers=2)
    prompt = _prompt(20)
    m = from_hf(model, max_seq_len=24, max_batch=1, page_size=4, prefill_chunk=8, workers=1)
    try:
        sequence = m.add(prompt, 2)
        assert m.step() == {} and m.step() == {}
        first = m.step()[sequence]
        with torch.no_grad():
            expected = model(prompt.reshape(1, -1)).logits[0, -1].float()
        assert_close(m.logits[0], expected, 1e-4, "last position's logits")
        assert m.kernel.launches == 3 and first == [int(expected.argmax())]
    finally:
        m.close()


def test_a_full_pool_is_a_clear_error_that_harms_no_other_sequence():
    """Two sequences that need 3 pages each and a pool of 5: the launch that would take the sixth raises,
    naming the sequence and the pool, having run nothing; the other goes on to what it makes alone."""
    model = hf_model("llama", layers=1)
    m = from_hf(model, max_seq_len=16, max_batch=2, page_size=4, kv_pages=5, prefill_chunk=0, workers=1)
    try:
        a, b = m.add(_prompt(3), 10), m.add(_prompt(4), 9)
        m.step(4), m.step(4)  # positions 0-7 (a position a step, the prompts' too): two pages each
        launches = m.kernel.launches
        with pytest.raises(KVCacheFull, match=f"sequence {b} needs 1 more page.*the pool has 5 pages and 0 free"):
            m.step(4)
        assert m.kernel.launches == launches and len(m.pool.free) == 1  # nothing launched, nothing kept
        m.cancel(b)
        while any(m.slots):
            m.step(4)
        assert torch.equal(m.finished[a], _alone(model, _prompt(3), 10))
    finally:
        m.close()
    m = from_hf(model, max_seq_len=16, max_batch=1, page_size=4, kv_pages=2, workers=1)
    try:
        m.decode(torch.tensor([5]), 0)  # row 0 keeps a page for the positions decode() wrote
        kept = list(m.pool.held[0])
        with pytest.raises(KVCacheFull, match="prompt 0 and 10 new tokens need 4 pages of 4 positions; the pool has 2"):
            m.generate([_prompt(5)], 10)
        with pytest.raises(KVCacheFull, match="1 rows of 5 prompt \\+ 10 new tokens need 4 pages"):
            m.generate(_prompt(5).reshape(1, -1), 10)
        assert m.kernel.launches == 1 and m.pool.held[0] == kept and len(m.pool.free) == 1
    finally:
        m.close()


def test_rows_of_no_sequence_do_no_work_and_leave_the_others_alone():
    """One row at position -1 among rows at positions of their own: its attention is zero, its cache
    untouched, and the others' results are those of a batch without it."""
    g = mk.Graph(world_size=1, rank=0)
    q, x = g.input("q", (3, 32), torch.float32), g.input("x", (3, 16), torch.float32)
    pos = g.input("pos", (3,), torch.int64)
    cache = g.input("cache", (3 * 8, 16), torch.float32)
    g.output("out", g.decode_attention(q, g.kv_append(cache, x, pos, batch=3), cache, pos, batch=3, head_dim=16))
    gen = torch.Generator().manual_seed(0)
    values = {"q": torch.randn(3, 32, generator=gen), "x": torch.randn(3, 16, generator=gen),
              "cache": torch.randn(24, 16, generator=gen), "pos": torch.tensor([5, -1, 2])}
    with mk.Megakernel(g, workers=2) as kernel:
        out = kernel.run(values)["out"]
        cache_after = kernel.tensor(g.inputs["cache"]).clone()
    assert torch.equal(out[1], torch.zeros(32)) and torch.equal(cache_after[8:16], values["cache"][8:16])
    for row, p in ((0, 5), (2, 2)):
        keys = values["cache"][row * 8:row * 8 + p + 1].clone()
        keys[p] = values["x"][row]
        for head in range(2):
            scores = torch.softmax(q_head := values["q"][row, head * 16:(head + 1) * 16] @ keys.T / 4.0, dim=-1)
            assert_close(out[row, head * 16:(head + 1) * 16], scores @ keys, 1e-5, f"row {row} head {head}")
            del q_head


def test_bad_requests_are_refused_with_clear_errors():
    model = hf_model("llama", layers=1)
    m = from_hf(model, max_seq_len=8, max_batch=1, workers=1)
    try:
        with pytest.raises(mk.GraphError, match="the prompt is empty"):
            m.add(torch.tensor([], dtype=torch.int64), 2)
        with pytest.raises(mk.GraphError, match="9 prompt \\+ 1 new tokens exceed max_seq_len 8"):
            m.add(_prompt(9), 1)
        with pytest.raises(mk.GraphError, match="token id 500 is outside the vocabulary"):
            m.add(torch.tensor([1, 500]), 1)
        m.add(_prompt(3), 2)
        with pytest.raises(mk.GraphError, match="all 1 slots"):
            m.add(_prompt(3), 2)
        with pytest.raises(mk.GraphError, match="sequences \\[0\\] of add\\(\\) are running"):
            m.decode(torch.tensor([1]), 0)
        with pytest.raises(mk.GraphError, match="no running sequence has id 7"):
            m.cancel(7)
    finally:
        m.close()
    for options, message in (({"page_size": 0}, "page_size must be a positive int"),
                             ({"kv_pages": -1}, "kv_pages must be a positive int or None"),
                             ({"prefill_chunk": 1.5}, "prefill_chunk must be a non-negative int")):
        with pytest.raises(mk.GraphError, match=message):
            from_hf(model, max_seq_len=8, **options)


@pytest.mark.interpreter  # a tile's semantics
@pytest.mark.parametrize("page_size,few_tiles,backend", [(4, False, "cpu"), (16, False, "cpu"), (4, True, "cpu"),
                                                        (4, True, "torch")])
def test_paged_attention_follows_the_block_table(page_size, few_tiles, backend):
    """Rows whose pages are scattered over a pool (in no order, shared by no one): the append lands in
    the page of its position, and attention over the pages equals float64 attention over the positions.
    With ``few_tiles`` (2 workers): an append tile takes a run of rows, and so does an attention tile
    (``whole_rows``: every position of its rows, no partials), as its tile and as its torch reference."""
    batch, head_dim, max_pages = 3, 16, 3
    pool_pages = batch * max_pages + 1
    g = mk.Graph(world_size=1, rank=0, parallelism=2 if few_tiles else 1, few_tiles=few_tiles)
    q, x = g.input("q", (batch, 32), torch.float32), g.input("x", (batch, 16), torch.float32)
    pos, table = g.input("pos", (batch,), torch.int64), g.input("table", (batch, max_pages), torch.int64)
    pool = g.input("pool", (pool_pages * page_size, 16), torch.float32)
    cache = g.kv_append(pool, x, pos, batch, table=table, page_size=page_size)
    g.output("out", g.decode_attention(q, cache, cache, pos, batch, head_dim, table=table, page_size=page_size))
    tiles = collections.Counter(g.specs[op].task_type for op in g.tasks.opcode)
    assert ((tiles["kv_append"], tiles["attention_rows"], tiles["attention_combine"])
            == ((2, 2, 0) if few_tiles else (3, 0, 6)))
    gen = torch.Generator().manual_seed(page_size)
    pages = torch.randperm(pool_pages, generator=gen)[:batch * max_pages].reshape(batch, max_pages)
    positions = torch.tensor([max_pages * page_size - 1, -1, page_size + 1])
    values = {"q": torch.randn(batch, 32, generator=gen), "x": torch.randn(batch, 16, generator=gen),
              "pool": torch.randn(pool_pages * page_size, 16, generator=gen), "pos": positions, "table": pages}
    with mk.Megakernel(g, workers=2, backend=backend) as kernel:
        kernel.poison()  # NaN in every buffer the graph makes: the row of no sequence must write its zeros
        out = kernel.run(values)["out"]
        pool_after = kernel.tensor(g.inputs["pool"]).clone()
    rows = lambda b, n: pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size  # noqa: E731
    expected_pool = values["pool"].clone()
    for b, p in enumerate(positions.tolist()):
        if p >= 0:
            expected_pool[rows(b, p + 1)[-1]] = values["x"][b]
    assert torch.equal(pool_after, expected_pool)  # one row per live sequence, in its page; nothing else
    assert torch.equal(out[1], torch.zeros(32))
    for b, p in ((0, int(positions[0])), (2, int(positions[2]))):
        keys = expected_pool[rows(b, p + 1)].double()
        for head in range(2):
            scores = torch.softmax(values["q"][b, head * 16:(head + 1) * 16].double() @ keys.T / 4.0, dim=-1)
            assert_close(out[b, head * 16:(head + 1) * 16], scores @ keys, 1e-5, f"row {b} head {head}")


def test_a_page_outside_the_pool_is_clamped_and_reported_by_whole_row_tiles():
    """The torch backend's whole-row tiles (``kv_append``, ``attention_rows``): a block table entry outside the
    pool makes its row's append write nothing and the run report the index, as the kernel's checked_index
    does; a table inside the pool runs again on the same kernel, and an entry past a row's position is not
    read, as on the kernel."""
    batch, head_dim, max_pages, page_size = 2, 16, 2, 4
    pool_pages = batch * max_pages + 1
    g = mk.Graph(world_size=1, rank=0, parallelism=2, few_tiles=True)
    q, x = g.input("q", (batch, 32), torch.float32), g.input("x", (batch, 16), torch.float32)
    pos, table = g.input("pos", (batch,), torch.int64), g.input("table", (batch, max_pages), torch.int64)
    pool = g.input("pool", (pool_pages * page_size, 16), torch.float32)
    cache = g.kv_append(pool, x, pos, batch, table=table, page_size=page_size)
    g.output("out", g.decode_attention(q, cache, cache, pos, batch, head_dim, table=table, page_size=page_size))
    gen = torch.Generator().manual_seed(5)
    values = {"q": torch.randn(batch, 32, generator=gen), "x": torch.randn(batch, 16, generator=gen),
              "pool": torch.randn(pool_pages * page_size, 16, generator=gen), "pos": torch.tensor([5, 6]),
              "table": torch.tensor([[0, 1], [2, 99]])}  # row 1's position 6 lies in page 99: outside the pool
    with mk.Megakernel(g, workers=2, backend="torch") as kernel:
        with pytest.raises(mk.GraphError, match=rf"index 99 .*is outside \[0, {pool_pages}\)"):
            kernel.run(values)
        expected = values["pool"].clone()
        expected[1 * page_size + 5 % page_size] = values["x"][0]  # row 0's append only
        assert torch.equal(kernel.tensor(g.inputs["pool"]), expected)
        out = kernel.run({"table": torch.tensor([[0, 1], [2, 3]])})["out"]
        assert torch.isfinite(out).all()
    # one tile of both rows: row 0 at position 2 reaches page 0 only, its second entry is never read, whatever it
    # holds, where row 1 reads two pages
    g = mk.Graph(world_size=1, rank=0, few_tiles=True)
    q, pos, table = g.input("q", (batch, 32), torch.float32), g.input("pos", (batch,), torch.int64), g.input(
        "table", (batch, max_pages), torch.int64)
    pool = g.input("pool", (pool_pages * page_size, 16), torch.float32)
    g.output("out", g.decode_attention(q, pool, pool, pos, batch, head_dim, table=table, page_size=page_size))
    values = {"q": values["q"], "pool": values["pool"], "pos": torch.tensor([2, 6]),
              "table": torch.tensor([[0, 99], [2, 3]])}
    with mk.Megakernel(g, workers=1, backend="torch") as kernel:
        short = kernel.run(values)["out"]
        assert torch.isfinite(short).all()
        assert torch.equal(short, kernel.run({"table": torch.tensor([[0, 4], [2, 3]])})["out"])


def test_a_chunk_tile_reports_a_page_outside_the_pool_only_where_a_block_reaches_it():
    """The torch backend's chunk attention over whole blocks (``few_tiles``: one tile, two blocks): entries of a
    block's table row past its furthest position, and a block of no rows' whole row, are never read, whatever
    they hold, as on the kernel; a page a block reaches outside the pool is clamped and reported."""
    rows, page_size, max_pages, pool_pages = 20, 4, 6, 13
    g = mk.Graph(world_size=1, rank=0, few_tiles=True)
    q, pos = g.input("q", (rows, 32), torch.float32), g.input("pos", (rows,), torch.int64)
    table = g.input("table", (rows, max_pages), torch.int64)
    pool = g.input("pool", (pool_pages * page_size, 16), torch.float32)
    g.output("out", g.chunk_attention(q, pool, pool, pos, 16, table=table, page_size=page_size))
    gen = torch.Generator().manual_seed(7)
    a, b = [0, 1, 2, 3, 99, 99], [6, 99, 99, 99, 99, 99]  # block 0 reaches pages 0-3, block 1 page 0
    values = {"q": torch.randn(rows, 32, generator=gen), "pool": torch.randn(pool_pages * page_size, 16, generator=gen),
              "pos": torch.tensor([*range(16), 0, 1, -1, -1]), "table": torch.tensor([a] * 16 + [b] * 4)}
    with mk.Megakernel(g, workers=1, backend="torch") as kernel:
        out = kernel.run(values)["out"]
        inside = kernel.run({"table": torch.tensor([a[:4] + [7, 8]] * 16 + [[6, 9, 10, 11, 12, 5]] * 4)})["out"]
        assert torch.equal(out, inside) and torch.isfinite(out).all()
        idle = kernel.run({"pos": torch.tensor([*range(16)] + [-1] * 4),
                           "table": torch.tensor([a] * 16 + [[99] * 6] * 4)})["out"]
        assert torch.equal(idle[:16], out[:16]) and not idle[16:].any()  # a block of no rows reads no page
        with pytest.raises(mk.GraphError, match=rf"index 99 .*is outside \[0, {pool_pages}\)"):
            kernel.run({"table": torch.tensor([[0, 1, 99, 3, 4, 5]] * 16 + [b] * 4)})


@pytest.mark.interpreter  # a tile's semantics
def test_a_guarded_part_runs_only_in_steps_whose_flag_is_not_minus_one():
    """Guarded tasks do their work while the flag holds a position and are skipped (outputs untouched)
    while it holds -1; the flag's reset at the end of a step (``advance`` to its limit) turns them off
    for the next step of the same launch."""
    g = mk.Graph(world_size=1, rank=0)
    x, flag = g.input("x", (8,), torch.float32), g.input("flag", (1,), torch.int64)
    count = g.input("count", (1,), torch.int64)
    with g.guarded(flag):
        g.output("sum", g.add(x, x))
        g.advance(count)            # counts the steps that ran the guarded part
    g.advance(flag, limit=0)        # any position becomes -1 after the step
    x0 = torch.randn(8, generator=torch.Generator().manual_seed(1))
    with mk.Megakernel(g, workers=2) as kernel:
        kernel.bind({"x": x0, "count": torch.tensor([0])})
        kernel.poison()  # NaN in every buffer the graph makes
        assert torch.isnan(kernel.run({"flag": torch.tensor([-1])}, steps=2)["sum"]).all()
        assert int(kernel.tensor(g.inputs["count"])) == 0
        kernel.bind({"flag": torch.tensor([3])})
        heap = kernel.heap.clone()
        assert torch.equal(kernel.run(steps=3)["sum"], 2 * x0)
        assert int(kernel.tensor(g.inputs["count"])) == 1 and int(kernel.tensor(g.inputs["flag"])) == -1
        execute(kernel.tables, heap, steps=3)  # the reference executor skips the same tiles
        assert int(HeapView(heap).tensor(g.inputs["count"].addr(0, 0), torch.int64, 1, 1, 1)) == 1
    other = mk.Graph(world_size=1, rank=0)
    with pytest.raises(mk.GraphError, match="one int64 element"):
        with other.guarded(other.input("x", (8,), torch.float32)):
            pass


@pytest.mark.parametrize("head_dim, q_pad, cache_col, cache_pad, aligned", [
    (16, 0, 0, 0, True),
    (20, 0, 0, 0, False),   # rows of 160 and 80 bytes, but the second head starts 40 bytes in
    (24, 4, 0, 0, False),   # q a view of wider rows: a row stride of 104 bytes
    (24, 0, 4, 4, False),   # the caches a view 8 bytes into rows of 64
])
def test_chunk_attention_loads_vectors_only_where_every_row_is_16_byte_aligned(head_dim, q_pad, cache_col,
                                                                                cache_pad, aligned):
    """When the rows of q, out and the caches, and each head's columns, all start at a multiple of 16 bytes,
    the tile is told so (``ALIGNED``) and loads 16-byte vectors; each case below misses one of them only
    and is loaded element by element (bfloat16, two query heads per KV head)."""
    g = mk.Graph(world_size=1, rank=0)
    kv_cols = 2 * head_dim if head_dim == 20 else head_dim
    cache = g.input("cache", (32, cache_col + kv_cols + cache_pad), torch.bfloat16)[:, cache_col:cache_col + kv_cols]
    q = g.input("q", (16, 2 * kv_cols + q_pad), torch.bfloat16)[:, :2 * kv_cols]
    g.chunk_attention(q, cache, cache, g.input("pos", (16,), torch.int64), head_dim)
    assert [dict(s.constexprs)["ALIGNED"] for s in g.specs] == [aligned]


@pytest.mark.interpreter  # a tile's semantics
@pytest.mark.parametrize("page_size, window, dtype", [(4, None, torch.float32), (16, 6, torch.float32),
                                                      (4, None, torch.bfloat16)], ids=["pages", "window", "bfloat16"])
@pytest.mark.parametrize("backend, few_tiles", [("cpu", False), ("cpu", True), ("torch", True)],
                         ids=["tile-per-block-and-head", "one-tile", "one-tile-torch"])
def test_chunk_attention_is_causal_over_the_chunk_and_the_cached_pages(page_size, window, dtype, backend, few_tiles):
    """A chunk of two blocks: 16 rows of sequence A at positions 5-20 (0-4 cached by an earlier chunk),
    then 2 rows of sequence B at positions 0-1 and 2 unused rows. Each row attends to its sequence's
    keys at or before its position (inside the window): float64 attention over the positions. In
    bfloat16 the tile's products are bfloat16 ones (tensor cores on a GPU; widened under the interpreter).
    A tile per (block, KV head), or (``few_tiles``, one worker) one tile looping over both blocks and both KV
    heads: the interpreter's, and the torch backend's (its reference, every block and head at once)."""
    rows, head_dim, max_pages = 20, 16, -(-24 // page_size)
    pool_pages = 2 * max_pages + 1
    g = mk.Graph(world_size=1, rank=0, few_tiles=few_tiles)
    q, kv = g.input("q", (rows, 64), dtype), g.input("kv", (rows, 32), dtype)
    pos, table = g.input("pos", (rows,), torch.int64), g.input("table", (rows, max_pages), torch.int64)
    paging = dict(table=table, page_size=page_size)
    k_pool = g.kv_append(g.input("k", (pool_pages * page_size, 32), dtype), kv, pos, rows, **paging)
    v_pool = g.kv_append(g.input("v", (pool_pages * page_size, 32), dtype), kv.block(), pos, rows, **paging)
    g.output("out", g.chunk_attention(q, k_pool, v_pool, pos, head_dim, window=window, **paging))
    gen = torch.Generator().manual_seed(page_size)
    pages = torch.randperm(pool_pages, generator=gen)[:2 * max_pages].reshape(2, max_pages)
    positions = torch.tensor([*range(5, 21), 0, 1, -1, -1])
    owner = torch.tensor([0] * 16 + [1] * 4)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    values = {"q": randn(rows, 64), "kv": randn(rows, 32), "k": randn(pool_pages * page_size, 32), "pos": positions,
              "table": pages[owner]}
    values["v"] = values["k"].clone()
    assert sum(g.specs[op].task_type == "chunk_attention" for op in g.tasks.opcode) == (1 if few_tiles else 4)
    with mk.Megakernel(g, workers=2, backend=backend) as kernel:
        kernel.poison()
        out = kernel.run(values)["out"]
    cache = values["k"].double().clone()
    row_of = lambda s, p: int(pages[s, p // page_size]) * page_size + p % page_size  # noqa: E731
    for r, p in enumerate(positions.tolist()):
        if p >= 0:
            cache[row_of(int(owner[r]), p)] = values["kv"][r].double()
    for r, p in enumerate(positions.tolist()):
        if p < 0:
            assert torch.equal(out[r], torch.zeros(64, dtype=dtype)), f"unused row {r}"
            continue
        first = max(0, p + 1 - (window or p + 1))
        keys = cache[[row_of(int(owner[r]), key) for key in range(first, p + 1)]]
        for head in range(4):  # two query heads per KV head
            kv_cols = slice((head // 2) * 16, (head // 2 + 1) * 16)
            scores = torch.softmax(values["q"][r, head * 16:(head + 1) * 16].double() @ keys[:, kv_cols].T / 4.0, -1)
            assert_close(out[r, head * 16:(head + 1) * 16], scores @ keys[:, kv_cols], tolerance(dtype),
                         f"row {r} head {head}")
