"""The serving engine's contract with its callers (issue 25): calls from several threads are serialized and
lose or invent no token, a launch ends when its sequences do, and a bad request is refused whole, before
anything runs, with a ``GraphError`` naming the argument. One small model (llama, one layer, two slots,
no prefill rows) is shared by the module: each test leaves no sequence behind."""
import threading

import pytest
import torch

import megakernel as mk
from megakernel.serving import from_hf

from test_decode import hf_model
from test_serving import _alone

JOIN_TIMEOUT = 300  # seconds


@pytest.fixture(scope="module")
def hf():
    return hf_model("llama", layers=1)


@pytest.fixture(scope="module")
def engine(hf):
    m = from_hf(hf, max_seq_len=8, max_batch=2, page_size=4, workers=1, backend="torch")  # the engine, not the tiles
    yield m
    m.close()


@pytest.fixture
def model(engine):
    """The shared model, checked to be left as found: no sequence in a slot, every page free."""
    yield engine
    assert not any(engine.slots) and len(engine.pool.free) == engine.pool.pages
    engine.finished.clear()


class HeldLaunch:
    """``kernel.run`` replaced by one whose first launch waits (``started`` set) until ``release`` is set."""

    def __init__(self, kernel, monkeypatch):
        self.started, self.release, self.run = threading.Event(), threading.Event(), kernel.run
        self.first = True
        monkeypatch.setattr(kernel, "run", self)

    def __call__(self, *args, **kwargs):
        if self.first:
            self.first = False
            self.started.set()
            assert self.release.wait(JOIN_TIMEOUT), "the test never released the held launch"
        return self.run(*args, **kwargs)


def _thread(call, results: dict, key: str) -> threading.Thread:
    def body():
        try:
            results[key] = call()
        except BaseException as error:  # reported by the test's thread
            results[key] = error
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_cancel_and_add_while_a_step_runs_wait_for_its_end_and_lose_or_invent_no_token(model, hf, monkeypatch):
    """A step held open in its launch; meanwhile another thread cancels its sequence and a third adds one.
    Both wait for the step's end: the cancelled sequence's tokens are exactly those the step returned,
    and the added one runs to what it makes alone."""
    a = model.add(torch.tensor([5]), 3)
    held = HeldLaunch(model.kernel, monkeypatch)
    results: dict = {}
    stepping = _thread(model.step, results, "step")
    try:
        assert held.started.wait(JOIN_TIMEOUT)
        cancelling = _thread(lambda: model.cancel(a), results, "cancel")
        cancelling.join(0.5)  # long enough for either call to be done, were it let in mid-step
        adding = _thread(lambda: model.add(torch.tensor([7]), 2), results, "add")
        adding.join(0.5)
        assert "cancel" not in results and "add" not in results, "cancel/add ran while the step was in its launch"
    finally:
        held.release.set()
    for thread in (stepping, cancelling, adding):
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive()
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    made = results["step"][a]
    assert torch.equal(results["cancel"], torch.cat([torch.tensor([5]), torch.tensor(made)]))
    assert a not in model.finished
    b = results["add"]
    while any(model.slots):
        model.step(2)
    assert torch.equal(model.finished[b], _alone(hf, torch.tensor([7]), 2))


@pytest.mark.slow
def test_a_launch_ends_when_its_sequences_have_all_their_tokens(model, hf, monkeypatch):
    """``step(2**40)`` for a sequence that needs 2 steps is one launch of 2 steps."""
    launched = []
    run = model.kernel.run

    def counting(inputs, steps):
        launched.append(steps)
        assert steps <= 2, f"a launch of {steps} steps for a sequence that needs 2"
        return run(inputs, steps=steps)
    monkeypatch.setattr(model.kernel, "run", counting)
    a = model.add(torch.tensor([5]), 2)
    made = model.step(2**40)
    assert launched == [2] and not any(model.slots)
    assert torch.equal(model.finished[a], _alone(hf, torch.tensor([5]), 2))
    assert made[a] == model.finished[a][1:].tolist()


@pytest.mark.parametrize("prompts, max_new_tokens, message", [
    ([[1, 2], list(range(7))], 2, "generate: prompt 1: 7 prompt \\+ 2 new tokens exceed max_seq_len 8"),
    ([[1, 2], [3, 500]], 2, "generate: prompt 1: token id 500 is outside the vocabulary"),
    ([[1, 2], []], 2, "generate: prompt 1: the prompt is empty"),
    ([[1, 2], [3.5]], 2, "generate: prompt 1: prompt_ids must be integer token ids"),
    ([[1, 2], [3]], True, "generate: max_new_tokens must be a non-negative int, got True"),
    ([[1, 2], [3]], -1, "generate: max_new_tokens must be a non-negative int, got -1"),
])
def test_a_bad_prompt_list_is_refused_whole_before_anything_runs(model, prompts, max_new_tokens, message):
    launches = model.kernel.launches
    with pytest.raises(mk.GraphError, match=message):
        model.generate([torch.tensor(p, dtype=torch.int64) if p and isinstance(p[0], int) else p for p in prompts],
                       max_new_tokens)
    assert model.kernel.launches == launches  # and the fixture checks that no slot or page is taken


@pytest.mark.parametrize("call, message", [
    (lambda m: m.add([1, 2], True), "add: max_new_tokens must be a positive int, got True"),
    (lambda m: m.add(torch.tensor([1.7, 2.2]), 2), "add: prompt_ids must be integer token ids, got torch.float32"),
    (lambda m: m.add([1.5], 2), "add: prompt_ids must be integer token ids, got torch.float32"),
    (lambda m: m.add("str", 2), "add: prompt_ids must be integer token ids, got str"),
    (lambda m: m.add(torch.tensor([True]), 2), "add: prompt_ids must be integer token ids, got torch.bool"),
    (lambda m: m.generate(torch.tensor([[1], [2]]), True), "generate: max_new_tokens must be a non-negative int"),
    (lambda m: m.generate(torch.tensor([[1.5], [2.0]]), 1), "generate: prompt_ids must be integer token ids"),
    (lambda m: m.generate(torch.tensor([[1], [2]]), 1, tokens_per_launch=True), "tokens_per_launch must be a pos"),
    (lambda m: m.decode(torch.tensor([1.5, 2.0]), 0), "decode: tokens must be integer token ids, got torch.float32"),
    (lambda m: m.decode(torch.tensor([1, 2]), True), "decode: position True is outside \\[0, 8\\) \\(max_seq_len\\): pos must be an int"),
    (lambda m: m.add([[1, 2], [3, 4]], 2), "add: prompt_ids must be one prompt, a 1-D list of token ids, got shape \\(2, 2\\)"),
    (lambda m: m.add(torch.tensor(3), 2), "add: prompt_ids must be one prompt, a 1-D list of token ids, got shape \\(\\)"),
    (lambda m: m.kernel.run({"pos": torch.empty(2, dtype=torch.int64, device="meta")}),
     "input 'pos' is a meta tensor: it has no values to copy"),
])
def test_arguments_of_the_wrong_type_are_refused_naming_them(model, call, message):
    launches = model.kernel.launches
    with pytest.raises(mk.GraphError, match=message):
        call(model)
    assert model.kernel.launches == launches


def test_a_zero_dimensional_tensor_is_one_stop_id(model, hf):
    tokens = model.generate([torch.tensor([1, 2])], 4)[0]
    stop = int(tokens[3])
    ended = model.generate([torch.tensor([1, 2])], 4, eos_token_id=torch.tensor(stop))[0]
    assert ended.tolist() == tokens[:4].tolist()


def test_close_waits_for_a_step_of_another_thread_and_then_every_call_refuses(hf, monkeypatch):
    m = from_hf(hf, max_seq_len=8, max_batch=2, page_size=4, workers=1, backend="torch")
    m.add([1, 2], 3)
    held, results = HeldLaunch(m.kernel, monkeypatch), {}
    stepping = _thread(m.step, results, "step")
    assert held.started.wait(JOIN_TIMEOUT)
    closing = _thread(m.close, results, "close")
    closing.join(0.5)
    assert closing.is_alive(), "close returned while a step ran"
    held.release.set()
    stepping.join(JOIN_TIMEOUT)
    closing.join(JOIN_TIMEOUT)
    assert isinstance(results["step"], dict) and results["close"] is None  # the step ran whole, then close
    for call in (m.step, lambda: m.add([1], 2), lambda: m.generate([torch.tensor([1])], 2), lambda: m.cancel(0),
                 lambda: m.decode(torch.tensor([1, 2]), 0)):
        with pytest.raises(mk.GraphError, match="the model is closed"):
            call()
    m.close()  # again: nothing to do


def test_a_sequence_whose_logits_are_not_finite_ends_with_an_error_and_the_others_go_on():
    """A token whose embedding is NaN: the sequence whose prompt holds it meets NaN logits on the device;
    its step raises ``SequenceFault`` naming it, its slot and pages are free, and the other sequence's
    tokens are what it gets alone; ``generate`` of a batch raises ``FaultError`` naming the row."""
    from megakernel.serving import SequenceFault

    hf = hf_model("llama", layers=1)
    with torch.no_grad():
        hf.model.embed_tokens.weight[7] = float("nan")
    m = from_hf(hf, max_seq_len=8, max_batch=2, page_size=4, workers=1, backend="torch")
    try:
        alone = m.generate([torch.tensor([1, 2])], 4)[0].tolist()
        good, bad = m.add([1, 2], 4), m.add([3, 7], 4)
        with pytest.raises(SequenceFault, match=f"sequence {bad} ended: its logits are not finite \\(at position"
                           ) as fault:
            m.step(8)
        assert list(fault.value.sequences) == [bad] and m.sequence(bad) is None
        while m.sequence(good) is not None:
            m.step()
        assert m.finished[good].tolist() == alone
        assert not any(m.slots) and len(m.pool.free) == m.pool.pages
        with pytest.raises(mk.FaultError, match="the logits of batch row 1 sampling position [2-4] are not finite"):
            m.generate(torch.tensor([[1, 2], [3, 7]]), 3)
        assert m.generate([torch.tensor([1, 2])], 4)[0].tolist() == alone  # the model goes on
    finally:
        m.close()
