"""Serving: sequences at positions of their own in the rows of one batch, joining and leaving (continuous
batching), each generating what it would alone (``transformers.generate``)."""
import functools

import pytest
import torch

import megakernel as mk
from megakernel.models import from_hf

from helpers import assert_close
from test_decode import hf_model


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(100 + length))


def _alone(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    ids = prompt.reshape(1, -1)
    with torch.no_grad():  # the mask explicit: a prompt token equal to the pad id is not padding
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0]


def _many(model, lengths, new):
    m = from_hf(model, max_seq_len=24, max_batch=2, workers=1)
    try:
        return m.generate([_prompt(n) for n in lengths], new), m.kernel.launches
    finally:
        m.close()


@pytest.mark.parametrize("world", [1, 2])
def test_prompts_of_different_lengths_generate_what_each_would_alone(world):
    """Prompts of 1, 7 and 20 tokens through 2 slots (the third waits for a free one): each exactly as alone."""
    model = hf_model("qwen3", kv_heads=2, layers=1)
    lengths, new = (1, 7, 20), 3
    job = functools.partial(_many, model, lengths, new)
    results = mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]
    for rank, (outputs, launches) in enumerate(results):
        for length, out in zip(lengths, outputs):
            assert torch.equal(out, _alone(model, _prompt(length), new)), f"prompt of {length}, rank {rank} of {world}"
        assert launches == 3  # a launch per sequence end: the waiting prompt joins as the first one leaves


def test_a_sequence_joins_others_mid_generation_and_reuses_a_freed_slot():
    model = hf_model("llama", layers=1)
    m = from_hf(model, max_seq_len=16, max_batch=3, workers=1)
    try:
        a, b = m.add(_prompt(4), 6), m.add(_prompt(2), 2)
        tokens = {a: [], b: []}
        for _ in range(4):  # b ends after its 2 tokens (at step 3): its slot is free again
            for sequence, made in m.step().items():
                tokens[sequence] += made
        assert m.slots[1] is None and b in m.finished
        c = m.add(_prompt(5), 4)  # joins a mid-generation, in b's old slot
        assert m.slots[1].id == c
        tokens[c] = []
        while any(m.slots):
            for sequence, made in m.step().items():
                tokens[sequence] += made
        for sequence, (length, new) in {a: (4, 6), b: (2, 2), c: (5, 4)}.items():
            expected = _alone(model, _prompt(length), new)
            assert tokens[sequence] == expected[length:].tolist(), f"sequence {sequence}"
            assert torch.equal(m.finished[sequence], expected)
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
    finally:
        m.close()
