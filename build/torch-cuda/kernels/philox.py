"""Philox4x32 (CuTe-DSL device code, trace time) and the dropout keep test of the score hook.

The RNG contract (counters, key, rounds, threshold) is stated once, in ``dropout.py`` (host), whose pure-torch
``dropout_mask`` the tests compare against; this file implements the same function on 32-bit registers:
one Philox call = ``PHILOX_ROUNDS`` x (2 IMAD.WIDE.U32 + 2 LOP3) + key bumps, for 8 elements (2 query rows x
4 key columns, a 16-bit half each, whose low KEEP_BITS bits are the element's value).
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
    """Per-kernel dropout state: the kernel's dropout arguments as given (kernel parameters, which live in the
    constant bank: nothing is derived from them up front, so no register is held across the main loop; the Philox
    key is formed where it is used, ``key``).  Row counters (query position, (b << 16) | h) are given per call."""

    threshold: Int32  # uint32 bits
    scale: Float32
    seed_lo: Int32
    seed_hi: Int32
    offset_lo: Int32
    offset_hi: Int32
    mSeed: cute.Tensor | None  # optional (1,) int64 device tensor replacing the scalar seed (CUDA-graph replays)

    @staticmethod
    def create(threshold: Int32, scale: Float32, seed_lo: Int32, seed_hi: Int32, offset_lo: Int32,
               offset_hi: Int32, mSeed):
        return DropoutRng(threshold, scale, seed_lo, seed_hi, offset_lo, offset_hi, mSeed)

    @cute.jit
    def key(self):
        """(k0, k1) = (seed_lo, seed_hi ^ offset_hi); the seed tensor, when given, is read here (once per use:
        an L1 hit, and no register holds it between uses)."""
        seed_lo, seed_hi = self.seed_lo, self.seed_hi
        if const_expr(self.mSeed is not None):
            s = Int64(self.mSeed[0])
            seed_lo = Int32(s)
            seed_hi = Int32(s >> Int64(32))
        return Uint32(seed_lo), Uint32(seed_hi) ^ Uint32(self.offset_hi)

    @cute.jit
    def words(self, col0: Int32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32):
        """The four words of the Philox call holding key column ``col0`` (even) of query position ``qpos``: words
        0/1 for columns j0, j0 + 1 and 2/3 for j0 + 8, j0 + 9; in each, the low 16 bits for the query row i0 =
        16 (qpos // 16) + qpos % 8 and the high 16 bits for i0 + 8 (dropout.py)."""
        group = (col0 >> 4) * 4 + ((col0 & 7) >> 1)
        return self.group_words(Uint32(group), qpos, bh, k0, k1)

    @cute.jit
    def group_words(self, group: Uint32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32):
        """``words`` of column group ``group`` ((j // 16) * 4 + (j % 8) // 2, given by the caller)."""
        pair = (qpos >> 4) * 8 + (qpos & 7)
        return philox4x32(Uint32(bh), Uint32(pair), Uint32(self.offset_lo), group, k0, k1)


def row_pairs(t0_rows):
    """Trace time: a thread's accumulator rows (thread 0's offsets, in mn-view order) as pairs (r, r + 1) whose
    offsets are t and t + 8 with t % 16 == 0 (the rows g and g + 8 of an m16 atom, one Philox call's two rows when
    they are query positions), or None when the rows do not pair up that way."""
    rows = [int(t) for t in t0_rows]
    if len(rows) % 2:
        return None
    pairs = []
    for r in range(0, len(rows), 2):
        if rows[r] % 16 != 0 or rows[r + 1] != rows[r] + 8:
            return None
        pairs.append((r, r + 1))
    return pairs


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
