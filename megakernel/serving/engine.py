"""``DecodeModel``: decoding with a compiled model (``compiled.CompiledModel``): greedy or sampled tokens on
the device for a fixed batch (``decode``, ``generate``), and continuous batching (``add`` / ``step`` /
``cancel``: sequences in slots of the batch, their KV cache in pages of a pool, their prompts prefilled in
chunks of the prefill rows). ``generate`` of a list of prompts runs on top of continuous batching."""
from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import replace

import torch

from ..errors import FaultError, GraphError, is_count, is_int
from ..layout import NOT_FINITE
from ..kernel_options import KernelOptions
from ..models.hf import ModelBuild
from .compiled import CompiledModel, Scheduled, serialized
from .pages import KVCacheFull
from .sampling_params import GREEDY, SEED_BITS, SamplingParams
from .sequences import Chunk, Sequence, SequenceFault, plan_prefill


class DecodeModel(CompiledModel):
    """A compiled model that decodes: a fixed batch of prompts at once (``generate``), or sequences that come
    and go in the batch's slots (``add`` / ``step`` / ``cancel``)."""

    def __init__(self, build: ModelBuild, options: KernelOptions | None = None, parallelism: int | str = "auto"):
        """``CompiledModel``'s arguments; the batch's slots empty."""
        super().__init__(build, options, parallelism)
        # seeds for sequences that bring none: from rank 0's base, so that every rank draws the same tokens
        self._seed_base, self._seeds_drawn = self.kernel.group.all_gather(secrets.randbits(SEED_BITS))[0], 0
        self.slots: list[Sequence | None] = [None] * self.config.batch  # the sequences of add(), by batch row
        self.finished: dict[int, torch.Tensor] = {}  # sequence id -> prompt + new tokens, once it ended
        self._next_id = 0

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
        chunk = plan_prefill(active, self.config.prefill_chunk)
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

    def _bind_prefill(self, chunk: Chunk) -> None:
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
            chunk = plan_prefill(rows, self.config.prefill_chunk)
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

    def _ends(self, end: int) -> dict[str, torch.Tensor]:
        """With drafts, the input that ends every batch row at position ``end``."""
        return {"end": torch.full((self.config.batch,), end)} if self.config.draft_tokens else {}

    def _positions(self, rows: list[int], ended: list[int]) -> list[int]:
        """The device's positions of batch ``rows`` after a launch with drafts, a row that ended (-1) at
        its ``ended`` position."""
        device = self.kernel.tensor(self.graph.inputs["pos"]).tolist()
        return [device[row] if device[row] >= 0 else end for row, end in zip(rows, ended)]

    def _require_no_sequences(self, what: str) -> None:
        busy = [s.id for s in self.slots if s is not None]
        if busy:
            raise GraphError(f"{what}: sequences {busy} of add() are running in the batch; step until they finish")

    @serialized
    def run_scheduled(self, requests: list[Scheduled]) -> torch.Tensor:
        """``CompiledModel.run_scheduled``, refused while sequences of ``add`` hold the batch's rows."""
        self._require_no_sequences("run_scheduled")
        return super().run_scheduled(requests)
