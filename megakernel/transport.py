"""Peers on other nodes: nothing of their heaps is mapped here; a progress agent carries what this rank's
tiles put and signal there, over torch.distributed's gloo point-to-point.

A tile writes a peer of another node as it writes one of its node: stores at ``bases[peer] + o``, an add on
the peer's event. For such a peer ``bases[peer]`` is a *shadow* of its comm area in this rank's own heap
(``heap.Heaps.shadows``), so the stores and adds land here, as NVSHMEM's proxy transport has a GPU post
into a local channel that a host thread drains. The graph is static, so everything that crosses from rank
``r`` to an off-node peer ``p`` is known when the kernel is built: a ``Channel`` of messages per step, one
per event of ``p`` that ``r``'s tasks raise, each with the count they add to it in a step and the regions of
``p``'s comm area they wrote first (each remote write goes with the first of its task's events in the
channel's order). The agent sends message ``i`` of step ``e`` once the shadow's count of its event reaches
``e x count`` (read with acquire: the writers' adds released their stores), with its regions' bytes as the
shadow holds them; the receiving agent stores them at the same offsets of its comm area, then adds the count
to its event (a release): the consumers see the bytes when they see the count, as from a peer of the node.

Why nothing is lost, stale or out of order:
- A channel's messages go in the order of their last producer's row in the sender's tables, the global
  order (``scheduler``), and step ``e``'s before step ``e + 1``'s: a message waits only for tasks that come
  before its producers, never for a later message of the channel, so the progress guarantee holds.
- A region's bytes stay as written until they are sent: a later write into it by the sender (next step's
  put, another op's) waits for the receiver to have read it (a credit, ``scheduler.remote``), which the
  receiver does only after the message.
- A shadow count only grows; signals of the next step that need no credit may run ahead of the agent,
  which only makes their message ready sooner.

A gloo receive cannot be cancelled: each receiving thread always has the next message's receive posted,
and closing sends every peer what is ready, then a message of that size marked ``CLOSING``. A peer that
dies breaks its connections: a rank that receives from it (or sends to it) records the failure and raises
``BackendError`` naming the peer. The loss is news for every rank: the finder writes it (``layout.LOST``,
``LOST_BY``) into its own header and those of its node's ranks, with their abort words (their workers stop
at their next wait), and every agent that finds it in its header tells its peers of other nodes with a
message of the size they wait for marked ``LOSS`` (ending the channel, as ``CLOSING`` does), whose agents
do the same; each rank then raises ``BackendError`` naming the lost rank and the rank that found it.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from . import atomics
from .bootstrap import Topology
from .errors import BackendError, GraphError
from .layout import ABORT, COMM, LOST, LOST_BY, SIGNAL_COUNT, SIGNAL_START, SIGNAL_WORDS

NAME = "gloo"            # what ``Megakernel.links`` calls a peer reached through this transport
MESSAGE_HEADER_WORDS = 2  # a message's step (its epoch) and index in the channel
CLOSING = -1             # a header step: the sender is closing, nothing follows
LOSS = -2                # a header step: a rank is gone (the index: finder << 32 | lost rank), nothing follows
RECEIVE_TIMEOUT = timedelta(days=365)  # a receive waits for the next step however long the host idles
PENDING_SENDS = 64       # sends in flight before the agent waits for the oldest
POLL_SECONDS = (20e-6, 1e-3)  # the agent's pause when nothing was ready: first, and at most (doubling)


@dataclass(frozen=True)
class Message:
    """What one step's tasks of the sender raise on one event of the receiver, and what they wrote first."""

    event: int                             # of the receiver
    count: int                             # what the sender's tasks add to it in a step
    regions: tuple[tuple[int, int], ...]   # (comm-area byte offset, bytes) written before, in sending order

    @property
    def nbytes(self) -> int:
        return 8 * MESSAGE_HEADER_WORDS + sum(size for _, size in self.regions)


@dataclass(frozen=True)
class Channel:
    """Everything rank ``src`` sends rank ``dst`` (of another node) in a step, in order."""

    src: int
    dst: int
    messages: tuple[Message, ...]

    @property
    def step_bytes(self) -> int:
        """Bytes on the network per step, headers included."""
        return sum(m.nbytes for m in self.messages)


def region_bytes(buffer, region) -> list[tuple[int, int]]:
    """The comm-area byte ranges (offset, size) of ``region`` = (buffer, row0, row1, col0, col1) of
    ``buffer`` (a graph's ``Buffer``), merged where rows are adjacent."""
    _, row0, row1, col0, col1 = region
    size = buffer.dtype.itemsize
    first = buffer.offset - COMM + (row0 * buffer.cols + col0) * size
    if row1 <= row0 or col1 <= col0:
        return []
    if col0 == 0 and col1 == buffer.cols:
        return [(first, (row1 - row0) * buffer.cols * size)]
    return [(first + r * buffer.cols * size, (col1 - col0) * size) for r in range(row1 - row0)]


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` with each one that starts where the previous ends joined to it (order kept)."""
    out: list[list[int]] = []
    for offset, size in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1][1] += size
        else:
            out.append([offset, size])
    return tuple((offset, size) for offset, size in out)


def outgoing_channels(tables, graph, topology: Topology) -> list[Channel]:
    """The channels from ``tables.rank`` to each peer on another node: from its tables' signals (rows in
    the global order) and the remote writes of the graph's tasks (``graph.tasks.remote``)."""
    me = tables.rank
    far = [peer for peer in range(tables.world_size) if not topology.same_node(me, peer)]
    counts: dict[int, dict[int, int]] = {peer: {} for peer in far}     # peer -> event -> count a step
    last: dict[int, dict[int, int]] = {peer: {} for peer in far}       # peer -> event -> its last row
    raised: dict[int, dict[int, list[int]]] = {peer: {} for peer in far}  # peer -> row -> its events
    for row, (start, count) in enumerate(tables.rows[:, [SIGNAL_START, SIGNAL_COUNT]].tolist()):
        for rank, event, increment in tables.signals[start:start + count, :SIGNAL_WORDS].tolist():
            if rank in counts:
                counts[rank][event] = counts[rank].get(event, 0) + increment
                last[rank][event] = row
                raised[rank].setdefault(row, []).append(event)
    order = {peer: sorted(counts[peer], key=lambda e, peer=peer: (last[peer][e], e)) for peer in far}
    index = {peer: {event: i for i, event in enumerate(order[peer])} for peer in far}
    regions: dict[int, list[list[tuple[int, int]]]] = {peer: [[] for _ in order[peer]] for peer in far}
    for row, tid in enumerate(tables.task_ids.tolist()):
        for rank, region in graph.tasks.remote[tid]:
            if rank not in counts:
                continue
            if row not in raised[rank]:
                raise GraphError(f"{graph.describe_task(tid)} writes rank {rank} (another node) but raises none of its "
                                 f"events: nothing would carry its bytes")
            first = min(index[rank][e] for e in raised[rank][row])
            regions[rank][first] += region_bytes(graph.buffers[region[0]], region)
    return [Channel(me, peer, tuple(Message(e, counts[peer][e], _merged(r)) for e, r in zip(order[peer], regions[peer])))
            for peer in far]


class Transport:
    """This rank's progress agent: a thread sending its channels' messages as their counts are reached, and
    a thread per incoming channel receiving them into the comm area, over a gloo group of their own.

    ``comm``: this rank's comm area (uint8, as this process maps it); ``shadows[peer]``: the shadow of an
    off-node peer's; ``events``: the comm-area offset of the event counters; ``headers``: the header record
    (``layout``: ABORT .. LOST_BY) of this rank and of each rank of its node, as this process maps them.
    Made by every rank at once (the group is collective)."""

    name = NAME

    def __init__(self, rank: int, outgoing: list[Channel], incoming: list[Channel], comm: torch.Tensor,
                 shadows: dict[int, torch.Tensor], events: int, headers: dict[int, torch.Tensor]):
        self.rank, self.outgoing, self.incoming = rank, outgoing, incoming
        self.comm, self.shadows, self.events, self.headers = comm, shadows, events, headers
        self.failures: list[str] = []
        self.received: dict[int, tuple[int, int]] = {c.src: (0, -1) for c in incoming}  # src -> last (step, index)
        self.sent: dict[int, tuple[int, int]] = {c.dst: (1, 0) for c in outgoing}       # dst -> next (step, index)
        self._dead: set[int] = set()  # peers lost: unreachable
        self._quiet: set[int] = set()  # peers sent nothing more: lost, or told of a loss (their receive ended)
        self.closed: set[int] = set()  # peers that closed their kernel: they send nothing more
        self._closing = threading.Event()
        self._told = threading.Event()  # news of a loss this rank knows has gone to every peer still listening
        self._group = dist.new_group(backend="gloo", timeout=RECEIVE_TIMEOUT)
        self._threads = [threading.Thread(target=self._send_loop, name=f"megakernel-transport-{rank}-send", daemon=True)]
        self._threads += [threading.Thread(target=self._receive_loop, args=(c,), daemon=True,
                                           name=f"megakernel-transport-{rank}-from-{c.src}") for c in incoming]
        for thread in self._threads:
            thread.start()

    # -- sending ------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            self._send_all()
        except Exception as error:  # not a peer's loss (``_lose``): this agent's own failure
            self.failures.append(f"rank {self.rank}'s transport stopped sending: {error!r}")
            self.headers[self.rank][ABORT] = 1

    def _send_all(self) -> None:
        pending: deque = deque()  # (peer, work, buffer) of the sends in flight, oldest first
        pause = POLL_SECONDS[0]
        while not self._closing.is_set():
            sent = self._send_ready(pending) | self._tell_loss(pending)
            while len(pending) > PENDING_SENDS:
                self._finish(pending.popleft())
            # a spinning agent takes the cores the workers need (measured: a hop 1.6x slower when it never backs off)
            pause = POLL_SECONDS[0] if sent else min(2 * pause, POLL_SECONDS[1])
            if not sent:
                time.sleep(pause)
        self._send_ready(pending)  # what the last launch released (a kernel closed without meeting its peers)
        for channel in self.outgoing:
            if channel.dst not in self._quiet:
                self._notice(channel, CLOSING, 0, pending)
        while pending:
            self._finish(pending.popleft())

    def _tell_loss(self, pending: deque) -> bool:
        """Once this rank's header names a lost rank (found here, by a rank of this node, or told by a peer),
        tell every peer of another node still listening; whether one was told."""
        header = self.headers[self.rank]
        lost = int(header[LOST])
        if not lost:
            return False
        told = False
        for channel in self.outgoing:
            if channel.dst not in self._quiet:
                self._notice(channel, LOSS, int(header[LOST_BY]) << 32 | lost - 1, pending)
                self._quiet.add(channel.dst)
                told = True
        while told and pending:  # delivered before the host may report it and end the process
            self._finish(pending.popleft())
        self._told.set()
        return told

    def _send_ready(self, pending: deque) -> bool:
        """Send every message whose count is reached, channel by channel; whether one went."""
        sent = False
        for channel in self.outgoing:
            address = self.shadows[channel.dst].data_ptr() + self.events
            while channel.dst not in self._quiet:
                step, i = self.sent[channel.dst]
                message = channel.messages[i]
                # acquire: the bytes the writers released with their adds are read after it
                if atomics.load_acquire(atomics.addresses(address + 8 * message.event)) < step * message.count:
                    break
                self._send(channel, step, i, pending)
                self.sent[channel.dst] = (step + 1, 0) if i + 1 == len(channel.messages) else (step, i + 1)
                sent = True
        return sent

    def _send(self, channel: Channel, step: int, index: int, pending: deque) -> None:
        message = channel.messages[index]
        buffer = torch.empty(message.nbytes, dtype=torch.uint8)
        buffer[:8 * MESSAGE_HEADER_WORDS].view(torch.int64).copy_(torch.tensor([step, index]))
        at = 8 * MESSAGE_HEADER_WORDS
        shadow = self.shadows[channel.dst]
        for offset, size in message.regions:
            buffer[at:at + size].copy_(shadow[offset:offset + size])
            at += size
        self._post(channel.dst, buffer, pending)

    def _notice(self, channel: Channel, kind: int, value: int, pending: deque) -> None:
        """A message marked ``kind`` (CLOSING, LOSS) with ``value``, of the size of the message the receiver
        has its receive posted for (the channel's next)."""
        buffer = torch.zeros(channel.messages[self.sent[channel.dst][1]].nbytes, dtype=torch.uint8)
        buffer[:8 * MESSAGE_HEADER_WORDS].view(torch.int64).copy_(torch.tensor([kind, value]))
        self._post(channel.dst, buffer, pending)

    def _post(self, peer: int, buffer: torch.Tensor, pending: deque) -> None:
        try:
            pending.append((peer, dist.isend(buffer, peer, group=self._group), buffer))
        except Exception as error:
            self._lose(peer, f"sending to it: {error}")

    def _finish(self, entry: tuple) -> None:
        peer, work, _ = entry
        try:
            work.wait()
        except Exception as error:
            self._lose(peer, f"sending to it: {error}")

    # -- receiving ----------------------------------------------------------------------------------
    def _receive_loop(self, channel: Channel) -> None:
        step, i = 1, 0
        counters = self.comm.data_ptr() + self.events
        try:
            while True:
                message = channel.messages[i]
                buffer = torch.empty(message.nbytes, dtype=torch.uint8)
                dist.recv(buffer, channel.src, group=self._group)
                got_step, got_index = buffer[:8 * MESSAGE_HEADER_WORDS].view(torch.int64).tolist()
                if got_step == CLOSING:
                    self.closed.add(channel.src)
                    return
                if got_step == LOSS:  # the sender goes quiet too
                    self._learn(got_index & 0xFFFFFFFF, got_index >> 32)
                    return
                if (got_step, got_index) != (step, i):
                    raise BackendError(f"rank {channel.src} sent message {got_index} of step {got_step} where "
                                       f"message {i} of step {step} was due")
                at = 8 * MESSAGE_HEADER_WORDS
                for offset, size in message.regions:
                    self.comm[offset:offset + size].copy_(buffer[at:at + size])
                    at += size
                atomics.add(atomics.addresses(counters + 8 * message.event), np.array([message.count], dtype=np.int64))
                self.received[channel.src] = (step, i)
                step, i = (step + 1, 0) if i + 1 == len(channel.messages) else (step, i + 1)
        except Exception as error:
            if not self._closing.is_set():
                self._lose(channel.src, f"receiving from it: {error}")

    def _lose(self, peer: int, why: str) -> None:
        """Peer ``peer`` is gone: nothing more goes to it, and every rank learns it (``_learn``)."""
        if peer not in self._dead:
            self._dead.add(peer)
            self._quiet.add(peer)
            self.failures.append(f"rank {self.rank}'s transport: rank {peer} (another node) is unreachable, {why}")
        self._learn(peer, self.rank)

    def _learn(self, lost: int, finder: int) -> None:
        """Rank ``lost`` is gone, as rank ``finder``'s transport found: written into the header of this rank
        and of each rank of its node that knows of no loss yet, with its abort word (their workers stop at
        their next wait, their agents tell their peers: ``_tell_loss``)."""
        for header in self.headers.values():
            if not header[LOST]:
                header[LOST_BY] = finder
                header[LOST] = lost + 1
            header[ABORT] = 1

    # -- what the host asks -------------------------------------------------------------------------
    def wait_told(self, timeout: float) -> None:
        """Wait, ``timeout`` seconds at most, until the news of a loss this rank knows has gone to its peers of
        other nodes (before the host reports it: the process may end then)."""
        self._told.wait(timeout)

    def arrival(self, src: int, event: int, step: int) -> str:
        """Whether the message of rank ``src`` that raises ``event`` in ``step`` has arrived (for hang reports)."""
        channel = next((c for c in self.incoming if c.src == src), None)
        if channel is None:
            return "it sends nothing here"
        index = next((i for i, m in enumerate(channel.messages) if m.event == event), None)
        got = self.received[src]
        if index is None:
            return "it raises this event through no message"
        arrived = (step, index) <= got
        gone = " and it has closed its kernel" if src in self.closed else (
            " and it is unreachable" if src in self._dead else "")
        return (f"its message {index} of step {step} {'arrived' if arrived else 'has not arrived'} "
                f"(the last from rank {src}: message {got[1]} of step {got[0]}{gone})")

    def step_bytes(self) -> int:
        """Bytes this rank sends over the network per step, headers included."""
        return sum(c.step_bytes for c in self.outgoing)

    def step_messages(self) -> int:
        return sum(len(c.messages) for c in self.outgoing)

    def close(self, timeout: float) -> None:
        """Stop: tell every peer, and wait up to ``timeout`` for their word and the threads (collective:
        every rank closes its kernel)."""
        self._closing.set()
        if not dist.is_initialized():  # at exit after the process group went: nothing can be sent
            return
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if not any(thread.is_alive() for thread in self._threads):
            dist.destroy_process_group(self._group)
        # else a peer that never closed: its receive stays posted in a daemon thread, the group with it
