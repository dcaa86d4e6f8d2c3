"""Ahead-of-time compilation of a generated megakernel for a GPU target, without a GPU.

The interpreter accepts code the compiler rejects (``break``, recursion, plain-Python calls), so
every kernel is also compiled for NVIDIA and AMD targets on the host: ``triton.compile`` on an
``ASTSource`` gives PTX/cubin or AMDGCN/hsaco. The binary also tells what one program takes from an
SM / CU (registers, shared memory), so how many workers the GPU can hold at once is known before any
GPU is at hand (``megakernel.occupancy``).
"""
from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import codegen, shmem
from .errors import BackendError
from .backends.gpu import launch_options
from .occupancy import KernelResources, binary_resources, cubin_code
from .scheduler import Spec

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),       # H100, H200
    "sm_100": GPUTarget("cuda", 100, 32),     # B200
    "gfx942": GPUTarget("hip", "gfx942", 64),  # MI300X
    "gfx950": GPUTarget("hip", "gfx950", 64),  # MI355X
}


@dataclass
class Compiled:
    target: str
    binary: str          # "cubin" or "hsaco"
    size: int            # bytes of the binary
    shared: int          # bytes of shared memory (LDS) per program, static + dynamic
    registers: int       # per thread (AMD: arch VGPRs + AGPRs)
    num_warps: int
    scalar_registers: int = 0                     # AMD: SGPRs per wave
    assembly: str = field(default="", repr=False)  # PTX or AMDGCN text, for reading
    spilled: int = 0     # bytes per thread of registers spilled to memory (NVIDIA: local; AMD: scratch)

    @property
    def resources(self) -> KernelResources:
        """What one program takes from an SM / CU: the input of ``occupancy.programs_per_unit``."""
        return KernelResources(self.registers, self.shared, self.num_warps, self.scalar_registers)


def compile_kernel(specs: list[Spec], target: str, row_words: int, trace: bool = False,
                   num_warps: int | None = None, protocol: str | None = None, transport: str = "memory") -> Compiled:
    """Compile the megakernel for ``specs`` for ``target`` (a key of ``TARGETS``), with or without tracing,
    with the wait/signal ``protocol`` (``device.PROTOCOLS``; the default one if None), reaching peers through
    ``transport`` (``codegen.TRANSPORTS``; "nvshmem" links NVSHMEM's device library, ``shmem``), with the
    options a GPU launch uses (``backends.gpu.launch_options``; ``num_warps`` overrides); its resources
    read from the binary and its spills from the assembler."""
    gpu = TARGETS[target]
    compiled = triton_compiled(specs, target, row_words, trace, num_warps, protocol, transport)
    binary, text = ("cubin", "ptx") if gpu.backend == "cuda" else ("hsaco", "amdgcn")
    res = binary_resources(compiled.asm, compiled.metadata.name, compiled.metadata.shared,
                           compiled.metadata.num_warps)
    spilled = ptxas_spilled(compiled) if gpu.backend == "cuda" else amdgcn_spilled(compiled.asm["amdgcn"])
    return Compiled(target, binary, len(compiled.asm[binary]), res.shared, res.registers, res.num_warps,
                    res.scalar_registers, compiled.asm[text], spilled)


def triton_compiled(specs: list[Spec], target: str, row_words: int, trace: bool = False,
                    num_warps: int | None = None, protocol: str | None = None, transport: str = "memory"):
    """``compile_kernel``'s kernel as Triton's ``compile`` returns it (its source generated or found in the
    kernel cache, its binary compiled or found in Triton's): what a process waits for before its first
    launch."""
    gpu = TARGETS[target]
    kernel = codegen.load_kernel(codegen.kernel_path(specs, gpu.backend, protocol, transport))
    signature = {name: "i64" for name in codegen.KERNEL_ARGS}
    signature.update(ROW="constexpr", TRACE="constexpr")
    source = ASTSource(fn=kernel, signature=signature, constexprs={"ROW": row_words, "TRACE": trace})
    options = launch_options(gpu.backend, transport=transport) | ({} if num_warps is None else {"num_warps": num_warps})
    library = shmem.device_library(gpu.arch) if transport == "nvshmem" else None
    if library is not None:
        options["extern_libs"] = {"libnvshmem_device": str(library)}
    try:
        compiled = triton.compile(source, target=gpu, options=options)
    except ValueError as error:  # LLVM bitcode newer than this Triton's LLVM (3.6 and NVSHMEM 3.8's files)
        if library is None or "Failed to parse library" not in str(error):
            raise
        raise BackendError(f"triton {triton.__version__} cannot read NVSHMEM's device library {library} (bitcode of a "
                           "newer LLVM than its own); nvidia-nvshmem-cu12==3.4.5's (LLVM 18) it reads, or set "
                           f"{shmem.LIBRARY_ENV} to such a file") from None
    return compiled


def ptxas_spilled(compiled) -> int:
    """Bytes per thread of spill stores in a Triton-compiled NVIDIA kernel, from ``ptxas -v`` run again on its
    PTX as Triton ran it (its ptxas, the options of ``make_cubin``: triton 3.9 adds ``--regAllocOptLevel=2``,
    3.6 does not); the run must give the same machine code (``occupancy.cubin_code``), or its report would
    describe other code. (A local array, such as the argument reduction of ``tl.sin`` for huge angles,
    takes stack but is no spill.)"""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    meta = compiled.metadata
    no_opt = knobs.nvidia.disable_ptxas_opt
    debug = (["-lineinfo", "-suppress-debug-info"] if knobs.compilation.disable_line_info else
             ["-g"] if no_opt else ["-lineinfo"])
    runs = []
    for allocation in (["--regAllocOptLevel=2"], []):
        options = [*debug, *([] if meta.enable_fp_fusion else ["--fmad=false"]), "-v",
                   *(["--opt-level", "0"] if no_opt else []), *allocation, *(meta.ptx_options or "").split(),
                   f"--gpu-name={sm_arch_from_capability(meta.target.arch)}"]
        with tempfile.TemporaryDirectory() as folder:
            source, binary = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
            source.write_text(compiled.asm["ptx"])
            run = subprocess.run([get_ptxas(meta.target.arch).path, *options, str(source), "-o", str(binary)],
                                 capture_output=True, text=True)
            same = run.returncode == 0 and cubin_code(binary.read_bytes()) == cubin_code(compiled.asm["cubin"])
        stores = re.findall(r"(\d+) bytes spill stores", run.stderr)  # the kernel's, and a called function's
        if same and stores:
            return sum(map(int, stores))
        runs.append(f"ptxas -v {' '.join(options)}:\n{run.stderr}")
    raise BackendError("no ptxas run reproduces the kernel's machine code:\n" + "\n".join(runs))


def amdgcn_spilled(assembly: str) -> int:
    """Bytes per lane of VGPRs an AMDGCN kernel spills to scratch (its metadata's ``vgpr_spill_count``, 4
    bytes each). SGPRs spilled into VGPR lanes stay in registers and do not count."""
    count = re.search(r"\.vgpr_spill_count:\s*(\d+)", assembly)
    if count is None:
        raise BackendError("the AMDGCN code object's metadata has no .vgpr_spill_count")
    return 4 * int(count.group(1))


@triton.jit
def _probe(x):
    tl.store(x, 1)


@functools.cache
def unsupported_reason(target: str) -> str | None:
    """Why the installed Triton cannot compile for ``target`` (None when it can), found once by compiling
    a one-store kernel, so that callers skip a target this Triton lacks instead of failing on it."""
    gpu = TARGETS[target]
    try:
        triton.compile(ASTSource(fn=_probe, signature={"x": "*i32"}), target=gpu)
    except Exception as error:  # whatever the backend raises: its message is the reason
        message = str(error).strip().splitlines()
        return f"triton {triton.__version__} cannot compile for {target}: {type(error).__name__}" + (
            f": {message[0]}" if message else "")
    return None


def supported_targets() -> list[str]:
    """The keys of ``TARGETS`` that the installed Triton can compile for."""
    return [target for target in TARGETS if unsupported_reason(target) is None]
