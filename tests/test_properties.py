"""Random DAGs of every op, on 1-3 workers, both policies: kernel == reference executor == torch (float64)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megakernel as mk

from helpers import assert_close, run_checked

pytestmark = pytest.mark.slow  # random graphs under hypothesis, every policy and worker count


@st.composite
def programs(draw):
    """Row and column counts of the first inputs and a list of op steps over a growing pool of values."""
    rows = draw(st.sampled_from([1, 2, 3, 5, 17]))
    cols = draw(st.sampled_from([8, 40, 96, 130]))
    steps = []
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["add", "mul", "silu_mul", "rms_norm", "linear", "linear", "slice"]))
        steps.append((kind, draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)),
                      draw(st.sampled_from([8, 33, 64, 100])), draw(st.integers(1, 3))))
    return rows, cols, steps


def build(rows, cols, steps, generator):
    g = mk.Graph()
    values = []  # (graph tensor, float64 torch value)

    def new_input(shape, scale=1.0):
        t = g.input(f"in{len(g.inputs)}", shape, torch.float32)
        v = (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).float()
        values_in[t.buffer.name] = v
        return t, v.double()

    values_in = {}
    values.append(new_input((rows, cols)))
    values.append(new_input((rows, cols)))
    for kind, a, b, width, split in steps:
        t, v = values[a % len(values)]
        if kind in ("add", "mul", "silu_mul"):
            same = [p for p in values if p[0].shape == t.shape]
            u, w = same[b % len(same)]
            ref = {"add": v + w, "mul": v * w, "silu_mul": torch.nn.functional.silu(v) * w}[kind]
            values.append((getattr(g, kind)(t, u), ref))
        elif kind == "rms_norm":
            nw, nv = new_input((t.shape[-1],))
            values.append((g.rms_norm(t, nw, 1e-5), nv * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)))
        elif kind == "linear" and t.ndim == 2:
            w, wv = new_input((width, t.shape[1]), scale=t.shape[1] ** -0.5)
            split = min(split, t.shape[1])
            values.append((g.linear(t, w, split_k=split), v @ wv.T))
        elif kind == "slice" and t.ndim == 2 and t.shape[1] > 1:
            c0 = b % (t.shape[1] - 1)
            values.append((t[:, c0:], v[:, c0:]))
    t, v = values[-1]
    values.append((g.add(t, t), v + v))  # at least one task, whatever the steps were
    outputs = values[-3:] if len(values) > 4 else values[-1:]
    for i, (t, v) in enumerate(outputs):
        g.output(f"out{i}", t)
    return g, values_in, {f"out{i}": v for i, (_, v) in enumerate(outputs)}


@pytest.mark.parametrize("policy", ["round_robin", "critical_path"])
@pytest.mark.parametrize("workers", [1, 2, 3])
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs())
def test_random_graphs_agree_with_reference_executor_and_torch(program, workers, policy):
    rows, cols, steps = program
    g, inputs, expected = build(rows, cols, steps, torch.Generator().manual_seed(len(steps) * 31 + cols))
    out = run_checked(g, inputs, workers=workers, policy=policy)
    for name, ref in expected.items():
        assert out[name].shape == ref.shape
        assert_close(out[name], ref, 1e-4, f"{name} of {[s[0] for s in steps]} on {workers} workers, {policy}")
