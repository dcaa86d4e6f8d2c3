"""What the fourth adversarial pass (issue 37) found in the runtime, as the user met it: unbounded runs,
and interrupts of tasks that never wait. (The sampler's edges are in ``test_sampling``, the engine's in
``test_engine``, the server's in ``test_http`` and ``test_server``.)"""
import os
import signal
import threading
import time

import pytest
import torch

import megakernel as mk
from megakernel.runtime import MAX_STEPS


def counter_graph() -> mk.Graph:
    """One task a step that never waits: y = x + x."""
    g = mk.Graph()
    x = g.input("x", (1, 64), torch.float32)
    g.output("y", g.add(x, x))
    return g


# -- unbounded runs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [MAX_STEPS + 1, 2**63, 2**64, 0, -1, 1.0, True])
def test_steps_past_the_launch_bound_are_refused(steps):
    with mk.Megakernel(counter_graph(), workers=1, backend="torch") as kernel:
        with pytest.raises(mk.GraphError, match=r"steps must be an int in \[1, 2\^32\]"):
            kernel.run({"x": torch.ones(1, 64)}, steps=steps)
        with pytest.raises(mk.GraphError, match=r"steps must be an int in \[1, 2\^32\]"):
            kernel.capture(steps)


def test_steps_that_would_overflow_the_event_counters_are_refused():
    with mk.Megakernel(counter_graph(), workers=1, backend="torch") as kernel:
        x = torch.randn(1, 64)
        kernel.run({"x": x})
        kernel.epoch = 2**63 - 10  # as if it had run that long
        with pytest.raises(mk.GraphError, match="would overflow the event counters"):
            kernel.run(steps=MAX_STEPS)


def test_an_interrupt_stops_tasks_that_never_wait_within_a_step(backend):
    """Ctrl-C during run(steps=2^32) of a graph whose one task never waits: the workers hear the host at
    the next step (not the 10 s kill path) and the kernel stays usable."""
    with mk.Megakernel(counter_graph(), workers=1) as kernel:
        x = torch.randn(1, 64)
        torch.testing.assert_close(kernel.run({"x": x})["y"], 2 * x, rtol=0, atol=0)  # warm
        inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        start = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                kernel.run(steps=MAX_STEPS)
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, inherited)
        assert time.monotonic() - start < 1.0 + kernel.backend.STOP_SECONDS / 2, "the workers were killed"
        assert not kernel.backend.lost_workers
        x = torch.randn(1, 64)
        kernel.poison()
        torch.testing.assert_close(kernel.run({"x": x}, steps=3)["y"], 2 * x, rtol=0, atol=0)
