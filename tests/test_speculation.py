"""Speculative decoding (``tasks.speculation``): drafts from each sequence's own history, verified and
accepted on the device, give the tokens of decoding without drafts, in fewer steps. (Verification rows
round differently from decode rows, by a few float32 ulps: a token could differ only at a tie that close,
which the models and prompts here do not have.)"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import megakernel as mk
from megakernel.serving import SamplingParams, from_hf
from megakernel.serving.sampling_params import GREEDY
from megakernel.tasks.speculation import STATS, lookup

pytestmark = pytest.mark.usefixtures("torch_backend")


def test_lookup_finds_the_latest_occurrence_of_the_longest_suffix():
    row = torch.tensor([7, 1, 2, 3, 5, 1, 2, 3, 6, 2, 3])
    assert lookup(row, 7) == 3                     # [1, 2, 3] ended at 3
    assert lookup(row, 10) == 7                    # no earlier [6, 2, 3]; [2, 3] ended at 3 and 7: the latest
    assert lookup(row, 8) == -1                    # 6 never came before
    assert lookup(torch.tensor([4, 4, 4, 4]), 3) == 2  # a loop: the occurrence one position back
    assert lookup(torch.tensor([4]), 0) == -1


# Four batch rows, worked by hand (module docstring of tasks.speculation), 4 verification rows each:
#   0: past its prompt at 9 in a loop of period 3: rows at 9..12 fed 1 | 2 3 1 (drafts); the model gives
#      2 3 5 at 10..12: two drafts kept, then its own token; pos 12
#   1: inside its prompt (7 tokens) at 2: rows at 2..5 fed prompt tokens; nothing sampled; pos 6
#   2: no sequence (-1)
#   3: at 5 with its end at 7: rows at 5, 6 (a draft of period 2), then off; the model agrees at 6 and gives
#      1 at 7, its end: the row ends (-1)
#   4: at 3 with nothing to look up: one row; the model's 9 at 4
HISTORY = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 4, 5, 6, 4], [], [8, 9, 8, 9, 8, 9], [1, 2, 3, 4]]
POS, PROMPT_LEN, END = [9, 2, -1, 5, 3], [4, 7, 1, 2, 4], [40, 40, 40, 7, 40]
VERIFIED = {0: {10: 2, 11: 3, 12: 5, 13: 7}, 3: {6: 8, 7: 1}, 4: {4: 9, 5: 2}}


def _draft_and_accept():
    g = mk.Graph(world_size=1, rank=0)
    history, verified = (g.input(name, (5, 24), torch.int64) for name in ("history", "verified"))
    pos, prompt_len, end = (g.input(name, (5,), torch.int64) for name in ("pos", "prompt_len", "end"))
    stats = g.input("stats", (len(STATS),), torch.int64)
    tokens, positions, live = g.draft(history, pos, prompt_len, end, 4)
    for name, t in (("tokens", tokens), ("positions", positions), ("live", live)):
        g.output(name, t)
    g.output("history", g.accept(history, verified, tokens, positions, pos, prompt_len, end, stats))
    g.output("pos", pos)
    g.output("stats", stats)
    return g


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_draft_and_accept_tiles_do_what_the_worked_rows_say(backend):
    history = torch.randint(20, 30, (5, 24))  # past each row's known tokens: what a real history holds there
    verified = torch.randint(20, 30, (5, 24))
    for b, tokens in enumerate(HISTORY):
        history[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        for position, token in VERIFIED.get(b, {}).items():
            verified[b, position] = token
    kernel = mk.Megakernel(_draft_and_accept(), backend=backend)
    try:
        out = kernel.run({"history": history, "verified": verified, "pos": torch.tensor(POS),
                          "prompt_len": torch.tensor(PROMPT_LEN), "end": torch.tensor(END),
                          "stats": torch.tensor([10, 0, 0, 0, 0])})
        assert out["positions"].view(5, 4).tolist() == [[9, 10, 11, 12], [2, 3, 4, 5], [-1] * 4, [5, 6, -1, -1],
                                                        [3, -1, -1, -1]]
        assert out["tokens"].view(5, 4)[[0, 1, 3, 4], :2].tolist() == [[1, 2], [6, 4], [9, 8], [4, 0]]
        assert out["tokens"].view(5, 4)[0].tolist() == [1, 2, 3, 1] and out["live"].item() == 0
        expected = history.clone()
        expected[0, 10:13] = torch.tensor([2, 3, 5])
        expected[3, 6:8] = torch.tensor([8, 1])
        expected[4, 4] = 9
        assert torch.equal(out["history"], expected)
        assert out["pos"].tolist() == [12, 6, -1, -1, 4]
        # steps, row steps, tokens made, drafted, accepted
        assert dict(zip(STATS, out["stats"].tolist())) == dict(steps=11, row_steps=4, tokens=6, drafted=4, accepted=3)
        out = kernel.run({"pos": torch.full((5,), -1)})  # no row runs: the step's guarded tasks would skip
        assert out["live"].item() == -1 and out["stats"].tolist()[:2] == [11, 4]
    finally:
        kernel.close()


# -- drafted decoding = undrafted decoding, end to end ----------------------------------------------------------
def small_llama(seed: int, vocab: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, rope_theta=5000.0)
    return LlamaForCausalLM(config).eval()


def decoded(model, case: dict, draft_tokens: int, world: int):
    """Each rank's outputs of ``case`` and its model's statistics (one model shared by virtual ranks)."""
    def job():
        m = from_hf(model, max_seq_len=48, max_batch=case["batch"], page_size=case["page_size"],
                    prefill_chunk=case["prefill_chunk"], draft_tokens=draft_tokens, workers=1)
        try:
            if case["continuous"]:
                out = m.generate(case["prompts"], case["new"], eos_token_id=case["eos"], sampling=case["sampling"])
            else:
                out = [m.generate(torch.stack(case["prompts"]), case["new"], case["per_launch"], sampling=case["sampling"])]
            return out, m.statistics()
        finally:
            m.close()
    return mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]


@st.composite
def repeating(draw, vocab: int, length: int) -> torch.Tensor:
    """``length`` tokens: some random ones, then a random piece over and over (what prompt lookup drafts from)."""
    piece = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
    head = draw(st.lists(st.integers(0, vocab - 1), max_size=length))
    return torch.tensor((head + piece * length)[:length], dtype=torch.int64)


@st.composite
def cases(draw):
    """A random model, and prompts of one length (a [B, T] batch) or of several (continuous batching)."""
    vocab = draw(st.integers(24, 80))
    continuous = draw(st.booleans())
    count = draw(st.integers(1, 3)) if continuous else draw(st.integers(1, 2))
    length = draw(st.integers(1, 12))
    prompts = [draw(repeating(vocab, draw(st.integers(1, 14)) if continuous else length)) for _ in range(count)]
    seeded = SamplingParams(temperature=0.8, top_k=draw(st.sampled_from([0, 5])), seed=draw(st.integers(0, 2**40)))
    return dict(model=(draw(st.integers(0, 2**16)), vocab, draw(st.integers(1, 2))), prompts=prompts,
                continuous=continuous, batch=draw(st.integers(1, 2)) if continuous else count,
                new=draw(st.integers(1, 12)), prefill_chunk=draw(st.sampled_from([0, 16])) if continuous else 0,
                page_size=draw(st.sampled_from([4, 16])), eos=draw(st.none() | st.integers(0, vocab - 1)) if continuous
                else None,
                per_launch=None if continuous else draw(st.sampled_from([None, 1, 3])),
                sampling=[draw(st.sampled_from([GREEDY, seeded])) for _ in prompts],
                draft_tokens=draw(st.integers(1, 4)), world=draw(st.sampled_from([1, 1, 2])))


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_drafted_decoding_gives_exactly_the_undrafted_tokens(case):
    """Random Llamas and prompts, greedy and seeded sampled rows, batches by [B, T] tensors (launches of 1, 3 or
    all steps) or by continuous batching (prefill rows or none, an end token or none), KV pages of 4 or 16
    positions, one rank or two: the same tokens with drafts as without, on every rank; the counters add up."""
    model = small_llama(*case["model"])
    expected, _ = decoded(model, case, 0, 1)[0]
    for rank, (out, stats) in enumerate(decoded(model, case, case["draft_tokens"], case["world"])):
        for i, (mine, theirs) in enumerate(zip(out, expected)):
            assert torch.equal(mine, theirs), (f"output {i}, rank {rank}: {mine.tolist()} with drafts, "
                                               f"{theirs.tolist()} without")
        if case["eos"] is None:  # an end token ends a sequence between launches: the device made more
            assert stats.tokens == case["new"] * len(case["prompts"])
        assert stats.accepted <= stats.drafted
        assert stats.tokens <= stats.row_steps + stats.accepted  # a row's step: its own token, and what it accepted


def test_a_model_that_repeats_itself_takes_fewer_steps_and_the_same_tokens():
    """A random Llama falls into loops under greedy decoding: drafts from its history are accepted and the
    steps per token fall below one."""
    model = small_llama(0, 97, 2)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7] * 3])
    runs = {}
    for draft_tokens in (0, 3):
        m = from_hf(model, max_seq_len=96, draft_tokens=draft_tokens, workers=1)
        try:
            runs[draft_tokens] = m.generate(prompt, 40), m.steps_run, m.statistics()
        finally:
            m.close()
    (plain, plain_steps, _), (drafted, steps, stats) = runs[0], runs[3]
    assert torch.equal(drafted, plain)
    assert plain_steps == 40                   # the prompt prefilled in the first step, then a token a step
    assert steps <= 0.5 * plain_steps, (steps, stats)
    assert stats.tokens == 40 and stats.steps == steps and stats.accepted > 10


@pytest.mark.slow
@pytest.mark.interpreter
def test_the_triton_tiles_draft_verify_and_accept_as_the_torch_references():
    """The same drafted decoding under the interpreter (draft, accept, sample and chunk attention of
    verification rows as Triton tiles): the tokens of the torch backend without drafts."""
    model = small_llama(1, 40, 1)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    expected = from_hf(model, max_seq_len=16, backend="torch", workers=1)
    try:
        tokens = expected.generate(prompt, 6)
    finally:
        expected.close()
    m = from_hf(model, max_seq_len=16, draft_tokens=2, backend="cpu", workers=1)
    try:
        assert torch.equal(m.generate(prompt, 6), tokens)
        assert m.steps_run < 8 + 6 - 1
    finally:
        m.close()


def test_bad_draft_tokens_are_refused():
    model = small_llama(0, 32, 1)
    for bad in (-1, 16, 2.0, "3"):
        with pytest.raises(mk.GraphError, match="draft_tokens must be an int in"):
            from_hf(model, max_seq_len=16, draft_tokens=bad)
    with pytest.raises(mk.GraphError, match="max_batch"):
        from_hf(model, max_seq_len=16, max_batch=1024, draft_tokens=7)


@pytest.mark.slow
def test_smollm2_copies_its_prompt_in_fewer_steps_with_the_same_tokens(smollm2):
    """SmolLM2-135M (its GGUF file as transformers loads it) asked to go on with a text it has seen once:
    transformers' greedy tokens, in clearly fewer steps than positions."""
    text = [504, 3458, 282, 4649, 314, 15879, 28, 1112, 2115, 11189, 690, 260, 8940, 2767, 30]
    prompt = torch.tensor([[1, *text, 198, *text[:4]]])
    with torch.no_grad():
        expected = smollm2.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    model = from_hf(smollm2, max_seq_len=48, draft_tokens=4, backend="torch", workers=2)
    try:
        tokens = model.generate(prompt, 16)
        stats = model.statistics()
    finally:
        model.close()
    assert torch.equal(tokens, expected), (tokens[0, prompt.shape[1]:].tolist(), expected[0, prompt.shape[1]:].tolist())
    steps_per_position = stats.steps / (prompt.shape[1] + 16 - 1)  # undrafted: one
    assert steps_per_position < 0.6, stats
