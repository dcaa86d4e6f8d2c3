"""The serving loop without HTTP: requests joining a running batch through the scheduler's thread, what each
hears, and a failed launch ending every request with an error instead of a hang."""
import threading

import pytest
import torch

from megakernel.serving import Request, SamplingParams, ServingLoop, Text, from_hf

from test_decode import hf_model, prompt


class Digits:
    """A tokenizer whose token i reads as ``<i>``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def ask(scheduler: ServingLoop, ids: list[int], new: int, **options) -> tuple[Request, list, threading.Event]:
    updates, ended = [], threading.Event()

    def emit(update):
        updates.append(update)
        if update.finish or update.error:
            ended.set()
    request = Request(prompt=ids, max_tokens=new, emit=emit, **options)
    scheduler.submit(request)
    return request, updates, ended


@pytest.mark.usefixtures("torch_backend")
def test_requests_join_the_batch_and_each_hears_its_own_tokens_and_text():
    model = hf_model("llama", layers=1)
    m = from_hf(model, max_seq_len=16, max_batch=2, page_size=4, prefill_chunk=4, max_logprobs=2, workers=1)
    scheduler = ServingLoop(m, Text(Digits(), frozenset()), steps_per_launch=3)
    loop = threading.Thread(target=scheduler.run)
    loop.start()
    try:
        prompts = [prompt(1, n)[0].tolist() for n in (3, 6, 2)]
        asks = [ask(scheduler, ids, 5, sampling=SamplingParams(temperature=0.7, seed=i) if i == 1 else SamplingParams())
                for i, ids in enumerate(prompts)]  # three through two rows: one waits
        for _, _, ended in asks:
            assert ended.wait(120)
        for i, (request, updates, _) in enumerate(asks):
            tokens = [t for u in updates for t in u.tokens]
            alone = m_alone(model, prompts[i], request.sampling)
            assert tokens == alone, i
            assert "".join(u.text for u in updates) == "".join(f"<{t}>" for t in tokens)
            assert updates[-1].finish == "length" and len([p for u in updates for p in u.logprobs]) == 5
            assert all(len(top) == 2 for u in updates for top in u.top)
        assert scheduler.metrics.requests["length"] == 3 and scheduler.metrics.generated_tokens == 15
        assert not scheduler.running and len(m.pool.free) == m.pool.pages and not m.finished

        def broken(steps=1):
            raise RuntimeError("injected launch failure")
        m.step = broken
        _, updates, ended = ask(scheduler, prompts[0], 4)
        assert ended.wait(60) and "injected launch failure" in updates[-1].error
        loop.join(30)
        assert not loop.is_alive() and scheduler.failure  # the loop ended rather than serve on a broken engine
        _, updates, ended = ask(scheduler, prompts[0], 4)
        assert ended.is_set() and "injected" in updates[-1].error
    finally:
        scheduler.stop()
        loop.join(30)
        m.close()


def m_alone(model, ids: list[int], sampling: SamplingParams) -> list[int]:
    m = from_hf(model, max_seq_len=16, workers=1)
    try:
        return m.generate(torch.tensor(ids), 5, sampling=sampling)[0, len(ids):].tolist()
    finally:
        m.close()
