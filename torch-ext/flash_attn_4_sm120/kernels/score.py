"""The score hook (CuTe-DSL device code, trace time): everything between the S = Q K^T accumulator and the
probabilities, written once and used by the forward kernels and both backward kernels, so P is computed by the
same code everywhere.

The hook holds the scale (in the log2 domain), the score transform (softcap, or the user's score_mod) and two
components: ``mask`` (score_mask.py: sequence end, causal / sliding window, mask_mod, block-sparse gating, and the
positions of the tile's elements) and ``dropout`` (score_dropout.py: the Philox parameters and keep bits; None
without dropout).  The forward calls ``apply`` before its online softmax, whose probabilities are ``probs`` (with
the running max as the offset); the backward calls ``apply`` and then the P path: ``backward_p`` /
``backward_ds`` (the dK/dV kernels) or ``backward_p_ds`` (the dQ kernel) recompute P = ``probs`` with the saved LSE
as the offset and form dS, including the derivative of whatever ``apply`` did (softcap's 1 - tanh^2 here, the
score_mod's through ``backward_mods``) and, when given the tile's keep bits, dropout.
The components hold what the hook held as one object before; the split emits the same operations in the same
order, and the kernels' SASS did not change (benchmarks/results/sass_compare_score_components_d13c2ba.txt).

Dropout (the keep mask is the Philox function of (seed, offset, b, h, i, j) in kernels/philox.py, never of the
tile): the forward's row sums / LSE take the undropped P and O accumulates P * keep (``Dropout.apply_fwd``; the
1/(1-p) scale is applied to O once, in the epilogue).  The backward follows FlashAttention-2: with dP = dO V^T and
D = rowsum(dO * O),
    dS = P * (keep * dP / (1 - p) - D),      dV = (P * keep / (1 - p))^T dO
(the dK/dV kernel scales dV by 1/(1-p) once at the end).
"""

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .cute_utils import LOG2_E
from .score_dropout import Dropout
from .score_mask import Mask, ssa


@dataclass(frozen=True)
class ScoreHook:
    """``scale_log2``: softmax scale * log2(e) (softcap * log2(e) when softcap is on, the scores being
    ``softcap * tanh(s * softcap_prescale)``); with a score_mod, ``softcap_prescale`` is the softmax scale applied
    to the raw scores before the mod and ``scale_log2`` is log2(e) (the host passes them so: upstream's
    convention).  Build it with ``ScoreHook.create(cfg, ...)``."""

    has_softcap: bool
    scale_log2: Float32
    softcap_prescale: Float32
    mask: Mask
    dropout: Dropout | None = None
    mods: object = None  # the user's mods (modspec.ModSpec, compile-time; None when off): score_mod here

    @staticmethod
    def create(cfg, scale_log2, softcap_prescale, mask: Mask, dropout: Dropout | None = None) -> "ScoreHook":
        return ScoreHook(cfg.has_softcap, scale_log2, softcap_prescale, mask, dropout, getattr(cfg, "mods", None))

    @property
    def seq(self):
        return self.mask.seq

    def with_head_rows(self, head_rows) -> "ScoreHook":
        """The forward tile's (first tile row, first head of the group, pack), so mods see (position, head) of
        packed rows (``Mask.row_head``)."""
        return replace(self, mask=replace(self.mask, head_rows=head_rows))

    def as_transposed(self) -> "ScoreHook":
        """The hook of a kernel whose accumulators hold S^T (``Mask.transposed``)."""
        return replace(self, mask=replace(self.mask, transposed=True))

    def mn(self, acc: cute.Tensor) -> cute.Tensor:
        """An accumulator (or its coordinates) as [query row, key column] (``Mask.mn``)."""
        return self.mask.mn(acc)

    def for_sparse_block(self, masked, gate_branch: bool = False) -> "ScoreHook":
        """The hook of one block-sparse tile: its mask is ``Mask.for_sparse_block``."""
        return replace(self, mask=self.mask.for_sparse_block(masked, gate_branch))

    # ---- the score transform and the masks (forward and backward)
    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
              n_block: Int32, mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
              mask_left: cutlass.Constexpr[bool], row_head=None, raw_out=None,
              mask_mod_on: cutlass.Constexpr[bool] = True):
        """Raw S tile -> transformed scores (softcap or score_mod), masked entries -inf (``Mask.apply``, whose
        docstring gives the coordinate arguments).  With mods: ``row_head`` is the query head of each row (a tensor
        like ``row_qpos``) or of all rows (a scalar); ``raw_out`` (backward with score_mod_bwd) receives the scaled
        scores before the score_mod."""
        if const_expr(self.has_softcap):  # never with a score_mod (the host refuses the pair)
            acc_S.store(cute.math.tanh(acc_S.load() * self.softcap_prescale, fastmath=True))
        if const_expr(self.mods is not None and self.mods.score_mod is not None):
            self.apply_score_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, raw_out)
        self.mask.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left, row_head,
                        mask_mod_on)

    @cute.jit
    def apply_backward(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
                       n_block: Int32, row_head, raw_out, needs_mask):
        """``apply`` for a backward tile: the sequence-end mask and (windowed) the causal / window masks, on every
        tile when ``needs_mask`` is None, else behind a branch on it (a runtime Boolean,
        ``BlockInfo.tile_needs_mask``), the other tiles getting no mask at all."""
        windowed = const_expr(self.mask.windowed)
        if const_expr(needs_mask is None):
            self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, True, windowed, windowed, row_head, raw_out)
        else:
            if needs_mask:
                self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, True, windowed, windowed, row_head,
                           raw_out)
            else:
                self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, False, False, False, row_head, raw_out)

    @cute.jit
    def apply_score_mod(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, raw_out):
        """The score_mod, with upstream flash-attn-4's call convention (the mask_mod: ``Mask.mask_with_mod``):
        ``score_mod(scores, b, h, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` on TensorSSA vectors of
        ``score_vec`` consecutive keys of one row (scores already times the softmax scale).  Indices are logical:
        batch entry, query head, position in the query sequence, position in the key sequence.  With aux
        tensors, indices past the sequence ends (entries masked anyway) are clamped to the last position, so a
        mod that indexes an aux tensor by position never reads outside it."""
        mods, m = self.mods, self.mask
        s_mn = self.mn(acc_S)
        nrow = const_expr(cute.size(s_mn, mode=[0]))
        ncol = const_expr(cute.size(s_mn, mode=[1]))
        col_base = n_block * m.tile_n + tScS_mn[0, 0][1]
        clamp = const_expr(m.aux is not None)
        q_last = cutlass.max(m.seq.seqlen_q - 1, 0)
        k_last = cutlass.max(m.seq.seqlen_k - 1, 0)
        aux = m.aux if const_expr(m.aux is not None) else ()
        vec = const_expr(mods.score_vec)
        for r in cutlass.range_constexpr(nrow):
            q = row_qpos[r]
            if const_expr(clamp):
                q = cutlass.min(q, q_last)
            h = m.row_head(tScS_mn, r, row_head)
            for c0 in cutlass.range_constexpr(0, ncol, vec):
                sv = cute.make_rmem_tensor(vec, Float32)
                kv = cute.make_rmem_tensor(vec, Int32)
                for j in cutlass.range_constexpr(vec):
                    x = s_mn[r, c0 + j] * self.softcap_prescale
                    if const_expr(raw_out is not None):
                        self.mn(raw_out)[r, c0 + j] = x
                    sv[j] = x
                    k = col_base + t0ScS_mn[0, c0 + j][1]
                    if const_expr(clamp):
                        k = cutlass.min(k, k_last)
                    kv[j] = k
                out = mods.score_mod(sv.load(), ssa(m.seq.batch, vec), ssa(h, vec), q_idx=ssa(q, vec),
                                     kv_idx=kv.load(), seqlen_info=m.seq, aux_tensors=aux)
                sv.store(out.to(Float32))
                for j in cutlass.range_constexpr(vec):
                    s_mn[r, c0 + j] = sv[j]

    # ---- the P path: P from the transformed scores, then (backward) dS
    def probs(self, scores, offset_log2):
        """P = exp2(scores * scale_log2 - offset) of a score or a row of scores: the forward's online softmax with
        the running max (times scale_log2) as the offset, the backward with the saved LSE (``lse_log2``)."""
        return cute.math.exp2(scores * self.scale_log2 - offset_log2, fastmath=True)

    @cute.jit
    def lse_log2(self, lse: Float32) -> Float32:
        """Saved natural-log LSE -> the log2-domain offset of P.  An empty row (LSE = -inf) gets +inf, so its P is
        exactly 0 rather than exp2(+inf)."""
        x = lse * LOG2_E
        return Float32.inf if x == -Float32.inf else x

    @cute.jit
    def backward_p(self, acc_S: cute.Tensor, lse_log2: cute.Tensor, acc_P: cute.Tensor):
        """P from the scores after ``apply``, row-vectorised (the dK/dV kernel issues it before its dP mma, so the
        exp2 work overlaps that mma)."""
        s_mn, p_mn = self.mn(acc_S), self.mn(acc_P)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            p_mn[r, None].store(self.probs(s_mn[r, None].load(), lse_log2[r]))

    @cute.jit
    def ds(self, s, p, dp, d_r, keep):
        """(dS, P * keep, the dP that the row sum of P dP takes) of one element: dS = P (dP - D) * d(apply)/dS
        without dropout (``keep`` None), else P (keep dP / (1-p) - D) * d(apply)/dS.  With dropout and without a
        window the keep test selects the scale (0 for a dropped element), so that dP * scale - D contracts to one
        FFMA; with one, dP * scale is selected: in Nsight Compute cycles (d128, S=4096, p=0.1) the FFMA form made
        the key-row dK/dV kernel faster without a window and slower with one, although its sm_120a loop is shorter
        either way (a scheduling effect).  Softcap's d tanh = 1 - T^2: masked entries hold T = -inf and P = 0, so
        it is clamped to give 0, not NaN."""
        dp_eff = dp
        ds = Float32(0.0)
        if const_expr(keep is None):
            ds = p * (dp - d_r)
        elif const_expr(self.mask.windowed):
            dp_eff = dp * self.dropout.scale if keep else Float32(0.0)
            ds = p * (dp_eff - d_r)
        else:
            s_e = self.dropout.scale if keep else Float32(0.0)
            dp_eff = dp * s_e
            ds = p * (dp * s_e - d_r)
        if const_expr(self.has_softcap):
            ds = ds * cute.arch.fmax(1.0 - s * s, 0.0)
        p_kept = p
        if const_expr(keep is not None):
            p_kept = p if keep else Float32(0.0)
        return ds, p_kept, dp_eff

    @cute.jit
    def backward_ds(self, acc_S: cute.Tensor, acc_P: cute.Tensor, acc_dP: cute.Tensor, dpsum: cute.Tensor,
                    bits: cute.Tensor = None):
        """dS in place of dP (P from ``backward_p``; ``ds``).  With dropout (``bits``: the tile's keep bits,
        ``Dropout.bits``), P * keep in place of P (for dV; the 1/(1-p) scale of dV is applied once by the caller).
        With a score_mod the chain rule through it is ``backward_mods`` (the caller runs it after this)."""
        s_mn, p_mn, dp_mn = self.mn(acc_S), self.mn(acc_P), self.mn(acc_dP)
        ncols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            if const_expr(bits is not None or self.has_softcap):
                for c in cutlass.range_constexpr(ncols):
                    keep = None
                    if const_expr(bits is not None):
                        keep = self.dropout.kept(bits, r * ncols + c)
                    ds, p_kept, _ = self.ds(s_mn[r, c], p_mn[r, c], dp_mn[r, c], dpsum[r], keep)
                    dp_mn[r, c] = ds
                    if const_expr(bits is not None):
                        p_mn[r, c] = p_kept
            else:
                dp_mn[r, None].store(p_mn[r, None].load() * (dp_mn[r, None].load() - dpsum[r]))

    @cute.jit
    def backward_p_ds(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, lse_log2: cute.Tensor, dpsum: cute.Tensor,
                      acc_P: cute.Tensor, pdp: cute.Tensor, want_p: cutlass.Constexpr[bool],
                      want_pdp: cutlass.Constexpr[bool], bits: cute.Tensor = None):
        """``backward_p`` and ``backward_ds`` fused element by element (the dQ kernel, which needs P only for dS
        and the per-row sums of P dP, into pdp when ``want_pdp``; P into acc_P when ``want_p``, not with
        dropout).  Same formulas; with dropout dP is the dropped and scaled one, so pdp stays D = rowsum(dO * O)
        exactly.  (Where pdp is summed, before or after dS, follows the two paths' order before they were one,
        which gives the kernels their SASS.)"""
        s_mn, dp_mn = self.mn(acc_S), self.mn(acc_dP)
        p_mn = self.mn(acc_P)
        ncols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(ncols):
                keep = None
                if const_expr(bits is not None):
                    keep = self.dropout.kept(bits, r * ncols + c)
                p = self.probs(s_mn[r, c], lse_log2[r])
                if const_expr(want_pdp and bits is None):
                    pdp[r] = pdp[r] + p * dp_mn[r, c]
                ds, _, dp_eff = self.ds(s_mn[r, c], p, dp_mn[r, c], dpsum[r], keep)
                if const_expr(want_pdp and bits is not None):
                    pdp[r] = pdp[r] + p * dp_eff
                if const_expr(want_p):
                    p_mn[r, c] = p
                dp_mn[r, c] = ds

    @cute.jit
    def backward_mods(self, acc_dS: cute.Tensor, acc_raw: cute.Tensor, tScS_mn, t0ScS_mn, row_qpos, row_head,
                      n_block):
        """Chain rule through the score_mod, in place of dS: ``score_mod_bwd(grad, score, b, h, q_idx=, kv_idx=,
        seqlen_info=, aux_tensors=)`` gets the gradient w.r.t. the modded score and the scaled score before the
        mod (``raw_out`` of ``apply``) and returns the gradient w.r.t. that scaled score (upstream's convention;
        the kernels apply the softmax scale to dQ/dK as without mods).  Masked entries have P = 0, so their grad
        is 0 and stays 0 for any finite derivative; NaN from a mod evaluated at a masked entry is zeroed."""
        mods, m = self.mods, self.mask
        if const_expr(mods is not None and mods.score_mod is not None):
            ds_mn, raw_mn = self.mn(acc_dS), self.mn(acc_raw)
            nrow = const_expr(cute.size(ds_mn, mode=[0]))
            ncol = const_expr(cute.size(ds_mn, mode=[1]))
            col_base = n_block * m.tile_n + tScS_mn[0, 0][1]
            clamp = const_expr(m.aux is not None)
            q_last = cutlass.max(m.seq.seqlen_q - 1, 0)
            k_last = cutlass.max(m.seq.seqlen_k - 1, 0)
            aux = m.aux if const_expr(m.aux is not None) else ()
            vec = const_expr(mods.score_vec)
            for r in cutlass.range_constexpr(nrow):
                q = row_qpos[r]
                if const_expr(clamp):
                    q = cutlass.min(q, q_last)
                h = m.row_head(tScS_mn, r, row_head)
                for c0 in cutlass.range_constexpr(0, ncol, vec):
                    gv = cute.make_rmem_tensor(vec, Float32)
                    sv = cute.make_rmem_tensor(vec, Float32)
                    kv = cute.make_rmem_tensor(vec, Int32)
                    for j in cutlass.range_constexpr(vec):
                        gv[j] = ds_mn[r, c0 + j]
                        sv[j] = raw_mn[r, c0 + j]
                        k = col_base + t0ScS_mn[0, c0 + j][1]
                        if const_expr(clamp):
                            k = cutlass.min(k, k_last)
                        kv[j] = k
                    out = mods.score_mod_bwd(gv.load(), sv.load(), ssa(m.seq.batch, vec), ssa(h, vec),
                                             q_idx=ssa(q, vec), kv_idx=kv.load(), seqlen_info=m.seq,
                                             aux_tensors=aux)
                    sv.store(out.to(Float32))
                    for j in cutlass.range_constexpr(vec):
                        g = sv[j]
                        ds_mn[r, c0 + j] = g if gv[j] != 0.0 else Float32(0.0)
