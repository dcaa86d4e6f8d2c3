"""The serving loop: requests from many clients joining one model's running batch (continuous batching).

``ServingLoop.run`` is the only caller of the engine (``DecodeModel``), in a thread of its own. Each turn
it cancels the sequences whose clients gave up or whose text reached a stop string, admits waiting
requests first come first served while a slot and every page they will need are free
(``DecodeModel.has_room``: a running sequence never runs out of pages), and runs one launch of the
batch; each request hears of its new tokens, their log-probabilities and its new text through its
callback (``Request.emit``, called on the loop's thread).

With tensor parallelism the ranks are processes and every rank's engine must do the same thing in the
same order: rank 0 decides a turn's commands (cancel, add with the seed drawn, step) and sends them to the
others (``follow``) before it runs its own launch, and an idle loop sends an empty turn every
``HEARTBEAT`` seconds, so that a follower waits on rank 0 no longer than that between turns.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from ..bootstrap import Group
from .engine import DecodeModel
from .sequences import Sequence, SequenceFault
from .sampling_params import SEED_BITS, SamplingParams
from .text import Streamer, Text

HEARTBEAT = 1.0  # seconds an idle loop waits before it sends the followers an empty turn
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds, for /metrics


@dataclass
class Update:
    """What a request hears after a launch: its new tokens (ids, log-probabilities, the most likely
    tokens' (id, log-probability) pairs at each), the text they make showable, and once it ended
    ``finish``: "stop" (a stop id or string) or "length" (``max_tokens``); ``error`` when it failed."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)  # each request is itself: two alike are two requests
class Request:
    """A client's request: prompt ids, how many tokens at most, how to draw them and where to stop."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Update], None]
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)       # stop strings (the text ends before them)
    # filled by the loop
    sequence: Sequence | None = None
    streamer: Streamer | None = None
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    ended: bool = False


@dataclass
class Metrics:
    """What ``/metrics`` reports (Prometheus counters, gauges and a histogram of launch latencies)."""

    requests: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0, "error": 0})
    prompt_tokens: int = 0
    generated_tokens: int = 0
    launches: int = 0
    launch_seconds: float = 0.0
    launch_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    first_token_seconds: float = 0.0
    first_tokens: int = 0

    def launched(self, seconds: float) -> None:
        self.launches += 1
        self.launch_seconds += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            self.launch_buckets[i] += seconds <= bound


class ServingLoop:
    """Rank 0's serving loop over ``model`` (see the module docstring); ``group``: the ranks to lead."""

    def __init__(self, model: DecodeModel, text: Text, steps_per_launch: int = 4, group: Group | None = None):
        self.model, self.text, self.steps_per_launch, self.group = model, text, steps_per_launch, group
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}   # sequence id -> request
        self.cancelled: list[Request] = []
        self.metrics = Metrics()
        self.failure: str | None = None         # why the engine can serve no more (a launch failed)
        self.stopping = False
        self.wake = threading.Condition()

    # -- called from the server's threads -----------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self.wake:
            if self.stopping or self.failure:
                request.emit(Update(error=self.failure or "the server is shutting down"))
                return
            self.waiting.append(request)
            self.wake.notify()

    def cancel(self, request: Request) -> None:
        """The client is gone: free its slot and pages at the next turn."""
        with self.wake:
            self.cancelled.append(request)
            self.wake.notify()

    def stop(self) -> None:
        """End the loop: every request waiting or running ends with an error."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.wake:
                if not (self.stopping or self.waiting or self.running or self.cancelled):
                    self.wake.wait(HEARTBEAT)
                if self.stopping or self.failure:
                    break
                cancelled, self.cancelled = self.cancelled, []
            commands = self._cancel(cancelled) + self._admit()
            if self.running:
                commands.append(("step", self._steps()))
            self._send(commands)
            if self.running:
                self._launch(commands[-1][1])
        if self.failure is None:  # (after a failure the followers are past hearing)
            self._end_all("the server is shutting down")
            self._send([("stop",)])

    def _cancel(self, requests: list[Request]) -> list[tuple]:
        commands = []
        for request in requests:
            if request in self.waiting:
                self.waiting.remove(request)
            if request.sequence is not None and self.running.get(request.sequence.id) is request:
                commands.append(("cancel", request.sequence.id))
                apply(self.model, commands[-1])
                del self.running[request.sequence.id]
            if not request.ended:
                request.ended = True
                self.metrics.requests["cancelled"] += 1
        return commands

    def _admit(self) -> list[tuple]:
        commands = []
        while self.waiting and self.model.has_room(len(self.waiting[0].prompt), self.waiting[0].max_tokens):
            request = self.waiting.popleft()
            sampling = request.sampling
            if sampling.seed is None:  # drawn here: the followers get it with the command
                sampling = replace(sampling, seed=secrets.randbits(SEED_BITS))
            command = ("add", request.prompt, request.max_tokens, sorted(self.text.stop_ids), sampling)
            try:
                sequence_id = apply(self.model, command)
            except Exception as error:  # the request's own fault (the server checked it): nothing changed
                self._end(request, Update(error=str(error)), "error")
                continue
            commands.append(command)
            request.sequence = self.model.sequence(sequence_id)
            request.streamer = self.text.streamer(request.stop)
            self.running[sequence_id] = request
            self.metrics.prompt_tokens += len(request.prompt)
        return commands

    def _steps(self) -> int:
        """Steps of the next launch: one while a prompt is being prefilled (a waiting request may join
        after it), else up to ``steps_per_launch``, no more than the nearest end needs."""
        sequences = [r.sequence for r in self.running.values()]
        if any(s.prefilling for s in sequences):
            return 1
        return max(1, min(self.steps_per_launch, *(s.last_position + 1 - s.pos for s in sequences)))

    def _launch(self, steps: int) -> None:
        start = time.monotonic()
        try:
            apply(self.model, ("step", steps))
        except SequenceFault as fault:  # those sequences ended (on every rank); the others go on
            for sequence_id, why in fault.sequences.items():
                request = self.running.pop(sequence_id, None)
                if request is not None and not request.ended:
                    self._end(request, Update(error=f"the engine ended this request: {why}"), "error")
        except Exception as error:  # the kernel failed: nothing more can be served
            self.failure = f"the engine failed: {type(error).__name__}: {error}"
            self._end_all(self.failure, followers=False)  # theirs failed too: their ranks' errors end the job
            return
        self.metrics.launched(time.monotonic() - start)
        for sequence_id, request in list(self.running.items()):
            if request.ended:  # at a stop string: its sequence is cancelled next turn
                continue
            self._report(request, request.sequence)
            if request.sequence.done:
                del self.running[sequence_id]
                self.model.finished.pop(sequence_id, None)

    def _report(self, request: Request, s: Sequence) -> None:
        """Tell ``request`` of the tokens its sequence made since the last report."""
        told = len(request.streamer.tokens)
        new = s.tokens[told:]
        if not new and not s.done:
            return
        if request.first_token is None and new:
            request.first_token = time.monotonic()
            self.metrics.first_tokens += 1
            self.metrics.first_token_seconds += request.first_token - request.submitted
        update = Update(request.streamer.add(new), new, s.logprobs[told:told + len(new)], s.top[told:told + len(new)])
        self.metrics.generated_tokens += len(new)
        if request.streamer.stopped:  # a stop string: the sequence ends here, its slot freed next turn
            if not s.done:
                with self.wake:
                    self.cancelled.append(request)
            update.finish = "stop"
        elif s.done:
            update.text += request.streamer.finish()
            update.finish = "stop" if s.tokens and s.tokens[-1] in s.stop else "length"
        if update.finish:
            self._end(request, update, update.finish)
        else:
            request.emit(update)

    def _end(self, request: Request, update: Update, outcome: str) -> None:
        request.ended = True
        self.metrics.requests[outcome] += 1
        request.emit(update)

    def _end_all(self, why: str, followers: bool = True) -> None:
        """End every request waiting or running with ``why``; cancel the running ones' sequences (on the
        followers too, unless they are past hearing)."""
        for request in [*self.waiting, *self.running.values()]:
            if not request.ended:
                self._end(request, Update(error=why), "error")
        self.waiting.clear()
        cancels = [("cancel", i) for i in self.running if self.model.sequence(i) is not None]
        if followers:
            self._send(cancels)
        for command in cancels:
            apply(self.model, command)
        self.running.clear()

    def _send(self, commands: list[tuple]) -> None:
        """The turn's commands to the followers (rank 0's all-gather; nothing in a world of one)."""
        if self.group is not None and self.group.world_size > 1:
            self.group.all_gather(commands)


def apply(model: DecodeModel, command: tuple):
    """Do one command of a turn on this rank's engine; returns ``add``'s sequence id."""
    kind, *args = command
    if kind == "add":
        prompt, max_tokens, stop_ids, sampling = args
        return model.add(prompt, max_tokens, stop_ids, sampling)
    if kind == "cancel":
        return model.cancel(*args)
    if kind == "step":
        return model.step(*args)
    raise ValueError(f"unknown serving command {kind!r}")


def follow(model: DecodeModel, group: Group) -> None:
    """A follower rank's loop: rank 0's commands, turn by turn, until it says stop."""
    while True:
        commands = group.all_gather(None)[0]
        for command in commands:
            if command[0] == "stop":
                return
            try:
                apply(model, command)
            except SequenceFault:  # rank 0 met the same fault and ends those requests
                pass
