"""The generated megakernel, with every task type of the library in it, compiles for both GPU vendors."""
import pytest

from megakernel.aot import TARGETS, compile_kernel
from megakernel.tasks import TASK_TYPES
from megakernel.tools.examples import every_task_type


@pytest.mark.parametrize("trace", [False, True])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_task_type_compiles_ahead_of_time(target, trace):
    graph = every_task_type()
    assert {s.task_type for s in graph.specs} == set(TASK_TYPES), "the example must use every task type"
    assert any(dict(s.constexprs).get("USE_DOT") for s in graph.specs)
    assert any(dict(s.constexprs).get("USE_DOT") is False for s in graph.specs)
    compiled = compile_kernel(graph.specs, target, row_words=32, trace=trace)  # trace: the GPU clocks too
    assert compiled.binary == ("cubin" if target.startswith("sm") else "hsaco")
    assert compiled.size > 10_000
