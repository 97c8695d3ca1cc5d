"""Attention dropout, host side: the RNG contract, argument checks, the seed/offset source, and a pure-torch
materialisation of the keep mask (for tests and debugging).  Host only: no CuTe-DSL import, no side effects.

RNG contract (the kernels implement exactly this; ``dropout_mask`` reproduces it bit for bit):

* Generator: Philox4x32 with ``PHILOX_ROUNDS`` = 7 rounds (Salmon et al., SC'11; constants M0 = 0xD2511F53,
  M1 = 0xCD9E8D57, Weyl key bumps W0 = 0x9E3779B9, W1 = 0xBB67AE85 between rounds).
* Key: ``(seed_lo, seed_hi ^ offset_hi)``; counter ``((b << 16) | h, pair, offset_lo, group)`` for batch entry
  ``b`` (the sequence index under varlen), query head ``h``, query position ``i`` and key position ``j`` (both
  counted from the start of their sequence), with ``group = (j // 16) * 4 + (j % 8) // 2`` and
  ``pair = (i // 16) * 8 + i % 8``.
* Counter order: the constant words (b, h) and offset_lo enter round 1's multiplies, the row pair and the column
  group only its XORs, so rounds 1-3 split into a part of the row pair and a part of the group: a kernel whose
  calls share the rows (forward, dQ) or the keys (key-row dK/dV) makes 10 multiplies per call, not 12.
* One Philox call yields 4 words = 8 16-bit halves for the 2 x 4 elements of its group: query rows ``i0, i0 + 8``
  (``i0 = 16 * (i // 16) + i % 8``) by key columns ``j0, j0 + 1, j0 + 8, j0 + 9``
  (``j0 = 16 * (j // 16) + 2 * ((j % 8) // 2)``).  Column ``j`` takes word ``2 * ((j // 8) % 2) + j % 2``; row
  ``i`` its low 16 bits when ``(i // 8) % 2 == 0``, else its high 16 bits.  These are the rows and columns one
  thread holds in an m16n8k16 accumulator, so a kernel whose rows are query positions uses all 8.  Every
  (b, h, i, j) has its own (counter, word, half): nothing depends on tiles, warps or splits, and nothing is
  reused.
* An element's random value is the low ``KEEP_BITS`` = 15 bits of its 16-bit half.  Keep element (b, h, i, j) iff
  that value ``>= threshold``, ``threshold = min(round(p * 2**15), 2**15)``: the keep probability is
  ``1 - threshold / 2**15``, p quantised to a multiple of 2**-15 (within 2**-16 of ``1 - p``;
  ``expected_keep_rate``).  Kept probabilities are scaled by ``1 / (1 - p)`` (the requested p, not the quantised
  one: the relative bias is below 2**-16 / (1 - p)).  15 bits, not 16, so that the forward can test two elements
  at once as fp16 numbers with one HSET2 whose operand takes the absolute value (the sign bit, the 16th, ignored):
  0 ... 0x7BFF are finite, non-negative fp16 numbers, subnormals included, ordered as the integers, and the test
  "value < threshold" (drop) is exact for every value up to thresholds of ``F16_DIRECT_MAX_THRESHOLD`` = 0x7C00
  (p <= 0.96875; a NaN pattern compares false, and those values are >= any such threshold).  Above it the
  forward tests the complement (``0x7FFF - value < 2**15 - threshold``, keep), exact there (kernels/score_dropout.py).
* Seed and offset: given (``dropout_seed``, ``dropout_offset``), or drawn from torch's CUDA default generator of
  q's device (its seed and offset; the offset then advances by ``OFFSET_INCREMENT``), so ``torch.manual_seed``
  reproduces a run.  Under CUDA-graph capture the generator is not read: pass ``dropout_seed`` as a CUDA int64
  tensor (updated between replays), or the call raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import DropoutParams
from .compat import refuse

PHILOX_ROUNDS = 7
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
OFFSET_INCREMENT = 4  # what one call takes from the generator (torch wants multiples of 4)
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_I32_SIGN = 1 << 31
_MAX_HEADS = 1 << 16  # (b << 16) | h: both fit in 16 bits (the grid limits them to 65535)


@dataclass(frozen=True)
class DropoutArgs:
    """Resolved dropout of one call.  ``seed``/``offset`` are unsigned 64-bit ints; ``seed_tensor`` (a CUDA int64
    tensor, read by the kernels) replaces ``seed`` when given."""

    p: float
    seed: int
    offset: int
    seed_tensor: torch.Tensor | None = None

    @property
    def threshold(self) -> int:
        return keep_threshold(self.p)

    @property
    def high_p(self) -> bool:
        """Whether the forward tests the complement (``FwdKernelConfig.dropout_high_p``): p > 0.96875."""
        return self.threshold > F16_DIRECT_MAX_THRESHOLD

    def kernel_params(self) -> DropoutParams:
        """The kernels' dropout argument, one record (32-bit patterns as signed Int32; the threshold is at most
        2**15).  Kernels compiled without dropout (p = 0) take None instead."""
        seed, offset = self.seed, self.offset  # unsigned 64-bit: each half (x ^ 2**31) - 2**31 is its int32 pattern
        return DropoutParams(self.threshold, 1.0 / (1.0 - self.p), ((seed & _U32) ^ _I32_SIGN) - _I32_SIGN,
                             ((seed >> 32) ^ _I32_SIGN) - _I32_SIGN, ((offset & _U32) ^ _I32_SIGN) - _I32_SIGN,
                             ((offset >> 32) ^ _I32_SIGN) - _I32_SIGN, self.seed_tensor)


HALF_BITS = 16  # one Philox call decides 8 elements: a 16-bit half of a word each
KEEP_BITS = 15  # of which the low 15 bits are the element's random value
# the forward's direct keep test (fp16 compare of the values) is exact for thresholds up to +inf's pattern; above
# it (p > 0.96875) the forward is compiled with ``FwdKernelConfig.dropout_high_p`` and tests the complement
F16_DIRECT_MAX_THRESHOLD = 0x7C00


def keep_threshold(p: float) -> int:
    """Random values (KEEP_BITS wide) >= this keep their element (0 < p < 1); 2**KEEP_BITS keeps none."""
    return min(int(round(p * float(1 << KEEP_BITS))), 1 << KEEP_BITS)


# ---- argument checks ----------------------------------------------------------------------------------------------
def check_p(dropout_p) -> float:
    """dropout_p as a float in [0, 1]; ValueError for anything else (bool, NaN, tensors, strings)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"dropout_p must be a float in [0, 1], got {type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not (0.0 <= p <= 1.0):  # False for NaN too
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p!r}")
    return p


def _check_u64(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int (or None), got {type(value).__name__} {value!r}")
    if not -(1 << 63) <= value <= _U64:
        raise ValueError(f"{name}={value} does not fit in 64 bits")
    return value & _U64


def check_seed(seed, offset, device: torch.device):
    """(seed or None, seed tensor or None, offset or None), checked; raises ValueError on a wrong type/device."""
    seed_tensor = None
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"dropout_seed as a tensor must hold one int64 value, got dtype {seed.dtype} and "
                             f"shape {tuple(seed.shape)}")
        if seed.device != device:
            raise ValueError(f"dropout_seed is on {seed.device} but q is on {device}; a seed tensor must be a CUDA "
                             "int64 tensor on q's device")
        seed_tensor, seed = seed.reshape(1), 0
    elif seed is not None:
        seed = _check_u64("dropout_seed", seed)
    elif offset is not None:
        raise ValueError("dropout_offset needs dropout_seed (without a seed, both come from torch's CUDA generator)")
    if offset is not None:
        offset = _check_u64("dropout_offset", offset)
    elif seed is not None:
        offset = 0
    return seed, seed_tensor, offset


def resolve(p: float, seed, offset, device: torch.device, capturing: bool | None = None) -> DropoutArgs:
    """Seed and offset of a call with dropout: checked, or (0 < p < 1 without a seed) drawn from the CUDA
    default generator of ``device``, whose offset then advances by OFFSET_INCREMENT.  ``capturing``: whether a
    CUDA graph is being captured (None: asked, only when the generator would be read)."""
    seed, seed_tensor, offset = check_seed(seed, offset, device)
    if seed is None:
        if not 0.0 < p < 1.0:  # p = 1 keeps nothing: no random numbers, the generator is left alone
            return DropoutArgs(p, 0, 0)
        if capturing is None:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing:
            refuse("dropout_capture_no_seed")
        gen = torch.cuda.default_generators[device.index if device.index is not None else
                                            torch.cuda.current_device()]
        seed = gen.initial_seed() & _U64
        offset = gen.get_offset()
        gen.set_offset(offset + OFFSET_INCREMENT)
    return DropoutArgs(p, seed, offset, seed_tensor)


# ---- Philox4x32 in int64 torch arithmetic (exact uint32 emulation) --------------------------------------------------
def _mulhilo(m: int, x: torch.Tensor):
    """(hi, lo) 32-bit halves of m * x for a 32-bit constant m and int64 tensor x of uint32 values, without
    overflowing int64 (x is split into 16-bit halves)."""
    a = m * (x >> 16)  # < 2**48
    b = m * (x & 0xFFFF)  # < 2**48
    hi = (a + (b >> 16)) >> 16
    lo = (((a & 0xFFFF) << 16) + b) & _U32
    return hi & _U32, lo


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-``rounds`` on int64 tensors (or ints) holding uint32 values; returns four int64 tensors."""
    c0, c1, c2, c3, k0, k1 = (torch.as_tensor(t, dtype=torch.int64) & _U32 for t in (c0, c1, c2, c3, k0, k1))
    for r in range(rounds):
        if r:
            k0 = (k0 + PHILOX_W0) & _U32
            k1 = (k1 + PHILOX_W1) & _U32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *,
                 batch_start: int = 0, device=None, rounds: int = PHILOX_ROUNDS) -> torch.Tensor:
    """The random value (KEEP_BITS wide) of every (b, h, i, j), as int64 (batch, heads, seqlen_q, seqlen_k); batch
    entries are numbered from ``batch_start`` (a varlen sequence: batch=1, batch_start=its index)."""
    seed, offset = int(seed) & _U64, int(offset) & _U64
    if heads > _MAX_HEADS or batch_start + batch > _MAX_HEADS:
        raise ValueError(f"heads and batch entries must be < {_MAX_HEADS}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    j = torch.arange(seqlen_k, device=dev, dtype=torch.int64)
    group = (j // 16) * 4 + (j % 8) // 2
    word = ((j // 8) % 2) * 2 + (j % 2)
    i = torch.arange(seqlen_q, device=dev, dtype=torch.int64)
    pair = (i // 16) * 8 + i % 8
    shift = ((i // 8) % 2) * HALF_BITS
    b = torch.arange(batch_start, batch_start + batch, device=dev, dtype=torch.int64)
    h = torch.arange(heads, device=dev, dtype=torch.int64)
    bh = ((b[:, None] << 16) | h[None, :])[:, :, None, None]  # (B, H, 1, 1)
    c0 = group[None, None, None, :]
    c1 = pair[None, None, :, None]
    shape = (batch, heads, seqlen_q, seqlen_k)
    k0 = seed & _U32
    k1 = (seed >> 32) ^ (offset >> 32)
    out = philox4x32(bh.expand(shape), c1.expand(shape), offset & _U32, c0.expand(shape), k0, k1, rounds)
    w = word.expand(shape)
    res = torch.where(w == 0, out[0], out[1])
    res = torch.where(w == 2, out[2], res)
    res = torch.where(w == 3, out[3], res)
    return (res >> shift[None, None, :, None]) & ((1 << KEEP_BITS) - 1)


def dropout_mask(seed: int, offset: int, p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *,
                 batch_start: int = 0, device=None) -> torch.Tensor:
    """Debug/test helper: the keep mask (bool, (batch, heads, seqlen_q, seqlen_k)) the kernels use for a call
    with this seed, offset and dropout_p (positions counted within each sequence; for a varlen sequence pass
    batch=1 and batch_start=its index).  Pure torch, CPU or CUDA; O(numel) memory.

    The seed and offset of a call that drew them from torch's generator are
    ``torch.cuda.default_generators[dev].initial_seed()`` and its ``get_offset()`` just before the call."""
    p = check_p(p)
    shape = (batch, heads, seqlen_q, seqlen_k)
    if p == 0.0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if p == 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    words = random_words(seed, offset, batch, heads, seqlen_q, seqlen_k, batch_start=batch_start, device=device)
    return words >= keep_threshold(p)


def expected_keep_rate(p: float) -> float:
    """Exact keep probability of ``dropout_mask`` for 0 < p < 1 (p quantised to a multiple of 2**-KEEP_BITS)."""
    return ((1 << KEEP_BITS) - keep_threshold(p)) / float(1 << KEEP_BITS)


__all__ = ["DropoutArgs", "F16_DIRECT_MAX_THRESHOLD", "HALF_BITS", "KEEP_BITS", "PHILOX_ROUNDS", "check_p",
           "check_seed", "dropout_mask", "expected_keep_rate", "keep_threshold", "philox4x32", "random_words",
           "resolve"]
