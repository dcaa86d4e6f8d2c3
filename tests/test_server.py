"""``megakernel serve``: SmolLM2's GGUF file behind the OpenAI HTTP API, a real server process on 127.0.0.1
driven by the official ``openai`` client (and ``httpx`` for raw requests), against transformers."""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from helpers import marked_processes, smollm2_path

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
    try:
        _wait_healthy(process, server.url, log, timeout)
    except BaseException:
        stop(server)
        raise
    return server


def _wait_healthy(process: subprocess.Popen, url: str, log: str, timeout: float = 400) -> None:
    """Until the server's /health says 200; a test failure, with its log, if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}):\n{open(log).read()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
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
    s = start(smollm2_path(), tmp_path_factory.mktemp("serve"), "--dequantize", "--idle-timeout", "5")
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


def _json(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # lone surrogates as \\u escapes; NaN as Python writes it


def test_malformed_requests_of_every_shape_are_4xx_with_openai_error_body(server):
    """A fuzz loop over the fields both endpoints take, with values of every JSON type and the edges of
    each (lone surrogates, NaN, huge numbers, nesting): each answer is a 4xx with OpenAI's error body or
    a correct answer, never a 5xx; the server's greedy text is the same afterwards."""
    import random

    client, name = server.client(), server.client().models.list().data[0].id
    before = client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=4).choices[0].text
    values = [None, True, False, 0, 1, -1, 2, 0.5, 1e308, -1e308, float("nan"), float("inf"), 10**30, "", "x",
              "\ud800", "a\udfffb", "\x00", [], [1], ["x"], ["\ud800"], [[1]], [1, "x"], {}, {"type": "text"},
              {"type": "text", "text": 5}, [{"type": "text", "text": "hi"}], [{"type": "text", "text": ["a"]}],
              [{"type": "image_url", "image_url": {"url": "x"}}], [[[[[]]]]], "s" * 300]
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
              "stream_options", "logprobs", "top_logprobs", "n", "model"]
    rng = random.Random(37)
    statuses = []
    for _ in range(160):
        path = rng.choice(["completions", "chat/completions"])
        body = {"model": name, "max_tokens": rng.choice([1, 2, 0, -1, "1", 2.5, True, 10**20, None, []])}
        body["prompt" if path == "completions" else "messages"] = (
            rng.choice(["hi", ["hi"], [1, 2]]) if path == "completions" else [{"role": "user", "content": "hi"}])
        for field in rng.sample(fields, rng.randint(1, 4)):
            value = rng.choice(values)
            if field == "messages" and rng.random() < 0.7:  # mostly a message whose parts are hostile
                value = [{"role": rng.choice(["user", "system", "robot", 5]), "content": value}]
            body[field] = value
        if body.get("max_tokens") is None:
            body["max_tokens"] = 2  # a request that passes generates little (by default: the context's rest)
        response = httpx.post(f"{server.url}/v1/{path}", content=_json(body), timeout=120,
                              headers={"content-type": "application/json"})
        statuses.append(response.status_code)
        assert response.status_code == 200 or 400 <= response.status_code < 500, (body, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], (body, error)
    assert statuses.count(200) >= 3, statuses  # some pass: the loop reaches the engine
    assert client.completions.create(model=name, prompt=TEXT, temperature=0, max_tokens=4).choices[0].text == before


def test_text_that_is_no_unicode_is_a_400_naming_where(server):
    name = server.client().models.list().data[0].id
    for path, body, where in (("completions", {"prompt": "ab\ud800"}, "prompt: not valid Unicode"),
                              ("completions", {"prompt": ["\udc00"]}, "prompt: not valid Unicode"),
                              ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                               "messages.0.content: not valid Unicode"),
                              ("chat/completions", {"messages": [{"role": "user", "content": [
                                  {"type": "text", "text": "\ud83d"}]}]}, "messages.0.content: not valid Unicode")):
        response = httpx.post(f"{server.url}/v1/{path}", timeout=30, headers={"content-type": "application/json"},
                              content=json.dumps({"model": name, "max_tokens": 1, **body}).replace("\\\\", "\\").encode())
        assert response.status_code == 400 and where in response.json()["error"]["message"], response.text


def test_a_huge_prompt_does_not_stall_other_clients(server):
    """A 3 MB prompt (longer than the context: a 400) is tokenized off the event loop: a stream running
    meanwhile keeps its pace and /health answers at once."""
    name = server.client().models.list().data[0].id
    huge = {"model": name, "prompt": TEXT * 110_000, "max_tokens": 1}
    answers = {}
    health = []

    def post_huge():
        answers["huge"] = httpx.post(f"{server.url}/v1/completions", json=huge, timeout=120)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": name, "prompt": TEXT, "max_tokens": 40, "stream": True}) as raw:
        lines = (line for line in raw.iter_lines() if line)
        next(lines)
        sender = threading.Thread(target=post_huge)
        sender.start()
        while sender.is_alive():
            start = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - start)
            time.sleep(0.05)
        rest = list(lines)
    assert answers["huge"].status_code == 400 and "exceed" in answers["huge"].json()["error"]["message"]
    assert health and max(health) < 1.5, health
    assert rest[-1] == "data: [DONE]"


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


@pytest.mark.parametrize("nodes", [(), ("--ranks-per-node", "1")], ids=["one node", "two nodes"])
def test_tensor_parallel_server_stops_cleanly_on_sigterm(small_llama, tokenizer, tmp_path, nodes):
    """Two process ranks (on one node, or each on a node of its own: the transport between them), 2 tokens
    drafted a step: transformers' greedy text; SIGTERM mid-stream ends the stream with an error, and leaves
    no process or shared memory behind."""
    model, path = small_llama
    server = start(path, tmp_path, "--tp", "2", "--draft-tokens", "2", *nodes)
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


def _marked_serve(path: str, tmp_path, *options: str) -> tuple[subprocess.Popen, str, str, str]:
    """A ``megakernel serve`` process of ``path`` on a free port, a mark in its environment (its
    processes are found by it); returns the process, its URL, its log's path and the mark."""
    mark = f"MEGAKERNEL_TEST_MARK={uuid.uuid4().hex}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = str(tmp_path / f"serve-{port}.log")
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "megakernel.tools.cli", "serve", path, "--port", str(port),
                                    "--backend", "torch", "--workers", "2", *options], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "MEGAKERNEL_TEST_MARK": mark.split("=")[1]})
    return process, f"http://127.0.0.1:{port}", log, mark


def test_serve_exits_in_one_line_when_the_tokenizer_cannot_load(small_llama, tmp_path):
    _, path = small_llama
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for name in os.listdir(broken):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            (broken / name).write_text("{not a tokenizer")
    process, _, log, mark = _marked_serve(str(broken), tmp_path)
    try:
        assert process.wait(300) == 1
    finally:
        process.kill()
    lines = open(log).read().strip().splitlines()
    assert len(lines) == 1 and "the model did not load" in lines[0] and "Traceback" not in lines[0], lines
    assert not _alive(marked_processes(mark), within=10)


def test_ctrl_c_while_the_model_compiles_exits_cleanly(small_llama, tmp_path):
    """SIGINT once the server answers (503: the model still compiling): it exits 0, nothing left running."""
    _, path = small_llama
    process, url, log, mark = _marked_serve(path, tmp_path)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                status = httpx.get(f"{url}/health", timeout=5).status_code
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, open(log).read()
    finally:
        process.kill()
    assert status in (200, 503)
    assert not _alive(marked_processes(mark), within=10)


def test_many_concurrent_requests_each_get_their_solo_answer_and_sigterm_ends_open_streams(small_llama, tmp_path):
    """What held under the adversarial pass, kept so: 200 requests at once through 8 batch rows (streamed
    and not, greedy and seeded, some abandoned after their first event) each get what they get alone; the
    KV pages all come back; SIGTERM with 10 streams open ends each with an error and exits 0, leaving no
    process or shared memory."""
    _, path = small_llama
    process, url, log, mark = _marked_serve(path, tmp_path, "--max-batch", "8", "--max-seq-len", str(MAX_SEQ_LEN),
                                            "--page-size", "16", "--prefill-chunk", "32")
    server = Server(process, url, log)
    try:
        _wait_healthy(process, url, log)
        name = server.client().models.list().data[0].id
        asks = [dict(model=name, prompt=f"{TEXT} {i}", max_tokens=2 + i % 4, stream=i % 3 == 0,
                     **(dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0))) for i in range(200)]
        abandoned = set(range(5, 200, 20))

        def text(ask, abandon=False) -> str | None:
            if not ask["stream"] and not abandon:
                return httpx.post(f"{url}/v1/completions", json=ask, timeout=300).json()["choices"][0]["text"]
            with httpx.stream("POST", f"{url}/v1/completions", json={**ask, "stream": True}, timeout=300) as raw:
                events = []
                for line in raw.iter_lines():
                    if line and line != "data: [DONE]":
                        events.append(json.loads(line[6:])["choices"][0]["text"])
                        if abandon:
                            return None
            return "".join(events)
        together: dict[int, str | None] = {}
        with ThreadPoolExecutor(48) as pool:
            for i, answer in zip(range(200), pool.map(lambda i: text(asks[i], i in abandoned), range(200))):
                together[i] = answer
        alone = {i: text(asks[i]) for i in range(200) if i not in abandoned}
        assert {i: t for i, t in together.items() if i not in abandoned} == alone
        settled = _settled(server)
        assert settled['megakernel_requests_total{outcome="cancelled"}'] >= len(abandoned) - 2  # (some finished)
        with contextlib.ExitStack() as open_streams:  # 8 rows run, 2 wait
            lines = [(line for line in open_streams.enter_context(httpx.stream(
                "POST", f"{url}/v1/completions", timeout=120, json={"model": name, "prompt": TEXT, "stream": True,
                                                                     "max_tokens": MAX_SEQ_LEN - 20})).iter_lines()
                      if line and line != "data: [DONE]") for _ in range(10)]
            assert next(lines[0]).startswith("data: ")
            workers = marked_processes(mark)
            process.send_signal(signal.SIGTERM)
            for events in lines:
                assert "error" in json.loads(list(events)[-1][6:])
        assert process.wait(60) == 0, open(log).read()
    finally:
        process.kill()
    assert not _alive(workers, within=10)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"megakernel-{process.pid}-")]


def test_a_killed_server_leaves_no_worker_and_no_shared_memory(small_llama, tmp_path):
    """SIGKILL of a server on the cpu backend (its workers are processes): they follow it within seconds,
    and no segment of its heap is left (its name went once the workers had mapped it)."""
    _, path = small_llama
    process, url, log, mark = _marked_serve(path, tmp_path, "--backend", "cpu")
    try:
        _wait_healthy(process, url, log)
        workers = [pid for pid in marked_processes(mark) if pid != process.pid]
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
    assert len(workers) >= 2 and not _alive(workers, within=30), workers
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"megakernel-{process.pid}-")]
