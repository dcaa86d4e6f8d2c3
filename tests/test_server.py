"""``megakernel serve``: SmolLM2's GGUF file behind the OpenAI HTTP API, a real server process on 127.0.0.1
driven by the official ``openai`` client (and ``httpx`` for raw requests), against transformers."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from helpers import smollm2_path

pytestmark = pytest.mark.slow  # a real model end to end, in server processes

MAX_SEQ_LEN = 160
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TEXT = "The three primary colors are"


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: str

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        lines = httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines()
        return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def start(model: str, logs, *options: str, timeout: float = 400) -> Server:
    """A ``megakernel serve`` process of ``model`` on a free port, once its /health says 200; its output in a
    file in the folder ``logs``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = str(logs / f"serve-{port}.log")
    command = [sys.executable, "-m", "megakernel.tools.cli", "serve", model, "--port", str(port),
               "--backend", "torch", "--max-batch", "3", "--max-seq-len", str(MAX_SEQ_LEN),
               "--page-size", "16", "--prefill-chunk", "32", "--workers", "2", *options]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}):\n{open(log).read()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(server)
    pytest.fail(f"the server was not healthy within {timeout} s:\n{open(log).read()}")


def stop(server: Server, timeout: float = 60) -> int:
    """SIGTERM, then wait (a kill after ``timeout``); returns the exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
            pytest.fail(f"the server did not stop within {timeout} s of SIGTERM:\n{open(server.log).read()}")
    return server.process.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # float32 weights: the torch backend unpacks packed ones every step
    s = start(smollm2_path(), tmp_path_factory.mktemp("serve"), "--dequantize")
    try:
        yield s
    finally:
        workers = _children(s.process.pid)
        assert stop(s) == 0, open(s.log).read()  # SIGTERM: a clean exit, its worker processes gone with it
        assert not _alive(workers, within=10), workers


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    path = smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def greedy(smollm2, tokenizer, ids: list[int], new: int) -> tuple[str, str]:
    """transformers' greedy text after ``ids`` (to its end-of-sequence token or ``new`` tokens), and why it ended."""
    with torch.no_grad():
        out = smollm2.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                               max_new_tokens=new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    ended = out[-1] == tokenizer.eos_token_id
    return tokenizer.decode(out, skip_special_tokens=True), "stop" if ended else "length"


def chat_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_and_text_completions_at_temperature_0_are_transformers_greedy_text(server, smollm2, tokenizer):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [os.path.basename(smollm2_path())[:-5]]
    name = client.models.list().data[0].id
    chat = client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=40)
    text, finish = greedy(smollm2, tokenizer, chat_ids(tokenizer), 40)
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == finish
    assert chat.usage.prompt_tokens == len(chat_ids(tokenizer)) and chat.usage.completion_tokens > 0
    completion = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=12)
    text, finish = greedy(smollm2, tokenizer, tokenizer(TEXT)["input_ids"], 12)
    assert completion.choices[0].text == text and completion.choices[0].finish_reason == finish == "length"
    assert completion.usage.completion_tokens == 12


def test_streamed_deltas_concatenate_to_the_same_text(server):
    client, name = server.client(), server.client().models.list().data[0].id
    whole = client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    pieces = list(client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == \
        client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=6).choices[0].text
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": name, "prompt": TEXT, "max_tokens": 3, "stream": True}) as raw:
        events = [line for line in raw.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_concurrent_requests_each_get_what_they_get_alone(server):
    """Four requests at once through three batch rows (one waits for a free one), greedy and seeded, each
    the text it gets alone."""
    client, name = server.client(), server.client().models.list().data[0].id
    asks = [dict(prompt=f"{TEXT} number {i}:", max_tokens=3 + 2 * i,
                 **(dict(temperature=0.8, top_p=0.9, seed=i) if i % 2 else dict(temperature=0))) for i in range(4)]
    alone = [client.completions.create(model=name, **ask).choices[0].text for ask in asks]
    together: list[str | None] = [None] * len(asks)

    def ask(i):
        together[i] = client.completions.create(model=name, **asks[i]).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert together == alone


def test_a_seeded_request_repeats(server):
    client, name = server.client(), server.client().models.list().data[0].id
    ask = dict(model=name, prompt="Once upon a time", temperature=1.5, max_tokens=8,
               extra_body={"top_k": 200, "min_p": 0.001})
    first, again = (client.completions.create(**ask, seed=7).choices[0].text for _ in range(2))
    assert first == again
    others = {client.completions.create(**ask, seed=seed).choices[0].text for seed in (8, 9)}
    assert len(others | {first}) > 1, "other seeds draw other texts"


def test_log_probabilities_are_the_models(server, smollm2, tokenizer):
    client, name = server.client(), server.client().models.list().data[0].id
    completion = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=4, logprobs=3)
    logprobs = completion.choices[0].logprobs
    ids = tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        first = torch.log_softmax(smollm2(torch.tensor([ids])).logits[0, -1].double(), 0)
    best = first.topk(3)
    assert logprobs.token_logprobs[0] == pytest.approx(best.values[0].item(), abs=1e-3)
    assert list(logprobs.top_logprobs[0]) == [tokenizer.decode([i]) for i in best.indices.tolist()]
    assert len(logprobs.tokens) == 4 and "".join(logprobs.tokens) == completion.choices[0].text
    chat = client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=3, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5) for c in content)  # greedy: the best


def test_bad_requests_are_400s_and_the_server_goes_on(server):
    name = server.client().models.list().data[0].id
    url = f"{server.url}/v1"
    bad = [("completions", b"{not json"), ("completions", {"model": name, "prompt": TEXT, "max_tokens": "ten"}),
           ("completions", {"model": name, "prompt": TEXT, "max_tokens": 0}),
           ("completions", {"model": name, "prompt": TEXT, "max_tokens": MAX_SEQ_LEN}),
           ("completions", {"model": name, "prompt": TEXT, "temperature": -1}),
           ("completions", {"model": name, "prompt": TEXT, "logprobs": 50}),
           ("completions", {"model": name, "prompt": TEXT, "n": 2}),
           ("completions", {"model": name, "prompt": [10**9]}),
           ("completions", {"model": name}), ("chat/completions", {"model": name, "messages": []}),
           ("chat/completions", {"model": name, "messages": [{"role": "user", "content": 5}]}),
           ("chat/completions", {"model": name, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]})]
    for path, body in bad:
        response = httpx.post(f"{url}/{path}", timeout=30, **({"content": body, "headers": {
            "content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}))
        assert response.status_code == 400, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (body, error)
    response = httpx.post(f"{url}/completions", json={"model": "gpt-4", "prompt": TEXT}, timeout=30)
    assert response.status_code == 404 and "gpt-4" in response.json()["error"]["message"]
    assert server.client().completions.create(model=name, prompt=TEXT, max_tokens=2).usage.completion_tokens == 2


def test_a_stop_string_ends_the_text_before_it(server):
    client, name = server.client(), server.client().models.list().data[0].id
    free = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=16).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    cut = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=16, stop=[stop])
    assert cut.choices[0].text == free[:free.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=16, stop=stop, stream=True)
    assert "".join(p.choices[0].text for p in streamed) == cut.choices[0].text


def _settled(server, timeout=60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["megakernel_requests_running"] == 0 and m["megakernel_kv_pages_in_use"] == 0:
            return m
        time.sleep(0.2)
    pytest.fail(f"the server still holds sequences or pages: {m}")


def test_a_client_that_disconnects_frees_its_sequence_and_pages(server):
    name = server.client().models.list().data[0].id
    before = _settled(server)['megakernel_requests_total{outcome="cancelled"}']
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": name, "messages": CHAT, "max_tokens": MAX_SEQ_LEN // 2, "stream": True}) as raw:
        lines = raw.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        assert server.metrics()["megakernel_requests_running"] == 1
    after = _settled(server)  # the stream closed after its first event: the sequence is cancelled
    assert after['megakernel_requests_total{outcome="cancelled"}'] == before + 1
    assert after["megakernel_kv_pages"] > 0 and after["megakernel_launch_seconds_count"] > 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory, tokenizer):
    """A random 2-layer Llama with SmolLM2's tokenizer, saved as a checkpoint directory: a model whose
    ranks start in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=MAX_SEQ_LEN,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("small-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, str(path)


def _alive(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    while [pid for pid in pids if os.path.exists(f"/proc/{pid}")] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_tensor_parallel_server_stops_cleanly_on_sigterm(small_llama, tokenizer, tmp_path):
    """Two process ranks, 2 tokens drafted a step: transformers' greedy text; SIGTERM mid-stream ends the
    stream with an error, and leaves no process or shared memory behind."""
    model, path = small_llama
    server = start(path, tmp_path, "--tp", "2", "--draft-tokens", "2")
    try:
        ranks = _children(server.process.pid)
        client = server.client()
        name = client.models.list().data[0].id
        text = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=8).choices[0].text
        assert text == greedy(model, tokenizer, tokenizer(TEXT)["input_ids"], 8)[0]
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={"model": name, "prompt": TEXT, "max_tokens": MAX_SEQ_LEN // 2, "stream": True}) as raw:
            lines = (line for line in raw.iter_lines() if line)
            first = next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert first.startswith("data: ") and any("error" in json.loads(line[6:]) for line in rest
                                                  if line != "data: [DONE]"), rest
        assert stop(server) == 0
    finally:
        stop(server)
    assert len(ranks) >= 2 and not _alive(ranks, within=10), ranks
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("megakernel-") and
                int(n.split("-")[1]) in ranks + [server.process.pid]]
