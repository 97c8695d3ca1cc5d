"""Read a CUDA cubin without a GPU: register count, stack frame, SASS instruction census.

Used by the sm_120a compile gate.  Only the standard library plus ``nvdisasm`` (pip: nvidia-cuda-nvdisasm).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sysconfig
from dataclasses import dataclass, field

# Instructions SM120/SM121 lack: wgmma (HGMMA), tcgen05 / tensor memory (UTC*: UTCHMMA, UTCBAR, UTCATOMSWS ...),
# 2-CTA TMA and multicast (.2CTA, .MULTICAST).  CTA-scope TMA (UTMALDG, UTMACCTL.PF descriptor prefetch) is
# present on SM120 and allowed.  Any forbidden opcode fails the gate.
FORBIDDEN_SASS = ("HGMMA", "GMMA", "UTC", ".2CTA", ".MULTICAST", "TCGEN05")
# On targets without TMA (sm_80, sm_86, sm_89; compile_gate --arch): the TMA copies and descriptor prefetch
# (UTMA*, UBLKCP), the mbarrier transaction counts (SYNCS.*) and setmaxnreg (USETMAXREG) must not appear either.
FORBIDDEN_WITHOUT_TMA = ("UTMA", "UBLKCP", "SYNCS", "USETMAXREG")

_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 4
_EIFMT_HVAL = 3
_EIFMT_BVAL = 2
_EIFMT_NVAL = 1


def find_nvdisasm() -> str:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for cand in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")) + glob.glob(
            os.path.join(root, "nvidia", "cuda_nvdisasm", "bin", "nvdisasm")
        ):
            return cand
    raise FileNotFoundError(
        "nvdisasm not found: install it with `pip install nvidia-cuda-nvdisasm` (see requirements-dev.txt)"
    )


def _sections(data: bytes) -> dict[str, tuple[int, int]]:
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = []
    for i in range(shnum):
        name, _typ, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        raw.append((name, offset, size))
    strtab = raw[shstrndx][1]
    out = {}
    for name, offset, size in raw:
        end = data.index(b"\0", strtab + name)
        out[data[strtab + name : end].decode()] = (offset, size)
    return out


def _nv_info_attrs(data: bytes, offset: int, size: int):
    p, end = offset, offset + size
    while p < end:
        fmt, attr = data[p], data[p + 1]
        if fmt == _EIFMT_SVAL:
            n = struct.unpack_from("<H", data, p + 2)[0]
            yield attr, data[p + 4 : p + 4 + n]
            p += 4 + n
        elif fmt == _EIFMT_HVAL:
            yield attr, data[p + 2 : p + 4]
            p += 4
        elif fmt == _EIFMT_BVAL:
            yield attr, data[p + 2 : p + 3]
            p += 4
        elif fmt == _EIFMT_NVAL:
            yield attr, b""
            p += 2
        else:
            return


@dataclass
class CubinReport:
    arch: str
    registers: int
    frame_bytes: int
    counts: dict[str, int] = field(default_factory=dict)
    forbidden: list[str] = field(default_factory=list)
    # register counts requested by setmaxnreg (USETMAXREG): the decreases and the increases
    maxreg_dealloc: list[int] = field(default_factory=list)
    maxreg_alloc: list[int] = field(default_factory=list)
    # opcodes of FORBIDDEN_WITHOUT_TMA present (allowed where the target has TMA)
    tma_ops: list[str] = field(default_factory=list)
    # sha256 of the normalised SASS (sass_digest): equal digests, identical kernels (scripts/sass_compare.py)
    sass_sha256: str = ""

    @property
    def spills(self) -> int:
        return self.counts.get("STL", 0) + self.counts.get("LDL", 0)


_CENSUS = {
    "HMMA": r"\bHMMA\.",
    "LDSM": r"\bLDSM\b",
    "LDGSTS": r"\bLDGSTS\b",
    "MUFU.EX2": r"\bMUFU\.EX2\b",
    "MUFU.TANH": r"\bMUFU\.TANH\b",
    "STL": r"\bSTL\b",
    "LDL": r"\bLDL\b",
    "BAR": r"\bBAR\.SYNC\b",
}


def _elf_arch(cubin: bytes) -> str:
    """``sm_NN`` from the cubin's ELF header (e_flags: the SM number in bits 0-7 up to ELF ABI version 7, in bits
    8-15 from version 8), for cubins that carry no target string (sm_80, sm_90a)."""
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    sm = (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF
    return f"sm_{sm}" if sm else "?"


def inspect_cubin(cubin: bytes) -> CubinReport:
    secs = _sections(cubin)
    regs = frame = 0
    info = secs.get(".nv.info")
    if info:
        for attr, val in _nv_info_attrs(cubin, *info):
            if attr == _EIATTR_REGCOUNT:
                regs = max(regs, struct.unpack_from("<II", val)[1])
            elif attr == _EIATTR_FRAME_SIZE:
                frame = max(frame, struct.unpack_from("<II", val)[1])
    arch = _elf_arch(cubin)
    m = re.search(rb"sm_\d+[af]?", cubin)
    if m:  # the target string, with its a/f suffix, where the cubin carries one
        arch = m.group().decode()
    sass = disassemble(cubin)
    counts = {k: len(re.findall(p, sass)) for k, p in _CENSUS.items()}
    opcodes = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    forbidden = sorted({op for op in opcodes for tok in FORBIDDEN_SASS if op.startswith(tok) or tok in op})
    dealloc = [int(v, 16) for v in re.findall(r"USETMAXREG\.DEALLOC\S*\s+(0x[0-9a-f]+)", sass)]
    alloc = [int(v, 16) for v in re.findall(r"USETMAXREG\.(?:TRY_)?ALLOC\S*\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)", sass)]
    tma_ops = sorted({op for op in opcodes for tok in FORBIDDEN_WITHOUT_TMA if op.startswith(tok)})
    return CubinReport(arch, regs, frame, counts, forbidden, dealloc, alloc, tma_ops, sass_digest(sass))


def sass_digest(sass: str) -> str:
    """sha256 of nvdisasm output with the instruction addresses and the directive lines (section offsets, sizes)
    left out: two builds of the same kernel give the same digest, any changed instruction a different one."""
    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln) for ln in sass.splitlines() if not ln.strip().startswith(".")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def disassemble(cubin: bytes) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([find_nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
