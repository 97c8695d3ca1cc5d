"""Block schedule (CuTe-DSL device code, trace time): which KV blocks a query tile visits, which query blocks a KV
tile is seen by, and in which order and with which masks the forward visits them.

Conventions (FlashAttention's): query row i (0-based in its sequence) may attend key j when
    j <  seqlen_k                                   (always)
    j <= i + (seqlen_k - seqlen_q) + right          (causal: right = 0; bottom-right aligned when Sq != Sk)
    j >= i + (seqlen_k - seqlen_q) - left           (sliding window)
An unbounded side uses WINDOW_UNBOUNDED, so causal is "right = 0, left unbounded" and needs no extra code path.

Packed GQA: tile row ``idx`` is query position ``idx // pack`` of query head ``group * pack + idx % pack``.

The forward visits KV blocks from the last to the first, in four phases (``kv_plan``):
    first block      (seqlen + right + left masks)
    phase A          blocks crossing the right/causal diagonal (right + left masks)
    phase B          blocks fully inside the window (no mask at all)
    phase C          blocks crossing the left edge of the window (left mask)
so that only boundary tiles pay for masking, and the work of a tile follows its window.

The schedule is overridable: a kernel takes its ``BlockInfo`` class as a class attribute, and a subclass may
replace ``kv_plan``/``run_kv_schedule`` (split-KV restricts the range; block sparsity replaces the phases by an
index list) or ``q_range`` without touching the kernels.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class BlockInfo:
    """Block ranges of one batch entry.  ``pack``: query rows per position in a tile (packed GQA), 1 otherwise."""

    tile_m: int
    tile_n: int
    windowed: bool
    seq: SeqInfo
    window_left: Int32
    window_right: Int32
    pack: Int32

    @cute.jit
    def kv_plan(self, m_block: Int32):
        """(n_min, n_max, count_a, count_b, count_c) for query tile ``m_block``: blocks n_max-1 (first), then
        count_a, count_b, count_c blocks in descending order cover [n_min, n_max)."""
        tile_m, tile_n = self.tile_m, self.tile_n
        seqlen_q, seqlen_k = self.seq.seqlen_q, self.seq.seqlen_k
        n_max = (seqlen_k + tile_n - 1) // tile_n
        n_min = Int32(0)
        n_right_full = n_max
        n_left_full = Int32(0)
        if const_expr(self.windowed):
            pack = self.pack
            diag = seqlen_k - seqlen_q
            row_lo = m_block * tile_m
            row_hi = cutlass.min((m_block + 1) * tile_m, seqlen_q * pack) - 1
            q_lo = row_lo // pack
            q_hi = row_hi // pack
            x = q_hi + diag + self.window_right
            n_max = cutlass.min(n_max, cutlass.max(x + tile_n, 0) // tile_n)
            n_min = cutlass.max(q_lo + diag - self.window_left, 0) // tile_n
            n_right_full = cutlass.max(q_lo + diag + self.window_right + 1, 0) // tile_n
            n_left_full = cutlass.max(q_hi + diag - self.window_left + tile_n - 1, 0) // tile_n
        n_first = n_max - 1
        r_end = cutlass.max(n_right_full, n_min)
        l_end = cutlass.max(n_left_full, n_min)
        count_a = cutlass.max(n_first - r_end, 0)
        start_b = cutlass.min(n_first, r_end)
        count_b = cutlass.max(start_b - l_end, 0)
        count_c = cutlass.max(cutlass.min(start_b, l_end) - n_min, 0)
        return n_min, n_max, count_a, count_b, count_c

    def kv_range(self, m_block: Int32):
        """[n_min, n_max): the KV blocks query tile ``m_block`` sees (the dQ kernel walks them in order)."""
        n_min, n_max, _, _, _ = self.kv_plan(m_block)
        return n_min, n_max

    @cute.jit
    def q_range(self, n_block: Int32):
        """[m_min, m_max): the query blocks (of ``tile_m`` positions, pack 1) that see KV block ``n_block``."""
        seqlen_q, seqlen_k = self.seq.seqlen_q, self.seq.seqlen_k
        m_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_min = Int32(0)
        if const_expr(self.windowed):
            diag = seqlen_k - seqlen_q
            # key j is seen by query i iff i >= j - diag - right and i <= j - diag + left
            i_lo = n_block * self.tile_n - diag - self.window_right
            i_hi = (n_block + 1) * self.tile_n - 1 - diag + self.window_left
            m_min = cutlass.max(i_lo, 0) // self.tile_m
            m_max = cutlass.min(m_max, cutlass.max(i_hi + self.tile_m, 0) // self.tile_m)
        return m_min, m_max

    @cute.jit
    def tile_needs_mask(self, m_block: Int32, n_block: Int32):
        """Whether the tile of query block ``m_block`` (pack 1) and KV block ``n_block`` holds an element that a mask
        removes: a key past seqlen_k, or (windowed) one right of the causal diagonal / window or left of the
        window.  The backward kernels mask only such tiles (a branch per tile), the rest of the walk needs none.
        Conservative past the last query: rows past seqlen_q have P = 0 whatever their scores."""
        seqlen_q, seqlen_k = self.seq.seqlen_q, self.seq.seqlen_k
        k_lo = n_block * self.tile_n
        need = k_lo + self.tile_n > seqlen_k
        if const_expr(self.windowed):
            diag = seqlen_k - seqlen_q
            q_lo = m_block * self.tile_m
            need = need | (k_lo + self.tile_n - 1 > q_lo + diag + self.window_right) | (
                k_lo < q_lo + self.tile_m - 1 + diag - self.window_left)
        return need

    @cute.jit
    def run_kv_schedule(self, step, state, plan):
        """Visit the KV blocks of ``plan`` (from ``kv_plan``) last to first, each with the masks its phase needs.
        ``step(n_block, state, is_first, mask_seqlen, mask_right, mask_left)`` processes one block and returns
        the updated pipeline state."""
        _, n_max, count_a, count_b, count_c = plan
        windowed = self.windowed
        n_first = n_max - 1
        state = step(n_first, state, is_first=True, mask_seqlen=True, mask_right=windowed, mask_left=windowed)
        if const_expr(windowed):
            for i in cutlass.range(count_a, unroll=1):
                state = step(n_first - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=True,
                             mask_left=True)
        start_b = n_first - count_a
        for i in cutlass.range(count_b, unroll=1):
            state = step(start_b - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=False,
                         mask_left=False)
        if const_expr(windowed):
            start_c = start_b - count_b
            for i in cutlass.range(count_c, unroll=1):
                state = step(start_c - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=False,
                             mask_left=True)
        return state


@dataclass(frozen=True)
class SplitBlockInfo(BlockInfo):
    """Split-KV schedule: split ``split_idx`` of ``num_splits`` visits only its share of the KV blocks a query tile
    sees.  The tile's range [n_min, n_max) (masks and window included) is cut into ``num_splits`` runs of
    ceil(count / num_splits) blocks; split s takes [n_min + s*per, min(n_min + (s+1)*per, n_max)), which may be
    empty (the kernels then write O = 0 and LSE = -inf, which the combine skips).

    The split's first (highest) block takes every mask the tile may need (seqlen, right, left): a superset, so it
    is correct whichever phase of the unsplit plan that block belongs to.  The other blocks keep the phase they
    have in the unsplit plan (A: right+left, B: none, C: left), intersected with the split's run.
    Inference only (the dQ kernel's ``kv_range`` is not split).
    """

    split_idx: Int32 = 0
    num_splits: Int32 = 1

    @cute.jit
    def kv_plan(self, m_block: Int32):
        n_min, n_max, count_a, count_b, count_c = BlockInfo.kv_plan(self, m_block)
        # phase boundaries of the unsplit plan (blocks descending from n_max - 1):
        #   A: [a_lo, n_max - 1)   B: [b_lo, a_lo)   C: [n_min, b_lo)
        a_lo = n_max - 1 - count_a
        b_lo = a_lo - count_b
        total = cutlass.max(n_max - n_min, 0)
        per = (total + self.num_splits - 1) // self.num_splits
        lo = cutlass.min(n_min + self.split_idx * per, n_max)
        hi = cutlass.min(lo + per, n_max)
        first = hi - 1  # the split's first block (all masks)
        # every block of [lo, first) keeps its phase: count the part of each phase inside the run
        s_count_a = cutlass.max(first - cutlass.max(a_lo, lo), 0)
        s_start_b = first - s_count_a
        s_count_b = cutlass.max(s_start_b - cutlass.max(b_lo, lo), 0)
        s_start_c = s_start_b - s_count_b
        s_count_c = cutlass.max(s_start_c - lo, 0)
        # uniform over the CTA: keep the plan in uniform registers, off the mma warps' budget (in general
        # registers these quotients stay live through the main loop and made the d256 tile spill)
        u = cute.arch.make_warp_uniform
        return u(lo), u(hi), u(s_count_a), u(s_count_b), u(s_count_c)
