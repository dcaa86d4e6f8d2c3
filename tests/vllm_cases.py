"""What ``tests/test_vllm.py`` runs in vLLM's environment (``.venv-vllm``: vLLM's CPU build), one case per
process, each printing one JSON line ``RESULT {...}`` (vLLM's engine runs in a process it spawns, so
``LLM`` is made under ``__main__``).

    python tests/vllm_cases.py convert FOLDER              SmolLM2's GGUF file as a float32 checkpoint folder
    python tests/vllm_cases.py transformers FOLDER N       transformers' greedy tokens of PROMPTS
    python tests/vllm_cases.py vllm FOLDER N own|megakernel TP  vLLM's greedy and seeded tokens of PROMPTS
    python tests/vllm_cases.py refuse FOLDER               an option the megakernel does not build, refused
    python tests/vllm_cases.py bfloat16 FOLDER N own|megakernel  the float32 folder in bfloat16, and transformers'
    python tests/vllm_cases.py probe FOLDER own|megakernel WORKERS race|classes   issue 56's probe: a block read
                                                           in the step that writes it, and requests of every class
"""
import importlib.util
import json
import operator
import os
import sys
from pathlib import Path

import torch

# bench/vllm.py by its path: on sys.path its name would hide vLLM's package
_bench = importlib.util.spec_from_file_location("bench_vllm", Path(__file__).resolve().parent.parent / "bench" / "vllm.py")
bench_vllm = importlib.util.module_from_spec(_bench)
_bench.loader.exec_module(bench_vllm)

# of different lengths (1 to 27 tokens), more than the batch holds at once (MAX_NUM_SEQS)
PROMPTS = ["Name three colours of the rainbow.", "The capital of France is", "1, 2, 3, 4,",
           "Write a haiku about the sea. It should mention the waves, the moon, the wind and the night sky above "
           "them all.", "Hello", "What is the largest planet in the solar system? Answer in one sentence."]
# two prompts that share more than a KV block (vLLM's block on CPU: 128 positions), run one after the other:
# the second finds the first's block in vLLM's prefix cache, its keys and values as the megakernel wrote them
SHARED = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 9
CACHED_PROMPTS = [SHARED + "What does the fox do?", SHARED + "Where does the cat sleep?"]
SHARED_REPEATS = 3          # the shared-block race (issue 56), prompt pairs per run
PROBE_LEN = 256             # the probe's max_model_len: two of vLLM's CPU blocks
MAX_NUM_SEQS = 2            # requests queue behind the running ones
MAX_NUM_BATCHED_TOKENS = 16  # a long prompt takes several steps, each mixing its chunk with the others' decodes
SEEDS = (7, 8, 9)           # seeded sampling: one request per seed, the first prompt
SEEDED_TOKENS = 16          # tokens of each seeded request (the probe's, compared with the tensor-parallel run's)
OVERRIDE = {"architectures": ["MegakernelForCausalLM"]}
RANKS = operator.attrgetter("engine.kernel.group.world_size", "engine.kernel.group.rank")  # of a worker's megakernel


def result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


def convert(folder: str) -> None:
    """vLLM 0.32 has no GGUF loader: the file as a float32 checkpoint folder (``bench/vllm.py``)."""
    result({"folder": bench_vllm.smollm2_folder(folder)})


def transformers_tokens(folder: str, new: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = []
    for prompt in PROMPTS + CACHED_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        tokens.append(out[0, ids.shape[1]:].tolist())
    result({"greedy": tokens[:len(PROMPTS)], "cached": tokens[len(PROMPTS):],
            "prompt_tokens": [len(tokenizer(p).input_ids) for p in PROMPTS + CACHED_PROMPTS]})


def vllm_tokens(folder: str, new: int, which: str, tensor_parallel: int) -> None:
    """vLLM's tokens with its own model or the megakernel's, at ``tensor_parallel`` ranks."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function (pickled) to the workers
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, tensor_parallel_size=tensor_parallel,
              hf_overrides=OVERRIDE if which == "megakernel" else None)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=new))
    cached = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new))[0] for prompt in CACHED_PROMPTS]
    seeded = llm.generate([PROMPTS[0]] * len(SEEDS), [SamplingParams(temperature=1.0, top_p=0.9, seed=seed,
                                                                     max_tokens=SEEDED_TOKENS) for seed in SEEDS])
    architecture = llm.llm_engine.model_config.hf_config.architectures
    result({"greedy": [list(o.outputs[0].token_ids) for o in greedy],
            "seeded": [list(o.outputs[0].token_ids) for o in seeded], "architectures": architecture,
            "cached": [list(o.outputs[0].token_ids) for o in cached],
            "cached_tokens": [o.num_cached_tokens for o in cached],
            "ranks": llm.apply_model(RANKS) if which == "megakernel" else None})


def refuse(folder: str) -> None:
    """An option the megakernel does not build (prompt embeddings) is refused at load (vLLM reports the engine's
    failure; the reason is in this process's output)."""
    from vllm import LLM

    try:
        LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=512, enable_prompt_embeds=True,
            hf_overrides=OVERRIDE)
    except Exception as error:  # vLLM wraps the engine process's error
        result({"refused": f"{type(error).__name__}: {error}"})
        return
    result({"refused": None})


def bfloat16(folder: str, new: int, which: str) -> None:
    """The float32 checkpoint served in bfloat16 (``LLM(dtype="bfloat16")``: vLLM's own model, or the megakernel,
    which casts the weights as vLLM and transformers do): the greedy tokens of PROMPTS, and transformers' in
    bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              hf_overrides=OVERRIDE if which == "megakernel" else None)
    tokens = [list(o.outputs[0].token_ids)
              for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=new), use_tqdm=False)]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    theirs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        theirs.append(out[0, ids.shape[1]:].tolist())
    result({"tokens": tokens, "transformers": theirs, "dtype": str(llm.llm_engine.model_config.dtype)})


def probe(folder: str, which: str, workers: int, classes: bool) -> None:
    """Issue 56's probe, in one engine with a small KV cache (8 blocks of 128 positions, prefix caching on).

    The race, ``SHARED_REPEATS`` times: prompt A fills one KV block exactly, prompt B is A and 40 tokens more;
    submitted together, B finds A's block in the prefix cache in the step that computes it (A's last position
    in its batch row); B's greedy tokens and top log-probabilities together and alone (the prefix cache
    emptied before each). Then a request for prompt logprobs (refused by the megakernel) and one more request.
    With ``classes``, the probe's classes: 16 requests of 1 to 100 tokens at once, greedy with top-5
    logprobs (their KV outgrows the blocks: vLLM preempts and recomputes), a prompt past max_model_len
    (refused), n = 3 seeded samples, a stop string, max_tokens=1, a generation to max_model_len, and the
    first prompt sampled with each of SEEDS; each for the test to hold against vLLM's own model's (the seeded
    tokens against the megakernel's at tensor parallelism too). ``workers``: the megakernel's per rank."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    overrides = OVERRIDE | {"megakernel_workers": workers} if which == "megakernel" else None
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=PROBE_LEN, max_num_seqs=16,
              max_num_batched_tokens=PROBE_LEN, num_gpu_blocks_override=8, enable_prefix_caching=True,
              disable_log_stats=False, hf_overrides=overrides)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    generator = torch.Generator().manual_seed(56)
    tokens = lambda n: torch.randint(100, 20000, (n,), generator=generator).tolist()  # noqa: E731
    rows = lambda output: [{str(t): l.logprob for t, l in step.items()} for step in output.logprobs]  # noqa: E731

    def run(prompts):
        llm.reset_prefix_cache()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, logprobs=5), use_tqdm=False)[-1]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens, "logprobs": rows(out.outputs[0])}

    out = {"block": block, "repeats": []}
    for _ in range(SHARED_REPEATS):
        a = tokens(block)
        b = a + tokens(40)
        out["repeats"].append({"together": run([a, b]), "alone": run([b])})
    try:
        llm.generate(["Hello"], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        out["refused"] = None
    except Exception as error:  # vLLM's validation error, raised for this request alone
        out["refused"] = f"{type(error).__name__}: {error}"
    after = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out["after"] = list(after[0].outputs[0].token_ids)
    if not classes:
        return result(out)
    prompts = [TokensPrompt(prompt_token_ids=tokens(n)) for n in torch.linspace(1, 100, 16).long().tolist()]
    batch = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, logprobs=5, ignore_eos=True),
                         use_tqdm=False)
    out["batch"] = [list(o.outputs[0].token_ids) for o in batch]
    out["batch_logprobs"] = [rows(o.outputs[0]) for o in batch]
    out["preemptions"] = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    try:
        llm.generate([TokensPrompt(prompt_token_ids=[100] * (PROBE_LEN + 1))], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        out["too_long"] = None
    except Exception as error:
        out["too_long"] = type(error).__name__
    samples = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=5, max_tokens=12),
                           use_tqdm=False)[0]
    out["n"] = sorted(list(c.token_ids) for c in samples.outputs)
    seeded = llm.generate([PROMPTS[0]] * len(SEEDS), [SamplingParams(temperature=1.0, top_p=0.9, seed=seed,
                                                                     max_tokens=SEEDED_TOKENS) for seed in SEEDS])
    out["seeded"] = [list(o.outputs[0].token_ids) for o in seeded]
    stopped = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40, stop=["\n"]), use_tqdm=False)[0]
    out["stop"] = [stopped.outputs[0].text, stopped.outputs[0].finish_reason]
    out["one"] = [list(o.outputs[0].token_ids)
                  for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)]
    long = llm.generate([TokensPrompt(prompt_token_ids=tokens(PROBE_LEN - 24))],
                        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    out["to_the_end"] = [len(long.prompt_token_ids), list(long.outputs[0].token_ids), long.outputs[0].finish_reason]
    result(out)


if __name__ == "__main__":
    case, folder, *rest = sys.argv[1:]
    if case == "convert":
        convert(folder)
    elif case == "transformers":
        transformers_tokens(folder, int(rest[0]))
    elif case == "vllm":
        vllm_tokens(folder, int(rest[0]), rest[1], int(rest[2]))
    elif case == "refuse":
        refuse(folder)
    elif case == "bfloat16":
        bfloat16(folder, int(rest[0]), rest[1])
    elif case == "probe":
        probe(folder, rest[0], int(rest[1]), rest[2] == "classes")
    else:
        raise SystemExit(f"unknown case {case!r}")
