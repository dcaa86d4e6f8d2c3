import os

import pytest

from megakernel import bootstrap
from megakernel.backends import cpu as cpu_backend


@pytest.fixture(scope="session", autouse=True)
def _shared_worker_pool():
    """Worker processes cost seconds to start: every test shares the default pool, stopped at the end."""
    yield
    cpu_backend.shutdown()


@pytest.fixture(params=["cpu", "torch"])
def backend(request, monkeypatch):
    """A protocol test runs once per host backend: the Triton interpreter's persistent loop, and torch's
    (the same queues, events and epochs; tiles as torch code). Kernels built with backend "auto", and
    the ranks ``launch`` starts, use it."""
    monkeypatch.setattr(bootstrap, "_process_backend", request.param)
    return request.param


@pytest.fixture
def torch_backend(request, monkeypatch):
    """Kernels built with backend "auto", and the ranks ``launch`` starts, run on the torch backend: for
    tests of models and of the engine around the tiles, which are proven under the interpreter (a test
    marked ``interpreter`` stays there)."""
    if request.node.get_closest_marker("interpreter") is None:
        monkeypatch.setattr(bootstrap, "_process_backend", "torch")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as transformers loads its GGUF file (dequantized to float32): the reference."""
    import torch
    from helpers import smollm2_path
    from transformers import AutoModelForCausalLM
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy to the end
    return model
