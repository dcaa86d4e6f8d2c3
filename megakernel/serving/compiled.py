"""``CompiledModel``: one rank's share of a decoder model compiled into one megakernel: its weights and
state on the kernel's heap, a launch of some steps (``decode_step``), and the step another scheduler plans
(``run_scheduled``: vLLM's). It knows the decode graph and its weights by input name (a ``models.ModelBuild``),
not where they came from (``from_hf``, ``from_pretrained``); ``engine.DecodeModel`` decodes with it."""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from ..errors import FaultError, GraphError
from ..graph import Graph
from ..kernel_options import KernelOptions
from ..runtime import Megakernel
from ..tasks.chunk_attention import BLOCK_ROWS
from ..tasks.expert_parallel import expert_ranks
from ..tasks.sampling import PARAMS
from ..tasks.speculation import STATS
from ..models.decoder import decode_step
from ..models.hf import ModelBuild
from .pages import PagePool, waves


Method = TypeVar("Method", bound=Callable)


def serialized(method: Method) -> Method:
    """Run ``method`` under the model's lock: a server calls the engine from several threads, and a step
    that read the batch's slots must not see them change under it (one call at a time; reentrant, for
    ``generate`` runs ``add`` and ``step``)."""
    @functools.wraps(method)
    def locked(self: "CompiledModel", *args, **kwargs):
        with self.lock:
            if self.closed:
                raise GraphError(f"{method.__name__}: the model is closed")
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class CompiledModel:
    """One rank's share of a model, compiled into one megakernel: one launch per decode step."""

    def __init__(self, build: ModelBuild, options: KernelOptions | None = None, parallelism: int | str = "auto"):
        """Compile ``build`` (its frequencies rebound when ``build.rope_at`` changes them) into a
        ``Megakernel`` of ``options`` (None: the defaults'). ``parallelism``: the workers the step's tiles are
        sized for (``Graph.parallelism``); "auto": what suits the backend (``BackendKind.tile_parallelism``: on a
        GPU every worker the kernel holds, found by building once; on the cpu backend 1, few large tiles for the
        interpreter; on torch the workers, at least 2)."""
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
        options = options or KernelOptions()
        kind = options.kind
        if parallelism == "auto":
            parallelism = kind.tile_parallelism(options.workers)
            learn, parallelism = parallelism is None, parallelism or 1
        self.graph = decode_step(config, Graph(parallelism=parallelism, few_tiles=kind.few_tiles))
        self.kernel = Megakernel(self.graph, **options.arguments())
        if learn and self.kernel.workers > 1:
            self.kernel.close()
            self.graph = decode_step(config, Graph(parallelism=self.kernel.workers, few_tiles=kind.few_tiles))
            self.kernel = Megakernel(self.graph, **options.arguments())
        self.kernel.bind(weights)
        self.pool = PagePool(config.pool_pages, config.page_size, config.table_rows, config.max_pages)
        self.kernel.bind({"history": torch.zeros(config.batch, config.max_seq_len, dtype=torch.int64),
                          "pos": torch.full((config.batch,), -1),
                          "prompt_len": torch.zeros(config.batch, dtype=torch.int64),
                          "block_table": self.pool.table})
        self.kernel.bind({"sampling": torch.zeros(config.batch, len(PARAMS)),  # temperature 0: greedy
                          "seed": torch.zeros(config.batch, dtype=torch.int64)})
        if config.draft_tokens:  # every row off until it is given an end; the counters from zero
            self.kernel.bind({"end": torch.zeros(config.batch, dtype=torch.int64),
                              "draft_stats": torch.zeros(len(STATS), dtype=torch.int64)})
        if "expert_passes" in self.graph.inputs:
            self.kernel.bind({"expert_passes": torch.zeros(2 * config.layers, config.experts, dtype=torch.int64)})
        self._steps_launched = 0
        if config.prefill_chunk:
            self.kernel.bind({"prefill_pos": torch.full((config.prefill_chunk,), -1),
                              "prefill_tokens": torch.zeros(config.prefill_chunk, dtype=torch.int64)})
        self._logits: torch.Tensor | None = None  # the last launch's, as the step wrote them
        self.lock = threading.RLock()  # held by every public method (``serialized``)
        self.closed = False

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
        self._logits = out["logits"]
        return out

    @property
    def logits(self) -> torch.Tensor | None:
        """The last launch's last step's logits, float32 [batch, vocab] by batch row; with drafts [batch *
        (draft_tokens + 1), vocab], each row's verification rows. Converted when read: a serving step
        reads none (and a conversion on torch's threads between launches would take the workers' cores:
        ``backends.cpu.one_torch_thread``)."""
        return None if self._logits is None else self._logits[:, :self.config.vocab].float()

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

    def _frequencies(self, pos: int) -> dict[str, torch.Tensor]:
        """The RoPE frequencies to bind for a launch starting at ``pos`` (none when they did not change)."""
        if self.rope_at is None:
            return {}
        inv_freq = self.rope_at(pos)
        if torch.equal(inv_freq, self.inv_freq):
            return {}
        self.inv_freq = inv_freq
        return {"inv_freq": inv_freq}

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

    def close(self) -> None:
        """Release the kernel, once a step of another thread has ended; the model refuses any call after."""
        with self.lock:
            self.closed = True
            self.kernel.close()

@dataclass(frozen=True)
class Scheduled:
    """A request's share of a step another scheduler planned (``CompiledModel.run_scheduled``): its tokens
    (int64 [q]) at positions ``start`` .. ``start + q - 1``, its KV cache in pool pages ``pages`` (in order:
    page j holds positions j * page_size ..; every page up to its last position)."""

    tokens: torch.Tensor
    start: int
    pages: torch.Tensor

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
