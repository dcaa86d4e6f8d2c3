"""Every op of the task library is a method of ``Graph`` that an editor and ``inspect`` find, with its
builder's signature, handing each argument to the builder's parameter of that name."""
import inspect
import os
import sys

import pytest
import torch

import megakernel as mk
from megakernel import graph as graph_module
from megakernel.tasks import OPS

BUILTIN = sorted(name for name, build in OPS.items() if build.__module__.startswith("megakernel.tasks."))


def _parameters(function, skip: int) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[skip:]]


def test_the_library_has_ops():
    assert {"add", "linear", "rms_norm", "decode_attention", "sample", "all_reduce"} <= set(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
def test_an_op_is_a_method_with_its_builders_signature(name):
    build, method = OPS[name], getattr(mk.Graph, name)
    assert name in vars(mk.Graph), f"Graph.{name} is not a method: add it to the ops section of megakernel/graph.py"
    assert os.path.isfile(inspect.getsourcefile(method)) and inspect.getsourcefile(method) == graph_module.__file__
    assert method.__doc__ and method.__doc__.strip()
    assert build.__name__ == name
    assert _parameters(method, 1) == _parameters(build, 1)  # all but self and g
    built = list(inspect.signature(build).parameters.values())[1:]
    own = list(inspect.signature(method).parameters.values())[1:]
    for b, m in zip(built, own):  # where the builder annotates a parameter, the method says the same
        assert b.annotation is inspect.Parameter.empty or m.annotation == b.annotation, (name, b.name)


@pytest.mark.parametrize("name", BUILTIN)
def test_an_op_hands_each_argument_to_its_builder(name, monkeypatch):
    build = OPS[name]
    calls = []

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return "result"

    recorder.__name__ = name  # what the op is called: its builder's name
    monkeypatch.setattr(sys.modules[build.__module__], name, recorder)
    g = mk.Graph(world_size=1, rank=0)
    values = {p: object() for p in list(inspect.signature(build).parameters)[1:]}
    assert getattr(g, name)(**values) == "result"
    (args, kwargs), = calls
    assert inspect.signature(build).bind(*args, **kwargs).arguments == {"g": g, **values}
    assert g.op_names == [name] and g.op_calls[0].startswith(f"{name}(")


def test_an_op_keeps_the_graph_whole():
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (1, 8), torch.float32)
    other = mk.Graph(world_size=1, rank=0).input("y", (1, 8), torch.float32)
    with pytest.raises(mk.GraphError, match="add: .* is not a tensor of this graph"):
        g.add(x, other)
    with pytest.raises(mk.GraphError, match="rms_norm: "):
        g.rms_norm(x, g.input("w", (3,), torch.float32))
    assert g.op_names == [] and g.op_calls == [] and len(g.tasks) == 0 and [b.name for b in g.buffers] == ["x", "w"]
    with g.scope("layer0"):
        y = g.add(x, x)
    assert y.shape == (1, 8) and g.op_names == ["layer0/add"] and g.op_calls == ["add((1, 8) float32, (1, 8) float32)"]
    sealed = g.sealed(set())
    with pytest.raises(mk.GraphError, match="mul: this is a kernel's sealed copy"):
        sealed.mul(x, x)


def test_an_op_of_a_module_outside_the_package_comes_from_the_registry(monkeypatch):
    def twice(g, x):
        """``x + x``."""
        return g.add(x, x)

    monkeypatch.setitem(OPS, "twice", twice)
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (4,), torch.float32)
    assert g.twice(x).shape == (4,) and g.twice.__doc__ == "``x + x``."
    assert g.op_names == ["twice", "add"] and g.op_calls == ["add((4,) float32, (4,) float32)", "twice((4,) float32)"]
    assert dir(g).count("twice") == 1 and dir(g).count("linear") == 1


def test_an_unknown_op_names_the_ops():
    g = mk.Graph(world_size=1, rank=0)
    with pytest.raises(AttributeError, match="Graph has no op 'conv'; ops: .*linear.*rms_norm"):
        g.conv
    assert not hasattr(g, "conv")
