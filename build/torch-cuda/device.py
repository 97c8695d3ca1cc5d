"""What a device offers the kernels: the one table from compute capability to features, and the per-device record
the dispatcher and the compile gate select by.

Selection asks this record (``DeviceCaps.tma``: may a TMA tile run; ``DeviceCaps.pdl``: may the split-KV path,
whose kernels use programmatic dependent launch, run), never an architecture number.  The record is derived once
per device (a host property query, no sync) and cached; the checks that run per call are two environment reads and
a dict lookup.

* A device whose capability is not in ``CAPABILITIES``, or whose shared memory per block or register file is below
  what the tiles need, is refused with one ``UnsupportedDeviceError`` (a ValueError) naming the device, its
  capability and what is supported, before anything compiles.
* ``CUTE_DSL_ARCH`` (CuTe-DSL's target override) must be one of the targets the device runs; another is refused
  the same way (a cubin built for another target does not load, or fails in ptxas).
* ``FA4_SM120_FORCE_CPASYNC=1`` (read on every call; for the GPU tests) makes the record say "no TMA" (and no
  vector reductions), so the proxy runs the selection of an SM80/SM86/SM89 device: the cp.async kernels
  everywhere, and the backward's kernel pair instead of the fused kernel.

Host-only module: no CuTe-DSL import; torch only queries device properties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .config import SMEM_LIMIT_BYTES

# Registers a CTA of the kernels may take: 8 warps x 32 threads x 255 registers (the cp.async kernels) fit in a
# 64K-register file; the TMA kernel's producer warpgroup is served by setmaxnreg inside the same file.
REGISTERS_NEEDED = 65536
FORCE_CPASYNC_ENV = "FA4_SM120_FORCE_CPASYNC"


@dataclass(frozen=True)
class ArchFeatures:
    """One row of the capability table: the compile target, the other targets whose cubins the device runs, and
    the features the kernels gate on.  ``smem_per_block`` / ``registers``: the published opt-in shared memory per
    block and the register file per SM, used when torch does not report them."""

    arch: str  # CuTe-DSL target for this capability
    also_runs: tuple[str, ...]  # other targets a forced CUTE_DSL_ARCH may name
    tma: bool  # cp.async.bulk.tensor, mbarrier expect-tx and setmaxnreg (kernels/fwd_tma.py)
    pdl: bool  # griddepcontrol (programmatic dependent launch): the split-KV forward and the combine kernel
    smem_per_block: int
    registers: int
    family: str
    red_f32x2: bool = True  # red.global.add.v2.f32 (sm_90 and later): the fused backward's dQ adds


# The single place that maps a compute capability to what the kernels may use.  mma.sync m16n8k16 with bf16 and
# cp.async need capability 8.0; TMA, mbarrier tx-counts, setmaxnreg and griddepcontrol need 9.0 (sm_90a) and are
# present on SM120/SM121 too.
CAPABILITIES: dict[tuple[int, int], ArchFeatures] = {
    (8, 0): ArchFeatures("sm_80", (), False, False, 166912, 65536, "Ampere (A100, A30)", red_f32x2=False),
    # 8.6 and 8.9 run sm_80 cubins (one compile target, and one gate run, for the three: the compile gate's
    # sm_80 full run vouches for what they load)
    (8, 6): ArchFeatures("sm_80", ("sm_86",), False, False, 101376, 65536, "Ampere (RTX 30xx, A40, A10)",
                         red_f32x2=False),
    (8, 9): ArchFeatures("sm_80", ("sm_86", "sm_89"), False, False, 101376, 65536, "Ada (RTX 40xx, L4, L40)",
                         red_f32x2=False),
    (9, 0): ArchFeatures("sm_90a", (), True, True, 232448, 65536, "Hopper (H100, H200; the test proxy)"),
    (12, 0): ArchFeatures("sm_120a", ("sm_120f",), True, True, 101376, 65536,
                          "consumer Blackwell (RTX 50xx, RTX PRO 6000)"),
    (12, 1): ArchFeatures("sm_121a", ("sm_120f",), True, True, 101376, 65536, "DGX Spark (GB10)"),
}


def supported_text() -> str:
    """The supported capabilities, for error messages and the README."""
    return ", ".join(f"{ma}.{mi} ({f.arch}: {f.family})" for (ma, mi), f in CAPABILITIES.items())


def features_of_arch(arch: str) -> ArchFeatures:
    """The table row whose compile target is ``arch`` (the compile gate's ``--arch``); ValueError otherwise."""
    for feat in CAPABILITIES.values():
        if feat.arch == arch:
            return feat
    raise ValueError(f"arch {arch!r} is not a target of flash-attn-4-sm120; targets: "
                     f"{', '.join(f.arch for f in CAPABILITIES.values())}")


class UnsupportedDeviceError(ValueError):
    """A device (or a forced CUTE_DSL_ARCH) the bundle cannot serve; raised before any compile."""


@dataclass(frozen=True)
class DeviceCaps:
    """What one device offers the kernels (``device_caps``)."""

    name: str
    capability: tuple[int, int]
    arch: str
    archs: tuple[str, ...]  # targets whose cubins run here (``arch`` first)
    tma: bool
    pdl: bool
    smem_per_block: int
    registers: int
    num_sms: int
    red_f32x2: bool = True  # the fused backward may run (ArchFeatures.red_f32x2)

    def describe(self) -> str:
        return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"


def caps_from_properties(name: str, major: int, minor: int, smem_per_block: int | None, registers: int | None,
                         num_sms: int) -> DeviceCaps:
    """The record of a device from its properties; ``UnsupportedDeviceError`` when the bundle cannot serve it.
    ``smem_per_block`` / ``registers`` None: the table's published values."""
    feat = CAPABILITIES.get((major, minor))
    what = f"{name} (compute capability {major}.{minor})"
    if feat is None:
        raise UnsupportedDeviceError(
            f"{what} is not supported by flash-attn-4-sm120: the kernels need mma.sync bf16 and cp.async "
            f"(capability 8.0 or later) and are built for the capabilities {supported_text()}. Use another "
            "attention backend (e.g. PyTorch's scaled_dot_product_attention) on this device")
    smem = feat.smem_per_block if smem_per_block is None else int(smem_per_block)
    regs = feat.registers if registers is None else int(registers)
    if smem < SMEM_LIMIT_BYTES:
        raise UnsupportedDeviceError(
            f"{what} offers {smem} B of shared memory per block; the kernels' tiles need {SMEM_LIMIT_BYTES} B. "
            f"Supported: {supported_text()}")
    if regs < REGISTERS_NEEDED:
        raise UnsupportedDeviceError(
            f"{what} has {regs} registers per SM; the kernels need {REGISTERS_NEEDED}. Supported: {supported_text()}")
    return DeviceCaps(name, (major, minor), feat.arch, (feat.arch, *feat.also_runs), feat.tma, feat.pdl, smem, regs,
                      num_sms, feat.red_f32x2)


_CAPS: dict[int, DeviceCaps] = {}


def _query(index: int) -> DeviceCaps:
    import torch

    p = torch.cuda.get_device_properties(index)
    return caps_from_properties(p.name, p.major, p.minor, getattr(p, "shared_memory_per_block_optin", None),
                                getattr(p, "regs_per_multiprocessor", None), p.multi_processor_count)


def device_caps(device) -> DeviceCaps:
    """The record of ``device`` (a torch.device or an index; None: the current device), derived once and cached,
    with the per-call overrides applied: a forced ``CUTE_DSL_ARCH`` is checked against it, and
    ``FA4_SM120_FORCE_CPASYNC=1`` turns its TMA off.  Raises ``UnsupportedDeviceError``."""
    index = getattr(device, "index", device)
    if index is None:
        import torch

        index = torch.cuda.current_device()
    caps = _CAPS.get(index)
    if caps is None:
        caps = _CAPS[index] = _query(index)
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced and forced not in caps.archs:
        raise UnsupportedDeviceError(
            f"CUTE_DSL_ARCH={forced} does not run on {caps.describe()}: its cubins load on {' or '.join(caps.archs)} "
            f"targets only. Unset CUTE_DSL_ARCH or set it to {caps.arch}")
    if caps.tma and os.environ.get(FORCE_CPASYNC_ENV, "0") == "1":  # what an SM8x device selects
        caps = replace(caps, tma=False, red_f32x2=False)
    return caps


def split_problem(caps: DeviceCaps) -> str | None:
    """Why split-KV cannot run on this device (None: it can)."""
    if caps.pdl:
        return None
    return (f"split-KV (num_splits > 1) and flash_attn_combine need programmatic dependent launch (griddepcontrol, "
            f"capability 9.0 or later), which {caps.describe()} lacks")
