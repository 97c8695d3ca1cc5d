"""Which KV blocks a query tile visits, and masking of the boundary blocks (CuTe-DSL device code).

Conventions (FlashAttention's): query row i (0-based in its sequence) may attend key j when
    j <  seqlen_k                                   (always)
    j <= i + (seqlen_k - seqlen_q) + right          (causal: right = 0; bottom-right aligned when Sq != Sk)
    j >= i + (seqlen_k - seqlen_q) - left           (sliding window)
An unbounded side uses WINDOW_UNBOUNDED, so causal is "right = 0, left unbounded" and needs no extra code path.

Packed GQA: tile row ``idx`` is query position ``idx // pack`` of query head ``group * pack + idx % pack``.

KV blocks are visited from the last to the first.  ``KvBlockPlan`` splits them into
    first block      (seqlen + right + left masks)
    phase A          blocks crossing the right/causal diagonal (right + left masks)
    phase B          blocks fully inside the window (no mask at all)
    phase C          blocks crossing the left edge of the window (left mask)
so that only boundary tiles pay for masking, and the work of a tile follows its window.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .cute_utils import acc_mn_view


@cute.jit
def kv_block_plan(
    seqlen_q: Int32,
    seqlen_k: Int32,
    m_block: Int32,
    pack: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    windowed: cutlass.Constexpr[bool],
):
    """Return (n_min, n_max, count_a, count_b, count_c) for query tile ``m_block``.

    Blocks n_max-1 (first), then count_a, count_b, count_c blocks in descending order cover [n_min, n_max).
    """
    n_max = (seqlen_k + tile_n - 1) // tile_n
    n_min = Int32(0)
    n_right_full = n_max
    n_left_full = Int32(0)
    if const_expr(windowed):
        diag = seqlen_k - seqlen_q
        row_lo = m_block * tile_m
        row_hi = cutlass.min((m_block + 1) * tile_m, seqlen_q * pack) - 1
        q_lo = row_lo // pack
        q_hi = row_hi // pack
        x = q_hi + diag + window_right
        n_max = cutlass.min(n_max, cutlass.max(x + tile_n, 0) // tile_n)
        n_min = cutlass.max(q_lo + diag - window_left, 0) // tile_n
        n_right_full = cutlass.max(q_lo + diag + window_right + 1, 0) // tile_n
        n_left_full = cutlass.max(q_hi + diag - window_left + tile_n - 1, 0) // tile_n
    n_first = n_max - 1
    r_end = cutlass.max(n_right_full, n_min)
    l_end = cutlass.max(n_left_full, n_min)
    count_a = cutlass.max(n_first - r_end, 0)
    start_b = cutlass.min(n_first, r_end)
    count_b = cutlass.max(start_b - l_end, 0)
    count_c = cutlass.max(cutlass.min(start_b, l_end) - n_min, 0)
    return n_min, n_max, count_a, count_b, count_c


@cute.jit
def apply_mask(
    acc_S: cute.Tensor,
    tScS_mn: cute.Tensor,
    t0ScS_mn: cute.Tensor,
    row_qpos: cute.Tensor,
    n_block: Int32,
    seqlen_k: Int32,
    diag: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_n: cutlass.Constexpr[int],
    mask_seqlen: cutlass.Constexpr[bool],
    mask_right: cutlass.Constexpr[bool],
    mask_left: cutlass.Constexpr[bool],
):
    """Set masked scores of one S tile to -inf.

    ``tScS_mn``/``t0ScS_mn`` are the (row, col) coordinates of this thread's / thread 0's accumulator elements;
    columns are compared as compile-time offsets of thread 0 against limits shifted by this thread's first
    column, so the inner loop is one integer compare + select per element.
    """
    s_mn = acc_mn_view(acc_S)
    col0 = tScS_mn[0, 0][1]
    col_base = n_block * tile_n + col0
    seq_hi = seqlen_k - col_base
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        hi = seq_hi
        lo = Int32(0)
        if const_expr(mask_right or mask_left):
            key_aligned = row_qpos[r] + diag - col_base
            if const_expr(mask_right):
                hi = key_aligned + window_right + 1
                if const_expr(mask_seqlen):
                    hi = cutlass.min(hi, seq_hi)
            if const_expr(mask_left):
                lo = key_aligned - window_left
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            col = t0ScS_mn[0, c][1]
            if const_expr(mask_left):
                if col >= hi or col < lo:
                    s_mn[r, c] = -Float32.inf
            elif const_expr(mask_seqlen or mask_right):
                if col >= hi:
                    s_mn[r, c] = -Float32.inf
