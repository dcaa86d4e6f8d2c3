"""How many programs of a compiled megakernel can be resident at once on a GPU, and refusing more.

Workers of the persistent kernel wait on each other's events, so every program of the grid must be
resident at the same time: a program that waits for one the hardware has not scheduled yet (because
the SMs / CUs are full) spins forever. Before a GPU launch the runtime computes how many programs fit
per SM (NVIDIA) or CU (AMD) from the kernel's registers, shared memory (LDS) and warps, and refuses a
larger grid with a ``BackendError`` that says which resource limits it and what to do.

The rules are the vendors' own occupancy calculators:

- NVIDIA: ``cuda_occupancy.h`` (CUDA 12), ``cudaOccMaxActiveBlocksPerMultiprocessor``. Registers are
  allocated per warp, ``registers × 32`` rounded up to 256, out of the 16K registers of one of the SM's
  4 sub-partitions; shared memory per block is static + dynamic + the 1 KiB the driver reserves per
  block (sm_80+), rounded up to 128 bytes; at most 64 warps and 32 blocks per SM (sm_90, sm_100).
- AMD CDNA (gfx90a, gfx942, gfx950): the HIP runtime's ``ihipOccupancyMaxActiveBlocksPerMultiprocessor``
  and LLVM's ``AMDGPUBaseInfo``. Each of a CU's 4 SIMDs holds 512 VGPRs per lane (arch VGPRs and AGPRs
  share them), allocated per wave in granules of 8, and 800 SGPRs allocated in granules of 16; at most
  8 waves per SIMD; LDS is divided by what one work-group uses; at most 16 multi-wave work-groups per CU
  (one barrier each).

Nothing here imports a GPU runtime at module import: ``device_limits`` and ``kernel_resources`` reach
the driver only when called.
"""
from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, replace

from .errors import BackendError


@dataclass(frozen=True)
class DeviceLimits:
    """Resources of one SM (NVIDIA) or CU (AMD), the number of them, and how a program is charged for them.

    Registers are counted in 32-bit registers of the whole unit; a warp takes ``registers per thread ×
    warp_size`` rounded up to ``register_granule``, all from one of ``register_partitions`` equal parts
    (NVIDIA: SM sub-partitions; AMD: SIMDs).
    """
    name: str
    arch: str                          # "sm_90", "gfx942"
    units: int                         # SMs or CUs
    warp_size: int
    max_programs_per_unit: int         # resident thread blocks per SM / multi-wave work-groups per CU
    max_warps_per_unit: int            # resident warps / waves per SM / CU
    registers_per_unit: int            # 32-bit registers per SM / CU (AMD: VGPRs per lane × lanes × SIMDs)
    register_partitions: int           # sub-partitions per SM / SIMDs per CU
    register_granule: int              # a warp's registers are allocated in multiples of this many
    max_registers_per_thread: int
    shared_per_unit: int               # bytes of shared memory / LDS per SM / CU
    shared_per_program: int            # the most one program may use (NVIDIA: the opt-in maximum)
    shared_reserved_per_program: int   # bytes the driver adds to every program (NVIDIA sm_80+: 1 KiB)
    shared_granule: int                # a program's shared memory is allocated in multiples of this
    scalar_registers_per_partition: int = 0  # AMD: SGPRs per SIMD, shared by its waves (0: no such limit)
    scalar_register_granule: int = 1

    @property
    def nvidia(self) -> bool:
        return self.arch.startswith("sm_")

    @property
    def unit(self) -> str:
        return "SM" if self.nvidia else "CU"


@dataclass(frozen=True)
class KernelResources:
    """What one program of a compiled kernel takes from its SM / CU."""
    registers: int         # per thread (AMD: arch VGPRs + AGPRs, the code object's .vgpr_count)
    shared: int            # bytes per program, static + dynamic (NVIDIA: without the driver's reservation)
    num_warps: int
    scalar_registers: int = 0  # AMD: SGPRs per wave (0: unknown or not a limit)


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


# Per-unit rules. NVIDIA numbers: CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability" (9.0 and 10.0: 32 resident blocks and 64 warps per SM, 64K 32-bit registers per SM,
# 255 registers per thread, 228 KiB shared memory per SM of which 227 KiB for one block), and
# cuda_occupancy.h (register allocation granularity 256 per warp, 4 sub-partitions, shared memory
# allocation granularity 128 bytes, cudaDevAttrReservedSharedMemoryPerBlock = 1 KiB added per block).
_HOPPER_BLACKWELL_SM = dict(
    warp_size=32, max_programs_per_unit=32, max_warps_per_unit=64, registers_per_unit=65536,
    register_partitions=4, register_granule=256, max_registers_per_thread=255, shared_per_unit=228 * 1024,
    shared_per_program=227 * 1024, shared_reserved_per_program=1024, shared_granule=128)

# AMD CDNA numbers: 4 SIMDs per CU, each with 512 VGPRs per lane of 64 lanes (AGPRs included on
# gfx90a/gfx942/gfx950: the ROCm GPU specifications table gives a 512 KiB VGPR file per CU) allocated
# per wave in granules of 8 (LLVM getVGPRAllocGranule / getTotalNumVGPRs for FeatureGFX90AInsts),
# 8 waves per SIMD (LLVM getMaxWavesPerEU for gfx90a+; HIP: "limited by SPI 32 per CU"), 800 SGPRs
# per SIMD allocated in granules of 16 (HIP runtime occupancy; the 12.5 KiB SGPR file per CU), and
# 16 work-groups of more than one wave per CU (LLVM getMaxWorkGroupsPerCU: one barrier each; a
# one-wave work-group needs none, so for num_warps=1 this undercounts, on the safe side). The HIP
# runtime divides a CU's LDS by the bytes one work-group uses, unrounded.
_CDNA_CU = dict(
    warp_size=64, max_programs_per_unit=16, max_warps_per_unit=32, registers_per_unit=512 * 64 * 4,
    register_partitions=4, register_granule=8 * 64, max_registers_per_thread=512,
    shared_reserved_per_program=0, shared_granule=1, scalar_registers_per_partition=800,
    scalar_register_granule=16)

LIMITS: dict[str, DeviceLimits] = {
    # 132 SMs on the H100 SXM and the H200 (an H100 PCIe has 114: device_limits reads the live count).
    "sm_90": DeviceLimits("NVIDIA H100 / H200", "sm_90", units=132, **_HOPPER_BLACKWELL_SM),
    "sm_100": DeviceLimits("NVIDIA B200", "sm_100", units=148, **_HOPPER_BLACKWELL_SM),
    # ROCm GPU specifications: MI300X 304 CUs and 64 KiB LDS per CU; MI355X 256 CUs and 160 KiB LDS
    # per CU, all of it addressable by one work-group (LLVM: "gfx950 supports up to 160 KB LDS").
    "gfx942": DeviceLimits("AMD Instinct MI300X", "gfx942", units=304, shared_per_unit=64 * 1024,
                           shared_per_program=64 * 1024, **_CDNA_CU),
    "gfx950": DeviceLimits("AMD Instinct MI355X", "gfx950", units=256, shared_per_unit=160 * 1024,
                           shared_per_program=160 * 1024, **_CDNA_CU),
}

# CDNA architectures whose per-CU rules equal a preset's (gfx90a, MI200: same VGPR file, waves and LDS).
_CDNA_RULES = {"gfx90a": "gfx942", "gfx940": "gfx942", "gfx941": "gfx942", "gfx942": "gfx942", "gfx950": "gfx950"}


def _words(limits: DeviceLimits) -> tuple[str, str, str, str]:
    """The vendor's words for a warp, a register partition, the registers and the shared memory."""
    if limits.nvidia:
        return "warp", "sub-partition", "registers", "shared memory"
    return "wave", "SIMD", "VGPRs", "LDS"


def _per_resource(limits: DeviceLimits, res: KernelResources) -> dict[str, tuple[int, str]]:
    """Programs per unit that each resource alone allows, with how that number comes about."""
    unit, warps, parts = limits.unit, res.num_warps, limits.register_partitions
    warp, part, registers, shared = _words(limits)
    out = {}

    per_part = limits.registers_per_unit // parts
    per_warp = _round_up(res.registers * limits.warp_size, limits.register_granule)
    if res.registers > limits.max_registers_per_thread:
        out[registers] = (0, f"{res.registers} per thread, above the maximum of {limits.max_registers_per_thread}")
    elif per_warp:
        fit = per_part // per_warp
        if limits.nvidia:
            take, pool = f"{res.registers} per thread x {limits.warp_size} threads = {per_warp} per warp", per_part
        else:
            lanes = limits.warp_size
            take, pool = f"{res.registers} take {per_warp // lanes} per lane", per_part // lanes
        out[registers] = (fit * parts // warps, f"{take}; {fit} {warp}s fit in each {part}'s {pool}, x {parts} "
                                                f"{part}s = {fit * parts} {warp}s, {warps} per program")
    if limits.scalar_registers_per_partition and res.scalar_registers:
        per_wave = _round_up(res.scalar_registers, limits.scalar_register_granule)
        fit = limits.scalar_registers_per_partition // per_wave
        out["SGPRs"] = (fit * parts // warps, f"{res.scalar_registers} take {per_wave}; {fit} waves fit in each "
                                              f"SIMD's {limits.scalar_registers_per_partition}, x {parts} SIMDs = "
                                              f"{fit * parts} waves, {warps} per program")

    taken = _round_up(res.shared + limits.shared_reserved_per_program, limits.shared_granule)
    if res.shared > limits.shared_per_program:
        out[shared] = (0, f"{res.shared} bytes per program, above the {limits.shared_per_program} one program "
                          f"may use")
    elif taken:
        reserved = limits.shared_reserved_per_program
        out[shared] = (limits.shared_per_unit // taken, f"{taken} bytes per program"
                       f"{f' with the driver reserve of {reserved}' if reserved else ''}, of "
                       f"{limits.shared_per_unit} per {unit}")

    out[f"{warp}s"] = (limits.max_warps_per_unit // warps,
                       f"{limits.max_warps_per_unit} {warp}s per {unit}, {warps} per program")
    cap = limits.max_programs_per_unit
    out["programs"] = (cap, f"at most {cap} resident programs per {unit}")
    return out


def programs_per_unit(limits: DeviceLimits, resources: KernelResources) -> int:
    """How many programs of this kernel can be resident at once on one SM / CU (0: not even one)."""
    return min(n for n, _ in _per_resource(limits, resources).values())


def max_grid(limits: DeviceLimits, resources: KernelResources) -> int:
    """The largest grid whose programs are all resident at once: the most workers a launch may have."""
    return limits.units * programs_per_unit(limits, resources)


def check_grid(grid: int, limits: DeviceLimits, resources: KernelResources) -> None:
    """Raise ``BackendError`` if ``grid`` programs of this kernel cannot all be resident at once.

    The message gives the kernel's resources, what each resource of the SM / CU allows, which one
    limits, and what to do about it.
    """
    per_unit = programs_per_unit(limits, resources)
    most = limits.units * per_unit
    if grid <= most:
        return
    unit = limits.unit
    warp, _, registers, shared = _words(limits)
    scalar = f" and {resources.scalar_registers} SGPRs" if resources.scalar_registers else ""
    kernel = (f"{resources.registers} {registers} per thread{scalar}, {resources.shared} bytes of {shared} and "
              f"{resources.num_warps} {warp}s per program")
    lines = [f"  {name}: {n} ({how}){'  <- limits' if n == per_unit else ''}"
             for name, (n, how) in _per_resource(limits, resources).items()]
    where = f"{limits.name} ({limits.arch})"
    if per_unit == 0:
        head = (f"not even one program of this megakernel fits on {'an' if limits.nvidia else 'a'} {unit} of "
                f"{where}, so a grid of {grid} cannot run: the kernel takes {kernel}.")
        advice = f"Make the kernel lighter: smaller tiles, fewer {warp}s per program, less {shared}."
    else:
        head = (f"a grid of {grid} programs cannot all be resident at once on {where}: at most {most} = "
                f"{limits.units} {unit}s x {per_unit} programs per {unit} for this kernel, which takes {kernel}.")
        advice = (f"Launch at most {most} workers, or make the kernel lighter (smaller tiles, fewer live values, "
                  f"less {shared}) so that more programs fit per {unit}.")
    raise BackendError("\n".join([
        head, f"Programs per {unit} that each resource allows:", *lines,
        "Persistent workers wait on each other: a program that is not resident is waited on forever (a deadlock).",
        advice]))


def device_limits(device_index: int = 0) -> DeviceLimits:
    """The limits of the live GPU ``device_index`` (a torch CUDA / ROCm device index), read from the driver.

    NVIDIA: every number from ``cuDeviceGetAttribute``, so any GPU the driver knows is covered. AMD:
    the CU count and name from torch; the per-CU rules from the preset of the same CDNA generation
    (HIP reports no register file or work-group cap that the occupancy rule could use).
    """
    import torch

    if torch.version.hip:
        props = torch.cuda.get_device_properties(device_index)
        arch = props.gcnArchName.split(":")[0]
        if arch not in _CDNA_RULES:
            raise BackendError(f"no occupancy rule for {props.name} ({arch}): megakernel knows the AMD CDNA "
                               f"GPUs {', '.join(sorted(_CDNA_RULES))}")
        return replace(LIMITS[_CDNA_RULES[arch]], name=props.name, arch=arch, units=props.multi_processor_count)
    return _cuda_device_limits(device_index, torch.cuda.get_device_name(device_index))


# CUdevice_attribute values (cuda.h).
_CU_ATTRIBUTES = dict(warp_size=10, units=16, threads_per_unit=39, major=75, minor=76, shared_per_unit=81,
                      registers_per_unit=82, shared_per_program=97, programs_per_unit=106,
                      shared_reserved_per_program=111)


@functools.lru_cache(maxsize=None)
def _cuda_device_limits(device_index: int, name: str) -> DeviceLimits:
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    device, value = ctypes.c_int(), ctypes.c_int()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise BackendError(f"the CUDA driver answered error {result} to {what} for device {device_index}")

    check(libcuda.cuInit(0), "cuInit")
    check(libcuda.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    got = {}
    for key, attribute in _CU_ATTRIBUTES.items():
        check(libcuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), f"cuDeviceGetAttribute({key})")
        got[key] = value.value
    sm = _HOPPER_BLACKWELL_SM  # register allocation rule: the same on every SM since 7.0 (cuda_occupancy.h)
    return DeviceLimits(
        name, f"sm_{got['major']}{got['minor']}", units=got["units"], warp_size=got["warp_size"],
        max_programs_per_unit=got["programs_per_unit"],
        max_warps_per_unit=got["threads_per_unit"] // got["warp_size"],
        registers_per_unit=got["registers_per_unit"], register_partitions=sm["register_partitions"],
        register_granule=sm["register_granule"], max_registers_per_thread=sm["max_registers_per_thread"],
        shared_per_unit=got["shared_per_unit"], shared_per_program=got["shared_per_program"],
        shared_reserved_per_program=got["shared_reserved_per_program"], shared_granule=sm["shared_granule"])


def kernel_resources(compiled, num_warps: int | None = None) -> KernelResources:
    """The resources of a loaded Triton ``CompiledKernel`` (what ``kernel[grid](...)`` or ``warmup`` returns).

    ``num_warps`` defaults to the kernel's own. Registers come from the driver (``n_regs``, after
    loading) on NVIDIA; the rest, and AMD's SGPRs that the driver does not report, from the binary.
    """
    compiled._init_handles()
    resources = binary_resources(compiled.asm, compiled.name, compiled.metadata.shared,
                                 num_warps or compiled.metadata.num_warps)
    if "cubin" in compiled.asm:
        resources = replace(resources, registers=compiled.n_regs)
    return resources


def binary_resources(asm, name: str, dynamic_shared: int, num_warps: int) -> KernelResources:
    """Resources of a compiled kernel from Triton's ``asm`` dict (a ``cubin`` or ``amdgcn`` entry), no GPU needed.

    ``dynamic_shared`` is the shared memory Triton asks for at launch (``metadata.shared``).
    """
    if "cubin" in asm:
        registers, static = cubin_resources(asm["cubin"], name)
        return KernelResources(registers, static + dynamic_shared, num_warps)
    vgprs, sgprs, static = amdgcn_resources(asm["amdgcn"])
    return KernelResources(vgprs, static + dynamic_shared, num_warps, sgprs)


_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4


def _elf_sections(elf: bytes):
    """The section headers of an ELF64 file, each with its name, and a reader of its string tables."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]

    def string(table: int, offset: int) -> str:
        start = headers[table][4] + offset
        return elf[start:elf.index(b"\0", start)].decode()

    return [(string(names, h[0]), h) for h in headers], string


def cubin_code(cubin: bytes) -> dict[str, bytes]:
    """The machine code (``.text.*``) and resource attributes (``.nv.info*``) sections of a cubin, by name:
    what a kernel's execution depends on, without its line tables (ptxas writes the source files' time
    and size into those)."""
    sections, _ = _elf_sections(cubin)
    return {name: cubin[h[4]:h[4] + h[5]] for name, h in sections if name.startswith((".text", ".nv.info"))}


def cubin_resources(cubin: bytes, kernel: str) -> tuple[int, int]:
    """(registers per thread, static shared bytes) of ``kernel`` in a cubin (an ELF64 file).

    Registers: the ``EIATTR_REGCOUNT`` attribute (symbol index, count) of an ``.nv.info`` section, as
    ``cuobjdump --dump-resource-usage`` reports them. Static shared memory: the size of the kernel's
    ``.nv.shared.<kernel>`` section; on sm_90+ it already holds a 1 KiB system reservation when the
    kernel uses shared memory, which the driver's per-block reservation may count once more: an
    estimate at most 1 KiB high, on the safe side.
    """
    if cubin[:5] != b"\x7fELF\x02":
        raise BackendError(f"cannot read the register count of {kernel}: not an ELF64 cubin")
    sections, string = _elf_sections(cubin)
    by_name = dict(sections)
    index = None
    for symtab in (s for _, s in sections if s[1] == 2):  # SHT_SYMTAB; its sh_link is the string table
        for i in range(symtab[5] // 24):
            if string(symtab[6], struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0]) == kernel:
                index = i
    for section_name, section in by_name.items():
        if section_name != ".nv.info" and not section_name.startswith(".nv.info."):
            continue
        at, end = section[4], section[4] + section[5]
        while at < end:  # records on a 4-byte grid: format, attribute, then a value or a sized payload
            fmt, attribute = cubin[at], cubin[at + 1]
            size = struct.unpack_from("<H", cubin, at + 2)[0] if fmt == _EIFMT_SVAL else 0
            if fmt == _EIFMT_SVAL and attribute == _EIATTR_REGCOUNT:
                symbol, registers = struct.unpack_from("<II", cubin, at + 4)
                if symbol == index:
                    shared = by_name.get(f".nv.shared.{kernel}")
                    return registers, shared[5] if shared else 0
            at += 4 + _round_up(size, 4)
    raise BackendError(f"cannot read the register count of {kernel}: no EIATTR_REGCOUNT for it in the cubin")


def amdgcn_resources(asm: str) -> tuple[int, int, int]:
    """(VGPRs incl. AGPRs, SGPRs, static LDS bytes) of the one kernel in Triton's AMDGCN assembly text.

    Read from the code object metadata (``.vgpr_count``, ``.sgpr_count``, ``.group_segment_fixed_size``),
    which the HIP runtime also reads for its occupancy; ``.vgpr_count`` is LLVM's ``TotalNumVgprs``
    (arch VGPRs aligned to 4, plus AGPRs).
    """
    values = []
    for key in ("vgpr_count", "sgpr_count", "group_segment_fixed_size"):
        found = re.findall(rf"^\s*\.{key}:\s+(\d+)\s*$", asm, re.MULTILINE)
        if len(found) != 1:
            raise BackendError(f"cannot read .{key} from the AMDGCN assembly: found {len(found)} values, expected 1")
        values.append(int(found[0]))
    return values[0], values[1], values[2]
