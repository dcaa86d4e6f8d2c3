"""Programs per SM / CU, hand-computed for each limiting resource under the NVIDIA and AMD rules.

Every expected number below is worked out in its comment from the rule the vendor's occupancy
calculator uses (``megakernel.occupancy``'s docstring says which).
"""
import ctypes
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from megakernel.errors import BackendError
from megakernel.occupancy import (LIMITS, KernelResources, amdgcn_resources, check_grid, cubin_resources,
                                  device_limits, kernel_resources, max_grid, programs_per_unit)

H100, B200, MI300X, MI355X = (LIMITS[t] for t in ("sm_90", "sm_100", "gfx942", "gfx950"))


def test_presets_are_the_vendor_numbers():
    for sm in (H100, B200):
        assert (sm.warp_size, sm.max_programs_per_unit, sm.max_warps_per_unit) == (32, 32, 64)
        assert (sm.registers_per_unit, sm.register_granule, sm.max_registers_per_thread) == (65536, 256, 255)
        assert (sm.shared_per_unit, sm.shared_per_program, sm.shared_reserved_per_program) == (233472, 232448, 1024)
    assert (H100.units, B200.units, MI300X.units, MI355X.units) == (132, 148, 304, 256)
    for cu in (MI300X, MI355X):
        # 512 VGPRs per lane x 64 lanes x 4 SIMDs: the 512 KiB VGPR file of a CDNA3 / CDNA4 CU
        assert cu.registers_per_unit * 4 == 512 * 1024 and cu.register_granule == 8 * 64
        assert (cu.warp_size, cu.max_warps_per_unit, cu.max_programs_per_unit) == (64, 32, 16)
    assert (MI300X.shared_per_unit, MI355X.shared_per_unit) == (64 * 1024, 160 * 1024)


@pytest.mark.parametrize("resources,expected,limit", [
    # 128 registers x 32 threads = 4096 per warp: 16384 / 4096 = 4 warps per sub-partition, 16 per SM = 4 programs
    (KernelResources(128, 0, 4), 4, "registers"),
    # 129 x 32 = 4128 rounds up to 4352 (a multiple of 256): 3 warps per sub-partition, 12 per SM = 3 programs
    (KernelResources(129, 0, 4), 3, "registers"),
    # 100 KiB + the 1 KiB reserve = 103424 bytes: 233472 / 103424 = 2 (registers would allow 16)
    (KernelResources(32, 100 * 1024, 4), 2, "shared memory"),
    # 10000 + 1024 = 11024 rounds up to 11136 (a multiple of 128): 233472 / 11136 = 20 (unrounded: 21)
    (KernelResources(16, 10000, 1), 20, "shared memory"),
    # 16 registers: 128 warps' worth, but 64 warps per SM / 8 per program = 8
    (KernelResources(16, 0, 8), 8, "warps"),
    # one warp per program: registers allow 128, warps 64, but at most 32 blocks per SM
    (KernelResources(16, 0, 1), 32, "programs"),
])
def test_nvidia_programs_per_sm(resources, expected, limit):
    for sm in (H100, B200):
        assert programs_per_unit(sm, resources) == expected
        with pytest.raises(BackendError, match=f"  {limit}: {expected} .*<- limits"):
            check_grid(max_grid(sm, resources) + 1, sm, resources)


@pytest.mark.parametrize("resources,expected,limit", [
    # 128 VGPRs: 512 / 128 = 4 waves per SIMD, 16 per CU = 4 programs of 4 waves
    (KernelResources(128, 0, 4), 4, "VGPRs"),
    # 129 VGPRs round up to 136 (granules of 8): 512 / 136 = 3 waves per SIMD = 3 programs
    (KernelResources(129, 0, 4), 3, "VGPRs"),
    # 256 arch VGPRs + 256 AGPRs: one wave per SIMD = 1 program
    (KernelResources(512, 0, 4), 1, "VGPRs"),
    # 106 SGPRs round up to 112: 800 / 112 = 7 waves per SIMD = 7 programs (VGPRs would allow 16, waves 8)
    (KernelResources(32, 0, 4, scalar_registers=106), 7, "SGPRs"),
    # 32 VGPRs allow 16 waves per SIMD, but 8 waves per SIMD = 32 per CU = 8 programs of 4
    (KernelResources(32, 0, 4), 8, "waves"),
    # one-wave programs: 32 waves per CU, but 16 work-groups per CU
    (KernelResources(32, 0, 1), 16, "programs"),
])
def test_amd_programs_per_cu(resources, expected, limit):
    for cu in (MI300X, MI355X):
        assert programs_per_unit(cu, resources) == expected
        with pytest.raises(BackendError, match=f"  {limit}: {expected} .*<- limits"):
            check_grid(max_grid(cu, resources) + 1, cu, resources)


def test_lds_limits_by_generation():
    # 20000 bytes of LDS: 65536 / 20000 = 3 on an MI300X CU; 163840 / 20000 = 8 on an MI355X CU
    resources = KernelResources(64, 20000, 4)
    assert programs_per_unit(MI300X, resources) == 3
    assert programs_per_unit(MI355X, resources) == 8


@pytest.mark.parametrize("limits,resources,limit", [
    (H100, KernelResources(256, 0, 4), "registers: 0 .*above the maximum of 255"),
    (H100, KernelResources(32, 232448 + 1, 4), "shared memory: 0 .*above the 232448"),
    # 255 registers: 8192 per warp, 2 warps per sub-partition, 8 per SM: a 16-warp program has no room
    (H100, KernelResources(255, 0, 16), "registers: 0 "),
    (MI300X, KernelResources(513, 0, 4), "VGPRs: 0 .*above the maximum of 512"),
    # 128 KiB of LDS: more than an MI300X CU has (an MI355X CU holds one)
    (MI300X, KernelResources(128, 128 * 1024, 4), "LDS: 0 .*above the 65536"),
])
def test_a_kernel_that_cannot_fit_at_all(limits, resources, limit):
    assert programs_per_unit(limits, resources) == 0 and max_grid(limits, resources) == 0
    with pytest.raises(BackendError, match=limit) as error:
        check_grid(1, limits, resources)
    unit = "an SM" if limits.nvidia else "a CU"
    assert str(error.value).startswith(f"not even one program of this megakernel fits on {unit}")


def test_what_one_generation_cannot_hold_the_next_can():
    # 128 KiB of LDS and 128 VGPRs: none on an MI300X CU (64 KiB); on an MI355X CU (160 KiB), one
    resources = KernelResources(128, 128 * 1024, 4)
    assert (programs_per_unit(MI300X, resources), programs_per_unit(MI355X, resources)) == (0, 1)


def test_check_grid_says_the_numbers_and_what_to_do():
    resources = KernelResources(128, 16384, 4)  # 4 programs per SM: 528 on 132 SMs
    assert max_grid(H100, resources) == 528
    check_grid(528, H100, resources)
    with pytest.raises(BackendError) as error:
        check_grid(529, H100, resources)
    message = str(error.value)
    for words in ("grid of 529", "NVIDIA H100 / H200 (sm_90)", "528 = 132 SMs x 4 programs per SM",
                  "128 registers per thread", "16384 bytes of shared memory", "4 warps per program",
                  "registers: 4 (128 per thread x 32 threads = 4096 per warp", "shared memory: 13",
                  "deadlock", "at most 528 workers"):
        assert words in message, (words, message)


def test_assembly_parsers_reject_what_they_cannot_read():
    with pytest.raises(BackendError, match="not an ELF64 cubin"):
        cubin_resources(b"not a cubin", "megakernel")
    text = "  .sgpr_count:     22\n  .vgpr_count:     219\n  .group_segment_fixed_size: 0\n"
    assert amdgcn_resources(text) == (219, 22, 0)
    with pytest.raises(BackendError, match=r"\.vgpr_count .*found 2"):
        amdgcn_resources(text + "  .vgpr_count:     7\n")


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
def test_live_device_limits_agree_with_the_preset():
    live = device_limits(0)
    if live.arch not in LIMITS:
        pytest.skip(f"no preset for {live.arch} to compare with")
    preset = LIMITS[live.arch]
    per_unit = ("warp_size", "max_programs_per_unit", "max_warps_per_unit", "registers_per_unit",
                "register_partitions", "register_granule", "shared_per_unit", "shared_per_program",
                "shared_reserved_per_program")
    assert {k: getattr(live, k) for k in per_unit} == {k: getattr(preset, k) for k in per_unit}
    assert live.units == torch.cuda.get_device_properties(0).multi_processor_count


@triton.jit
def square(x, N: tl.constexpr):
    """x <- x @ x for one N x N tile: a kernel that uses registers and shared memory."""
    tile = x + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(tile, tl.dot(tl.load(tile), tl.load(tile)))


@needs_gpu
@pytest.mark.skipif(bool(torch.version.hip), reason="compares with the CUDA driver's occupancy calculator")
def test_programs_per_sm_match_the_cuda_occupancy_calculator():
    """The driver's own calculator agrees, for the kernel as compiled and for any dynamic shared memory."""
    x = torch.zeros(64 * 64, device="cuda", dtype=torch.float16)
    compiled = square.warmup(x, 64, grid=(1,), num_warps=4)
    resources, limits = kernel_resources(compiled), device_limits(0)
    assert resources.registers == cubin_resources(compiled.asm["cubin"], compiled.name)[0]
    static = resources.shared - compiled.metadata.shared
    libcuda, function, blocks = ctypes.CDLL("libcuda.so.1"), ctypes.c_void_p(compiled.function), ctypes.c_int()
    most = limits.shared_per_program - static
    assert libcuda.cuFuncSetAttribute(function, 8, most) == 0  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for dynamic in (compiled.metadata.shared, *range(0, most + 1, 1024)):
        assert libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), function, resources.num_warps * limits.warp_size, ctypes.c_size_t(dynamic)) == 0
        ours = programs_per_unit(limits, replace(resources, shared=static + dynamic))
        assert ours == blocks.value, f"{dynamic} bytes of dynamic shared memory ({static} static): " \
                                     f"{ours} programs per SM, the driver says {blocks.value}"
