"""The generated megakernel, with every task type of the library in it, compiles for both GPU vendors, and
what one of its programs takes from an SM / CU, read from the binary, lets its workers be resident.

Every target of ``megakernel.aot.TARGETS`` is tried; one the installed Triton cannot compile for is
skipped, with Triton's own reason. Compiles are slow (seconds each; every task type in one kernel took a
minute a target, in ``EVERY_TASK_PARTS`` kernels 20 s), so each kernel is compiled once per target for the
whole module.
"""
import functools
import os
import multiprocessing
import re
import subprocess
import sys
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler import ASTSource

import megakernel as mk
from megakernel import device
from megakernel.aot import (TARGETS, amdgcn_spilled, compile_kernel, ptxas_spilled, supported_targets,
                            unsupported_reason)
from megakernel.errors import BackendError
from megakernel.backends.gpu import MAX_REGISTERS
from megakernel.models import DecoderConfig, ServingConfig, decode_step
from megakernel.occupancy import (LIMITS, binary_resources, check_grid, cubin_code, cubin_resources, max_grid,
                                  programs_per_unit)
from megakernel.tasks import TASK_TYPES
from megakernel.tasks.common import rounded
from megakernel.tools.examples import EVERY_TASK_PARTS, across_nodes, every_task_type

pytestmark = pytest.mark.aot  # compiled for the GPU targets: the interpreter accepts code the compiler rejects

# every task type (in EVERY_TASK_PARTS kernels: ``examples.every_task_type``); the decode step as a GPU runs it,
# and as the torch backend cuts it (``Graph.few_tiles``: its tiles loop over their blocks), with prefill rows
# (``tl.dot`` tiles of many blocks); a GPU may be given such a graph too; and the step of a served
# mixture-of-experts model: prefill rows, drafts and their verification, sparse MLPs under expert parallelism,
# sampling
EVERY_TASK = [f"every task type {part + 1}/{EVERY_TASK_PARTS}" for part in range(EVERY_TASK_PARTS)]
KERNELS = [*EVERY_TASK, "decode step", "few tiles", "serving step"]
NVIDIA = [t for t, gpu in TARGETS.items() if gpu.backend == "cuda"]
AMD = [t for t, gpu in TARGETS.items() if gpu.backend == "hip"]
FAST = ("sm_90", "gfx942")  # one target of each vendor in the fast tier; the others with the slow tests


def fast_first(targets: list[str]) -> list:
    return [t if t in FAST else pytest.param(t, marks=pytest.mark.slow) for t in targets]


EVERY_TARGET = fast_first(sorted(TARGETS))


def kernel_targets(targets=tuple(TARGETS)) -> list:
    """(kernel, target) pairs: every kernel for one target of each vendor; for the others the decode step's
    (its tiles are those a model runs: the kernels with every task type take 20 s a target)."""
    return [(kernel, target) for kernel in KERNELS for target in FAST if target in targets] + [
        pytest.param("decode step", target, marks=pytest.mark.slow) for target in sorted(targets) if target not in FAST]


KERNEL_TARGETS = kernel_targets()


def need(target: str) -> None:
    reason = unsupported_reason(target)
    if reason:
        pytest.skip(reason)


@functools.cache
def graph(kernel: str) -> tuple[mk.Graph, int]:
    """The graph of ``kernel`` and its task-table row width."""
    if kernel in EVERY_TASK:
        return every_task_type(EVERY_TASK.index(kernel), EVERY_TASK_PARTS), 32
    config = DecoderConfig(hidden=96, heads=4, kv_heads=2, head_dim=48, intermediate=200, layers=1, vocab=128,
                           eps=1e-6, qk_norm=True, serving=ServingConfig(max_seq_len=80, max_batch=2, prefill_chunk=0),
                           dtype=torch.bfloat16)
    if kernel == "few tiles":
        config = replace(config, serving=replace(config.serving, prefill_chunk=16))
        return decode_step(config, mk.Graph(world_size=1, rank=0, parallelism=2, few_tiles=True)), 16
    if kernel == "serving step":  # rank 0 of 2, its experts whole: the all-reduces' and combine's puts too
        config = replace(config, serving=replace(config.serving, prefill_chunk=16, draft_tokens=2,
                                                 expert_parallel=True),
                         moe=(True,), experts=4, top_k=2, moe_intermediate=64, norm_topk=True)
        return decode_step(config, mk.Graph(world_size=2, rank=0)), 16
    return decode_step(config, mk.Graph(world_size=1, rank=0)), 16


@functools.cache
def compiled(kernel: str, target: str, trace: bool = False, num_warps: int = 4):
    need(target)
    if kernel in EVERY_TASK and target in FAST and not trace and num_warps == 4:
        return every_task_kernels()[kernel, target]
    g, row_words = graph(kernel)
    return compile_kernel(g.specs, target, row_words=row_words, trace=trace, num_warps=num_warps)


def every_task_kernel(kernel_target: tuple[str, str]):
    g, row_words = graph(kernel_target[0])
    return compile_kernel(g.specs, kernel_target[1], row_words=row_words)


@functools.cache
def every_task_kernels() -> dict:
    """The kernels with every task type for each FAST target, compiled side by side in two processes: the
    suite's longest wait, halved where two cores are free."""
    pairs = [(kernel, target) for target in FAST if unsupported_reason(target) is None for kernel in EVERY_TASK]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(pairs, pool.map(every_task_kernel, pairs)))


def test_the_targets_every_triton_has_are_supported():
    assert unsupported_reason("sm_90") is None and unsupported_reason("gfx942") is None
    assert {"sm_90", "gfx942"} <= set(supported_targets()) <= set(TARGETS)


TRACED = ("sm_90", "gfx942")  # the traced loop compiled once a vendor


@pytest.mark.parametrize("target,trace", [(target, False) for target in FAST] + [
    pytest.param(target, True, marks=pytest.mark.slow) for target in TRACED])
def test_every_task_type_compiles_ahead_of_time(target, trace):
    specs = [s for kernel in EVERY_TASK for s in graph(kernel)[0].specs]
    assert {s.task_type for s in specs} == set(TASK_TYPES), "the examples must use every task type"
    assert any(dict(s.constexprs).get("USE_DOT") for s in specs)
    assert any(dict(s.constexprs).get("USE_DOT") is False for s in specs)
    # trace: the GPU clocks and stamps around every tile, the same code whatever the tiles; compiled with the
    # decode step's kernel
    for kernel in ["decode step"] if trace else EVERY_TASK:
        c = compiled(kernel, target, trace)
        assert c.binary == ("cubin" if target.startswith("sm") else "hsaco")
        assert c.size > 10_000


@pytest.mark.parametrize("kernel,target", KERNEL_TARGETS)
def test_registers_read_from_the_binary_are_plausible(kernel, target):
    c = compiled(kernel, target)
    assert c.num_warps == 4 and c.shared > 0
    if target in NVIDIA:
        assert 0 < c.registers <= 255 and c.scalar_registers == 0
    else:  # VGPRs with AGPRs: 512 at most; SGPRs: 112 at most per wave on gfx9
        assert 0 < c.registers <= 512 and 0 < c.scalar_registers <= 112


@pytest.mark.parametrize("kernel,target", KERNEL_TARGETS)
def test_workers_fit_on_every_target(kernel, target):
    c = compiled(kernel, target)
    limits = LIMITS[target]
    assert programs_per_unit(limits, c.resources) >= 1
    check_grid(max_grid(limits, c.resources), limits, c.resources)
    with pytest.raises(BackendError, match="<- limits"):
        check_grid(max_grid(limits, c.resources) + 1, limits, c.resources)


@pytest.mark.parametrize("kernel,target", kernel_targets(NVIDIA))
def test_nvidia_kernels_are_capped_to_four_programs_per_sm(kernel, target):
    c = compiled(kernel, target)
    assert c.registers <= MAX_REGISTERS
    assert programs_per_unit(LIMITS[target], c.resources) >= 4


# What triton 3.6 (the GPU image's) still spills at the 128-register cap, whichever ptxas, held here so that it
# grows no further: the step with drafts (4 bytes with drafts alone, 8 with prefill rows and sparse MLPs too; the
# plain, prefill and MoE steps spill nothing, nor do the draft, accept and sample tiles together: the union with
# the verification rows' tiles does). Issue 57 item 6, left open.
SPILLED_UNDER_TRITON_36 = {("serving step", "sm_90"): 8}


@pytest.mark.parametrize("kernel,target", KERNEL_TARGETS)
def test_no_kernel_spills_a_register(kernel, target):
    """Nothing of a kernel lives in local memory / scratch: each tile's invariants stay in the tile
    (``device.persistent_loop``), no tile divides 64-bit integers (a subroutine call on NVIDIA, with
    registers saved around it), and the prefill ``chunk_attention`` tile loads rows as 16-byte vectors
    and multiplies bfloat16 on tensor cores (``tasks.common.dot``). The kernels models launch spill
    nothing under 3.9, and under 3.6 but the step with drafts (``SPILLED_UNDER_TRITON_36``). The kernels with
    every task type, unions no model launches, are held to no 64-bit division but to no spill count (issue 57
    item 6): ptxas's allocation of such unions is at the edge (on sm_90, 3.9 spills 16 bytes of the part
    with the grouped expert tiles, which spill nothing in the MoE step models launch; 3.6 152 and 408 bytes
    of two parts)."""
    c = compiled(kernel, target)
    if kernel not in EVERY_TASK:
        assert c.spilled <= (SPILLED_UNDER_TRITON_36.get((kernel, target), 0) if triton.__version__.startswith("3.6.")
                             else 0)
    if target in NVIDIA:
        assert not re.search(r"\b(div|rem)\.[su]64\b", c.assembly)


def loads_by_file(assembly: str) -> dict[str, Counter]:
    """The global load instructions of a PTX or AMDGCN text, counted by the source file they come from
    (its ``.file`` / ``.loc`` line information)."""
    files = {m.group(1): (m.group(3) or m.group(2)).rsplit("/", 1)[-1]
             for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]*)"(?:\s+"([^"]*)")?', assembly)}
    where, loads = None, defaultdict(Counter)
    for line in assembly.splitlines():
        if m := re.match(r"\s*\.loc\s+(\d+)\s", line):
            where = files.get(m.group(1))
        elif m := re.search(r"\b(ld\.global\S*|global_load_\w+|buffer_load_\w+)", line):
            loads[where][m.group(1)] += 1
    return loads


@pytest.mark.parametrize("kernel,target", KERNEL_TARGETS)
def test_weights_and_caches_are_not_loaded_element_by_element(kernel, target):
    """A decode step's bytes are its weights and KV cache: the GEMV, ``tl.dot``, attention and prefill tiles
    load their 16-byte-aligned rows in vectors, never one bfloat16 element at a time (what a hint lost on
    an argument word gives: ``tasks.common.row_offsets``)."""
    loads = loads_by_file(compiled(kernel, target).assembly)
    # the every-task kernels' linear tiles together: a part may hold only small or unaligned ones, or none
    linear = ([op for part in EVERY_TASK for op in loads_by_file(compiled(part, target).assembly).get("linear.py", {})]
              if kernel in EVERY_TASK else loads["linear.py"])
    assert any(re.search(r"\.v4\.|dwordx4", op) for op in linear)
    for source in ("linear.py", "attention.py", "chunk_attention.py"):
        assert not [op for op in loads.get(source, {}) if re.search(r"\.b16$|short", op)], (source, loads[source])


@pytest.mark.parametrize("target", list(FAST))
def test_every_weight_format_compiles_without_spills_and_aligned_ones_load_vectors(target):
    """A quantized linear in every format (``tasks.quantized.every_format``) compiles for both vendors'
    targets without spills; FP8 rows and Q4_K's nibbles, aligned, are loaded as vectors (16 bytes on
    sm_90; gfx942's compiler splits them in 8-byte loads), where the other formats gather each element's
    bytes (``_w_block``)."""
    from megakernel.tasks.quantized import every_format
    need(target)
    g = mk.Graph(world_size=1, rank=0)
    for i, result in enumerate(every_format(g)):
        g.output(f"y{i}", result)
    assert {dict(s.constexprs)["ALIGNED"] for s in g.specs if s.task_type == "quantized_linear"} == {True, False}
    c = compile_kernel(g.specs, target, row_words=32)
    assert c.spilled == 0
    vectors = [op for op in loads_by_file(c.assembly)["quantized.py"] if re.search(r"\.v4\.|dwordx[24]", op)]
    assert vectors and (target not in NVIDIA or any(".v4." in op for op in vectors)), vectors


@pytest.mark.parametrize("target", FAST)
def test_16_bit_dots_run_on_tensor_cores_and_float32_ones_stay_ieee(target):
    """The every-task kernels have bfloat16 ``tl.dot`` tiles (chunk attention) and float32 ones (a linear):
    the first are matrix-core instructions on bfloat16, none rounds float32 to tf32 / xf32 (on one target
    of each vendor: the kernels with every task type, ``kernel_targets``)."""
    asm = "\n".join(compiled(kernel, target).assembly for kernel in EVERY_TASK)
    if target in NVIDIA:
        assert re.search(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b", asm)
        assert ".tf32" not in asm
    else:
        assert re.search(r"\bv_mfma_f32_\w+_bf16\b", asm)
        assert not re.search(r"\bv_mfma\w*xf32", asm)  # an instruction: the debug info's "0xf32" offsets are not


@triton.jit
def centre(x, y, N: tl.constexpr):
    """``y = x - sum(x)``: every element of x stays live across the sum (N / 128 per thread)."""
    values = tl.load(x + tl.arange(0, N))
    tl.store(y + tl.arange(0, N), values - tl.sum(values))


def test_spills_are_read_from_ptxas():
    """A tile compiled under a cap it cannot fit spills; the report comes from ptxas run again as Triton ran
    it: one that gives the kernel's machine code, whatever its line tables say, and no other."""
    need("sm_90")
    source = ASTSource(fn=centre, signature={"x": "*fp32", "y": "*fp32", "N": "constexpr"}, constexprs={"N": 8192})
    for cap, spills in ((40, True), (255, False)):  # 64 values per thread
        kernel = triton.compile(source, target=TARGETS["sm_90"], options={"num_warps": 4, "maxnreg": cap})
        assert (ptxas_spilled(kernel) > 0) == spills, cap
    cubin = kernel.asm["cubin"]
    # this file in the line table: directory 1, then its time and size as LEB128 (0 and 0 from triton 3.9's
    # ptxas; 3.6's writes the file's own): another time, of the same length, is what a re-run may write
    entries = list(re.finditer(rb"test_aot\.py\x00\x01[\x80-\xff]*([\x00-\x7f])", cubin))
    assert len(entries) == 1
    time_end = entries[0].start(1)
    retimed = cubin[:time_end] + bytes([cubin[time_end] ^ 1]) + cubin[time_end + 1:]
    code = cubin.index(cubin_code(cubin)[".text.centre"])
    changed = cubin[:code + 16] + bytes([cubin[code + 16] ^ 0xFF]) + cubin[code + 17:]
    with_cubin = lambda binary: SimpleNamespace(asm={"ptx": kernel.asm["ptx"], "cubin": binary},  # noqa: E731
                                                metadata=kernel.metadata)
    assert ptxas_spilled(with_cubin(retimed)) == 0
    with pytest.raises(BackendError, match="no ptxas run reproduces the kernel's machine code"):
        ptxas_spilled(with_cubin(changed))


@triton.jit
def to_bfloat16(x, y, N: tl.constexpr):
    tl.store(y + tl.arange(0, N), rounded(tl.load(x + tl.arange(0, N)), tl.bfloat16))


# How each target's compiler converts float32 to bfloat16 (round to nearest even: the rounding bit of gfx942
# is bit 16 added with 0x7fff, NaN kept by a compare; gfx950 has the instruction)
NEAREST_EVEN = {"sm_90": r"cvt\.rn\.bf16\.f32", "sm_100": r"cvt\.rn\.bf16\.f32",
                "gfx942": r"v_bfe_u32 \S+, \S+, 16, 1\b", "gfx950": r"v_cvt_pk_bf16_f32\b"}


@pytest.mark.parametrize("target", EVERY_TARGET)
def test_compiled_bfloat16_stores_round_to_nearest_even(target):
    """``rounded`` rounds the bits itself only under the interpreter (which truncates); a compiled kernel
    leaves it to the conversion, which rounds to nearest even on every target."""
    need(target)
    source = ASTSource(fn=to_bfloat16, signature={"x": "*fp32", "y": "*bf16", "N": "constexpr"},
                       constexprs={"N": 1024})
    kernel = triton.compile(source, target=TARGETS[target], options={"num_warps": 4})
    asm = kernel.asm["ptx" if target in NVIDIA else "amdgcn"]
    assert re.search(NEAREST_EVEN[target], asm)
    assert not re.search(r"cvt\.rz|-65536\b|0xffff0000\b", asm)  # no truncation; no mask of a rounding of ours


@pytest.mark.parametrize("target", fast_first(AMD))
def test_spills_are_read_from_the_amd_code_object(target):
    """64 values per lane: they fit in the VGPRs of one wave per SIMD, not in those of 8 (64 each)."""
    need(target)
    source = ASTSource(fn=centre, signature={"x": "*fp32", "y": "*fp32", "N": "constexpr"}, constexprs={"N": 16384})
    spilled = [amdgcn_spilled(triton.compile(source, target=TARGETS[target], options=options).asm["amdgcn"])
               for options in ({"num_warps": 4}, {"num_warps": 4, "waves_per_eu": 8})]
    assert spilled[0] == 0 and spilled[1] > 0


def test_num_warps_reaches_the_compiler():
    need("sm_90")
    g = mk.Graph(world_size=1, rank=0)
    g.output("y", g.add(g.input("x", (2, 64), torch.float32), g.input("z", (2, 64), torch.float32)))
    c = compile_kernel(g.specs, "sm_90", row_words=16, num_warps=8)
    assert c.num_warps == 8 and ".reqntid 256" in c.assembly
    assert programs_per_unit(LIMITS["sm_90"], c.resources) >= 1


@pytest.mark.parametrize("kernel,target", kernel_targets(AMD))
def test_amd_occupancy_agrees_with_llvm(kernel, target):
    """LLVM writes the waves per SIMD it expects into the assembly; the occupancy rule must say the same.

    LLVM knows only static LDS (Triton's is dynamic), so the rule is asked without LDS.
    """
    c = compiled(kernel, target)
    occupancy = int(re.search(r"; Occupancy: (\d+)", c.assembly).group(1))
    limits = LIMITS[target]
    waves = programs_per_unit(limits, replace(c.resources, shared=0)) * c.num_warps
    assert waves == occupancy * limits.register_partitions, (c.resources, occupancy)


@triton.jit
def dot_tile(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))


def compile_dot_tile(target: str, m: int, n: int, k: int):
    need(target)
    signature = {"a": "*fp16", "b": "*fp16", "c": "*fp32", "M": "constexpr", "N": "constexpr", "K": "constexpr"}
    source = ASTSource(fn=dot_tile, signature=signature, constexprs={"M": m, "N": n, "K": k})
    return triton.compile(source, target=TARGETS[target], options={"num_warps": 4})


@pytest.mark.parametrize("target", fast_first(AMD))
def test_a_tile_too_big_for_an_mi300x_cu(target):
    """A 256x128 tile with K=256 takes 128 KiB of LDS and AGPRs beside 256 VGPRs: an MI355X CU holds one
    program, an MI300X CU (64 KiB of LDS) none."""
    kernel = compile_dot_tile(target, 256, 128, 256)
    res = binary_resources(kernel.asm, kernel.name, kernel.metadata.shared, kernel.metadata.num_warps)
    assert res.shared == 128 * 1024 and res.registers > 256  # the accumulators live in AGPRs
    occupancy = int(re.search(r"; Occupancy: (\d+)", kernel.asm["amdgcn"]).group(1))
    assert programs_per_unit(LIMITS[target], replace(res, shared=0)) == occupancy == 1
    if target == "gfx942":
        assert programs_per_unit(LIMITS[target], res) == 0
        with pytest.raises(BackendError, match=r"not even one program(.|\n)*LDS: 0 \(131072 bytes"):
            check_grid(1, LIMITS[target], res)
    else:
        assert programs_per_unit(LIMITS[target], res) == 1


@pytest.mark.parametrize("target", fast_first(NVIDIA))
def test_cubin_resources_match_cuobjdump(target, tmp_path):
    """The registers and shared memory read from the cubin are those NVIDIA's own tool reports."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"this Triton ships no cuobjdump ({cuobjdump})")
    kernel = compile_dot_tile(target, 64, 64, 64)
    path = tmp_path / "kernel.cubin"
    path.write_bytes(kernel.asm["cubin"])
    report = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                            check=True).stdout
    registers, shared = (int(re.search(rf"\b{key}:(\d+)", report).group(1)) for key in ("REG", "SHARED"))
    assert cubin_resources(kernel.asm["cubin"], kernel.name) == (registers, shared)
    assert registers > 0 and kernel.metadata.shared > 0


# -- the wait/signal protocol, read in the assembly ---------------------------------------------------------
BLOCK = re.compile(r"^\s*(?:\$L__|\.L)(BB\d+_\d+):|^\s*(?://|;) %bb\.\d+:")
POLL_LOAD = {"cuda": "ld.relaxed.sys.global", "hip": "sc0 sc1"}        # the poll's relaxed system-scope load
CLOCK = {"cuda": "%globaltimer", "hip": "s_memrealtime"}
BARRIER = {"cuda": "bar.sync", "hip": "s_barrier"}
RMW = {"cuda": ("atom.", "red."), "hip": ("global_atomic",)}
ACQUIRE = {"cuda": "fence.acquire.sys", "hip": "buffer_inv sc0 sc1"}
RELEASE = {"cuda": {scope: re.compile(rf"\b(red|atom)\.global\.{scope}\.release\.add")  # fence + add in one
                    for scope in ("gpu", "sys")},  # (triton 3.6 keeps the unused result: atom)
           "hip": {"gpu": re.compile(r"buffer_wbl2 sc1\n"), "sys": re.compile(r"buffer_wbl2 sc0 sc1\n")}}
FENCE = {"cuda": {"gpu": "fence.acq_rel.gpu", "sys": "fence.acq_rel.sys"}, "hip": RELEASE["hip"]}
RELAXED_ADD = {"cuda": {"gpu": "red.global.gpu.relaxed.add", "sys": "red.global.sys.relaxed.add"},  # no result
               "hip": {"gpu": re.compile(r"global_atomic_add_x2 v\[\d+:\d+\], v\[\d+:\d+\], off\n"),
                       "sys": re.compile(r"global_atomic_add_x2 v\[\d+:\d+\], v\[\d+:\d+\], off sc1\n")}}


def found(pattern: str | re.Pattern, text: str) -> bool:
    return (pattern in text) if isinstance(pattern, str) else bool(pattern.search(text))


def inner_loops(assembly: str) -> list[str]:
    """The text of every innermost loop, from LLVM's loop comments (``This Inner Loop Header``, ``in Loop:
    Header=BBn_m``), which both PTX and AMDGCN carry."""
    blocks, members, inner = [], {}, []
    for line in assembly.splitlines():
        match = BLOCK.match(line)
        if match:
            blocks.append((match.group(1), []))
        if blocks:
            blocks[-1][1].append(line)
    for label, lines in blocks:
        head = "\n".join(lines[:4])
        header = label if "This Inner Loop Header" in head else (re.search(r"in Loop: Header=(BB\d+_\d+)", head)
                                                                  or [None, None])[1]
        if header:
            members.setdefault(header, []).extend(lines)
        if label and "This Inner Loop Header" in head:
            inner.append(label)
    return ["\n".join(members[label]) for label in inner]


def wait_loops(assembly: str, vendor: str) -> list[str]:
    """The innermost loops that read the clock: the waits' (no tile reads a clock)."""
    return [loop for loop in inner_loops(assembly) if CLOCK[vendor] in loop]


@functools.cache
def protocol_kernel(target: str, protocol: str):
    need(target)
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (2, 64), torch.float32)
    g.output("y", g.add(g.add(x, x), x))
    return compile_kernel(g.specs, target, row_words=16, protocol=protocol)


def need_poll() -> None:
    if not hasattr(tl, "atomic_poll"):  # what device.protocol asks
        pytest.skip(f"triton {triton.__version__} has no tl.atomic_poll: it builds the spin protocol alone")


def spins(loop: str, vendor: str) -> bool:
    """Whether a wait loop is the spin protocol's: every thread at the barrier and a read-modify-write."""
    return BARRIER[vendor] in loop and any(op in loop for op in RMW[vendor])


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_a_poll_is_one_thread_reading_relaxed_then_one_fence_and_one_barrier(target):
    need_poll()
    vendor = TARGETS[target].backend
    for c in (protocol_kernel(target, "poll"), *(compiled(kernel, target) for kernel in EVERY_TASK)):  # the default
        loops = wait_loops(c.assembly, vendor)
        assert loops, "no wait loop found"
        for loop in loops:
            assert POLL_LOAD[vendor] in loop, loop
            assert not spins(loop, vendor), loop
        assert ACQUIRE[vendor] in c.assembly


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_signals_pay_one_fence_at_the_widest_scope_then_relaxed_adds_at_their_own(target):
    """A task's signals: one release fence, at gpu scope when every event is this rank's and at system scope
    when one is a peer's, then a loop of relaxed adds (gpu scope for this rank's events) with no fence in it."""
    need_poll()
    vendor = TARGETS[target].backend
    poll = protocol_kernel(target, "poll").assembly
    for scope in ("gpu", "sys"):
        assert found(FENCE[vendor][scope], poll) and found(RELAXED_ADD[vendor][scope], poll), scope
        if vendor == "cuda":  # (on AMD a release add is the fence's own instructions, then the add)
            assert not found(RELEASE[vendor][scope], poll), scope
    adds = [loop for loop in inner_loops(poll) if any(found(add, loop) for add in RELAXED_ADD[vendor].values())]
    assert adds and not any(found(fence, loop) for loop in adds for fence in FENCE[vendor].values()), adds


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_the_spin_protocol_spins_every_thread_and_releases_every_add_at_system_scope(target):
    """The protocol every Triton builds (triton 3.6's only one, the GPU image's): each wait loop has every
    thread at a barrier around a scalar atomic, and every signal is a system-scope release add; where it
    is the default, the kernel with every task type waits so (``spins``, what a poll's loops must not be)."""
    vendor = TARGETS[target].backend
    spin = protocol_kernel(target, "spin").assembly
    assert any(spins(loop, vendor) for loop in wait_loops(spin, vendor))
    assert not found(FENCE[vendor]["gpu"], spin)
    assert any(found(RELEASE[vendor]["sys"], loop) for loop in inner_loops(spin))  # a release per add
    if device.protocol() == "spin":
        for kernel in EVERY_TASK:
            loops = wait_loops(compiled(kernel, target).assembly, vendor)
            assert loops and all(spins(loop, vendor) for loop in loops)


FENCE_CHOICE = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from megakernel.device import signal_all
fences = []

def recording_fence(system):
    fences.append(1 if system != 0 else 0)

@triton.jit
def send(bases, signals, count, FENCE: tl.constexpr):
    signal_all(bases, 0, signals, 0, count, 0, FENCE, True, True, None)  # rank 0, events at heap offset 0; no network

heap = torch.zeros(8, dtype=torch.int64)
bases = torch.tensor([heap.data_ptr()] * 2)  # rank 1's heap mapped at the same place: one counter array
for table in ([[0, 3, 1], [0, 5, 2]], [[0, 3, 1], [1, 5, 2]], [[1, 3, 1]], [[0, 3, 1]]):
    send[(1,)](bases, torch.tensor(table), len(table), FENCE=recording_fence)
send[(1,)](bases, torch.zeros(1, 3, dtype=torch.int64), 0, FENCE=recording_fence)
print(fences, heap.tolist())
"""


def test_a_tasks_signals_choose_the_fence_by_the_ranks_they_reach():
    """One fence per task, at system scope exactly when a signal goes to a peer, none without signals,
    and every add made (run under the interpreter with a fence that records its scope)."""
    done = subprocess.run([sys.executable, "-c", FENCE_CHOICE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[0, 1, 1, 0] [0, 0, 0, 4, 0, 4, 0, 0]", done.stdout


def test_launches_are_cooperative_where_triton_can_and_virtual_ranks_need_their_queues(monkeypatch):
    from megakernel.backends.gpu import check_queues, launch_options
    for vendor in ("cuda", "hip"):
        assert launch_options(vendor).get("launch_cooperative_grid") is True  # triton 3.9 has the option
        assert "launch_cooperative_grid" not in launch_options(vendor, cooperative=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    check_queues("cuda", 8)
    with pytest.raises(BackendError, match=r"9 virtual ranks need 9 hardware queues.*CUDA_DEVICE_MAX_CONNECTIONS=8 "
                                           r"\(the default\)"):
        check_queues("cuda", 9)
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "2")
    with pytest.raises(BackendError, match="GPU_MAX_HW_QUEUES=2: set GPU_MAX_HW_QUEUES=3"):
        check_queues("hip", 3)


def test_aot_writes_the_assembly(tmp_path, capsys):
    from megakernel.tools.cli import main as cli
    assert cli(["aot", "--target", "sm_90", "--asm", str(tmp_path / "kernel.ptx")]) == 0
    assert "assembly (PTX)" in capsys.readouterr().out
    text = (tmp_path / "kernel.ptx").read_text()
    assert ".visible .entry megakernel" in text and wait_loops(text, "cuda")


def nvshmem_library() -> None:
    """Skip (or, where CI must have it, fail) without NVSHMEM's device bitcode (``shmem.device_library``)."""
    from megakernel import shmem
    try:
        shmem.device_library(90)
    except BackendError as error:
        if os.environ.get("MEGAKERNEL_REQUIRE_NVSHMEM"):
            pytest.fail(str(error))
        pytest.skip(str(error))


def test_the_nvshmem_transport_puts_and_signals_through_nvshmems_device_library(tmp_path, capsys):
    """``megakernel aot --transport nvshmem``: the collectives across nodes, their put tiles and signals
    calling NVSHMEM's block-scoped put and put-with-signal for peers of other nodes, the library linked in
    whole (its device state, which ``nvshmemx_cumodule_init`` fills, and nothing left to resolve), no spills;
    the same graph's kernel of the memory transport has none of it."""
    need("sm_90")
    nvshmem_library()
    from megakernel.tools.cli import main as cli
    assert cli(["aot", "--target", "sm_90", "--transport", "nvshmem", "--asm", str(tmp_path / "nvshmem.ptx")]) == 0
    assert "(0 bytes spilled)" in capsys.readouterr().out
    text = (tmp_path / "nvshmem.ptx").read_text()
    assert re.search(r"^\.visible \.const .*nvshmemi_device_state_d\[", text, re.M)
    assert not re.search(r"^\.extern \.func.*nvshmem", text, re.M), "an NVSHMEM call left unresolved"
    calls = re.findall(r"^\s*call(?:\.uni)?\s.*?(\w*(?:put_rows|signal|nvshmemi_transfer)\w*)", text, re.M)
    assert {"put_rows", "signal"} <= {c for c in ("put_rows", "signal") if any(c in name for name in calls)}, calls
    assert any("nvshmemi_transfer" in name for name in calls), "NVSHMEM's transfer functions are not called"
    assert ".visible .entry megakernel" in text and wait_loops(text, "cuda")  # the waits stay polls of local memory
    memory = compile_kernel(across_nodes().specs, "sm_90", row_words=16)
    assert "nvshmem" not in memory.assembly and memory.spilled == 0


def test_the_one_pe_loopback_links_the_transports_puts_and_signal_whole():
    """``shmem.loopback``, what the GPU check runs on one GPU to try NVSHMEM's host side: for sm_90 with the
    device library it calls the transport's ``put_rows`` and ``signal``, NVSHMEM's transfer, fence and
    put-with-signal, nothing left unresolved, the device state for ``nvshmemx_cumodule_init``, no spills;
    its int64 arguments (the addresses, sizes and the signal's value) met NVSHMEM's declared types."""
    need("sm_90")
    nvshmem_library()
    from megakernel import shmem
    source = ASTSource(fn=shmem.loopback, signature={name: "i64" for name in shmem.loopback.arg_names})
    compiled = triton.compile(source, target=TARGETS["sm_90"], options={
        "num_warps": 4, "extern_libs": {"libnvshmem_device": str(shmem.device_library(90))}})
    text = compiled.asm["ptx"]
    assert re.search(r"^\.visible \.const .*nvshmemi_device_state_d\[", text, re.M)
    assert not re.search(r"^\.extern \.func.*nvshmem", text, re.M), "an NVSHMEM call left unresolved"
    calls = " ".join(re.findall(r"^\s*call(?:\.uni)?\s.*?(\w*(?:put_rows|signal|nvshmemi_transfer)\w*)", text, re.M))
    for name in ("put_rows", "signal", "nvshmemi_transfer_rma", "nvshmemi_transfer_fence",
                 "nvshmemi_transfer_put_signal"):
        assert name in calls, name
    assert ptxas_spilled(compiled) == 0


def test_nvshmems_host_side_refuses_with_its_reason_where_a_piece_is_missing(monkeypatch):
    """Here (no CUDA GPU, a CPU torch without NVSHMEM) the symmetric area and the module init raise with
    the missing piece, and the GPU check's loopback row says "not run" with it instead of failing; a torch
    that sees a GPU but was built without NVSHMEM is named as such."""
    from megakernel import shmem
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    missing = shmem.host_missing()
    assert missing
    with pytest.raises(BackendError, match="NVSHMEM's host side: " + re.escape(missing)):
        shmem.symmetric_area(4096, torch.device("cuda", 0), "0")
    with pytest.raises(BackendError, match=re.escape(missing)):
        shmem.init_module(None)
    row = gpu_check.nvshmem_loopback(90)
    assert row.value == f"not run: {missing}" and row.ok is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert "NVSHMEM" in shmem.host_missing()


def test_a_device_library_this_triton_cannot_read_is_a_backend_error_naming_it(tmp_path, monkeypatch):
    """The GPU image's NVSHMEM (3.8, LLVM 22 bitcode) under its triton 3.6: the GPU check's nodes section
    reports it as not compiled, with the reason, and goes on (a file that is no bitcode stands in here)."""
    library = tmp_path / "libnvshmem_device_sm_90.bc"
    library.write_bytes(b"BC\xc0\xde" + bytes(60))
    monkeypatch.setenv("MEGAKERNEL_NVSHMEM_LIB", str(library))
    with pytest.raises(BackendError, match=f"cannot read NVSHMEM's device library {library}"):
        compile_kernel(across_nodes().specs, "sm_90", row_words=16, transport="nvshmem")
