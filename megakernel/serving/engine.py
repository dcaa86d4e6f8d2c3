"""``DecodeModel``: one rank's share of a decoder model compiled into one megakernel, and the engine that
serves it: greedy decoding on the device (``decode``, ``generate``) and continuous batching
(``add`` / ``step`` / ``cancel``: sequences in slots of the batch, their KV cache in pages of a pool, their
prompts prefilled in chunks). It knows the decode graph (``decode_step``) and its weights by input name
(a ``models.ModelBuild``), not where they came from (``from_hf``, ``from_pretrained``)."""
from __future__ import annotations

import functools
import math
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

import torch

from ..backends import KINDS, resolve
from ..errors import FaultError, GraphError, is_count, is_int, is_number
from ..graph import Graph
from ..layout import NOT_FINITE
from ..runtime import Megakernel
from ..tasks.chunk_attention import BLOCK_ROWS
from ..tasks.expert_parallel import expert_ranks
from ..tasks.sampling import PARAMS
from ..tasks.speculation import STATS
from ..models.decoder import decode_step
from ..models.hf import ModelBuild
from .pages import KVCacheFull, PagePool, waves


Method = TypeVar("Method", bound=Callable)


def serialized(method: Method) -> Method:
    """Run ``method`` under the model's lock: a server calls the engine from several threads, and a step
    that read the slots must not see them change under it (one call at a time; reentrant, for ``generate``
    runs ``add`` and ``step``)."""
    @functools.wraps(method)
    def locked(self: "DecodeModel", *args, **kwargs):
        with self.lock:
            if self.closed:
                raise GraphError(f"{method.__name__}: the model is closed")
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class SequenceFault(GraphError):
    """A step whose launch met data it cannot use in some sequences (``runtime.FaultError``: logits that
    are not finite, an index out of range): those sequences ended, their slots and pages free, and
    ``sequences`` maps each one's id to what it met; the others' tokens of the step are theirs as usual
    (an index fault, whose clamped data may be anywhere, ends every sequence of the step)."""

    def __init__(self, message: str, sequences: dict[int, str]):
        super().__init__(message, sequences)
        self.message, self.sequences = message, sequences

    def __str__(self) -> str:
        return self.message


SEED_BITS = 63  # a seed is an int64 on the device's heap
# the least positive float parameter: float32's smallest normal number (GPUs flush the subnormal ones to 0,
# where a temperature would divide by zero and a min-p would keep everything)
SMALLEST_NORMAL = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence's tokens are drawn on the device (``tasks.sampling``): ``temperature`` 0 is greedy
    (the argmax); above it, softmax(logits / temperature) over the tokens that ``top_k`` (0: all), ``top_p``
    (1: all) and ``min_p`` (0: all) keep. ``seed``: the key of the sequence's random stream, which with
    the position alone decides its draws (None: one drawn for it, the same on every rank). A positive
    float parameter is at least ``SMALLEST_NORMAL`` (1.18e-38): at the least temperature the draw is the
    argmax (among equal logits, one of them at random)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def zero_or_normal(x) -> bool:
            return x == 0 or x >= SMALLEST_NORMAL

        checks = (("temperature", is_number(self.temperature) and 0 <= self.temperature < math.inf
                   and zero_or_normal(self.temperature), f"0 or a finite number >= {SMALLEST_NORMAL:.8g}"),
                  ("top_k", is_int(self.top_k) and 0 <= self.top_k < 1 << 24, "an int in [0, 2^24) (0: off)"),
                  ("top_p", is_number(self.top_p) and SMALLEST_NORMAL <= self.top_p <= 1,
                   f"a number in [{SMALLEST_NORMAL:.8g}, 1]"),
                  ("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1 and zero_or_normal(self.min_p),
                   f"0 or a number in [{SMALLEST_NORMAL:.8g}, 1]"),
                  ("seed", self.seed is None or is_int(self.seed), "an int or None"))
        for name, good, what in checks:
            if not good:
                raise GraphError(f"sampling: {name} must be {what}, got {getattr(self, name)!r}")

    @property
    def row(self) -> list[float]:
        """The sampling tile's float32 params (``tasks.sampling.PARAMS``)."""
        return [float(getattr(self, name)) for name in PARAMS]


GREEDY = SamplingParams()


@dataclass
class Sequence:
    """A sequence of continuous batching (``DecodeModel.add``): its batch row, prompt and new tokens, and
    the log-probability of each (with the ``max_logprobs`` most likely tokens' ids and log-probabilities)."""

    id: int
    slot: int
    prompt: torch.Tensor
    max_new: int
    stop: frozenset[int]                           # token ids that end it (included in its tokens)
    sampling: SamplingParams = GREEDY              # its seed set: the one drawn for it where it brought none
    pos: int = 0                                   # the position its row is at (the device's, mirrored)
    prefilled: int = 0                             # prompt positions whose KV the prefill rows wrote
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    done: bool = False

    @property
    def prefilling(self) -> bool:
        """Its prompt still has positions before the last for prefill rows (its batch row waits)."""
        return self.prefilled < self.prompt.numel() - 1

    @property
    def last_position(self) -> int:
        """The position of its last step (which samples its last token)."""
        return self.prompt.numel() + self.max_new - 2


class DecodeModel:
    """One rank's share of a model, compiled into one megakernel: one launch per decode step."""

    def __init__(self, build: ModelBuild, parallelism: int | str = "auto", **kernel_options):
        """Compile ``build`` (its frequencies rebound when ``build.rope_at`` changes them). ``parallelism``:
        the workers the step's tiles are sized for (``Graph.parallelism``); "auto": what suits the backend
        (``BackendKind.tile_parallelism``: on a GPU every worker the kernel holds, found by building once; on
        the cpu backend 1, few large tiles for the interpreter; on torch the workers, at least 2).
        ``kernel_options``: ``Megakernel``'s."""
        config, weights, rope_at = build.config, build.weights, build.rope_at
        if config.draft_tokens and rope_at is not None:
            raise GraphError("draft_tokens: rope types whose frequencies follow the position (dynamic, longrope) "
                             "need one position per launch; a step with drafts advances each row by its own count")
        self.config = config
        self.rope_at = rope_at
        self.bytes_read = build.bytes_read  # of a checkpoint, by this rank (from_pretrained)
        # the bytes of weights this rank holds on its heap, as bound: packed ones as they are stored
        self.weight_bytes = sum(t.numel() * t.element_size() for name, t in weights.items() if name != "inv_freq")
        self.inv_freq = weights["inv_freq"].clone()  # the frequencies bound now (the model may update its own)
        learn = False  # size the tiles for the workers the kernel turns out to hold
        kind = KINDS[resolve(kernel_options.get("backend", "auto"))]
        if parallelism == "auto":
            workers = kernel_options.get("workers")  # a bad value is Megakernel's to refuse
            parallelism = kind.tile_parallelism(workers if is_count(workers) else None)
            learn, parallelism = parallelism is None, parallelism or 1
        self.graph = decode_step(config, Graph(parallelism=parallelism, few_tiles=kind.few_tiles))
        self.kernel = Megakernel(self.graph, **kernel_options)
        if learn and self.kernel.workers > 1:
            self.kernel.close()
            self.graph = decode_step(config, Graph(parallelism=self.kernel.workers, few_tiles=kind.few_tiles))
            self.kernel = Megakernel(self.graph, **kernel_options)
        self.kernel.bind(weights)
        self.pool = PagePool(config.pool_pages, config.page_size, config.table_rows, config.max_pages)
        self.kernel.bind({"history": torch.zeros(config.batch, config.max_seq_len, dtype=torch.int64),
                          "pos": torch.full((config.batch,), -1), "prompt_len": torch.zeros(config.batch, dtype=torch.int64),
                          "block_table": self.pool.table})
        self.kernel.bind({"sampling": torch.zeros(config.batch, len(PARAMS)),  # temperature 0: greedy
                          "seed": torch.zeros(config.batch, dtype=torch.int64)})
        # seeds for sequences that bring none: from rank 0's base, so that every rank draws the same tokens
        self._seed_base, self._seeds_drawn = self.kernel.group.all_gather(secrets.randbits(SEED_BITS))[0], 0
        if config.draft_tokens:  # every row off until it is given an end; the counters from zero
            self.kernel.bind({"end": torch.zeros(config.batch, dtype=torch.int64),
                              "draft_stats": torch.zeros(len(STATS), dtype=torch.int64)})
        if "expert_passes" in self.graph.inputs:
            self.kernel.bind({"expert_passes": torch.zeros(2 * config.layers, config.experts, dtype=torch.int64)})
        self._steps_launched = 0
        if config.prefill_chunk:
            self.kernel.bind({"prefill_pos": torch.full((config.prefill_chunk,), -1),
                              "prefill_tokens": torch.zeros(config.prefill_chunk, dtype=torch.int64)})
        self.slots: list[Sequence | None] = [None] * config.batch  # the sequences of add(), by batch row
        self.finished: dict[int, torch.Tensor] = {}  # sequence id -> prompt + new tokens, once it ended
        # float32 [batch, vocab]: the last step's (of ``step``, by slot, or of ``generate``, by row); with
        # drafts [batch * (draft_tokens + 1), vocab], each slot's verification rows
        self.logits: torch.Tensor | None = None
        self._next_id = 0
        self.lock = threading.RLock()  # held by every public method (``serialized``)
        self.closed = False

    @serialized
    def decode(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [B, vocab] (float32) for ``tokens`` [B] at position ``pos``; the KV cache keeps the step.

        One launch of one step: the tokens go into the history at ``pos``, and the step writes no token
        (the prompt length is set past the history)."""
        c = self.config
        tokens = self._token_ids(tokens, "decode", "tokens").reshape(-1)
        if tokens.numel() != c.batch:
            raise GraphError(f"decode: tokens has {tokens.numel()} entries; the model was built for batch {c.batch}")
        if not (is_int(pos) and 0 <= pos < c.max_seq_len):
            raise GraphError(f"decode: position {pos!r} is outside [0, {c.max_seq_len}) (max_seq_len): pos must be an int "
                             "there")
        self._require_no_sequences("decode")
        with self.pool.transaction():  # each row keeps its pages from one decode() to the next
            for row in range(c.batch):
                self.pool.grow(row, pos + 1, f"batch row {row}")
        self.kernel.tensor(self.graph.inputs["history"])[:, pos] = tokens  # the host's write, between launches
        inputs = {"pos": torch.full((c.batch,), pos), "prompt_len": torch.full((c.batch,), c.max_seq_len),
                  "block_table": self.pool.table, **self._ends(pos + 1)}
        self._launch({**inputs, **self._frequencies(pos)}, 1)
        logits = self.logits[::c.rows_per_sequence]  # with drafts: each batch row's first verification row
        self.kernel.bind({"pos": torch.full((c.batch,), -1)})  # every row free again
        return logits

    @serialized
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, tokens_per_launch: int | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> torch.Tensor:
        """Decoding on the device: the prompt and ``max_new_tokens`` tokens (greedy, or drawn with
        ``sampling``: one ``SamplingParams`` for every row or prompt, or a list of one per row or prompt).
        With prefill rows (``prefill_chunk``) the prompts' first T - 1 tokens are prefilled in the first
        step (those past a chunk in a launch of one step each before it), then each step makes a token in
        ``ceil(max_new_tokens / tokens_per_launch)`` launches; without, a step per position in
        ``ceil((T + max_new_tokens - 1) / tokens_per_launch)`` launches. ``tokens_per_launch``: by
        default all in one; fewer where the RoPE frequencies change with the position (``rope_at``, whose
        prompts go through the batch rows). After ``eos_token_id`` (one id or several) a row's tokens are dropped:
        generation stops (checked between launches) once every row has produced one, and a row that ends
        earlier than others is filled with the id it ended with.

        ``prompt_ids`` [B, T] (or [T] for batch 1); returns [B, T + new tokens], prompt included. A list
        of prompts (1-D, of any lengths, as many as you like) runs them by continuous batching
        (``add``/``step``: each in a slot at a position of its own, a waiting one joining as a slot frees)
        and returns one tensor per prompt, prompt + new tokens, what each would get alone.

        With ``draft_tokens`` a step advances a row by 1 .. draft_tokens + 1 positions (``tasks.speculation``):
        ``tokens_per_launch`` is then the steps a launch holds, and fewer launches may do; the tokens are
        the same.
        """
        if not (is_int(max_new_tokens) and max_new_tokens >= 0):
            raise GraphError(f"generate: max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not isinstance(prompt_ids[0], int):
            if tokens_per_launch is not None:
                raise GraphError("generate: a list of prompts runs by continuous batching: its launches end where a "
                                 "sequence does (no tokens_per_launch)")
            return self._generate_each(prompt_ids, max_new_tokens, eos_token_id,
                                       self._per_row(sampling, len(prompt_ids), "generate"))
        c = self.config
        stop = self._stop_ids(eos_token_id, "generate")
        sampling = self._per_row(sampling, c.batch, "generate")
        ids = self._token_ids(prompt_ids, "generate", "prompt_ids")
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        prompt = ids.shape[1]
        if ids.ndim != 2 or ids.shape[0] != c.batch or prompt < 1:
            raise GraphError(f"generate: prompt_ids must be [{c.batch}, T >= 1] (the model's batch), got "
                             f"{tuple(ids.shape)}")
        if tokens_per_launch is not None and not is_count(tokens_per_launch):
            raise GraphError(f"generate: tokens_per_launch must be a positive int, got {tokens_per_launch!r}")
        if prompt + max_new_tokens > c.max_seq_len:
            raise GraphError(f"generate: {prompt} prompt + {max_new_tokens} new tokens exceed max_seq_len "
                             f"{c.max_seq_len}")
        if max_new_tokens == 0:
            return ids.clone()
        self._require_no_sequences("generate")
        steps = prompt + max_new_tokens - 1  # step p embeds the token at p and samples the one at p + 1
        if c.batch * self.pool.pages_for(steps) > self.pool.pages:  # before the rows' pages are given back
            raise KVCacheFull(f"KV cache full: generate: {c.batch} rows of {prompt} prompt + {max_new_tokens} new "
                              f"tokens need {c.batch * self.pool.pages_for(steps)} pages of {self.pool.page_size} "
                              f"positions; the pool has {self.pool.pages}. Nothing changed")
        self._release_rows()  # each row keeps its pages afterwards, as decode() does: decode() may go on
        for row, params in enumerate(sampling):
            self._bind_sampling(row, params)
        with self.pool.transaction():
            for row in range(c.batch):
                self.pool.grow(row, steps, f"batch row {row} ({prompt} prompt + {max_new_tokens} new tokens)")
        history = torch.zeros(c.batch, c.max_seq_len, dtype=torch.int64)
        history[:, :prompt] = ids
        self.kernel.bind({"history": history, "pos": torch.full((c.batch,), -1),
                          "prompt_len": torch.full((c.batch,), prompt), "block_table": self.pool.table,
                          **self._ends(steps)})
        try:
            pos = self._prefill_prompts(ids)
            self.kernel.bind({"pos": torch.full((c.batch,), pos), "block_table": self.pool.table})
            while pos < steps:
                count = min(tokens_per_launch or steps, steps - pos)
                frequencies = self._frequencies(pos)
                if self.rope_at is not None:  # the steps of one launch share the frequencies bound for its first
                    count = next((k for k in range(1, count)
                                  if not torch.equal(self.rope_at(pos + k), self.inv_freq)), count)
                history = self._launch(frequencies, count)["history"]
                pos = min(self._positions(list(range(c.batch)), [steps] * c.batch)) if c.draft_tokens else pos + count
                if stop.numel() and pos >= prompt and bool(torch.isin(history[:, prompt:pos + 1], stop)
                                                            .any(dim=1).all()):
                    break
        except FaultError:  # (the rows' positions name batch rows: the prompts')
            self.kernel.bind({"pos": torch.full((c.batch,), -1)})  # every row free again
            raise
        tokens = history[:, :pos + 1].clone()
        if stop.numel():
            new = tokens[:, prompt:]
            ended = torch.isin(new, stop).cumsum(dim=1) > 0
            after = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1)  # past each row's first eos
            for row in range(c.batch):
                if ended[row].any():
                    new[row, after[row]] = new[row, int(ended[row].nonzero()[0])]
            if ended.all(dim=0).any():  # every row ended: drop the columns after the last row's eos
                tokens = tokens[:, :prompt + int(ended.all(dim=0).nonzero()[0]) + 1]
        self.kernel.bind({"pos": torch.full((c.batch,), -1)})  # every row free again
        return tokens

    # -- continuous batching -------------------------------------------------------------------------
    @serialized
    def add(self, prompt_ids, max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
            sampling: SamplingParams | None = None) -> int:
        """Start a sequence in a free batch row (slot): its prompt goes into the row's history; the next
        ``step`` prefills it (``prefill_chunk`` tokens per launch; without prefill rows its batch row reads
        the prompt a token per step) and then advances it with the others, its tokens drawn with
        ``sampling`` (None: greedy). It ends after ``max_new_tokens`` or at a token of ``eos_token_id``
        (one id or several). Returns its id."""
        c = self.config
        if not is_count(max_new_tokens):
            raise GraphError(f"add: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        ids = self._admissible(prompt_ids, max_new_tokens, "add")
        stop = frozenset(self._stop_ids(eos_token_id, "add").tolist())
        sampling = self._per_row(sampling, 1, "add")[0]
        slot = next((row for row, sequence in enumerate(self.slots) if sequence is None), None)
        if slot is None:
            raise GraphError(f"add: all {c.batch} slots (max_batch) hold sequences; step until one finishes")
        if not any(self.slots):
            self._release_rows()  # the pages decode() kept
        sequence = Sequence(self._next_id, slot, ids, max_new_tokens, stop, self._bind_sampling(slot, sampling))
        if c.prefill_chunk:  # the prefill rows write positions before the last; the batch row starts there
            sequence.pos = ids.numel() - 1
        else:                # the batch row reads the prompt from position 0
            sequence.prefilled = ids.numel() - 1
        self.slots[slot] = sequence
        self._next_id += 1
        self.kernel.tensor(self.graph.inputs["history"])[slot, :ids.numel()] = ids  # between launches
        self.kernel.tensor(self.graph.inputs["prompt_len"])[slot] = ids.numel()
        self.kernel.tensor(self.graph.inputs["pos"])[slot] = -1 if sequence.prefilling else sequence.pos
        if c.draft_tokens:
            self.kernel.tensor(self.graph.inputs["end"])[slot] = sequence.last_position + 1
        return sequence.id

    @serialized
    def step(self, steps: int = 1) -> dict[int, list[int]]:
        """One launch of ``steps`` steps, or fewer: it ends when every sequence in it has all its tokens. Its
        first step prefills up to ``prefill_chunk`` prompt tokens of the sequences still in their prompts (in
        the order they were added); every other sequence advances a position a step (one still in its
        prompt without prefill rows reads the next prompt token; the others sample one token each; with
        ``draft_tokens``, up to draft_tokens + 1 prompt tokens or tokens a step, ``tasks.speculation``, and
        the steps after every sequence has its tokens skip their work).
        Returns the new tokens of each sequence that made some. A sequence that has all its tokens, or
        ends with its eos token, frees its slot and its KV pages (tokens it sampled past its end in the
        same launch are dropped). Out of KV pages: ``KVCacheFull``, nothing run or changed."""
        if not is_count(steps):
            raise GraphError(f"step: steps must be a positive int, got {steps!r}")
        active = [s for s in self.slots if s is not None]
        if not active:
            return {}
        chunk = self._plan_prefill(active)
        running = [s for s in active if not s.prefilling or s.id in chunk.finishing]
        # steps past the longest remaining sequence would only run rows that sample nothing anyone keeps
        # (one step when the launch only prefills: its prefill rows are off after the first)
        steps = min(steps, max((s.last_position + 1 - s.pos for s in running), default=1))
        with self.pool.transaction():
            for s, first, count, _ in chunk.parts:
                self.pool.grow(s.slot, first + count, f"sequence {s.id}")
            for s in running:  # a step advances a row by up to draft_tokens + 1 positions
                self.pool.grow(s.slot, min(s.pos + steps * self.config.rows_per_sequence, s.last_position + 1),
                               f"sequence {s.id}")
        self._bind_prefill(chunk)
        for s in running:  # a sequence whose prefill ends in this launch starts in its batch row
            self.kernel.tensor(self.graph.inputs["pos"])[s.slot] = s.pos
        try:
            out, faulted = self._launch({"block_table": self.pool.table}, steps), {}
        except FaultError as error:  # the launch ran: its outputs are on the heap, some sequences' not valid
            out, faulted = error.outputs, self._faulted(error, running)
            running = [s for s in running if s.id not in faulted]
            for s in self.slots:
                if s is not None and s.id in faulted:
                    self._free(s)
        history = out["history"]
        moved = (self._positions([s.slot for s in running], [s.last_position + 1 for s in running])
                 if self.config.draft_tokens else [s.pos + steps for s in running])
        top_n = self.config.max_logprobs
        for s, first, count, _ in chunk.parts:
            s.prefilled = first + count
        new: dict[int, list[int]] = {}
        for s, reached in zip(running, moved):
            start, s.pos = s.pos, reached
            first = max(start + 1, s.prompt.numel())  # the first position this launch sampled into
            made = history[s.slot, first:s.pos + 1].tolist()[:s.max_new - len(s.tokens)]
            end = next((i for i, token in enumerate(made) if token in s.stop), None)
            made = made if end is None else made[:end + 1]
            if made:
                s.tokens += made
                s.logprobs += out["logprobs"][s.slot, first:first + len(made)].tolist()
                if top_n:
                    ids = out["top_ids"][s.slot, first * top_n:(first + len(made)) * top_n].view(-1, top_n).tolist()
                    values = out["top_logprobs"][s.slot, first * top_n:(first + len(made)) * top_n].view(-1, top_n)
                    s.top += [list(zip(i, v)) for i, v in zip(ids, values.tolist())]
                new[s.id] = made
            if len(s.tokens) == s.max_new or (made and made[-1] in s.stop):
                s.done = True
                self._free(s)
                self.finished[s.id] = torch.cat([s.prompt, torch.tensor(s.tokens, dtype=torch.int64)])
        if faulted:
            raise SequenceFault("step: " + "; ".join(f"sequence {i} ended: {why}" for i, why in faulted.items())
                                + f" (the others' tokens are theirs: {new})", faulted)
        return new

    # -- steps scheduled from outside (vLLM) -----------------------------------------------------------
    @serialized
    def run_scheduled(self, requests: list["Scheduled"]) -> torch.Tensor:
        """Run a step that another scheduler planned (``serving.vllm``: vLLM's): each request's tokens at
        their positions, its KV cache in the pool pages it names (that scheduler's block ids: it owns the
        pool, this model's page allocator stays out of it). Returns float32 logits [len(requests), vocab] of
        each request's last token; no token is sampled into the history.

        A request's tokens but the last go through the prefill rows (several launches of one step, each
        prefill-only but the last, where the chunk cannot hold them all), its last through a batch row, in
        the last launch, after its prefill rows wrote their keys. A request that reads a position another
        request of the step writes (a page a prefix cache hands out in the step that computes it) runs
        after it, in a step of its own (``pages.waves``); more requests than the batch has rows run in
        steps of ``batch`` requests."""
        c = self.config
        self._require_no_sequences("run_scheduled")
        if c.draft_tokens or not c.prefill_chunk or self.rope_at is not None:
            raise GraphError("run_scheduled: the model must be built with prefill rows (prefill_chunk > 0), "
                             "without drafts (draft_tokens=0) and with RoPE frequencies that stay fixed")
        if not requests:
            raise GraphError("run_scheduled: no requests")
        checked = [self._checked_request(row, r) for row, r in enumerate(requests)]
        logits = torch.empty(len(requests), c.vocab)
        for wave in waves([(r.start, r.start + ids.numel() - 1, pages) for ids, r, pages in checked], c.page_size):
            for group in range(0, len(wave), c.batch):
                rows = wave[group:group + c.batch]
                logits[rows] = self._run_wave([checked[i] for i in rows])
        return logits

    def _checked_request(self, row: int, r: "Scheduled") -> tuple[torch.Tensor, "Scheduled", torch.Tensor]:
        """Request ``row`` of ``run_scheduled``'s as (token ids, the request, its pages), or a ``GraphError``
        naming what is wrong with it."""
        c = self.config
        ids = self._token_ids(r.tokens, "run_scheduled", f"requests[{row}].tokens").reshape(-1)
        last = r.start + ids.numel() - 1
        pages = torch.as_tensor(r.pages, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise GraphError(f"run_scheduled: request {row} has no tokens")
        if r.start < 0 or last >= c.max_seq_len:
            raise GraphError(f"run_scheduled: request {row}'s {ids.numel()} tokens from position {r.start} "
                             f"are not inside [0, {c.max_seq_len}) (max_seq_len)")
        if pages.numel() < self.pool.pages_for(last + 1) or pages.numel() > c.max_pages or (
                pages.numel() and not (0 <= int(pages.min()) and int(pages.max()) < self.pool.pages)):
            raise GraphError(f"run_scheduled: request {row} reaches position {last}: it needs "
                             f"{self.pool.pages_for(last + 1)} to {c.max_pages} pages of [0, {self.pool.pages}),"
                             f" got {pages.tolist()}")
        return ids, r, pages

    def _run_wave(self, requests: list[tuple[torch.Tensor, "Scheduled", torch.Tensor]]) -> torch.Tensor:
        """``run_scheduled``'s step for at most ``batch`` requests none of which reads what another writes:
        request i in batch row i; their logits."""
        c = self.config
        table = torch.full_like(self.pool.table, self.pool.pages)  # unnamed pages: the spill page
        history, pos = self.kernel.tensor(self.graph.inputs["history"]), torch.full((c.batch,), -1)
        prefill: list[tuple[int, int, torch.Tensor]] = []  # (batch row, first position, tokens)
        for row, (ids, r, pages) in enumerate(requests):
            table[row, :pages.numel()] = pages
            history[row, r.start + ids.numel() - 1] = ids[-1]  # between launches
            pos[row] = r.start + ids.numel() - 1
            if ids.numel() > 1:
                prefill.append((row, r.start, ids[:-1]))
        self.kernel.bind({"prompt_len": torch.full((c.batch,), c.max_seq_len), "pos": torch.full((c.batch,), -1)})
        launches = self._packed(prefill)
        for index, chunk in enumerate(launches):
            tokens, positions = torch.zeros(c.prefill_chunk, dtype=torch.int64), torch.full((c.prefill_chunk,), -1)
            table[c.batch:] = self.pool.pages
            for row, first, part, at in chunk:
                tokens[at:at + part.numel()] = part
                positions[at:at + part.numel()] = torch.arange(first, first + part.numel())
                table[c.batch + at:c.batch + at + part.numel()] = table[row]
            self.kernel.bind({"prefill_tokens": tokens, "prefill_pos": positions, "block_table": table})
            if index < len(launches) - 1:  # the last chunk runs in the launch of the batch rows
                self._launch({}, 1)
        try:
            self._launch({"pos": pos, "block_table": table}, 1)
        finally:
            self.kernel.bind({"pos": torch.full((c.batch,), -1)})  # every row free again
        return self.logits[:len(requests)]

    def _packed(self, prefill: list[tuple[int, int, torch.Tensor]]) -> list[list[tuple[int, int, torch.Tensor, int]]]:
        """The prefill rows of ``run_scheduled``'s launches: (batch row, first position, tokens, first chunk
        row) parts, each from a multiple of ``BLOCK_ROWS`` rows; a request that does not fit in a launch's
        rows goes on in the next one's (at least one launch, maybe with no parts)."""
        launches: list[list[tuple[int, int, torch.Tensor, int]]] = [[]]
        at = 0
        for row, first, tokens in prefill:
            while tokens.numel():
                if at >= self.config.prefill_chunk:
                    launches.append([])
                    at = 0
                part = tokens[:self.config.prefill_chunk - at]
                launches[-1].append((row, first, part, at))
                at += -(-part.numel() // BLOCK_ROWS) * BLOCK_ROWS
                first, tokens = first + part.numel(), tokens[part.numel():]
        return launches

    def _faulted(self, error: FaultError, running: list[Sequence]) -> dict[int, str]:
        """The sequences of ``running`` that ``error``'s faults make invalid, with what each met."""
        by_slot = {s.slot: s for s in running}
        faulted: dict[int, str] = {}
        for fault in error.faults:
            if fault.kind == NOT_FINITE and fault.value in by_slot:
                s = by_slot[fault.value]
                faulted.setdefault(s.id, f"its logits are not finite (at position {fault.bound}, new token "
                                         f"{fault.bound - s.prompt.numel() + 1}, device step {fault.step}, the "
                                         "launch's last to meet them): the model overflowed, or its weights hold "
                                         "NaN or inf")
            elif fault.kind != NOT_FINITE:
                return {s.id: f"the step read an index out of range ({fault})" for s in running}
        return faulted

    @serialized
    def cancel(self, sequence_id: int) -> torch.Tensor:
        """Stop a sequence of ``add``: its slot and pages are free for others. Returns its prompt and the
        tokens it made. Called while a step runs (from another thread), it waits for the step's end: the
        tokens are those the step made too."""
        sequence = self.sequence(sequence_id)
        if sequence is None:
            if sequence_id in self.finished:  # e.g. in the step this cancel waited for
                raise GraphError(f"cancel: sequence {sequence_id} already finished: its tokens are in "
                                 f"finished[{sequence_id}]")
            running = [s.id for s in self.slots if s is not None]
            raise GraphError(f"cancel: no running sequence has id {sequence_id!r} (running: {running})")
        self._free(sequence)
        return torch.cat([sequence.prompt, torch.tensor(sequence.tokens, dtype=torch.int64)])

    def has_room(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """A free slot, and the pages a sequence of that many prompt and new tokens takes through its end
        free besides those the running sequences will still take: ``add`` now would never run out of pages
        later. (An empty batch has every page.)"""
        running = [s for s in self.slots if s is not None]
        if len(running) == len(self.slots):
            return False
        need = self.pool.pages_for(prompt_tokens + max_new_tokens - 1)
        if not running:
            return need <= self.pool.pages
        later = sum(self.pool.pages_for(s.last_position + 1) - len(self.pool.held[s.slot]) for s in running)
        return later + need <= len(self.pool.free)

    def sequence(self, sequence_id: int) -> Sequence | None:
        """The running sequence of that id (its tokens and log-probabilities so far), or None."""
        return next((s for s in self.slots if s is not None and s.id == sequence_id), None)

    def _free(self, s: Sequence) -> None:
        self.slots[s.slot] = None
        self.pool.release(s.slot)
        self.kernel.tensor(self.graph.inputs["pos"])[s.slot] = -1  # no sequence: no work

    def _plan_prefill(self, active: list[Sequence]) -> "Chunk":
        """The prompt positions the prefill rows take in the next launch: each prefilling sequence in turn
        (oldest first), from a row at a multiple of ``BLOCK_ROWS`` (a block of rows holds one sequence's),
        up to ``prefill_chunk`` rows in all."""
        chunk, row = Chunk(), 0
        for s in sorted((s for s in active if s.prefilling), key=lambda s: s.id):
            count = min(self.config.prefill_chunk - row, s.prompt.numel() - 1 - s.prefilled)
            if count <= 0:
                break
            chunk.parts.append((s, s.prefilled, count, row))
            row += -(-count // BLOCK_ROWS) * BLOCK_ROWS
            if s.prefilled + count == s.prompt.numel() - 1:
                chunk.finishing.add(s.id)
        return chunk

    def _bind_prefill(self, chunk: "Chunk") -> None:
        """Write the chunk's tokens, positions and block table rows (between launches)."""
        c = self.config
        if not c.prefill_chunk:
            return
        tokens = torch.zeros(c.prefill_chunk, dtype=torch.int64)
        positions = torch.full((c.prefill_chunk,), -1)
        for j in range(c.prefill_chunk):
            self.pool.release(c.batch + j)
        for s, first, count, row in chunk.parts:
            tokens[row:row + count] = s.prompt[first:first + count]
            positions[row:row + count] = torch.arange(first, first + count)
            for j in range(row, row + count):
                self.pool.share(c.batch + j, s.slot)
        self.kernel.tensor(self.graph.inputs["prefill_tokens"]).copy_(tokens)
        self.kernel.tensor(self.graph.inputs["prefill_pos"]).copy_(positions)

    def _prefill_prompts(self, ids: torch.Tensor) -> int:
        """``generate``'s prompts [batch, T] through the prefill rows: every launch but the last of one step
        that only prefills (the batch rows off), the last chunk bound for the next launch, whose first step
        prefills it before its batch rows read the cache (``decode_step``). Returns the position the batch
        rows start at: T - 1, or 0 where the prompts go through the batch rows (no prefill rows; RoPE
        frequencies that follow the position, ``rope_at``, which a chunk of positions cannot share)."""
        c = self.config
        if not c.prefill_chunk or self.rope_at is not None or ids.shape[1] == 1:
            return 0
        rows = [Sequence(row, row, ids[row], 1, frozenset()) for row in range(c.batch)]
        while True:
            chunk = self._plan_prefill(rows)
            self._bind_prefill(chunk)
            for s, first, count, _ in chunk.parts:
                s.prefilled = first + count
            if not any(s.prefilling for s in rows):
                return ids.shape[1] - 1
            self._launch({"block_table": self.pool.table}, 1)  # the prefill rows' rows share their sequences' pages

    def _generate_each(self, prompts, max_new_tokens: int, eos_token_id, sampling: list[SamplingParams]
                       ) -> list[torch.Tensor]:
        """Continuous batching: every prompt (1-D ids, of any lengths) gets a slot as one frees and
        the pool has the pages it will need, and each launch runs until the next sequence ends (so that a
        waiting prompt joins then; one launch while a prompt is being prefilled). Returns one tensor
        per prompt, prompt + new tokens: what it would get alone. Every prompt is checked before anything
        runs: a bad one anywhere in the list runs nothing and leaves nothing behind."""
        prompts = [self._admissible(prompt, max_new_tokens, f"generate: prompt {index}")
                   for index, prompt in enumerate(prompts)]
        if max_new_tokens == 0:
            return [prompt.clone() for prompt in prompts]
        waiting = list(enumerate(prompts))
        ids: dict[int, int] = {}  # sequence id -> prompt index
        out: list[torch.Tensor | None] = [None] * len(waiting)
        for index, prompt in enumerate(prompts):  # before anything runs or any page is given back
            need = self.pool.pages_for(prompt.numel() + max_new_tokens - 1)
            if need > self.pool.pages:
                raise KVCacheFull(f"KV cache full: generate: prompt {index} and {max_new_tokens} new tokens need {need} "
                                  f"pages of {self.pool.page_size} positions; the pool has {self.pool.pages}. "
                                  f"Nothing changed")
        while waiting or any(self.slots):
            while waiting and self.has_room(waiting[0][1].numel(), max_new_tokens):
                index, prompt = waiting.pop(0)
                ids[self.add(prompt, max_new_tokens, eos_token_id, sampling[index])] = index
            running = [s for s in self.slots if s is not None]
            if any(s.prefilling for s in running):
                self.step()
            else:
                self.step(min(s.last_position + 1 - s.pos for s in running))
            for sequence_id in [i for i in ids if i in self.finished]:
                out[ids.pop(sequence_id)] = self.finished.pop(sequence_id)
        return out

    def _release_rows(self) -> None:
        for row in range(self.config.table_rows):
            self.pool.release(row)

    def _admissible(self, prompt_ids, max_new_tokens: int, what: str) -> torch.Tensor:
        """``prompt_ids`` as the 1-D prompt of a sequence (``add``) that will make ``max_new_tokens``, or a
        ``GraphError`` saying why it cannot be one."""
        ids = self._token_ids(prompt_ids, what, "prompt_ids")
        if ids.ndim != 1:
            raise GraphError(f"{what}: prompt_ids must be one prompt, a 1-D list of token ids, got shape "
                             f"{tuple(ids.shape)}")
        if ids.numel() == 0:
            raise GraphError(f"{what}: the prompt is empty")
        if ids.numel() + max_new_tokens > self.config.max_seq_len:
            raise GraphError(f"{what}: {ids.numel()} prompt + {max_new_tokens} new tokens exceed max_seq_len "
                             f"{self.config.max_seq_len}")
        if self.rope_at is not None:
            raise GraphError(f"{what}: rope types whose frequencies follow the position (dynamic, longrope) need "
                             "one position for the whole batch: generate a [batch, T] tensor of prompts")
        return ids

    def _token_ids(self, value, what: str, argument: str) -> torch.Tensor:
        """``value`` (a tensor or nested lists) as int64 token ids, or a ``GraphError`` naming ``argument``:
        floats and bools are refused, not truncated, and so are ids outside the vocabulary (the embedding
        would read past its rows)."""
        refused = f"{what}: {argument} must be integer token ids, got"
        try:
            ids = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise GraphError(f"{refused} {type(value).__name__} ({error})") from error
        # an empty list is a float tensor: it holds nothing to truncate (the caller says what is wrong with it)
        if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
            raise GraphError(f"{refused} {ids.dtype}")
        ids = ids.to(torch.int64)
        outside = ids[(ids < 0) | (ids >= self.config.vocab)]
        if outside.numel():
            raise GraphError(f"{what}: token id {int(outside[0])} is outside the vocabulary [0, {self.config.vocab})")
        return ids

    def _stop_ids(self, eos_token_id, what: str) -> torch.Tensor:
        """``eos_token_id`` (None, an id or several) as a 1-D int64 tensor of ids in the vocabulary."""
        if eos_token_id is None:
            return torch.zeros(0, dtype=torch.int64)
        if not is_int(eos_token_id) and not isinstance(eos_token_id, (list, tuple, set, frozenset, torch.Tensor)):
            raise GraphError(f"{what}: eos_token_id must be a token id or several, got {eos_token_id!r}")
        ids = ([eos_token_id] if is_int(eos_token_id) else eos_token_id.reshape(-1)
               if isinstance(eos_token_id, torch.Tensor) else list(eos_token_id))
        return self._token_ids(ids, what, "eos_token_id").reshape(-1)

    def _per_row(self, sampling, rows: int, what: str) -> list[SamplingParams]:
        """``sampling`` (None: greedy, one ``SamplingParams`` for all, or a list of ``rows``) as one per row."""
        every = [sampling or GREEDY] * rows if not isinstance(sampling, (list, tuple)) else list(sampling)
        if len(every) != rows or not all(isinstance(p, SamplingParams) for p in every):
            raise GraphError(f"{what}: sampling must be a SamplingParams or a list of {rows} (one per row or "
                             f"prompt), got {sampling!r}")
        return every

    def _bind_sampling(self, row: int, params: SamplingParams) -> SamplingParams:
        """Write ``params`` into batch row ``row``'s sampling params and seed (between launches); a sequence
        without a seed gets the next of the model's (the same on every rank). Returns them, seed set."""
        if params.seed is None:
            self._seeds_drawn += 1
            params = replace(params, seed=(self._seed_base + self._seeds_drawn * 0x9E3779B97F4A7C15) % (1 << SEED_BITS))
        self.kernel.tensor(self.graph.inputs["sampling"])[row] = torch.tensor(params.row)
        # any int seeds: its 64 low bits, as the int64 the tile's Philox takes them as
        self.kernel.tensor(self.graph.inputs["seed"])[row] = (params.seed + (1 << 63)) % (1 << 64) - (1 << 63)
        return params

    def _launch(self, inputs: dict[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
        """One launch of ``steps`` steps; keeps the last step's logits (float32, the vocabulary's). A launch
        that faulted (``FaultError``) ran all its steps: they count, and its outputs are on the heap."""
        try:
            out = self.kernel.run(inputs, steps=steps)
        except FaultError as error:
            self._ran(steps, error.outputs)
            raise
        return self._ran(steps, out)

    def _ran(self, steps: int, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._steps_launched += steps
        self.logits = out["logits"][:, :self.config.vocab].float()
        return out

    def _ends(self, end: int) -> dict[str, torch.Tensor]:
        """With drafts, the input that ends every batch row at position ``end``."""
        return {"end": torch.full((self.config.batch,), end)} if self.config.draft_tokens else {}

    def _positions(self, rows: list[int], ended: list[int]) -> list[int]:
        """The device's positions of batch ``rows`` after a launch with drafts, a row that ended (-1) at
        its ``ended`` position."""
        device = self.kernel.tensor(self.graph.inputs["pos"]).tolist()
        return [device[row] if device[row] >= 0 else end for row, end in zip(rows, ended)]

    @property
    def steps_run(self) -> int:
        """Device steps since the model was built: those of every launch; with drafts, the steps in which a
        batch row ran (a step whose batch rows had all ended, or that only prefilled, is not counted: its
        batch-row tasks skip their work)."""
        return self.statistics().steps if self.config.draft_tokens else self._steps_launched

    def statistics(self) -> "Statistics":
        """The counters of decoding with drafts since the model was built (``Statistics``)."""
        if not self.config.draft_tokens:
            return Statistics(self._steps_launched, 0, 0, 0, 0)
        return Statistics(*self.kernel.tensor(self.graph.inputs["draft_stats"]).tolist())

    @property
    def expert_passes(self) -> int:
        """The (layer, expert) weight passes this rank's sparse MLPs have run since the model was built: one
        per expert that some row chose in a layer-step, however many rows chose it (0 for a dense model)."""
        if "expert_passes" not in self.graph.inputs:
            return 0
        return int(self.kernel.tensor(self.graph.inputs["expert_passes"]).sum())

    @property
    def expert_ranks(self) -> tuple[int, ...]:
        """The rank that holds each expert whole (``expert_parallel``; the same on every rank), or () where
        every rank holds a share of every expert (tensor parallelism, one rank, a dense model)."""
        if not (self.config.expert_parallel and self.config.experts):
            return ()
        return expert_ranks(self.config.experts, self.graph.world_size)

    def _require_no_sequences(self, what: str) -> None:
        busy = [s.id for s in self.slots if s is not None]
        if busy:
            raise GraphError(f"{what}: sequences {busy} of add() are running in the batch; step until they finish")

    def _frequencies(self, pos: int) -> dict[str, torch.Tensor]:
        """The RoPE frequencies to bind for a launch starting at ``pos`` (none when they did not change)."""
        if self.rope_at is None:
            return {}
        inv_freq = self.rope_at(pos)
        if torch.equal(inv_freq, self.inv_freq):
            return {}
        self.inv_freq = inv_freq
        return {"inv_freq": inv_freq}

    def close(self) -> None:
        """Release the kernel, once a step of another thread has ended; the model refuses any call after."""
        with self.lock:
            self.closed = True
            self.kernel.close()


@dataclass(frozen=True)
class Scheduled:
    """A request's share of a step another scheduler planned (``DecodeModel.run_scheduled``): its tokens
    (int64 [q]) at positions ``start`` .. ``start + q - 1``, its KV cache in pool pages ``pages`` (in order:
    page j holds positions j * page_size ..; every page up to its last position)."""

    tokens: torch.Tensor
    start: int
    pages: torch.Tensor


@dataclass
class Chunk:
    """The prefill rows of a launch: (sequence, first position, positions, first row) parts, and the
    sequences whose prompt they finish."""

    parts: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    finishing: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Statistics:
    """Counters of decoding on the device (``DecodeModel.statistics``): ``steps`` run, and with drafts
    (``tasks.speculation``) the batch rows' steps (``row_steps``), the tokens they made, the drafted
    tokens they verified and those accepted."""

    steps: int
    row_steps: int
    tokens: int
    drafted: int
    accepted: int

    @property
    def tokens_per_row_step(self) -> float:
        """Tokens a running sequence made per step: 1 without drafts, up to ``draft_tokens + 1``."""
        return self.tokens / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens the model agreed with."""
        return self.accepted / self.drafted if self.drafted else 0.0
