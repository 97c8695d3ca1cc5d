"""The score hook (CuTe-DSL device code, trace time): everything between the S = Q K^T accumulator and the
probabilities, written once and used by the forward kernels and both backward kernels, so P is computed by the
same code everywhere.

Today it holds the scale (in the log2 domain), softcap and the causal / sliding-window / sequence-end masks.
Score modifiers (score_mod, mask_mod) and dropout plug in here: the forward calls ``apply`` before its online
softmax, the backward calls ``apply`` and then ``backward_p_ds``, which recomputes P from the saved LSE and
forms dS, including the derivative of whatever ``apply`` did (softcap's 1 - tanh^2 today).

Mask conventions: see block_info.py.  Only boundary blocks are masked (the caller says which masks a block
needs, as compile-time flags); the inner loop is one integer compare + select per element.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..config import WINDOW_UNBOUNDED
from .cute_utils import LOG2_E, acc_mn_view
from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class ScoreHook:
    """``scale_log2``: softmax scale * log2(e) (softcap * log2(e) when softcap is on, the scores being
    ``softcap * tanh(s * softcap_prescale)``); window bounds as runtime values; flags as compile-time values.
    Build it with ``ScoreHook.create(cfg, ...)``."""

    has_softcap: bool
    windowed: bool
    tile_n: int
    seq: SeqInfo
    scale_log2: Float32
    softcap_prescale: Float32
    window_left: Int32
    window_right: Int32
    diag: Int32  # seqlen_k - seqlen_q: query i's diagonal key is i + diag (bottom-right alignment)

    @staticmethod
    def create(cfg, tile_n: int, seq: SeqInfo, scale_log2, softcap_prescale, window_left, window_right):
        return ScoreHook(cfg.has_softcap, cfg.windowed, tile_n, seq, scale_log2, softcap_prescale, window_left,
                         window_right, seq.seqlen_k - seq.seqlen_q)

    @cute.jit
    def for_sparse_block(self, masked) -> "ScoreHook":
        """The hook of one block-sparse tile of a windowed call: the call's window on a mask block, an unbounded one
        on a full block (only the sequence end is masked then).  A runtime choice of bounds, so the kernel keeps one
        masking code path (two compiled variants behind a branch cost the d=256 dK/dV tile its registers)."""
        left = Int32(WINDOW_UNBOUNDED)
        right = Int32(WINDOW_UNBOUNDED)
        if masked:
            left = self.window_left
            right = self.window_right
        return ScoreHook(self.has_softcap, self.windowed, self.tile_n, self.seq, self.scale_log2,
                         self.softcap_prescale, left, right, self.diag)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
              n_block: Int32, mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
              mask_left: cutlass.Constexpr[bool]):
        """Raw S tile -> transformed scores (softcap), masked entries -inf.  ``row_qpos``: query position of each
        of this thread's rows; ``tScS_mn``/``t0ScS_mn``: (row, col) coordinates of this thread's / thread 0's
        accumulator elements."""
        if const_expr(self.has_softcap):
            acc_S.store(cute.math.tanh(acc_S.load() * self.softcap_prescale, fastmath=True))
        if const_expr(mask_seqlen or mask_right or mask_left):
            self.mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)

    @cute.jit
    def mask(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen: cutlass.Constexpr[bool],
             mask_right: cutlass.Constexpr[bool], mask_left: cutlass.Constexpr[bool]):
        """Columns are compared as compile-time offsets of thread 0 against limits shifted by this thread's first
        column."""
        seqlen_k = self.seq.seqlen_k
        diag = self.diag
        s_mn = acc_mn_view(acc_S)
        col0 = tScS_mn[0, 0][1]
        col_base = n_block * self.tile_n + col0
        seq_hi = seqlen_k - col_base
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            hi = seq_hi
            lo = Int32(0)
            if const_expr(mask_right or mask_left):
                key_aligned = row_qpos[r] + diag - col_base
                if const_expr(mask_right):
                    hi = key_aligned + self.window_right + 1
                    if const_expr(mask_seqlen):
                        hi = cutlass.min(hi, seq_hi)
                if const_expr(mask_left):
                    lo = key_aligned - self.window_left
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                col = t0ScS_mn[0, c][1]
                if const_expr(mask_left):
                    if col >= hi or col < lo:
                        s_mn[r, c] = -Float32.inf
                elif const_expr(mask_seqlen or mask_right):
                    if col >= hi:
                        s_mn[r, c] = -Float32.inf

    # ---- backward
    @cute.jit
    def lse_log2(self, lse: Float32) -> Float32:
        """Saved natural-log LSE -> the log2-domain offset of P.  An empty row (LSE = -inf) gets +inf, so its P is
        exactly 0 rather than exp2(+inf)."""
        x = lse * LOG2_E
        return Float32.inf if x == -Float32.inf else x

    @cute.jit
    def backward_p(self, acc_S: cute.Tensor, lse_log2: cute.Tensor, acc_P: cute.Tensor):
        """P = exp2(S * scale_log2 - LSE_log2) from the scores after ``apply``, row-vectorised (the dK/dV kernel
        issues it before its dP mma, so the exp2 work overlaps that mma)."""
        s_mn, p_mn = acc_mn_view(acc_S), acc_mn_view(acc_P)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            p_mn[r, None].store(cute.math.exp2(s_mn[r, None].load() * self.scale_log2 - lse_log2[r], fastmath=True))

    @cute.jit
    def backward_ds(self, acc_S: cute.Tensor, acc_P: cute.Tensor, acc_dP: cute.Tensor, dpsum: cute.Tensor):
        """dS = P (dP - D) * d(apply)/dS, in place of dP (P from ``backward_p``)."""
        s_mn, p_mn, dp_mn = acc_mn_view(acc_S), acc_mn_view(acc_P), acc_mn_view(acc_dP)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            if const_expr(self.has_softcap):
                # d tanh = 1 - T^2; masked entries hold T = -inf and P = 0: clamp so they give 0, not NaN
                for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                    t = s_mn[r, c]
                    dp_mn[r, c] = p_mn[r, c] * (dp_mn[r, c] - dpsum[r]) * cute.arch.fmax(1.0 - t * t, 0.0)
            else:
                dp_mn[r, None].store(p_mn[r, None].load() * (dp_mn[r, None].load() - dpsum[r]))

    @cute.jit
    def backward_p_ds(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, lse_log2: cute.Tensor, dpsum: cute.Tensor,
                      acc_P: cute.Tensor, pdp: cute.Tensor, want_p: cutlass.Constexpr[bool],
                      want_pdp: cutlass.Constexpr[bool]):
        """``backward_p`` and ``backward_ds`` fused element by element (the dQ kernel, which needs P only for dS
        and the per-row sums of P dP, into pdp when ``want_pdp``; P into acc_P when ``want_p``).  Same formulas."""
        s_mn, dp_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        p_mn = acc_mn_view(acc_P)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                p = cute.math.exp2(s_mn[r, c] * self.scale_log2 - lse_log2[r], fastmath=True)
                if const_expr(want_pdp):
                    pdp[r] = pdp[r] + p * dp_mn[r, c]
                ds = p * (dp_mn[r, c] - dpsum[r])
                if const_expr(self.has_softcap):
                    # d tanh = 1 - T^2; masked entries hold T = -inf and P = 0: clamp so they give 0, not NaN
                    t = s_mn[r, c]
                    ds = ds * cute.arch.fmax(1.0 - t * t, 0.0)
                if const_expr(want_p):
                    p_mn[r, c] = p
                dp_mn[r, c] = ds
