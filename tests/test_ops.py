"""Every op against torch in float64, at shapes that are and are not multiples of the tiles."""
import pytest
import torch

import megakernel as mk

from conftest import assert_close, random_inputs, run_checked, tolerance


def _rms(x, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("op", ["add", "mul", "silu_mul"])
@pytest.mark.parametrize("shape", [(1, 7), (9, 1000), (3, 1025), (17,)])
def test_elementwise(op, shape):
    g = mk.Graph()
    a, b = g.input("a", shape, torch.float32), g.input("b", shape, torch.float32)
    g.output("y", getattr(g, op)(a, b))
    inputs = random_inputs(g, seed=len(shape) + shape[0])
    out = run_checked(g, inputs)["y"]
    x, y = inputs["a"].double(), inputs["b"].double()
    expected = {"add": x + y, "mul": x * y, "silu_mul": torch.nn.functional.silu(x) * y}[op]
    assert out.shape == expected.shape
    assert_close(out, expected, tolerance(torch.float32), op)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_bfloat16_results_are_rounded_to_nearest_like_torch(op):
    """One rounding of the float32 result, to nearest even: bitwise what torch computes (the interpreter
    alone would truncate)."""
    g = mk.Graph()
    a, b = g.input("a", (4, 300), torch.bfloat16), g.input("b", (4, 300), torch.bfloat16)
    g.output("y", getattr(g, op)(a, b))
    inputs = random_inputs(g, seed=9)
    out = run_checked(g, inputs)["y"]
    assert torch.equal(out, getattr(torch, op)(inputs["a"], inputs["b"]))


def test_elementwise_on_views_writes_only_the_view():
    g = mk.Graph()
    a = g.input("a", (5, 300), torch.float32)
    b = g.input("b", (4, 40), torch.float32)
    y = g.add(a[1:, 250:290], b)
    g.output("y", y)
    g.output("row", g.mul(a[2], a[3]))
    inputs = random_inputs(g, seed=3)
    out = run_checked(g, inputs)
    assert_close(out["y"], inputs["a"][1:, 250:290].double() + inputs["b"].double(), 1e-6, "view add")
    assert out["row"].shape == (300,)
    assert_close(out["row"], inputs["a"][2].double() * inputs["a"][3].double(), 1e-6, "row mul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (6, 1500), (100,)])
def test_rms_norm(shape, dtype):
    g = mk.Graph()
    x = g.input("x", shape, dtype)
    w = g.input("w", (shape[-1],), dtype)
    g.output("y", g.rms_norm(x, w, 1e-5))
    inputs = random_inputs(g, seed=shape[-1])
    out = run_checked(g, inputs)["y"]
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, _rms(inputs["x"], inputs["w"], 1e-5), tolerance(dtype), "rms_norm")


@pytest.mark.parametrize("m,k,n,split_k", [
    (1, 64, 32, 1), (1, 300, 33, 1), (3, 100, 70, 2), (2, 129, 65, 3),  # GEMV tiles
    (16, 40, 50, 1), (20, 96, 40, 2), (33, 65, 17, 3),                  # tl.dot tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(m, k, n, split_k, dtype):
    g = mk.Graph()
    x = g.input("x", (m, k), dtype)
    w = g.input("w", (n, k), dtype)
    g.output("y", g.linear(x, w, split_k=split_k))
    inputs = random_inputs(g, seed=m * 1000 + k)
    out = run_checked(g, inputs, workers=3)["y"]
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, inputs["x"].double() @ inputs["w"].double().T, tolerance(dtype), "linear")


def test_linear_of_slices():
    g = mk.Graph()
    h = g.input("h", (2, 200), torch.float32)
    w = g.input("w", (90, 200), torch.float32)
    y = g.linear(h[:, :150], w[10:, 50:])
    g.output("y", y)
    inputs = random_inputs(g, seed=11)
    out = run_checked(g, inputs)["y"]
    assert_close(out, inputs["h"][:, :150].double() @ inputs["w"][10:, 50:].double().T, 1e-5, "sliced linear")


def test_rms_norm_with_weight_of_another_dtype():
    g = mk.Graph()
    x = g.input("x", (1, 64), torch.float32)
    w = g.input("w", (64,), torch.bfloat16)
    y = g.rms_norm(x, w)  # mixed norm weight dtype is allowed: the weight is upcast
    g.output("y", y)
    inputs = random_inputs(g, seed=5)
    out = run_checked(g, inputs)["y"]
    assert_close(out, _rms(inputs["x"], inputs["w"], 1e-6), 1e-5, "mixed-dtype rms_norm")
