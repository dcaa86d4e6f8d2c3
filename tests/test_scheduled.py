"""Steps another scheduler plans (``DecodeModel.run_scheduled``, what vLLM's model class runs): each
request's tokens at its positions, its KV cache in pool pages the scheduler names. Here a small
scheduler plays vLLM — a token budget per step (chunked prefill mixed with decodes), pages handed out
in a scrambled order, a prompt that shares a cached page with an earlier one (prefix caching) — and
every step's logits are checked against transformers in float64 on the same tokens."""
import copy

import pytest
import torch

from megakernel.errors import GraphError
from megakernel.serving import from_hf
from megakernel.serving.compiled import Scheduled

from helpers import assert_close, tolerance
from test_decode import hf_model

PAGE, PAGES, CHUNK, BATCH = 4, 40, 16, 3


@pytest.fixture(scope="module")
def hf():
    return hf_model("llama", layers=2)


@pytest.fixture(scope="module")
def engine(hf):
    m = from_hf(hf, max_seq_len=48, max_batch=BATCH, page_size=PAGE, kv_pages=PAGES, prefill_chunk=CHUNK,
                backend="torch")
    yield m
    m.close()


@pytest.fixture(scope="module")
def reference(hf):
    """transformers' logits in float64 at the last of ``tokens``."""
    model = copy.deepcopy(hf).double()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -1]
    return logits


def test_a_planned_schedule_gives_transformers_logits_at_each_requests_last_token(engine, reference):
    torch.manual_seed(1)
    shared = torch.randint(0, 128, (PAGE,)).tolist()  # a whole page both prompts start with
    prompts = [shared + torch.randint(0, 128, (26,)).tolist(), torch.randint(0, 128, (3,)).tolist(),
               shared + torch.randint(0, 128, (7,)).tolist()]
    free = torch.randperm(PAGES).tolist()
    pages: list[list[int]] = [[], [], []]
    done = [0, 0, 0]              # positions whose KV is written
    tokens = [list(p) for p in prompts]
    order = [0, 1]                # request 2 arrives later, and finds request 0's first page cached
    budget, checked = 12, 0
    for step in range(12):
        if step == 2:
            order.append(2)
            pages[2].append(pages[0][0])
            done[2] = PAGE
        left, planned = budget, []
        for i in order:
            count = min(left, len(tokens[i]) - done[i])
            if count <= 0:
                continue
            left -= count
            while len(pages[i]) * PAGE < done[i] + count:
                pages[i].append(free.pop())
            planned.append((i, count))
        logits = engine.run_scheduled([Scheduled(torch.tensor(tokens[i][done[i]:done[i] + count]), done[i],
                                                 torch.tensor(pages[i])) for i, count in planned])
        assert logits.shape == (len(planned), 128)
        for (i, count), row in zip(planned, logits):
            done[i] += count
            expected = reference(tokens[i][:done[i]])
            assert_close(row, expected, tolerance(torch.float32), f"step {step}, request {i}")
            checked += 1
            if done[i] >= len(prompts[i]):  # past its prompt: the greedy token is the next input
                tokens[i].append(int(row.argmax()))
    assert checked > 20 and all(len(t) > len(p) + 3 for t, p in zip(tokens, prompts))


def test_a_step_with_more_prompt_tokens_than_the_prefill_rows_runs_in_several_launches(engine, reference):
    torch.manual_seed(2)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (37, 9, 20)]
    first = iter(range(PAGES))
    requests = [Scheduled(torch.tensor(p), 0, torch.tensor([next(first) for _ in range(-(-len(p) // PAGE))]))
                for p in prompts]
    launches = engine._steps_launched
    logits = engine.run_scheduled(requests)
    assert engine._steps_launched - launches >= 3  # 36 + 8 + 19 prompt rows in chunks of 16 rows
    for p, row in zip(prompts, logits):
        assert_close(row, reference(p), tolerance(torch.float32))


@pytest.mark.parametrize("requests, message", [
    (lambda: [Scheduled(torch.tensor([1, 2]), 0, torch.tensor([PAGES]))], "pages of \\[0, 40\\)"),
    (lambda: [Scheduled(torch.tensor([1] * 5), 0, torch.tensor([0]))], "needs 2 to"),
    (lambda: [], "no requests"),
    (lambda: [Scheduled(torch.tensor([128]), 0, torch.tensor([0]))], "outside the vocabulary"),
    (lambda: [Scheduled(torch.tensor([1]), 48, torch.tensor([0] * 12))], "max_seq_len"),
])
def test_a_bad_plan_is_refused_naming_what_is_wrong_and_the_next_one_runs(engine, reference, requests, message):
    with pytest.raises(GraphError, match=message):
        engine.run_scheduled(requests())
    logits = engine.run_scheduled([Scheduled(torch.tensor([5, 6, 7]), 0, torch.tensor([3]))])
    assert_close(logits[0], reference([5, 6, 7]), tolerance(torch.float32))


def test_more_requests_than_batch_rows_run_in_steps_of_a_batch(engine, reference):
    torch.manual_seed(5)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (3, 6, 1, 5, 2, 7, 4)]
    requests = [Scheduled(torch.tensor(p), 0, torch.tensor([2 * i, 2 * i + 1])) for i, p in enumerate(prompts)]
    for p, row in zip(prompts, engine.run_scheduled(requests)):
        assert_close(row, reference(p), tolerance(torch.float32))


def test_a_model_with_sequences_of_its_own_refuses_a_plan(engine):
    sequence = engine.add(torch.tensor([1, 2, 3]), 2)
    try:
        with pytest.raises(GraphError, match="running in the batch"):
            engine.run_scheduled([Scheduled(torch.tensor([1]), 0, torch.tensor([0]))])
    finally:
        engine.cancel(sequence)


def test_a_page_written_in_the_step_that_another_request_reads_as_cached_is_written_first(engine, reference):
    """Prefix caching: request 1 finds request 0's first pages cached while request 0 computes them in this
    same step, listed first and with more prompt tokens than one launch's prefill rows hold."""
    torch.manual_seed(3)
    prompt = torch.randint(0, 128, (30,)).tolist()
    reader = prompt[:2 * PAGE] + torch.randint(0, 128, (5,)).tolist()
    writer_pages = list(range(10, 18))
    requests = [Scheduled(torch.tensor(reader[2 * PAGE:]), 2 * PAGE, torch.tensor(writer_pages[:2] + [30, 31])),
                Scheduled(torch.tensor(prompt), 0, torch.tensor(writer_pages))]
    logits = engine.run_scheduled(requests)
    assert_close(logits[0], reference(reader), tolerance(torch.float32), "the reader")
    assert_close(logits[1], reference(prompt), tolerance(torch.float32), "the writer")


def shared_page_step(engine, a: list[int], b: list[int], page: int, b_pages: list[int]) -> torch.Tensor:
    """One step of two requests: A fills ``page`` (its last token, a batch row, writes its last position),
    and B, A's tokens then its own, finds that page cached while A computes it."""
    return engine.run_scheduled([Scheduled(torch.tensor(a), 0, torch.tensor([page])),
                                 Scheduled(torch.tensor(b), PAGE, torch.tensor([page] + b_pages))])


@pytest.mark.parametrize("b_tokens", [3, 2 * CHUNK + 3], ids=["one launch", "B's prefill in launches before A's last"])
def test_a_request_that_reads_a_page_another_fills_in_the_same_step_waits_for_it(engine, reference, b_tokens):
    """The issue-56 race: A's last position is written by its batch row, after every layer's prefill rows
    (B's) have read the page. Each repeat first fills the page with other tokens, whose stale keys B would
    read; B together with A must be bitwise what B gives in the step after A's (the torch backend runs the
    same tiles on the same rows), and transformers' within float32's rounding."""
    torch.manual_seed(4)
    for repeat in range(6):
        a = torch.randint(0, 128, (PAGE,)).tolist()
        b = torch.randint(0, 128, (b_tokens,)).tolist()
        page, b_pages = 20 + repeat % 3, list(range(30, 30 + -(-b_tokens // PAGE)))
        engine.run_scheduled([Scheduled(torch.randint(0, 128, (PAGE,)), 0, torch.tensor([page]))])  # stale keys
        together = shared_page_step(engine, a, b, page, b_pages)
        engine.run_scheduled([Scheduled(torch.randint(0, 128, (PAGE,)), 0, torch.tensor([page]))])
        first = engine.run_scheduled([Scheduled(torch.tensor(a), 0, torch.tensor([page]))])
        after = engine.run_scheduled([Scheduled(torch.tensor(b), PAGE, torch.tensor([page] + b_pages))])
        assert torch.equal(together[0], first[0]), f"repeat {repeat}: A"
        assert torch.equal(together[1], after[0]), f"repeat {repeat}: B together with A vs B in the next step"
        assert_close(together[1], reference(a + b), tolerance(torch.float32), f"repeat {repeat}: B")


@pytest.mark.parametrize("second, message", [
    (Scheduled(torch.tensor([1, 2]), 3, torch.tensor([5, 6])), "requests 0 and 1 both write position 0 of page 6"),
    (Scheduled(torch.tensor([1]), 4, torch.tensor([6, 5])), "each read a position another of them writes"),
])
def test_a_plan_whose_requests_write_one_position_or_read_each_others_is_refused(engine, reference, second, message):
    first = Scheduled(torch.tensor([1]), 4, torch.tensor([5, 6]))  # writes position 0 of page 6, reads page 5
    with pytest.raises(GraphError, match=message):
        engine.run_scheduled([first, second])
    logits = engine.run_scheduled([Scheduled(torch.tensor([5, 6, 7]), 0, torch.tensor([3]))])
    assert_close(logits[0], reference([5, 6, 7]), tolerance(torch.float32))


def test_requests_apart_by_pages_make_one_wave_as_the_positions_say(monkeypatch):
    """``waves``' check by pages (no request touches a page another writes: one wave) against its check by
    positions, on random plans whose requests share pages now and then."""
    from megakernel.serving import pages as pages_module
    generator = torch.Generator().manual_seed(5)
    checked = apart = 0
    for _ in range(300):
        requests = []
        for _ in range(int(torch.randint(1, 6, (), generator=generator))):
            last = int(torch.randint(0, 3 * PAGE, (), generator=generator))
            first = int(torch.randint(0, last + 1, (), generator=generator))
            requests.append((first, last, torch.randint(0, 8, (last // PAGE + 1,), generator=generator)))
        if not pages_module._apart(requests, PAGE):
            continue
        apart += 1
        with monkeypatch.context() as patched:
            patched.setattr(pages_module, "_apart", lambda requests, page_size: False)
            try:
                by_positions = pages_module.waves(requests, PAGE)
            except GraphError:
                by_positions = None
        assert by_positions == [list(range(len(requests)))], requests
        checked += 1
    assert apart == checked > 20
