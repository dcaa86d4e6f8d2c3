"""Mixture-of-experts decode: the router, expert tiles addressed by it, and Qwen3-MoE / Mixtral end to end."""
import functools

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import megakernel as mk
from megakernel.serving import SamplingParams, from_hf, from_pretrained
from megakernel.tasks.formats import FP8_CHANNEL, Q8_0, quantized_input
from megakernel.tasks.expert_parallel import Held

from helpers import assert_close, run_checked

# mixture-of-experts models end to end against transformers: on the torch backend (the tiles are proven
# under the interpreter: test_ops, test_task_types), but for the tests marked interpreter
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_backend")]


def moe_graph(tokens: int, hidden: int, experts: int, inter: int, k: int, normalize: bool):
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (tokens, hidden), torch.float32)
    router = g.input("router", (experts, hidden), torch.float32)
    gate_up = g.input("gate_up", (experts * 2 * inter, hidden), torch.float32)
    down = g.input("down", (experts * hidden, inter), torch.float32)
    chosen, weights = g.route(g.linear(x, router), k, normalize)
    both = g.expert_rows(x, gate_up, chosen, experts)
    g.output("y", g.moe_sum(g.expert_rows(g.silu_mul(both[:, :inter], both[:, inter:]), down, chosen, experts), weights))
    g.output("experts", chosen)
    return g


def moe_float64(inputs: dict, experts: int, inter: int, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, router = inputs["x"].double(), inputs["router"].double()
    gate_up = inputs["gate_up"].double().reshape(experts, 2 * inter, -1)
    down = inputs["down"].double().reshape(experts, x.shape[1], inter)
    top, chosen = torch.sort(torch.softmax(x @ router.T, dim=-1), dim=-1, descending=True, stable=True)
    top, chosen = top[:, :k], chosen[:, :k]  # equal probabilities: the lowest expert first
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(k):
            gate, up = (gate_up[chosen[b, s]] @ x[b]).split(inter)
            y[b] += top[b, s] * (down[chosen[b, s]] @ (torch.nn.functional.silu(gate) * up))
    return y, chosen


def _inputs(tokens, hidden, experts, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(tokens, hidden, generator=gen), "router": torch.randn(experts, hidden, generator=gen),
            "gate_up": torch.randn(experts * 2 * inter, hidden, generator=gen) * hidden ** -0.5,
            "down": torch.randn(experts * hidden, inter, generator=gen) * inter ** -0.5}


@pytest.mark.interpreter  # the tiles' semantics
@pytest.mark.parametrize("tokens,k,normalize", [(1, 2, True), (3, 3, False)])
def test_sparse_mlp_matches_float64_and_the_reference_executor(tokens, k, normalize):
    hidden, experts, inter = 48, 8, 41  # an odd expert width
    inputs = _inputs(tokens, hidden, experts, inter)
    out = run_checked(moe_graph(tokens, hidden, experts, inter, k, normalize), inputs, workers=2)
    y, chosen = moe_float64(inputs, experts, inter, k, normalize)
    assert torch.equal(out["experts"], chosen)  # the kernel's choice, the reference executor's and torch's
    assert_close(out["y"], y, 1e-5, "sparse MLP vs float64")


@pytest.mark.interpreter  # the tiles' semantics
def test_a_router_can_pick_one_expert_for_every_token_or_each_expert_once():
    hidden, experts, inter = 8, 8, 16
    gen = torch.Generator().manual_seed(3)
    inputs = _inputs(8, hidden, experts, inter)
    inputs["x"] = torch.eye(8) * 10 + torch.rand(8, 8, generator=gen) * 0.1  # token t leans on dimension t
    inputs["router"] = torch.eye(8)                                          # ... so it picks expert t
    once = run_checked(moe_graph(8, hidden, experts, inter, 1, True), inputs, workers=2)
    assert once["experts"][:, 0].tolist() == list(range(8))
    inputs["router"] = -torch.ones(8, 8)                                     # the others tie: lowest first
    inputs["router"][5] = 3.0                                                # positive x: expert 5 always first
    same = run_checked(moe_graph(8, hidden, experts, inter, 2, True), inputs, workers=2)
    assert same["experts"][:, 0].tolist() == [5] * 8
    for out, k in ((once, 1), (same, 2)):
        y, chosen = moe_float64(inputs if k == 2 else {**inputs, "router": torch.eye(8)}, experts, inter, k, True)
        assert torch.equal(out["experts"], chosen)
        assert_close(out["y"], y, 1e-5, f"top-{k}")


def grouped_graph(tokens: int, hidden: int, experts: int, inter: int, k: int, normalize: bool, format=None):
    """``moe_mlp``: the rows grouped by expert, ``passes`` counting their weight passes; the expert weights
    as stored in a quantized ``format`` if one is given."""
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (tokens, hidden), torch.float32)
    router = g.input("router", (experts, hidden), torch.float32)
    weight = functools.partial(quantized_input, format=format, dtype=torch.float32) if format else \
        (lambda g, name, shape: g.input(name, shape, torch.float32))
    gate_up, down = weight(g, "gate_up", (experts * 2 * inter, hidden)), weight(g, "down", (experts * hidden, inter))
    passes = g.input("passes", (experts,), torch.int64)
    g.output("y", g.moe_mlp(x, router, gate_up, down, k, normalize, torch.float32, passes=passes))
    return g


def run_grouped(g: mk.Graph, inputs: dict) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The kernel's outputs (checked against the reference executor) and its weight passes per group."""
    with mk.Megakernel(g, workers=2) as kernel:
        out = run_checked(g, {**inputs, "passes": torch.zeros(g.inputs["passes"].cols, dtype=torch.int64)},
                          kernel=kernel)
        return out, kernel.tensor(g.inputs["passes"]).tolist()


def one_pass_per_expert_chosen(chosen: torch.Tensor, experts: int) -> list[int]:
    distinct = len(torch.unique(chosen))
    return [1] * distinct + [0] * (experts - distinct)


@pytest.mark.interpreter  # the grouped tiles' semantics: GEMV below 16 tokens, tl.dot from 16
@pytest.mark.parametrize("tokens,k,normalize", [(1, 2, True), (3, 3, False), (20, 2, True)])
def test_rows_grouped_by_expert_match_float64_with_a_pass_per_expert_chosen(tokens, k, normalize):
    hidden, experts, inter = 48, 8, 41
    inputs = _inputs(tokens, hidden, experts, inter, seed=tokens)
    out, passes = run_grouped(grouped_graph(tokens, hidden, experts, inter, k, normalize), inputs)
    y, chosen = moe_float64(inputs, experts, inter, k, normalize)
    assert_close(out["y"], y, 1e-5, f"grouped sparse MLP vs float64, {tokens} tokens")
    assert passes == one_pass_per_expert_chosen(chosen, experts)
    if tokens == 3:  # a pass per (token, slot) row: 9 where the grouped tiles ran fewer
        ungrouped = run_checked(moe_graph(tokens, hidden, experts, inter, k, normalize), inputs)
        assert_close(ungrouped["y"], y, 1e-5, "ungrouped sparse MLP vs float64")
        assert sum(passes) < tokens * k


@pytest.mark.interpreter
def test_grouped_rows_all_on_one_expert_and_experts_nobody_picks():
    """Every token routed to expert 5 first (and, top-2, to expert 0 on the others' tie): the tile of
    expert 5 serves all 18 rows of its pass in two blocks of 16, seven experts do no weight read."""
    tokens, hidden, experts, inter = 18, 8, 8, 16
    inputs = _inputs(tokens, hidden, experts, inter)
    inputs["x"] = torch.rand(tokens, hidden, generator=torch.Generator().manual_seed(4)) + 0.5  # positive
    inputs["router"] = -torch.ones(experts, hidden)
    inputs["router"][5] = 3.0
    for k in (1, 2):
        out, passes = run_grouped(grouped_graph(tokens, hidden, experts, inter, k, True), inputs)
        y, chosen = moe_float64(inputs, experts, inter, k, True)
        assert chosen[:, 0].tolist() == [5] * tokens and passes == [1] * k + [0] * (experts - k)
        assert_close(out["y"], y, 1e-5, f"every token on expert 5, top-{k}")


@pytest.mark.interpreter
@pytest.mark.parametrize("format", [Q8_0, FP8_CHANNEL], ids=lambda f: f.name)
def test_grouped_experts_stream_quantized_weights_as_stored(format):
    tokens, hidden, experts, inter, k = 3, 64, 4, 32, 2
    inputs = _inputs(tokens, hidden, experts, inter, seed=5)
    dequantized = dict(inputs)
    for name in ("gate_up", "down"):
        if format.scales is None:  # Q8_0: a float16 scale and 32 int8 weights per block
            blocks = inputs[name].reshape(-1, 32)
            scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).half()
            q = torch.round(blocks / scale.float()).clamp(-127, 127).to(torch.int8)
            inputs[name] = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], 1).reshape(
                inputs[name].shape[0], -1)
            dequantized[name] = (q.float() * scale.float()).reshape(dequantized[name].shape)
        else:  # a float8 row and its scale
            scale = inputs[name].abs().amax(dim=1) / 448
            q = (inputs[name] / scale[:, None]).to(torch.float8_e4m3fn)
            inputs[name], inputs[f"{name}.scales"] = q.view(torch.uint8), scale
            dequantized[name] = q.float() * scale[:, None]
    out, passes = run_grouped(grouped_graph(tokens, hidden, experts, inter, k, True, format), inputs)
    y, chosen = moe_float64(dequantized, experts, inter, k, True)
    assert_close(out["y"], y, 1e-5, f"grouped {format.name} experts vs float64 of the dequantized weights")
    assert passes == one_pass_per_expert_chosen(chosen, experts)


def moe_model(family: str, k: int):
    torch.manual_seed(0)
    shapes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                  max_position_embeddings=64, num_experts_per_tok=k)
    # expert widths 44 and 36, not powers of two (transformers' grouped matmuls need 16-byte strides)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers): both kinds of MLP in one model
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shapes, head_dim=16, intermediate_size=96, moe_intermediate_size=44,
                                                   num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]))
    else:
        model = MixtralForCausalLM(MixtralConfig(**shapes, intermediate_size=36, num_local_experts=8))
    model.generation_config.eos_token_id = None
    return model.eval()


def _moe_rank(model, ids, prefill_chunk=None, expert_parallel=False):
    m = from_hf(model, max_seq_len=12, max_batch=ids.shape[0], workers=1, prefill_chunk=prefill_chunk,
                expert_parallel=expert_parallel)
    try:
        tokens = m.generate(ids, max_new_tokens=4)
        return tokens, m.expert_passes, m.decode(ids[:, 0], 0), m.expert_ranks, m.bytes_read
    finally:
        m.close()


def distinct_experts_per_layer_step(model, ids, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """transformers' greedy tokens, and the experts its routers chose summed over (layer, position): the
    distinct experts among the batch's tokens at each position of each sparse layer."""
    calls = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _, inp, out: calls.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    finally:
        for hook in hooks:
            hook.remove()
    chosen = [c.reshape(ids.shape[0], -1, c.shape[-1]) for c in calls]  # [batch, positions, k]
    return tokens, sum(len(torch.unique(c[:, p])) for c in chosen for p in range(c.shape[1]))


@pytest.mark.parametrize("family,k,world,batch,prefill_chunk", [("qwen3_moe", 2, 1, 3, None), ("qwen3_moe", 2, 2, 1, None),
                                                                ("mixtral", 3, 1, 1, None), ("mixtral", 3, 2, 3, 0)])
def test_moe_models_generate_what_transformers_generates(family, k, world, batch, prefill_chunk):
    """Greedy tokens and first logits as transformers', and a weight pass per expert chosen in a
    layer-step: exactly transformers' distinct choices per (layer, position) when a step runs a position
    of every sequence (no prefill rows), fewer when prefill rows take several positions in one step."""
    model = moe_model(family, k)
    ids = torch.randint(0, 100, (batch, 5), generator=torch.Generator().manual_seed(1))
    expected, distinct = distinct_experts_per_layer_step(model, ids, 4)
    with torch.no_grad():
        first = model(ids[:, :1]).logits[:, 0].float()
    job = functools.partial(_moe_rank, model, ids, prefill_chunk)
    results = mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]
    for rank, (tokens, passes, logits, _, _) in enumerate(results):
        assert torch.equal(tokens, expected), f"{family} top-{k}, rank {rank} of {world}, batch {batch}"
        assert_close(logits, first, 1e-4, f"{family} top-{k}, rank {rank} of {world}, batch {batch}")
        # the grouped tiles: a pass over an expert's weights per layer-step that some row chose it in
        assert passes == distinct if prefill_chunk == 0 else 0 < passes <= distinct, \
            f"{passes} weight passes for {distinct} (layer, position, expert) choices"


def test_shared_experts_are_refused_by_name():
    from megakernel.models.hf import _moe_config
    model = moe_model("qwen3_moe", 2)
    model.model.layers[0].mlp.shared_expert = torch.nn.Identity()
    with pytest.raises(mk.GraphError, match="layer 0 has a shared expert"):
        _moe_config(model)


def _pretrained_rank(path, ids, expert_parallel=False):
    m = from_pretrained(path, max_seq_len=10, workers=1, expert_parallel=expert_parallel)
    try:
        return m.generate(ids, max_new_tokens=3), m.bytes_read
    finally:
        m.close()


@pytest.mark.parametrize("family,expert_parallel", [("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True)])
def test_moe_checkpoints_load_expert_by_expert(family, expert_parallel, tmp_path):
    """Checkpoints store each expert apart (``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe``
    ``w1``/``w3``/``w2``): loaded straight into the heap, each of two ranks reading about half (under expert
    parallelism its own experts whole)."""
    model = moe_model(family, 2)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    alone = _pretrained_rank(tmp_path, ids)
    pair = mk.launch(functools.partial(_pretrained_rank, tmp_path, ids, expert_parallel), world_size=2, virtual=True,
                     timeout=600)
    for tokens, _ in [alone, *pair]:
        assert torch.equal(tokens, expected)
    assert all(read < 0.75 * alone[1] for _, read in pair)


# -- expert parallelism ---------------------------------------------------------------------------------------

def held_slice(inputs: dict, held: Held, hidden: int, inter: int) -> dict:
    """A rank's inputs under expert parallelism: its experts' gate/up and down rows whole, zero experts
    after them up to ``held.stacked``."""
    def stacked(w: torch.Tensor, rows: int) -> torch.Tensor:
        mine = w[held.first * rows:(held.first + held.count) * rows]
        return torch.cat([mine, mine.new_zeros((held.stacked - held.count) * rows, w.shape[1])])
    return {**inputs, "gate_up": stacked(inputs["gate_up"], 2 * inter), "down": stacked(inputs["down"], hidden)}


def _expert_parallel_rank(inputs: dict, tokens: int, hidden: int, experts: int, inter: int, k: int):
    g = mk.Graph()
    held = Held.balanced(experts, g.rank, g.world_size)
    x, router = g.input("x", (tokens, hidden), torch.float32), g.input("router", (experts, hidden), torch.float32)
    gate_up = g.input("gate_up", (held.stacked * 2 * inter, hidden), torch.float32)
    down = g.input("down", (held.stacked * hidden, inter), torch.float32)
    passes = g.input("passes", (experts,), torch.int64)
    g.output("y", g.moe_mlp(x, router, gate_up, down, k, True, torch.float32, passes=passes, expert_parallel=True))
    with mk.Megakernel(g, workers=2) as kernel:
        kernel.bind({**held_slice(inputs, held, hidden, inter), "passes": torch.zeros(experts, dtype=torch.int64)})
        kernel.poison()
        return kernel.run()["y"], kernel.tensor(g.inputs["passes"]).tolist(), held


@pytest.mark.interpreter  # the tiles' semantics: routed puts and their rank-order sum
@pytest.mark.parametrize("world,skewed", [(2, False), (3, True)])
def test_expert_parallel_ranks_hold_their_experts_whole_and_agree_bit_for_bit(world, skewed):
    """5 experts over 2 ranks (2 and 3 each) or 3 (1, 2, 2): every rank ends with the whole sparse MLP, bit
    for bit the same, as float64 computes it, each running a weight pass per expert of its own chosen;
    ``skewed``: every token's first choice is expert 4 (the last rank's), its second the lowest of the
    others' tie (expert 0, the first rank's): the middle rank's experts nobody picks, it sends no row."""
    tokens, hidden, experts, inter, k = 3, 16, 5, 12, 2
    inputs = _inputs(tokens, hidden, experts, inter, seed=world)  # made once, before the launch: ranks share them
    if skewed:
        inputs["x"] = torch.rand(tokens, hidden, generator=torch.Generator().manual_seed(4)) + 0.5  # positive
        inputs["router"] = -torch.ones(experts, hidden)
        inputs["router"][4] = 3.0
    results = mk.launch(functools.partial(_expert_parallel_rank, inputs, tokens, hidden, experts, inter, k),
                        world_size=world, virtual=True, timeout=600)
    y, chosen = moe_float64(inputs, experts, inter, k, True)
    if skewed:
        assert chosen.tolist() == [[4, 0]] * tokens
    for rank, (out, passes, held) in enumerate(results):
        assert torch.equal(out, results[0][0]), f"rank {rank} differs from rank 0"
        assert_close(out, y, 1e-5, f"expert-parallel sparse MLP on rank {rank} of {world}")
        mine = [e for e in torch.unique(chosen).tolist() if held.first <= e < held.first + held.count]
        assert passes == [1] * len(mine) + [0] * (experts - len(mine)), f"rank {rank} holds {held}, chose {mine}"


@pytest.mark.parametrize("family,world,batch,prefill_chunk,ranks", [
    ("qwen3_moe", 2, 3, None, "virtual"), ("qwen3_moe", 3, 2, 0, "virtual"), ("mixtral", 4, 3, None, "virtual"),
    ("qwen3_moe", 2, 2, None, "processes"), ("qwen3_moe", 2, 2, None, "two nodes")])
def test_expert_parallel_models_generate_what_transformers_generates(family, world, batch, prefill_chunk, ranks):
    """Each expert whole on one rank (8 experts: 4 + 4, 2 + 3 + 3, 2 each), attention tensor-parallel, the
    ranks threads, processes, or processes on two nodes (the routed puts through the node transport):
    transformers' greedy tokens for a batch of prompts on every rank, the same logits on every rank bit
    for bit, the same expert map everywhere, and the weight passes of all ranks together exactly
    transformers' distinct (layer, position, expert) choices (each expert chosen is served once, by its
    rank) when every step runs a position of every sequence."""
    model = moe_model(family, 2)
    ids = torch.randint(0, 100, (batch, 5), generator=torch.Generator().manual_seed(world))
    expected, distinct = distinct_experts_per_layer_step(model, ids, 4)
    job = functools.partial(_moe_rank, model, ids, prefill_chunk, True)
    results = mk.launch(job, world_size=world, virtual=ranks == "virtual", backend="torch", timeout=600,
                        ranks_per_node=1 if ranks == "two nodes" else None)
    ranks = tuple(((e + 1) * world - 1) // 8 for e in range(8))
    for rank, (tokens, _, logits, expert_ranks, _) in enumerate(results):
        assert torch.equal(tokens, expected), f"{family}, rank {rank} of {world}, batch {batch}"
        assert torch.equal(logits, results[0][2]) and expert_ranks == ranks
    passes = sum(r[1] for r in results)
    assert passes == distinct if prefill_chunk == 0 else 0 < passes <= distinct, \
        f"{passes} weight passes on {world} ranks for {distinct} (layer, position, expert) choices"
    alone = _moe_rank(model, ids, prefill_chunk)
    assert_close(results[0][2], alone[2], 1e-5, "expert-parallel logits vs one rank's")


def _drafting_rank(model, ids, expert_parallel, sampling):
    m = from_hf(model, max_seq_len=16, max_batch=ids.shape[0], workers=1, draft_tokens=2,
                expert_parallel=expert_parallel)
    try:
        return m.generate(ids, max_new_tokens=5, sampling=sampling)
    finally:
        m.close()


def test_expert_parallel_drafts_and_samples_as_tensor_parallel_does():
    """Drafts verified in the step (2 a sequence) and tokens drawn on the device, under expert parallelism
    over 2 ranks: greedy, transformers' tokens; seeded sampling, the tokens tensor parallelism draws."""
    model = moe_model("qwen3_moe", 2)
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    sampled = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=20, seed=9)]
    for sampling in (None, sampled):
        ep, tp = (mk.launch(functools.partial(_drafting_rank, model, ids, expert_parallel, sampling), world_size=2,
                            virtual=True, timeout=600) for expert_parallel in (True, False))
        assert torch.equal(ep[0], ep[1]) and torch.equal(ep[0], tp[0]), f"sampling {sampling}"
        assert torch.equal(ep[0], expected) == (sampling is None), "greedy is transformers'; the draws are not"
