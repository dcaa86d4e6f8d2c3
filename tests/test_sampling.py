"""Sampling on the device: the tile against its host twin bit for bit, the host twin's frequencies against the
filtered softmax, and seeded requests that draw the same tokens wherever they run."""
import math

import pytest
import torch

import megakernel as mk
from megakernel.serving import SamplingParams, from_hf
from megakernel.serving.sampling_params import SMALLEST_NORMAL
from megakernel.tasks.sampling import PARAMS, drawn, kept, most_likely, philox_uniform

from test_decode import hf_model, prompt

VOCAB, POSITIONS, TOP = 300, 8, 3
# rows of one launch: (temperature, top_k, top_p, min_p); the first is greedy
ROWS = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.05),
        (0.8, 40, 0.9, 0.02), (2.0, 1, 1.0, 0.0), (1.0, 0, 1e-6, 0.0)]


def sampling_graph(dtype: torch.dtype) -> mk.Graph:
    g = mk.Graph(world_size=1, rank=0)
    batch = len(ROWS)
    logits = g.input("logits", (batch, VOCAB + 20), dtype)  # 20 padding logits past the vocabulary
    history = g.input("history", (batch, POSITIONS), torch.int64)
    pos, prompt_len = g.input("pos", (batch,), torch.int64), g.input("prompt_len", (batch,), torch.int64)
    params, seed = g.input("params", (batch, len(PARAMS)), torch.float32), g.input("seed", (batch,), torch.int64)
    logprobs = g.new_tensor((batch, POSITIONS), torch.float32, name="logprobs")
    top = (g.new_tensor((batch, POSITIONS * TOP), torch.int64, name="top_ids"),
           g.new_tensor((batch, POSITIONS * TOP), torch.float32, name="top_logprobs"))
    g.output("history", g.sample(logits, history, pos, prompt_len, params, seed, logprobs, top, vocab=VOCAB))
    g.output("logprobs", logprobs)
    g.output("top_ids", top[0])
    g.output("top_logprobs", top[1])
    g.advance(pos, limit=POSITIONS)
    return g


def sampling_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    batch = len(ROWS)
    logits = (torch.randn(batch, VOCAB + 20, generator=gen) * 3).to(dtype)
    logits[:, VOCAB:] = 100.0  # padding: never drawn, never among the most likely
    logits[0, 29] = logits[0, 17] = logits[0, :VOCAB].max() + 1  # a tie for the largest: the lower index first
    return {"logits": logits, "history": torch.full((batch, POSITIONS), -7),
            "pos": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), "prompt_len": torch.tensor([1, 1, 4, 1, 1, 3, 1, 1]),
            "params": torch.tensor(ROWS), "seed": torch.tensor([5, -3, 2**62, 11, 0, 99, 123456789, 8])}


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # as the decode step gathers logits
def test_the_tile_draws_what_its_host_twin_draws(dtype):
    """Every row's tokens, log-probabilities and most likely tokens over the launch's steps, under the
    interpreter: the same tokens as the host twin (``drawn``, the torch backend's tile), bit for bit."""
    g, inputs = sampling_graph(dtype), sampling_inputs(dtype)
    out = {}
    for backend in ("cpu", "torch"):
        with mk.Megakernel(g, workers=2, backend=backend) as kernel:
            out[backend] = kernel.run(inputs, steps=POSITIONS)
    assert torch.equal(out["cpu"]["history"], out["torch"]["history"])
    assert torch.equal(out["cpu"]["top_ids"], out["torch"]["top_ids"])
    for name in ("logprobs", "top_logprobs"):
        assert torch.allclose(out["cpu"][name], out["torch"][name], atol=1e-5), name
    history, logits = out["cpu"]["history"], inputs["logits"].float()[:, :VOCAB]
    for row, params in enumerate(ROWS):
        start = max(int(inputs["pos"][row]) + 1, int(inputs["prompt_len"][row]))
        tokens = history[row, start:]
        assert (history[row, :start] == -7).all(), f"row {row} wrote before its prompt ended"
        if params[0] == 0:
            assert (tokens == logits[row].argmax()).all()
        else:
            expected = drawn(logits[row], torch.tensor(params), int(inputs["seed"][row]), torch.arange(start, POSITIONS))
            assert torch.equal(tokens, expected), f"row {row}"
        reference = torch.log_softmax(logits[row], 0)
        assert torch.allclose(out["cpu"]["logprobs"][row, start:], reference[tokens], atol=1e-5)
        top_ids = out["cpu"]["top_ids"][row].view(POSITIONS, TOP)[start:]
        assert torch.equal(top_ids, torch.sort(logits[row], descending=True, stable=True).indices[:TOP].expand_as(top_ids))
    assert (history[0, 1:] == 17).all(), "greedy: the lowest index of a tie"
    assert (history[6, 3:] == logits[6].argmax()).all(), "top_k 1 is the argmax"
    assert (history[7, 4:] == logits[7].argmax()).all(), "a tiny top_p keeps the most likely token"


def test_the_uniforms_are_uniform_and_inside_the_open_interval():
    u = philox_uniform(12345, torch.arange(200), 1000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(philox_uniform(1, [0], 64), philox_uniform(2, [0], 64))
    assert not torch.equal(philox_uniform(1, [0], 64), philox_uniform(1, [1], 64))


def test_the_most_likely_are_a_stable_sorts_first():
    """The torch backend's top-N (sorting only the logits at or above the N-th largest) against a stable sort
    of the whole vocabulary: ties across the N-th, infinities and NaN (which sort as the largest)."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(400):
        vocab = int(torch.randint(1, 200, (1,), generator=gen))
        n = int(torch.randint(1, min(vocab, 12) + 1, (1,), generator=gen))
        logits = torch.randint(-3, 3, (vocab,), generator=gen).float() if trial % 2 else torch.randn(vocab, generator=gen)
        special = (float("nan"), float("inf"), float("-inf"), None)[trial // 2 % 4]  # with each kind of logits
        if special is not None:
            logits[torch.randint(0, vocab, (2,), generator=gen)] = special
        expected = torch.sort(logits, descending=True, stable=True).indices[:n]
        assert torch.equal(most_likely(logits, n), expected), (logits.tolist(), n)
    assert most_likely(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0]), 3).tolist() == [1, 3, 2]


# (temperature, top_k, top_p, min_p) whose filters each leave part of a vocabulary of 8
FILTERS = [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.12),
           (1.5, 5, 0.9, 0.05)]
DRAWS = 40_000


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: "T{}-k{}-p{}-min{}".format(*p))
def test_draws_follow_the_filtered_softmax(params):
    """DRAWS draws (one per position) against softmax(logits / T) over the tokens the filter keeps: nothing
    outside it, and a chi-square statistic below its 1e-4 quantile (Wilson-Hilferty)."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0])
    z = (logits - logits.max()) / params[0]
    keep = kept(z, *params[1:])
    expected = torch.where(keep, torch.softmax(torch.where(keep, z, -math.inf).double(), 0), 0.0) * DRAWS
    counts = torch.bincount(drawn(logits, torch.tensor(params), 2024, torch.arange(DRAWS)), minlength=8).double()
    assert counts[~keep].sum() == 0, f"drew filtered tokens: {counts.tolist()} keep {keep.tolist()}"
    assert keep.sum() >= 2
    chi2 = (((counts - expected)[keep]) ** 2 / expected[keep]).sum().item()
    df = int(keep.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3  # z of 1 - 1e-4
    assert chi2 < quantile, f"chi-square {chi2:.1f} >= {quantile:.1f} ({df} degrees): {counts.tolist()} vs {expected.tolist()}"


def test_the_filters_keep_what_they_say():
    z = torch.tensor([0.0, -2.0, -1.0, -1.0, -4.0])  # tempered: the largest is 0
    assert kept(z, 2, 1.0, 0.0).tolist() == [True, False, True, True, False]  # ties at the k-th: kept
    p = torch.softmax(z, 0)
    assert kept(z, 0, float(p[0]) - 1e-4, 0.0).tolist() == [True, False, False, False, False]
    assert kept(z, 0, float(p[0]) + 1e-4, 0.0).tolist() == [True, False, True, True, False]
    assert kept(z, 0, 1.0, math.exp(-1.5)).tolist() == [True, False, True, True, False]


def _seeded(model, rows: int, per_launch, params, order, world=1, chunk=0):
    """The tokens of ``params`` requests in the given batch rows, one model per rank; ``chunk``: prompts
    prefilled in chunks by continuous batching (``generate`` of a list) instead of a batch in one."""
    def job():
        m = from_hf(model, max_seq_len=16, max_batch=rows, prefill_chunk=chunk, workers=1)
        try:
            sampling = [params[i] for i in order]
            prompts = prompt(rows, 4)[list(order)]
            if chunk:
                return torch.stack(m.generate(list(prompts), max_new_tokens=8, sampling=sampling))
            return m.generate(prompts, max_new_tokens=8, tokens_per_launch=per_launch, sampling=sampling)
        finally:
            m.close()
    return mk.launch(job, world_size=world, virtual=True, timeout=600)[0] if world > 1 else job()


@pytest.mark.usefixtures("torch_backend")
def test_a_seeded_request_draws_the_same_tokens_whatever_its_row_launch_or_ranks():
    model = hf_model("llama", layers=1)
    params = [SamplingParams(temperature=1.0, seed=17), SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=4)]
    base = _seeded(model, 2, None, params, (0, 1))
    for per_launch, order, world, chunk in ((1, (0, 1), 1, 0), (3, (1, 0), 1, 0), (None, (1, 0), 2, 0),
                                            (None, (1, 0), 1, 16), (None, (0, 1), 2, 16)):
        tokens = _seeded(model, 2, per_launch, params, order, world, chunk)
        assert torch.equal(tokens[list(order)], base), (per_launch, order, world, chunk)
    greedy = _seeded(model, 2, None, [SamplingParams(), SamplingParams(temperature=0.0, seed=3)], (0, 1))
    with torch.no_grad():
        expected = model.generate(prompt(2, 4), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, expected), "temperature 0 is greedy"
    other = _seeded(model, 2, None, [SamplingParams(temperature=1.0, seed=18), params[1]], (0, 1))
    assert not torch.equal(other[0], base[0]), "another seed, other tokens"


def test_sampling_params_are_checked():
    for bad in (dict(temperature=-1), dict(temperature=math.inf), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                dict(min_p=2), dict(seed=1.5), dict(temperature=True), dict(temperature=math.nan),
                dict(top_p=math.nan), dict(min_p=math.nan), dict(min_p=-math.inf), dict(temperature=1e-45),
                dict(temperature=1e-39), dict(min_p=1e-40), dict(top_p=1e-40), dict(top_p=5e-324)):
        with pytest.raises(mk.GraphError, match=next(iter(bad))):
            SamplingParams(**bad)
    for edge in (dict(temperature=SMALLEST_NORMAL), dict(min_p=SMALLEST_NORMAL), dict(top_p=SMALLEST_NORMAL),
                 dict(min_p=1.0), dict(top_p=1.0), dict(temperature=3e38)):
        SamplingParams(**edge)


# rows at the least temperatures, with and without filters, and rows of equal logits
TINY = [(SMALLEST_NORMAL, 0, 1.0, 0.0), (1e-37, 0, 1.0, 0.0), (1e-30, 0, 1.0, 0.0), (1e-30, 5, 0.5, 0.01),
        (1e-30, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (SMALLEST_NORMAL, 0, SMALLEST_NORMAL, 1.0), (3e38, 0, 1.0, 0.0)]


def test_a_tiny_temperature_draws_the_argmax_and_equal_logits_draw_among_them():
    """At the least temperatures the tile (interpreter) and its host twin both draw the argmax, where
    dividing the raw logits by T would overflow; a row of equal logits draws all over the vocabulary at
    any temperature; T near float32's largest draws all over too."""
    batch, positions = len(TINY), 32
    g = mk.Graph(world_size=1, rank=0)
    logits, history = g.input("logits", (batch, VOCAB), torch.float32), g.input("history", (batch, positions), torch.int64)
    pos, prompt_len = g.input("pos", (batch,), torch.int64), g.input("prompt_len", (batch,), torch.int64)
    params, seed = g.input("params", (batch, len(PARAMS)), torch.float32), g.input("seed", (batch,), torch.int64)
    g.output("history", g.sample(logits, history, pos, prompt_len, params, seed))
    g.advance(pos, limit=positions)
    values = torch.randn(batch, VOCAB) * 20 + 50  # large logits: logit / 1e-30 is inf in float32
    values[4:6] = 7.5  # every logit equal
    inputs = {"logits": values, "history": torch.full((batch, positions), -7), "pos": torch.zeros(batch, dtype=torch.int64),
              "prompt_len": torch.ones(batch, dtype=torch.int64), "params": torch.tensor(TINY),
              "seed": torch.arange(batch) * 977 + 3}
    out = {}
    for backend in ("cpu", "torch"):
        with mk.Megakernel(g, workers=2, backend=backend) as kernel:
            out[backend] = kernel.run(inputs, steps=positions - 1)["history"][:, 1:]
    assert torch.equal(out["cpu"], out["torch"])
    tokens = out["cpu"]
    for row in (0, 1, 2, 3, 6):
        assert (tokens[row] == values[row].argmax()).all(), (row, tokens[row])
    for row in (4, 5, 7):
        assert len(set(tokens[row].tolist())) > positions // 2, (row, tokens[row])  # 32 draws of 300 tokens
    ties = drawn(torch.zeros(8), torch.tensor(TINY[2]), 11, torch.arange(DRAWS))
    assert torch.bincount(ties, minlength=8).min() > DRAWS / 8 * 0.9, "equal logits: every one as likely"


@pytest.mark.usefixtures("torch_backend")
def test_several_stop_ids_end_a_sequence_at_the_first_of_them():
    model = hf_model("llama", layers=1)
    ids = prompt(1, 3)
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0]
    stop = [int(free[3 + 4]), int(free[3 + 2])]
    end = next(i for i in range(3, 11) if int(free[i]) in stop) + 1
    m = from_hf(model, max_seq_len=16, max_batch=2, workers=1)
    try:
        assert torch.equal(m.generate([ids[0]], 8, eos_token_id=stop)[0], free[:end])
        assert torch.equal(m.generate(torch.cat([ids, ids]), 8, eos_token_id=stop)[0], free[:end])
        sequence = m.add(ids[0], 8, eos_token_id=stop)
        while m.sequence(sequence) is not None:
            m.step(3)
        assert torch.equal(m.finished[sequence], free[:end])
    finally:
        m.close()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_logits_that_are_not_finite_are_a_fault_naming_the_row_and_position(backend):
    """A row of logits holding NaN, one holding inf: the launch runs to its end and raises ``FaultError``
    naming the row and the position it sampled, with the run's outputs; the finite row draws as usual and the
    kernel goes on."""
    g = mk.Graph(world_size=1, rank=0)
    logits, history = g.input("logits", (3, VOCAB), torch.float32), g.input("history", (3, 4), torch.int64)
    pos, prompt_len = g.input("pos", (3,), torch.int64), g.input("prompt_len", (3,), torch.int64)
    g.output("history", g.sample_greedy(logits, history, pos, prompt_len))
    values = torch.randn(3, VOCAB)
    inputs = {"logits": values, "history": torch.full((3, 4), -7), "pos": torch.tensor([0, 1, 2]),
              "prompt_len": torch.ones(3, dtype=torch.int64)}
    with mk.Megakernel(g, workers=2, backend=backend) as kernel:
        bad = values.clone()
        bad[0, 5], bad[2, 9] = math.nan, math.inf
        with pytest.raises(mk.FaultError, match="sampled logits that are not finite") as error:
            kernel.run({**inputs, "logits": bad})
        met = {(f.value, f.bound) for f in error.value.faults}  # a worker keeps the first fault of a step
        assert met and met <= {(0, 1), (2, 3)}, met
        row, position = min(met)
        assert f"the logits of batch row {row} sampling position {position} are not finite" in str(error.value)
        assert int(kernel.tensor(g.outputs["history"])[1, 2]) == int(values[1].argmax())
        assert torch.equal(error.value.outputs["history"], kernel.tensor(g.outputs["history"]))  # the run's, cloned
        assert kernel.run(inputs)["history"][:, 1:].diagonal().tolist() == values.argmax(1).tolist()
