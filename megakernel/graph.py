"""The graph users build: symmetric heap buffers, tensor views of them, and ops split into tile tasks.

Every buffer gets its heap offset when it is created, in program order, so two ranks that build the
same graph get the same layout (the heap is symmetric). A buffer that other ranks' puts write is a
communication buffer, in the heap's comm area (``layout``): ``new_tensor(..., comm=True)``; the
collectives make theirs, and ``put`` wants one. Tensors are views: a rectangle of a 2-D
buffer (1-D tensors are one row). Ops come from the task library (``megakernel.tasks``): each op
splits into tile tasks that declare the regions they read and write, and the scheduler infers
dependencies from those regions.

Every op of the library is a method of ``Graph`` with the op's signature (``g.linear(x, w)``), so an
editor and ``inspect`` find it; the method hands its arguments to the op's builder, a function
``build(g, ...)`` of ``tasks/<family>.py``, through ``Graph._op``, which keeps the graph whole: it
checks that the tensors are this graph's, names the op, counts its tasks, and undoes a failed one.
Adding an op takes two files: the builder in ``tasks/<family>.py``, listed in that module's ``OPS``,
and its method in the ops section below (``tests/test_graph_ops.py`` checks the two agree). An op
of a module outside the package (``MEGAKERNEL_TASK_MODULES``) has no method: ``Graph.__getattr__``
finds it in ``OPS``.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from itertools import repeat
from operator import itemgetter
from typing import Any, Callable

import torch

from .backends import largest_heap
from .bootstrap import Topology, current_topology, current_world
from .errors import BackendError, GraphError, is_count, is_int
from .layout import COMM, align
from .scheduler import NO_GUARD, Region, Spec, Tasks, task_cost
from .tasks import DTYPES, OPS, TaskType
from .tasks import (activation, attention, chunk_attention, comm, control, elementwise, embedding, expert_parallel,
                    kv_cache, linear, moe, norm, rope, sampling, speculation)
from .tasks.formats import Quantized


@dataclass(frozen=True)
class Buffer:
    index: int
    name: str
    rows: int
    cols: int
    dtype: torch.dtype
    offset: int   # bytes from the heap base, the same on every rank (from ``layout.COMM`` on: the comm area)

    @property
    def comm(self) -> bool:
        """A communication buffer: other ranks may write it."""
        return self.offset >= COMM

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dtype.itemsize


class Tensor:
    """A view ``[row0:row0+rows, col0:col0+cols]`` of a graph buffer; 1-D when ``ndim == 1``."""

    __slots__ = ("graph", "buffer", "row0", "col0", "rows", "cols", "ndim")

    def __init__(self, graph: "Graph", buffer: Buffer, row0: int, col0: int, rows: int, cols: int, ndim: int):
        self.graph, self.buffer = graph, buffer
        self.row0, self.col0, self.rows, self.cols, self.ndim = row0, col0, rows, cols, ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.cols,) if self.ndim == 1 else (self.rows, self.cols)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def element_size(self) -> int:
        return self.buffer.dtype.itemsize

    @property
    def row_stride(self) -> int:
        return self.buffer.cols

    def addr(self, row: int, col: int) -> int:
        """Heap byte offset of element (row, col) of this view."""
        return self.buffer.offset + ((self.row0 + row) * self.buffer.cols + self.col0 + col) * self.element_size

    def block(self, row: int = 0, rows: int | None = None, col: int = 0, cols: int | None = None) -> "Tensor":
        """The 2-D view of rows [row, row+rows) x cols [col, col+cols) (all by default), whatever ndim is."""
        rows = self.rows - row if rows is None else rows
        cols = self.cols - col if cols is None else cols
        assert 0 <= row and row + rows <= self.rows and 0 <= col and col + cols <= self.cols, "block out of bounds"
        return Tensor(self.graph, self.buffer, self.row0 + row, self.col0 + col, rows, cols, 2)

    def region(self, row: int, rows: int, col: int, cols: int) -> Region:
        """The buffer rectangle under rows [row, row+rows) x cols [col, col+cols) of this view."""
        r, c = self.row0 + row, self.col0 + col
        return (self.buffer.index, r, r + rows, c, c + cols)

    def __getitem__(self, index) -> "Tensor":
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim:
            raise GraphError(f"too many indices for a tensor of shape {self.shape}")
        index = index + (slice(None),) * (self.ndim - len(index))
        if self.ndim == 1:
            c0, cols, _ = _span(index[0], self.cols, self.shape)
            return Tensor(self.graph, self.buffer, self.row0, self.col0 + c0, 1, cols, 1)
        r0, rows, row_is_int = _span(index[0], self.rows, self.shape)
        c0, cols, col_is_int = _span(index[1], self.cols, self.shape)
        if col_is_int and not row_is_int:
            raise GraphError(f"selecting a column of shape {self.shape} is not a contiguous view; "
                             f"use [:, j:j+1]")
        return Tensor(self.graph, self.buffer, self.row0 + r0, self.col0 + c0, rows, cols, 1 if row_is_int else 2)

    def __repr__(self) -> str:
        return f"Tensor({self.buffer.name}, shape={self.shape}, dtype={self.dtype})"


MAX_TASKS = 1 << 23  # tile tasks of one graph: ~8x the host path's 1M-task benchmark


def _span(index, size: int, shape) -> tuple[int, int, bool]:
    if isinstance(index, int):
        if not -size <= index < size:
            raise GraphError(f"index {index} is out of range for a tensor of shape {shape}")
        return index % size, 1, True
    if isinstance(index, slice):
        start, stop, step = index.indices(size)
        if step != 1:
            raise GraphError(f"slices with a step are not views; got step {step} on shape {shape}")
        if stop <= start:
            raise GraphError(f"empty slice {index} of a tensor of shape {shape}")
        return start, stop - start, False
    raise GraphError(f"tensors are indexed by ints and slices, got {index!r}")


def _describe(value) -> str:
    """An op argument as ranks compare it: tensors by shape and dtype; ranks (ints) may differ."""
    if isinstance(value, Tensor):
        return f"{value.shape} {str(value.dtype).removeprefix('torch.')}"
    return "int" if is_int(value) else repr(value)


class Graph:
    """A DAG of tile tasks over symmetric heap buffers.

    Ops (``add``, ``mul``, ``rms_norm``, ``linear``, ``silu_mul``, ...) are its methods, one per builder
    of the task library (the ops section); ``dir(graph)`` lists them with those of modules outside it.
    """

    def __init__(self, world_size: int | None = None, rank: int | None = None, parallelism: int = 1,
                 few_tiles: bool = False, ranks_per_node: int | None = None):
        """``parallelism``: the number of workers the graph is meant for; ops whose natural tiling gives
        fewer tiles split finer (split-K linears, more attention splits) to keep that many busy.
        ``few_tiles``: cut each op into about ``parallelism`` tiles, each looping over the blocks it
        covers, rather than a tile per block: for a backend whose every tile costs a host call (torch's
        ~10-30 us), not the few hundred cycles of a GPU's. ``ranks_per_node``: how the ranks sit on
        nodes (``topology``; collectives send each byte between nodes once); None: as this process's
        ranks do (``bootstrap.current_topology``) when the world is this process's, else one node."""
        if not is_count(parallelism):
            raise GraphError(f"parallelism must be a positive integer, got {parallelism!r}")
        if not isinstance(few_tiles, bool):
            raise GraphError(f"few_tiles must be a bool, got {few_tiles!r}")
        self.parallelism = parallelism
        self.few_tiles = few_tiles
        group_size, group_rank = current_world()
        self.world_size = group_size if world_size is None else world_size
        self.rank = group_rank if rank is None else rank
        if not 0 <= self.rank < self.world_size:
            raise GraphError(f"rank {self.rank} is outside world size {self.world_size}")
        if ranks_per_node is None and self.world_size == group_size:
            self.topology = current_topology()
        else:
            try:
                self.topology = Topology.uniform(self.world_size, ranks_per_node)
            except BackendError as error:
                raise GraphError(str(error)) from None
        self.buffers: list[Buffer] = []
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}  # what run returns, by name; in a sealed copy, where it reads them
        self.tasks = Tasks()
        self.specs: list[Spec] = []
        self.op_names: list[str] = []
        self._scope = ""  # label prefix of the ops built now, e.g. "layer3/"
        self.op_calls: list[str] = []  # one line per op call, what ranks compare before a launch
        self.heap_bytes = 0  # of data buffers
        self.comm_bytes = 0  # of communication buffers
        self._spec_index: dict[tuple, int] = {}
        self._words: list[tuple[Callable[[dict], tuple], int]] = []  # per opcode: keywords -> words, how many
        self._sealed = False  # a kernel's copy (``sealed``): no more ops
        self._guard: tuple[int, Region] | None = None  # the guard of the tasks built now (``guarded``)

    # -- user API ---------------------------------------------------------------------------------
    def input(self, name: str, shape, dtype: torch.dtype) -> Tensor:
        """A buffer whose value is bound at ``run`` (and stays bound for later runs)."""
        if name in self.inputs:
            raise GraphError(f"input {name!r} is defined twice")
        tensor = self.new_tensor(shape, dtype, name=name)
        self.inputs[name] = tensor
        return tensor

    def output(self, name: str, tensor: Tensor) -> None:
        """Return ``tensor`` from ``run`` under ``name``."""
        self._require_open(f"output {name!r}")
        self._own(tensor, f"output {name!r}")
        if name in self.outputs:
            raise GraphError(f"output {name!r} is defined twice")
        self.outputs[name] = tensor

    def __getattr__(self, name: str):
        build = OPS.get(name)  # only ops without a method come here: those of modules outside the package
        if build is None:
            raise AttributeError(f"Graph has no op {name!r}; ops: {', '.join(sorted(OPS))}")

        def op(*args: Any, **kwargs: Any):
            return self._add_op(name, build, args, kwargs)

        op.__name__ = name
        op.__doc__ = build.__doc__
        return op

    def __dir__(self):
        return sorted({*super().__dir__(), *OPS})

    def sealed(self, remote_targets: set[int]) -> "Graph":
        """A copy of this graph to build a kernel from, closed to new ops; this graph stays as it is.

        ``remote_targets``: the buffers that some rank's tasks write on another rank (every rank's
        view, the same on every rank). In the copy, such an output is a copy of it made at the end of
        each step, in a buffer of this rank alone: a peer that already runs the next step may write
        the output again while the host reads this one, but never the copy (its own writes into the
        output wait, across the wrap, for the copy tiles to have read it). An input that peers write
        is refused: the host writes inputs while peers may run; so is any other buffer that peers
        write and that is not a communication buffer (``new_tensor(..., comm=True)``).
        """
        for name, t in self.inputs.items():
            if t.buffer.index in remote_targets:
                raise GraphError(f"input {name!r} is written by other ranks' puts; inputs are written by the host "
                                 f"between runs, when peers may already run the next one: put into a new tensor")
        for b in self.buffers:
            if b.index in remote_targets and not b.comm:
                raise GraphError(f"buffer {b.name!r} is written by other ranks' puts but is not a communication "
                                 f"buffer: create it with new_tensor(..., comm=True)")
        twin = self._copy()
        for name, t in self.outputs.items():
            if t.buffer.index in remote_targets:
                twin.op_names.append(f"outputs/{name}.copy")
                twin.outputs[name] = twin.new_tensor(t.shape, t.dtype, name=f"{name}.copy")
                comm.put_tiles(twin, t.block(), twin.rank, twin.outputs[name].block())
        twin._sealed = True
        return twin

    def _copy(self) -> "Graph":
        """A copy that shares no container with this graph (what they hold, tuples and frozen records, is
        immutable), so that ops added to either leave the other as it was."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, dict)):
                setattr(twin, name, copy.copy(value))
        twin.tasks = replace(self.tasks, **{f.name: copy.copy(getattr(self.tasks, f.name)) for f in fields(Tasks)})
        return twin

    def remote_targets(self) -> set[int]:
        """The buffers this rank's tasks write on other ranks."""
        return {region[0] for remote in self.tasks.remote for _, region in remote}

    def _require_open(self, what: str) -> None:
        if self._sealed:
            raise GraphError(f"{what}: this is a kernel's sealed copy of a graph; add ops to the graph it was built from")

    # -- ops: one method per builder of the task library (module docstring) -----------------------
    def _op(self, build: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """The op that ``build(self, *args, **kwargs)`` adds, under the builder's name."""
        return self._add_op(build.__name__, build, args, kwargs)

    def _add_op(self, name: str, build: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._require_open(name)
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                self._own(value, name)
        mark = (len(self.op_names), len(self.tasks), len(self.buffers), len(self.specs), self.heap_bytes,
                self.comm_bytes)
        self.op_names.append(self._scope + name)
        try:
            result = build(self, *args, **kwargs)
            if len(self.tasks) > MAX_TASKS:
                raise GraphError(f"{name}: the graph would have {len(self.tasks):,} tasks; at most {MAX_TASKS:,} "
                                 f"(tables of that many take minutes to schedule)")
            self.op_calls.append(f"{name}({', '.join(_describe(a) for a in (*args, *kwargs.values()))})")
            return result
        except BaseException:
            self._rollback(*mark)  # a failed op leaves no trace: no tasks, buffers or opcodes
            raise

    # tasks/elementwise.py, tasks/activation.py
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a + b``."""
        return self._op(elementwise.add, a, b)

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``a * b``."""
        return self._op(elementwise.mul, a, b)

    def silu_mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``silu(a) * b`` (in float32): a gated MLP's activation."""
        return self._op(activation.silu_mul, a, b)

    def gelu_tanh_mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``gelu(a) * b``, gelu's tanh approximation (in float32)."""
        return self._op(activation.gelu_tanh_mul, a, b)

    # tasks/norm.py, tasks/linear.py, tasks/rope.py
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float = 1e-6, head_dim: int | None = None,
                 unit_offset: bool = False) -> Tensor:
        """RMSNorm of each row of ``x`` [M, N] (``weight`` [N]) or of each ``head_dim`` piece of a row
        (``weight`` [head_dim]); ``unit_offset``: scaled by ``1 + weight``."""
        return self._op(norm.rms_norm, x, weight, eps, head_dim, unit_offset)

    def linear(self, x: Tensor, w: Tensor | Quantized, split_k: int | None = None,
               out: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
        """``x [M, K] @ w [N, K].T``, [M, N] in x's dtype (written into the view ``out`` if given); K cut
        into ``split_k`` ranges, by default as many as ``parallelism`` wants. ``w`` may be ``Quantized``.
        ``pos`` (int64 [M]): the rows' positions; a row at -1 holds no sequence, its output row is zero."""
        return self._op(linear.linear, x, w, split_k, out, pos)

    def rope(self, x: Tensor, inv_freq: Tensor, pos: Tensor, head_dim: int, scaling: float = 1.0) -> Tensor:
        """Rotary embedding: each ``head_dim`` head of each row of ``x`` rotated by its position ``pos``
        (one int64, or one per row), frequencies ``inv_freq`` (float32 [head_dim / 2])."""
        return self._op(rope.rope, x, inv_freq, pos, head_dim, scaling)

    # tasks/attention.py, tasks/chunk_attention.py
    def kv_append(self, cache: Tensor, x: Tensor, pos: Tensor, batch: int, table: Tensor | None = None,
                  page_size: int | None = None, rows_per_sequence: int = 1) -> Tensor:
        """Each row of ``x`` [batch, cols] written into ``cache`` at its sequence's position ``pos``:
        contiguous, or through the block ``table`` of pages of ``page_size`` rows. Returns ``cache``."""
        return self._op(kv_cache.kv_append, cache, x, pos, batch, table, page_size, rows_per_sequence)

    def decode_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, batch: int, head_dim: int,
                         window: int | None = None, table: Tensor | None = None,
                         page_size: int | None = None, whole_rows: bool | None = None) -> Tensor:
        """Attention of one query row per sequence, ``q`` [batch, heads * head_dim], over the cached
        positions up to ``pos`` (the last ``window`` of them), grouped KV heads, contiguous or paged; split
        along the sequence, or (``whole_rows``, by default with ``few_tiles``) a tile per run of rows."""
        return self._op(attention.decode_attention, q, k_cache, v_cache, pos, batch, head_dim, window, table,
                        page_size, whole_rows)

    def chunk_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, head_dim: int,
                        window: int | None = None, table: Tensor | None = None, page_size: int | None = None,
                        rows_per_sequence: int | None = None) -> Tensor:
        """Causal attention of many query rows (a prefill chunk, or verification rows), each at its
        position ``pos`` (-1: unused, zeros), over its sequence's cache, contiguous or paged."""
        return self._op(chunk_attention.chunk_attention, q, k_cache, v_cache, pos, head_dim, window, table,
                        page_size, rows_per_sequence)

    # tasks/embedding.py, tasks/moe.py, tasks/expert_parallel.py
    def embedding(self, tokens: Tensor, table: Tensor | Quantized, pos: Tensor | None = None) -> Tensor:
        """The rows of ``table`` [vocab, hidden] that ``tokens`` (int64 [B]) name, or with ``pos`` those
        that a token history (int64 [B, positions]) holds at ``pos``. ``table`` may be ``Quantized``."""
        return self._op(embedding.embedding, tokens, table, pos)

    def route(self, logits: Tensor, k: int, normalize: bool,
              weight_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """A mixture of experts' router: per row of ``logits`` [tokens, experts], the ``k`` most probable
        experts (int64 [tokens, k]) and their probabilities (``normalize``: summing to 1)."""
        return self._op(moe.route, logits, k, normalize, weight_dtype)

    def expert_rows(self, x: Tensor, w: Tensor | Quantized, experts: Tensor, count: int) -> Tensor:
        """Per token and chosen expert (``experts`` [tokens, slots]), its row of ``x`` times that expert's
        rows of ``w`` (``count`` experts stacked): [tokens * slots, n]. ``w`` may be ``Quantized``."""
        return self._op(moe.expert_rows, x, w, experts, count)

    def grouped_experts(self, x: Tensor, w: Tensor | Quantized, experts: Tensor, count: int, act: str = "",
                        after: Tensor | None = None, passes: Tensor | None = None,
                        expert_parallel: bool = False) -> tuple[Tensor, Tensor]:
        """``expert_rows`` with the rows grouped by expert: each chosen expert's rows of ``w`` read once for
        all the rows that chose it; ``act`` a gated activation over gate rows then up rows. Returns ``(y,
        marker)``: the marker is what a reader of y names as ``after`` (the rows written depend on the
        router). ``passes`` (int64 [count]) counts the weight passes; ``expert_parallel``: only this rank's
        experts, which w stacks (``expert_parallel.Held.balanced``)."""
        return self._op(moe.grouped_experts, x, w, experts, count, act, after, passes, expert_parallel)

    def moe_sum(self, y: Tensor, weights: Tensor, after: Tensor | None = None, experts: Tensor | None = None,
                count: int | None = None) -> Tensor:
        """Per token, its slots' rows of ``y`` [tokens * slots, n] summed with ``weights`` [tokens, slots];
        ``after``: the marker of the ``grouped_experts`` that wrote y; ``experts`` (the router's, of
        ``count``): only the slots of this rank's experts under expert parallelism."""
        return self._op(moe.moe_sum, y, weights, after, experts, count)

    def combine(self, part: Tensor, experts: Tensor, count: int) -> Tensor:
        """The sum over the ranks of each rank's part of a sparse MLP under expert parallelism, on every
        rank: a token's row travels only from the ranks holding one of its ``experts`` (the router's)."""
        return self._op(expert_parallel.combine, part, experts, count)

    def moe_mlp(self, x: Tensor, router: Tensor | Quantized, gate_up: Tensor | Quantized, down: Tensor | Quantized,
                k: int, normalize: bool, weight_dtype: torch.dtype, act: str = "silu_mul",
                passes: Tensor | None = None, expert_parallel: bool = False) -> Tensor:
        """A sparse MLP: ``route``, each token's ``k`` experts' gated MLP (``act``), the rows that chose an
        expert sharing one pass over its weights (``tasks.moe.grouped_experts``; ``passes`` counts them),
        and ``moe_sum`` of their outputs, [tokens, hidden]. ``expert_parallel``: this rank's experts whole
        (``expert_parallel.Held.balanced``), the parts combined over the ranks."""
        return self._op(moe.moe_mlp, x, router, gate_up, down, k, normalize, weight_dtype, act, passes,
                        expert_parallel)

    # tasks/comm.py
    def put(self, x: Tensor, to_rank: int, into: Tensor) -> Tensor:
        """``x`` stored into ``into`` on rank ``to_rank`` (a communication buffer, ``new_tensor(...,
        comm=True)``, unless every rank puts into itself). Returns ``into``, what peers put here."""
        return self._op(comm.put, x, to_rank, into)

    def all_reduce(self, x: Tensor, algorithm: str | None = None) -> Tensor:
        """The sum of every rank's ``x``, on every rank; ``algorithm``: "one_shot", "two_shot" or None
        (chosen by size)."""
        return self._op(comm.all_reduce, x, algorithm)

    def all_gather(self, x: Tensor, dim: int = 0) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank."""
        return self._op(comm.all_gather, x, dim)

    def reduce_scatter(self, x: Tensor, dim: int = 0) -> Tensor:
        """The sum of every rank's ``x``, cut along ``dim`` into a chunk per rank: this rank's chunk."""
        return self._op(comm.reduce_scatter, x, dim)

    # tasks/sampling.py
    def sample(self, logits: Tensor, history: Tensor, pos: Tensor, prompt_len: Tensor, params: Tensor | None = None,
               seed: Tensor | None = None, logprobs: Tensor | None = None,
               top: tuple[Tensor, Tensor] | None = None, vocab: int | None = None,
               rows_per_sequence: int = 1) -> Tensor:
        """The next token of each sequence past its prompt, from its row of ``logits``, written into
        ``history`` after ``pos``: drawn with ``params`` and ``seed``, or the argmax; ``logprobs`` and
        ``top`` record probabilities. Returns ``history``."""
        return self._op(sampling.sample, logits, history, pos, prompt_len, params, seed, logprobs, top, vocab,
                        rows_per_sequence)

    def sample_greedy(self, logits: Tensor, history: Tensor, pos: Tensor, prompt_len: Tensor,
                      vocab: int | None = None) -> Tensor:
        """``sample`` by argmax alone (no params). Returns ``history``."""
        return self._op(sampling.sample_greedy, logits, history, pos, prompt_len, vocab)

    def advance(self, pos: Tensor, by: int = 1, limit: int = 2**62) -> Tensor:
        """``pos += by`` (int64 positions) once the step's tasks have read it; -1 stays -1, and a position
        reaching ``limit`` becomes -1. Returns ``pos``."""
        return self._op(sampling.advance, pos, by, limit)

    # tasks/speculation.py
    def draft(self, history: Tensor, pos: Tensor, prompt_len: Tensor, end: Tensor,
              rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """A step's verification rows, ``rows`` per sequence: (tokens, positions, live), ``live`` a flag
        for ``guarded`` that is -1 in a step where no sequence runs."""
        return self._op(speculation.draft, history, pos, prompt_len, end, rows)

    def accept(self, history: Tensor, verified: Tensor, tokens: Tensor, positions: Tensor, pos: Tensor,
               prompt_len: Tensor, end: Tensor, stats: Tensor) -> Tensor:
        """The drafted tokens the model agrees with (``verified``), kept in ``history``; ``pos`` advanced,
        ``stats`` counted. Returns ``history``."""
        return self._op(speculation.accept, history, verified, tokens, positions, pos, prompt_len, end, stats)

    # tasks/control.py
    def touch(self, t: Tensor) -> Tensor:
        """One empty task that writes ``t`` as far as dependencies go. Returns ``t``."""
        return self._op(control.touch, t)

    # -- builder API (used by the task library) ---------------------------------------------------
    def require(self, condition: bool, message: str) -> None:
        """Refuse a bad op: a ``GraphError`` with ``message`` (which names the op, the tensor, the shapes)
        unless ``condition`` holds."""
        if not condition:
            raise GraphError(message)

    def new_tensor(self, shape, dtype: torch.dtype, name: str | None = None, comm: bool = False) -> Tensor:
        """A new buffer; ``comm``: a communication buffer, one that other ranks' puts may write (it lives
        where their stores stay coherent, ``layout``)."""
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        if len(shape) not in (1, 2) or not all(map(is_count, shape)):
            raise GraphError(f"{name or 'tensor'}: shape must be 1-D or 2-D of positive ints, got {shape}")
        if dtype not in DTYPES:
            raise GraphError(f"{name or 'tensor'}: dtype {dtype} is not supported; use one of "
                             f"{', '.join(str(d) for d in DTYPES)}")
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        index = len(self.buffers)
        total = self.heap_bytes + self.comm_bytes + rows * cols * dtype.itemsize
        if total > largest_heap():  # before any op splits it into tiles: that alone would never end
            raise GraphError(f"{name or 'tensor'} {shape} {dtype}: the graph's buffers would take {total:,} bytes; the "
                             f"largest heap this machine can hold is {largest_heap():,}")
        if comm:
            buffer = Buffer(index, name or f"t{index}", rows, cols, dtype, COMM + self.comm_bytes)
            self.comm_bytes += align(buffer.nbytes)
        else:
            buffer = Buffer(index, name or f"t{index}", rows, cols, dtype, self.heap_bytes)
            self.heap_bytes += align(buffer.nbytes)
        self.buffers.append(buffer)
        return Tensor(self, buffer, 0, 0, rows, cols, len(shape))

    def opcode(self, task_type: TaskType, **constexprs) -> int:
        """The opcode that runs ``task_type``'s tile with these compile-time constants (every one its
        signature declares), made on first use."""
        if set(constexprs) != set(task_type.constexpr_names):
            missing = sorted(set(task_type.constexpr_names) - set(constexprs))
            name = missing[0] if missing else sorted(set(constexprs) - set(task_type.constexpr_names))[0]
            raise GraphError(f"task type {task_type.name}: {'missing' if missing else 'unknown'} constexpr {name!r}; "
                             f"its tile takes {', '.join(task_type.constexpr_names) or 'none'}")
        consts = tuple((k, DTYPES[v] if isinstance(v, torch.dtype) else v) for k, v in constexprs.items())
        key = (task_type.name, consts)
        opcode = self._spec_index.get(key)
        if opcode is None:
            opcode = self._spec_index[key] = len(self.specs)
            self.specs.append(Spec(task_type.name, consts, task_type.arg_names))
            names = task_type.arg_names  # itemgetter gives a tuple only for two names or more
            getter = itemgetter(*names) if len(names) > 1 else lambda words: tuple(words[n] for n in names)
            self._words.append((getter, len(names)))
        return opcode

    def add_task(self, opcode: int, /, *, reads: tuple[Region, ...], writes: tuple[Region, ...], bytes: int,
                 flops: int, remote: tuple[tuple[int, Region], ...] = (), **words: int) -> None:
        """One task of ``opcode``: its argument ``words`` by name (every one its tile declares), the
        regions it reads and writes here, what it writes on other ranks, and its cost."""
        words_of, count = self._words[opcode]  # the hot path of graph building: nothing else per task
        if len(words) != count:
            self._bad_words(opcode, words)
        try:
            args = words_of(words)
        except KeyError:
            self._bad_words(opcode, words)
        guard = NO_GUARD
        if self._guard is not None:
            guard, reads = self._guard[0], (*reads, self._guard[1])
        self.tasks.append(opcode, args, reads, writes, task_cost(bytes, flops), len(self.op_names) - 1, remote, guard)

    def add_tasks(self, opcode: int, /, *, reads: list[tuple[Region, ...]], writes: list[tuple[Region, ...]],
                  bytes: list[int], flops: list[int], **words: int | range | list[int]) -> None:
        """A run of tasks of ``opcode``, as ``add_task`` for each in turn: ``reads``, ``writes``, ``bytes``
        and ``flops`` hold one entry per task, and each argument word is one int for all of them or a
        list (or range) of one per task. For ops of many tiles: a call with keywords per tile is most of
        a big graph's build, and here the argument tuples are made by ``zip``."""
        count = len(writes)
        names = self.specs[opcode].arg_names
        if len(words) != len(names):
            self._bad_words(opcode, words)
        try:
            columns = [words[name] for name in names]
        except KeyError:
            self._bad_words(opcode, words)
        columns = [c if isinstance(c, (list, range)) else repeat(c, count) for c in columns]
        if any(len(c) != count for c in (reads, bytes, flops, *columns) if not isinstance(c, repeat)):
            raise GraphError(f"add_tasks: {count} tasks' writes, but reads, bytes, flops or an argument word "
                             f"of another length")
        args = list(zip(*columns)) if columns else [()] * count
        if self._guard is not None:
            reads = [(*r, self._guard[1]) for r in reads]
        guard = NO_GUARD if self._guard is None else self._guard[0]
        self.tasks.extend(opcode, args, reads, writes, list(map(task_cost, bytes, flops)), len(self.op_names) - 1,
                          guard)

    def _bad_words(self, opcode: int, words: dict) -> None:
        spec = self.specs[opcode]
        missing, unknown = sorted(set(spec.arg_names) - set(words)), sorted(set(words) - set(spec.arg_names))
        if missing:
            raise GraphError(f"task type {spec.task_type}: missing argument word {missing[0]!r}")
        raise GraphError(f"task type {spec.task_type}: unknown argument word {unknown[0]!r}; its tile takes "
                         f"{', '.join(spec.arg_names) or 'none'}")

    def phase(self, name: str) -> None:
        """Start a new phase of the current op: tasks after it come later in the global order.

        A collective is several phases (scatter, sum, gather); a remote write lands between the
        phase that makes it and the next, on every rank.
        """
        self.op_names.append(self._scope + name)

    @contextmanager
    def guarded(self, flag: Tensor) -> Iterator[None]:
        """Make the tasks built inside skip their work in a step where ``flag`` (one int64 element) is -1
        (``device.NO_SEQUENCE``): they still wait and signal, so the schedule is the same whatever it
        holds. For a part of a graph that not every step needs (a prefill chunk in a decode step)."""
        self._own(flag, "guarded")
        if flag.dtype != torch.int64 or flag.shape not in ((1,), (1, 1)):
            raise GraphError(f"guarded: the flag must be one int64 element, got {flag.shape} {flag.dtype}")
        if self._guard is not None:
            raise GraphError("guarded: already inside a guarded part")
        self._guard = (flag.addr(0, 0), flag.region(0, 1, 0, 1))
        try:
            yield
        finally:
            self._guard = None

    @property
    def is_guarded(self) -> bool:
        """Whether the tasks built now are inside ``guarded`` (whose flag they skip on)."""
        return self._guard is not None

    @contextmanager
    def scope(self, label: str) -> Iterator[None]:
        """Label the ops built inside: their names become ``label/op`` in tables, traces and reports."""
        outer = self._scope
        self._scope = f"{outer}{label}/"
        try:
            yield
        finally:
            self._scope = outer

    # -- helpers ----------------------------------------------------------------------------------
    def buffer_layout(self) -> list[str]:
        """One line per buffer: what must be the same on every rank for the heap to be symmetric."""
        return [f"buffer {b.name!r} at offset {b.offset}: {b.rows}x{b.cols} {str(b.dtype).removeprefix('torch.')}"
                for b in self.buffers]

    def buffer_shapes(self) -> dict[int, tuple[int, int]]:
        return {b.index: (b.rows, b.cols) for b in self.buffers}

    def describe_task(self, tid: int) -> str:
        op = self.tasks.op[tid]
        return f"task {tid} ({self.op_names[op]} op {op})"

    def _rollback(self, ops: int, tasks: int, buffers: int, specs: int, heap_bytes: int, comm_bytes: int) -> None:
        del self.op_names[ops:], self.buffers[buffers:]
        self.tasks.truncate(tasks)
        for spec in self.specs[specs:]:
            del self._spec_index[(spec.task_type, spec.constexprs)]
        del self.specs[specs:], self._words[specs:]
        self.heap_bytes, self.comm_bytes = heap_bytes, comm_bytes

    def _own(self, tensor: Tensor, what: str) -> None:
        if not isinstance(tensor, Tensor) or tensor.graph is not self:
            raise GraphError(f"{what}: {tensor!r} is not a tensor of this graph")
