"""The device-side protocol: heap pointers, translation to a peer, wait, signal, clock.

The whole remote-memory idea: every rank maps a heap of the same layout, so a buffer lives at the
same byte offset on every rank. A worker holds a table of heap bases *as mapped in its own address
space*; the pointer to offset ``o`` on rank ``r`` is ``bases[r] + o``. Task tables store offsets, not
pointers, because each process (and each GPU) maps the heaps at addresses of its own.

Events are int64 counters on the heap. Every counter that another worker or rank may write is read
with acquire semantics at system scope: a gpu-scope flag written by another GPU can be spun on
forever. Two wait/signal protocols share the one loop (code generation picks one, ``PROTOCOLS``):

- ``poll`` (the default where Triton has ``tl.atomic_poll``): one thread of the program polls the
  counter with relaxed loads for a slice of POLL_SLICE_NS, then one acquire fence and one barrier;
  between slices the abort word is read and the total timeout counted in slices. A task's signals
  pay one release fence, at gpu scope when every event it signals is this rank's and at system
  scope when one is a peer's, then relaxed adds at the scope of each event (under the interpreter
  every add releases instead).
- ``spin`` (triton 3.6, and the baseline that ``bench/gpu_check.py`` compares with): every thread
  reads the counter and the abort word with scalar atomics, and a program-wide clock, each
  iteration; every signal is a system-scope release.
"""
from __future__ import annotations

import os
import time

import triton
import triton.language as tl

from . import layout
from .errors import BackendError
from .interpreter import use_squeezed_index

use_squeezed_index()  # triton 3.6's interpreter with numpy >= 2.4

# The status record and trace stamps (``layout``), as constexprs for the kernel.
STATUS_WORDS, TRACE_WORDS = tl.constexpr(layout.STATUS_WORDS), tl.constexpr(layout.TRACE_WORDS)
(STATE, TASK, EVENT, OBSERVED, EXPECTED, DONE, EPOCH, CLOCK_SLOT, FAULT, FAULT_AT, FAULT_KIND, FAULT_VALUE,
 FAULT_BOUND) = (tl.constexpr(i) for i in (layout.STATE, layout.TASK, layout.EVENT, layout.OBSERVED, layout.EXPECTED,
                                          layout.DONE, layout.EPOCH, layout.CLOCK_SLOT, layout.FAULT, layout.FAULT_AT,
                                          layout.FAULT_KIND, layout.FAULT_VALUE, layout.FAULT_BOUND))
INDEX, NOT_FINITE = tl.constexpr(layout.INDEX), tl.constexpr(layout.NOT_FINITE)  # kinds of fault
TIMED_OUT, STOPPED, FAULTED = tl.constexpr(layout.TIMED_OUT), tl.constexpr(layout.STOPPED), tl.constexpr(layout.FAULTED)


@triton.jit
def heap_ptr(base, offset, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset`` of the heap mapped at ``base``."""
    return (base + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def peer_ptr(bases, peer, offset, DTYPE: tl.constexpr):
    """Typed pointer to byte ``offset`` of rank ``peer``'s heap, as mapped in this process."""
    return heap_ptr(tl.load(bases + peer), offset, DTYPE)


def interpreter_clock():
    """Host monotonic nanoseconds, as an int64 scalar: the interpreter runs kernels as Python."""
    return tl.full((), time.monotonic_ns(), tl.int64)


@triton.jit
def cuda_clock():
    """Nanoseconds from the global timer, shared by every SM of the GPU."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def hip_clock():
    """Nanoseconds from the 100 MHz real-time counter, constant across the GPU's clock changes."""
    ticks = tl.inline_asm_elementwise("s_memrealtime $0\ns_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    return ticks * 10


CLOCKS = {"interpreter": "interpreter_clock", "cuda": "cuda_clock", "hip": "hip_clock"}


def interpreter_fence(system):
    """Nothing to do: under the interpreter the adds themselves release (``RELAXED_ADDS`` is off), as a
    relaxed atomic on a weakly ordered host (aarch64) would not order the tile's stores before it."""


@triton.jit
def cuda_fence(system):
    """Release (and acquire) fence of this thread: at system scope if ``system``, else at gpu scope."""
    if system != 0:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def hip_fence(system):
    """Release fence of this thread, as LLVM's memory model writes one for gfx942: write back the L2 (its
    lines of non-coherent memory; with ``sc0`` too for system scope), then wait for every store."""
    if system != 0:
        tl.inline_asm_elementwise("buffer_wbl2 sc0 sc1\ns_waitcnt vmcnt(0) lgkmcnt(0)\nv_mov_b32 $0, 0", "=v", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("buffer_wbl2 sc1\ns_waitcnt vmcnt(0) lgkmcnt(0)\nv_mov_b32 $0, 0", "=v", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


FENCES = {"interpreter": "interpreter_fence", "cuda": "cuda_fence", "hip": "hip_fence"}


@triton.jit
def program_clock(slot, CLOCK: tl.constexpr):
    """The clock as one thread of the program read it at its previous call, the same value for every
    thread (a scalar atomic runs on one thread and broadcasts its result; ``slot`` keeps the reading).

    Each thread reading the clock itself would let warps disagree on a timeout and leave a loop whose
    body has barriers at different iterations.
    """
    return tl.atomic_xchg(slot, CLOCK(), sem="relaxed", scope="cta")


@triton.jit
def wait_spinning(counter, target, abort, timeout_ns, clock_slot, CLOCK: tl.constexpr):
    """Spin until ``*counter >= target``, another worker aborts the run, or ``timeout_ns`` passes;
    whether the target was reached. Every value the loop condition depends on is uniform across the
    program's threads (scalar atomics run on one thread and broadcast their result)."""
    observed = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
    stop = tl.atomic_add(abort, 0, sem="relaxed", scope="sys")
    program_clock(clock_slot, CLOCK)
    start = program_clock(clock_slot, CLOCK)
    now = start
    while (observed < target) & (stop == 0) & (now - start < timeout_ns):
        observed = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
        stop = tl.atomic_add(abort, 0, sem="relaxed", scope="sys")
        now = program_clock(clock_slot, CLOCK)
    return observed >= target


if hasattr(tl, "atomic_load"):  # triton >= 3.9
    @triton.jit
    def aborted(abort):
        """Whether a worker (or the host) stopped the run: the abort word, read at system scope."""
        return tl.atomic_load(abort, sem="relaxed", scope="sys") != 0  # a load: no read-modify-write on AMD
else:
    @triton.jit
    def aborted(abort):
        """Whether a worker (or the host) stopped the run: the abort word, read at system scope."""
        return tl.atomic_add(abort, 0, sem="relaxed", scope="sys") != 0


POLL_SLICE_NS = tl.constexpr(20_000)  # one poll's budget: the abort word and the timeout are read between


if hasattr(tl, "atomic_poll"):  # triton >= 3.9
    @triton.jit
    def wait_polled(counter, target, abort, timeout_ns, clock_slot, CLOCK: tl.constexpr):
        """Poll until ``*counter == target`` (an event's count stops at its target within a run), another
        worker aborts the run, or ``timeout_ns`` passes; whether the target was reached."""
        reached = tl.atomic_poll(counter, target, sem="acquire", scope="sys", timeout_ns=POLL_SLICE_NS)
        if reached == 0:  # a task that waits at all: from here on, once per slice
            program_clock(clock_slot, CLOCK)
            start = program_clock(clock_slot, CLOCK)
            now = start
            stop = tl.full((), 0, tl.int64)
            while (reached == 0) & (stop == 0) & (now - start < timeout_ns):
                stop = tl.atomic_load(abort, sem="relaxed", scope="sys")  # a load: no read-modify-write on AMD
                reached = tl.atomic_poll(counter, target, sem="acquire", scope="sys", timeout_ns=POLL_SLICE_NS)
                now = program_clock(clock_slot, CLOCK)
        return reached != 0


PROTOCOLS = {"poll": "wait_polled", "spin": "wait_spinning"}  # protocol -> its wait


def protocol(chosen: str | None = None) -> str:
    """``chosen``, else ``MEGAKERNEL_PROTOCOL``, else "poll" where Triton has ``tl.atomic_poll``, else
    "spin"; one this Triton cannot build is a ``BackendError``."""
    chosen = chosen or os.environ.get("MEGAKERNEL_PROTOCOL") or ("poll" if hasattr(tl, "atomic_poll") else "spin")
    if chosen not in PROTOCOLS or (chosen == "poll" and not hasattr(tl, "atomic_poll")):
        raise BackendError(f"wait/signal protocol {chosen!r}: expected 'spin'"
                           + (" or 'poll'" if hasattr(tl, "atomic_poll") else f" (triton {triton.__version__} has no "
                              f"tl.atomic_poll for 'poll')"))
    return chosen


@triton.jit
def report_stall(status, abort, task, event, observed, target):
    """Write this worker's status record and tell every other worker to stop."""
    stop = tl.atomic_add(abort, 0, sem="relaxed", scope="sys")
    state = tl.where(stop != 0, STOPPED, TIMED_OUT)
    tl.store(status + TASK, task)
    tl.store(status + EVENT, event)
    tl.store(status + OBSERVED, observed)
    tl.store(status + EXPECTED, target)
    tl.store(status + STATE, state)
    tl.atomic_xchg(abort, 1, sem="release", scope="sys")


@triton.jit
def record_fault(status, kind, value, bound):
    """Note in the worker's status record that the running task met data it cannot use (``layout``:
    INDEX or NOT_FINITE, with a value and a bound): the first fault of a step is kept, with the task
    (its queue position: the tasks the worker finished before it) and the step's epoch (FAULT; a later
    step's fault overwrites an earlier one's); the host raises after the run."""
    epoch = tl.load(status + EPOCH)
    if tl.load(status + FAULT) < epoch:
        tl.store(status + FAULT_KIND, kind)
        tl.store(status + FAULT_VALUE, value)
        tl.store(status + FAULT_BOUND, bound)
        tl.store(status + FAULT_AT, tl.load(status + DONE))
        tl.store(status + FAULT, epoch)


@triton.jit
def checked_index(status, index, bound):
    """``index`` clamped into [0, bound): a data-dependent index (a token id, a position) never leaves
    its buffer; one out of range is recorded (``record_fault``, INDEX)."""
    if (index < 0) | (index >= bound):
        record_fault(status, INDEX, index, bound)
    return tl.minimum(tl.maximum(index, 0), bound - 1)


NO_SEQUENCE = tl.constexpr(-1)  # the position of a batch row that holds no sequence (a free slot)


@triton.jit
def row_position(status, pos, bound):
    """A batch row's position, read at heap pointer ``pos``: NO_SEQUENCE for a row that holds no sequence
    (its tiles do no work), else ``checked_index`` into [0, bound)."""
    position = tl.load(pos)
    checked = checked_index(status, tl.where(position == NO_SEQUENCE, 0, position), bound)
    return tl.where(position == NO_SEQUENCE, NO_SEQUENCE, checked)


@triton.jit
def add_to_event(bases, rank, dst, events_off, event, increment, SCOPED: tl.constexpr, SEM: tl.constexpr):
    """Add ``increment`` to ``event`` on rank ``dst`` (this rank or a peer whose heap is mapped) with semantics
    ``SEM``: with ``SCOPED`` at gpu scope when ``dst`` is this rank (the data and the event stayed on this
    GPU), else (and always without) at system scope."""
    counter = peer_ptr(bases, dst, events_off + event * 8, tl.int64)
    if SCOPED and dst == rank:
        tl.atomic_add(counter, increment, sem=SEM, scope="gpu")
    else:
        tl.atomic_add(counter, increment, sem=SEM, scope="sys")


@triton.jit
def signal_event(bases, rank, dst, events_off, event, increment, SCOPED: tl.constexpr, SEM: tl.constexpr,
                 NETWORK_SIGNAL: tl.constexpr):
    """``add_to_event``; with a network transport (``NETWORK_SIGNAL``: ``shmem.signal``), through it when
    ``dst`` is a rank of another node (its base 0: its heap is not mapped here)."""
    if NETWORK_SIGNAL is not None:
        if tl.load(bases + dst) == 0:
            NETWORK_SIGNAL(tl.load(bases + rank), events_off + event * 8, increment, dst)
        else:
            add_to_event(bases, rank, dst, events_off, event, increment, SCOPED, SEM)
    else:
        add_to_event(bases, rank, dst, events_off, event, increment, SCOPED, SEM)


@triton.jit
def signal_all(bases, rank, signals, first, count, events_off, FENCE: tl.constexpr, SCOPED: tl.constexpr,
               RELAXED_ADDS: tl.constexpr, NETWORK_SIGNAL: tl.constexpr):
    """Send a task's ``count`` signals from signal ``first`` on, after its tile's stores (and a barrier).
    With ``RELAXED_ADDS``, one release fence covers them all (at system scope if one goes to a peer),
    then relaxed adds; without, every add releases."""
    if RELAXED_ADDS and count > 0:
        remote = 0
        for s in range(first, first + count):
            remote |= (tl.load(signals + s * SIGNAL_WORDS + SIGNAL_RANK) != rank).to(tl.int32)
        FENCE(remote)
    for s in range(first, first + count):
        signal = signals + s * SIGNAL_WORDS
        signal_event(bases, rank, tl.load(signal + SIGNAL_RANK), events_off, tl.load(signal + SIGNAL_EVENT),
                     tl.load(signal + SIGNAL_INCREMENT), SCOPED, "relaxed" if RELAXED_ADDS else "release",
                     NETWORK_SIGNAL)


# The task row and signal layouts (``layout``), as constexprs for the kernel.
(ROW_OPCODE, ROW_WAIT_EVENT, ROW_FAN_IN, ROW_CARRY_EVENT, ROW_CARRY_FAN_IN, ROW_SIGNAL_START, ROW_SIGNAL_COUNT, ROW_GUARD,
 ROW_ARG0) = (tl.constexpr(i) for i in (layout.OPCODE, layout.WAIT_EVENT, layout.FAN_IN, layout.CARRY_EVENT,
                                       layout.CARRY_FAN_IN, layout.SIGNAL_START, layout.SIGNAL_COUNT, layout.GUARD,
                                       layout.ARG0))
SIGNAL_WORDS, SIGNAL_RANK, SIGNAL_EVENT, SIGNAL_INCREMENT = (
    tl.constexpr(i) for i in (layout.SIGNAL_WORDS, layout.SIGNAL_RANK, layout.SIGNAL_EVENT, layout.SIGNAL_INCREMENT))


@triton.jit
def header_word(row, word, more, default):
    """Word ``word`` of a task row (a count or an index), as int32: the next task's header stays live
    across the current tile, and int32 words take half the registers of int64 ones."""
    return tl.load(row + word, mask=more, other=default).to(tl.int32)


@triton.jit
def task_header(tasks, queue, i, last, ROW: tl.constexpr):
    """Queue entry ``i``'s task and the words of its row the loop needs: (task, wait event, fan-in,
    carried wait's event, its fan-in, opcode, first signal, signal count, guard); an empty header (no
    wait, no signal) past ``last``.

    The tables do not change during a run, so the loop loads the next task's header before running
    the current one: its latency hides behind the current task, and it is not re-fetched after the
    next acquire (which invalidates the L1 cache).
    """
    more = i < last
    task = tl.load(queue + i, mask=more, other=0).to(tl.int32)
    row = tasks + task * ROW
    return (task, header_word(row, ROW_WAIT_EVENT, more, -1), header_word(row, ROW_FAN_IN, more, 0),
            header_word(row, ROW_CARRY_EVENT, more, -1), header_word(row, ROW_CARRY_FAN_IN, more, 0),
            header_word(row, ROW_OPCODE, more, 0), header_word(row, ROW_SIGNAL_START, more, 0),
            header_word(row, ROW_SIGNAL_COUNT, more, 0),
            tl.load(row + ROW_GUARD, mask=more, other=-1))  # a heap offset: int64


@triton.jit
def skipped(base, guard):
    """Whether a task skips its tile this step: its ``guard`` (a heap offset; -1: none) holds NO_SEQUENCE.
    Read after the task's waits: the guard's writers are among the producers it waited for. (A comm-area
    offset, rewritten, may be negative; never -1: areas are aligned.)"""
    skip = 0
    if guard != -1:
        skip = (tl.load(heap_ptr(base, guard, tl.int64)) == NO_SEQUENCE).to(tl.int32)
    return skip


@triton.jit
def wait_for(events, event, target, abort, status, task, timeout_ns, WAIT: tl.constexpr, CLOCK: tl.constexpr):
    """Wait until ``event`` counts ``target`` (no wait for a target of 0); whether it did. A wait that times
    out writes this worker's status record and stops every worker of the rank."""
    reached = 1
    if (event >= 0) & (target > 0):
        if not WAIT(events + event, target, abort, timeout_ns, status + CLOCK_SLOT, CLOCK):
            observed = tl.atomic_add(events + event, 0, sem="relaxed", scope="sys")  # for the report alone
            report_stall(status, abort, task, event, observed, target)
            reached = 0
    return reached


@triton.jit
def persistent_loop(bases_addr, rank, worker, steps, timeout_ns, tasks_off, signals_off, queue_off, index_off,
                    events_off, status_off, trace_off, ROW: tl.constexpr, RUN_TILE: tl.constexpr,
                    CLOCK: tl.constexpr, FENCE: tl.constexpr, WAIT: tl.constexpr, SCOPED_SIGNALS: tl.constexpr,
                    RELAXED_ADDS: tl.constexpr, TRACE: tl.constexpr, NETWORK_PUT: tl.constexpr = None,
                    NETWORK_SIGNAL: tl.constexpr = None):
    """One worker's whole launch: ``steps`` steps (epochs ``epoch``, ``epoch + 1``, ...), each running the
    worker's queue: for each task, wait, run the tile (unless its guard skips it this step, ``skipped``),
    signal.

    A launch starts at the step after the last one the worker's status record holds (EPOCH; 0 after
    the host clears the records), so the host passes no epoch: every launch of a kernel with the same
    ``steps`` has the same arguments, and a CUDA graph may replay one.

    A task waits for its event to count ``epoch * fan_in`` (its producers of this step) and for its
    carried event to count ``(epoch - 1) * carry_fan_in`` (those of the previous step, which the host
    no longer separates from this one). ``WAIT``, ``SCOPED_SIGNALS`` and ``RELAXED_ADDS`` are the
    protocol's (see the module docstring; the interpreter keeps releasing adds, ``interpreter_fence``).

    ``NETWORK_PUT`` and ``NETWORK_SIGNAL`` are a network transport's device calls (``shmem``; None: every peer's
    heap is mapped, or shadowed by the host's transport, ``transport``), handed to the tiles that take them.

    ``RUN_TILE(opcode, base, bases, status, args, NETWORK_PUT)`` dispatches to the tile functions (generated per graph). A wait
    that times out writes this worker's status record and stops every worker of the rank; a launch
    that finds the rank stopped (a stall whose records the host has not read: replays) runs nothing, and
    every step starts by reading the abort word: a host that stops a launch of tasks that never wait (or
    of 2^32 steps) is heard within a step.
    A task whose tile met an index out of range raises the rank's FAULTED word before its signals,
    so the host of any rank its results reach finds it. With
    ``TRACE``, each task records when it started waiting, started running and finished (its stores
    done, just before its signals) at ``trace[task * TRACE_WORDS]``, the last step's; without it no
    clock is read and nothing is stored.

    Registers: both loops hoist nothing (``disable_licm``). Each tile's loop-invariant work (thread-index
    arithmetic, the shared-memory addresses of its layout conversions) would otherwise move out of the
    persistent loop and stay live across every other tile, and spill. The queue is walked by a for
    loop: over a marked while loop (``tl.condition``) the compiler still hoisted, and spilled ten times as
    much (bench/RESULTS.md). After a stall the remaining iterations only load headers.
    """
    bases = bases_addr.to(tl.pointer_type(tl.int64))
    base = tl.load(bases + rank)
    tasks = heap_ptr(base, tasks_off, tl.int64)
    signals = heap_ptr(base, signals_off, tl.int64)
    queue = heap_ptr(base, queue_off, tl.int64)
    events = heap_ptr(base, events_off, tl.int64)
    abort = heap_ptr(base, status_off, tl.int64)
    status = abort + STATUS_WORDS * (worker + 1)
    epoch = tl.load(status + EPOCH) + 1
    first = tl.load(heap_ptr(base, index_off, tl.int64) + worker).to(tl.int32)  # int32: live across every tile
    last = tl.load(heap_ptr(base, index_off, tl.int64) + worker + 1).to(tl.int32)
    running = (tl.load(abort) == 0).to(tl.int32)  # a stall the host has not read yet: keep its records
    step = tl.full((), 0, tl.int64)
    while (step < steps) & (running == 1):  # a stopped run leaves at once, however many steps remain
        running = 1 - aborted(abort).to(tl.int32)  # a host that stops the run is heard, even where no task waits
        if running == 1:
            now = epoch + step
            tl.store(status + DONE, 0)
            tl.store(status + EPOCH, now)  # DONE counts tasks of this step; peers' reports read both
            task, event, fan_in, carry, carry_fan_in, opcode, first_signal, signal_count, guard = task_header(
                tasks, queue, first, last, ROW)
            for i in tl.range(first, last, disable_licm=True):
                next_header = task_header(tasks, queue, i + 1, last, ROW)
                if running == 1:
                    row = tasks + task * ROW
                    if TRACE:
                        stamp = heap_ptr(base, trace_off, tl.int64) + task * TRACE_WORDS
                        tl.store(stamp, CLOCK())
                    running = wait_for(events, event, now * fan_in, abort, status, task, timeout_ns, WAIT, CLOCK)
                    if running == 1:
                        running = wait_for(events, carry, (now - 1) * carry_fan_in, abort, status, task, timeout_ns,
                                           WAIT, CLOCK)
                    if running == 1:
                        tl.debug_barrier()
                        if TRACE:
                            tl.store(stamp + 1, CLOCK())
                        if skipped(base, guard) == 0:
                            RUN_TILE(opcode, base, bases, status, row + ROW_ARG0, NETWORK_PUT)
                        tl.debug_barrier()
                        if tl.load(status + FAULT) == now:  # a tile faulted: tell the host
                            tl.atomic_max(abort + FAULTED, now, sem="relaxed", scope="gpu")  # before the signals
                        if TRACE:  # before the signals: a consumer may start as soon as they are sent
                            tl.store(stamp + 2, CLOCK())
                        signal_all(bases, rank, signals, first_signal, signal_count, events_off, FENCE,
                                   SCOPED_SIGNALS, RELAXED_ADDS, NETWORK_SIGNAL)
                        tl.store(status + DONE, i - first + 1)
                task, event, fan_in, carry, carry_fan_in, opcode, first_signal, signal_count, guard = next_header
        step += 1
