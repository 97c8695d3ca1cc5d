"""Philox4x32 (CuTe-DSL device code, trace time) and the dropout keep test of the score hook.

The RNG contract (counters, key, rounds, threshold) is stated once, in ``dropout.py`` (host), whose pure-torch
``dropout_mask`` the tests compare against; this file implements the same function on 32-bit registers:
one Philox call = ``PHILOX_ROUNDS`` x (2 IMAD.WIDE.U32 + 2 LOP3) + key bumps, for 4 elements.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, Uint64, const_expr

from ..dropout import PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1


@cute.jit
def philox4x32(c0: Uint32, c1: Uint32, c2: Uint32, c3: Uint32, k0: Uint32, k1: Uint32):
    """Philox4x32-PHILOX_ROUNDS: returns the four output words."""
    for r in cutlass.range_constexpr(PHILOX_ROUNDS):
        if const_expr(r > 0):
            k0 = k0 + Uint32(PHILOX_W0)
            k1 = k1 + Uint32(PHILOX_W1)
        p0 = cute.arch.mul_wide(Uint32(PHILOX_M0), c0)
        p1 = cute.arch.mul_wide(Uint32(PHILOX_M1), c2)
        hi0, lo0 = Uint32(p0 >> Uint64(32)), Uint32(p0)
        hi1, lo1 = Uint32(p1 >> Uint64(32)), Uint32(p1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@dataclass(frozen=True)
class DropoutRng:
    """Per-kernel dropout state: Philox key, the call's counter word (offset low bits), the keep threshold and
    the 1/(1-p) scale.  Row counters (query position, (b << 16) | h) are given per call."""

    k0: Uint32
    k1: Uint32
    c3: Uint32
    threshold: Uint32
    scale: Float32

    @staticmethod
    def create(threshold: Int32, scale: Float32, seed_lo: Int32, seed_hi: Int32, offset_lo: Int32,
               offset_hi: Int32, mSeed):
        """``mSeed``: optional (1,) int64 device tensor that replaces the scalar seed (CUDA-graph replays)."""
        if const_expr(mSeed is not None):
            s = Int64(mSeed[0])
            seed_lo = Int32(s)
            seed_hi = Int32(s >> Int64(32))
        return DropoutRng(Uint32(seed_lo), Uint32(seed_hi) ^ Uint32(offset_hi), Uint32(offset_lo),
                          Uint32(threshold), scale)

    @staticmethod
    def row_counter(batch, head) -> Int32:
        return (Int32(batch) << 16) | Int32(head)

    @cute.jit
    def keep_pair(self, col_pair: Int32, qpos: Int32, bh: Int32):
        """Keep decisions of key columns ``col_pair`` (even) and ``col_pair + 1`` of one query row (one Philox call,
        two of its words used: the caller owns only this pair of the group)."""
        group = (col_pair >> 4) * 4 + ((col_pair & 7) >> 1)
        w0, w1, w2, w3 = philox4x32(Uint32(group), Uint32(qpos), Uint32(bh), self.c3, self.k0, self.k1)
        hi_half = (col_pair & 8) != 0
        a = w2 if hi_half else w0
        b = w3 if hi_half else w1
        return a >= self.threshold, b >= self.threshold

    @cute.jit
    def keep_quad(self, col0: Int32, qpos: Int32, bh: Int32):
        """Keep decisions of columns col0, col0 + 1, col0 + 8, col0 + 9 (col0 even, col0 % 16 < 8): one whole
        group, all four words used."""
        group = (col0 >> 4) * 4 + ((col0 & 7) >> 1)
        w0, w1, w2, w3 = philox4x32(Uint32(group), Uint32(qpos), Uint32(bh), self.c3, self.k0, self.k1)
        t = self.threshold
        return w0 >= t, w1 >= t, w2 >= t, w3 >= t


def column_groups(t0_cols, quad_ok: bool):
    """Trace time: split a thread's accumulator columns (thread 0's offsets, in mn-view order; a thread's own
    columns are its first column plus these) into Philox groups: ("quad", t, (c0, c1, c8, c9)) covering offsets
    t, t+1, t+8, t+9, or ("pair", t, (c0, c1)) covering t, t+1.  Quads are used only when ``quad_ok``: the kernel
    guarantees that every thread's first column is even and < 8 mod 16 (warps stacked along M)."""
    idx = {int(t): c for c, t in enumerate(t0_cols)}
    used, groups = set(), []
    for c, t in enumerate(t0_cols):
        t = int(t)
        if c in used:
            continue
        if t % 2 or (t + 1) not in idx:
            raise ValueError(f"dropout: accumulator columns must come in aligned adjacent pairs, got {sorted(idx)}")
        if quad_ok and t % 16 < 8 and (t + 8) in idx and (t + 9) in idx:
            cs = (c, idx[t + 1], idx[t + 8], idx[t + 9])
            groups.append(("quad", t, cs))
        else:
            cs = (c, idx[t + 1])
            groups.append(("pair", t, cs))
        used.update(cs)
    return groups
