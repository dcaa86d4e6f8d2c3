"""The cores a job of worker processes has to itself, and how its queues go to its workers.

Another program that keeps one of the job's cores busy takes that core's turns from the worker on it, and
every other worker then waits for that one at its next dependency: beside a busy loop on 2 cores a step of
2 workers takes ~2.7x its time alone. The torch backend looks before each launch (``CoreShare``): the
machine's busy CPU time on the job's cores (``/proc/stat``) less the job's own (its processes'
``/proc/<pid>/stat``), over the time since the last look; with fewer cores free than workers it deals the
queues out over as many workers as there are free cores (``plan``). A worker then runs its queues' tasks
in the global order (task ids), so every wait's producer ran before it or runs on another worker: no
deadlock, and the same results.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

WINDOW_S = 0.1  # the shortest time between two looks: the counters move in ticks of 10 ms


def plan(workers: int, free: float) -> tuple[tuple[int, ...], ...]:
    """Each worker's queues for a launch: its own, or with fewer cores ``free`` than ``workers``, queue q on
    worker q % n for n = the free cores, rounded (at least one); the other workers run none."""
    active = max(1, min(workers, int(free + 0.5)))
    return tuple(tuple(range(w, workers, active)) if w < active else () for w in range(workers))


@dataclass
class CoreShare:
    """What other programs leave of a job's cores (its affinity), measured between launches."""

    cores: frozenset[int]
    pids: Callable[[], list[int]]  # the job's processes, its host's included
    free: float = field(init=False)
    last: tuple[float, float, float] | None = field(default=None, init=False)  # when, the cores' busy s, the job's s

    def __post_init__(self):
        self.free = float(len(self.cores))

    def look(self) -> float:
        """The cores free for the job: all of them, less what others kept busy since the last look (at least
        WINDOW_S ago; sooner, the last look's answer). Where ``/proc`` cannot say, all of them."""
        now = time.monotonic()
        if self.last is not None and now - self.last[0] < WINDOW_S:
            return self.free
        try:
            busy, ours = self._busy(), self._ours()
        except (OSError, ValueError, IndexError):
            return self.free
        if self.last is not None:
            others = (busy - self.last[1]) - (ours - self.last[2])
            self.free = min(len(self.cores), max(0.0, len(self.cores) - others / (now - self.last[0])))
        self.last = (now, busy, ours)
        return self.free

    def _busy(self) -> float:
        """Seconds the job's cores have run anything (``/proc/stat``: user, nice, system, irq, softirq, steal)."""
        ticks = 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *counts = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cores:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, counts[:8])
                    ticks += user + nice + system + irq + softirq + steal
        return ticks / os.sysconf("SC_CLK_TCK")

    def _ours(self) -> float:
        """Seconds the job's processes have run (user and system; a process gone since counts nothing)."""
        ticks = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")
