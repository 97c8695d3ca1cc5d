"""The score hook (CuTe-DSL device code, trace time): everything between the S = Q K^T accumulator and the
probabilities, written once and used by the forward kernels and both backward kernels, so P is computed by the
same code everywhere.

Today it holds the scale (in the log2 domain), softcap and the causal / sliding-window / sequence-end masks.
Score modifiers (score_mod, mask_mod) plug in here: the forward calls ``apply`` before its online softmax, the
backward calls ``apply`` and then ``backward_p_ds``, which recomputes P from the saved LSE and forms dS,
including the derivative of whatever ``apply`` did (softcap's 1 - tanh^2 today).

Dropout (``has_dropout``, a compile-time flag; the keep mask is the Philox function of (seed, offset, b, h, i, j)
in kernels/philox.py, never of the tile): the forward's row sums / LSE take the undropped P and O accumulates
P * keep (``dropout_fwd``; the 1/(1-p) scale is applied to O once, in the epilogue).  The backward follows
FlashAttention-2: with dP = dO V^T and D = rowsum(dO * O),
    dS = P * (keep * dP / (1 - p) - D),      dV = (P * keep / (1 - p))^T dO
(the dK/dV kernel scales dV by 1/(1-p) once at the end).  The dropout methods (keep bits, their application) are
in score_dropout.py, a mixin of ``ScoreHook``.

Mask conventions: see block_info.py.  Only boundary blocks are masked (the caller says which masks a block
needs, as compile-time flags); the inner loop is one integer compare + select per element.
"""

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..config import WINDOW_UNBOUNDED
from .cute_utils import LOG2_E, acc_mn_view
from .philox import DropoutRng
from .score_dropout import DropoutScore
from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class ScoreHook(DropoutScore):
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
    has_dropout: bool = False
    quad_ok: bool = True  # every thread's first accumulator column is even and < 8 mod 16 (see philox.py)
    rng: DropoutRng | None = None
    row_loop: bool = True  # dropout_bits: one row per iteration of a loop that is not unrolled (else unrolled)
    dropout_packed: bool = False  # forward with packed GQA rows: keep bits row by row (dropout_bits)
    dropout_high_p: bool = False  # forward, threshold > dropout.F16_DIRECT_MAX_THRESHOLD: the direct test's complement
    group_loop: bool = False  # dropout_bits: one column group (Philox call) per iteration of a loop not unrolled
    # dropout_bits: the keep test as sign bits moved in by funnel shifts (the forward, ``as_drop``); else ISETP +
    # SEL + OR per element (the backward: the sign test's unrolled word chains spill its dS code)
    sign_test: bool = False
    # user mods (modspec.ModSpec, compile-time; None when off) and their aux tensors (a tuple of cute tensors)
    mods: object = None
    aux: object = None
    # forward only: (first tile row, first head of the group, pack) to map packed tile rows to query heads
    head_rows: object = None
    # block sparsity: whether the mask_mod applies to this block (a runtime value: True on "mask" blocks, False on
    # "full" ones, which skip it as upstream's do; ``for_sparse_block``; a mod without aux tensors is evaluated on
    # both and its verdict dropped on "full" ones, ``branches_on_gate``), None = always
    mask_gate: object = None
    # the accumulators hold S^T (keys as the mma rows: the key-row dK/dV kernel, bwd_dkdv_kvrows.py); ``mn`` then
    # views them as (query, key) all the same, so every method below indexes [query row, key column]
    transposed: bool = False
    # block-sparse backward tiles: put a mask_mod that reads no aux tensor behind a branch on ``mask_gate`` too (as
    # one that reads aux tensors always is), so "full" tiles skip its integer work (measured faster in the key-row
    # dK/dV kernel and slower in the dQ kernel, d128 S=16K causal as a block mask: not used there)
    gate_branch: bool = False

    @staticmethod
    def create(cfg, tile_n: int, seq: SeqInfo, scale_log2, softcap_prescale, window_left, window_right,
               rng=None, quad_ok: bool = True, row_loop: bool = True, group_loop: bool = False, aux=None):
        """With ``cfg.mods`` carrying a score_mod, ``softcap_prescale`` is the softmax scale applied to the raw
        scores before the mod and ``scale_log2`` is log2(e) (the host passes them so: upstream's convention)."""
        has_dropout = getattr(cfg, "has_dropout", False)
        mods = getattr(cfg, "mods", None)
        return ScoreHook(cfg.has_softcap, cfg.windowed, tile_n, seq, scale_log2, softcap_prescale, window_left,
                         window_right, seq.seqlen_k - seq.seqlen_q, has_dropout=has_dropout, quad_ok=quad_ok,
                         rng=rng if has_dropout else None, row_loop=row_loop,
                         dropout_packed=getattr(cfg, "dropout_packed", False),
                         dropout_high_p=getattr(cfg, "dropout_high_p", False), group_loop=group_loop, mods=mods,
                         aux=aux if mods is not None else None)

    def mn(self, acc: cute.Tensor) -> cute.Tensor:
        """An accumulator (or its coordinates) as [query row, key column] (``acc_mn_view``, transposed for S^T)."""
        v = acc_mn_view(acc)
        if const_expr(self.transposed):
            v = cute.make_tensor(v.iterator, cute.select(v.layout, mode=[1, 0]))
        return v

    @cute.jit
    def for_sparse_block(self, masked) -> "ScoreHook":
        """The hook of one block-sparse tile: the call's window on a mask block, an unbounded one on a full block
        (only the sequence end is masked then); the mask_mod on mask blocks only.  A runtime choice of bounds, so the kernel keeps one
        masking code path (two compiled variants behind a branch cost the d=256 dK/dV tile its registers)."""
        left = Int32(WINDOW_UNBOUNDED)
        right = Int32(WINDOW_UNBOUNDED)
        if masked:
            left = self.window_left
            right = self.window_right
        gate = None
        if const_expr(self.mods is not None and self.mods.mask_mod is not None):
            gate = cutlass.Boolean(masked)
        return replace(self, window_left=left, window_right=right, mask_gate=gate)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
              n_block: Int32, mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
              mask_left: cutlass.Constexpr[bool], row_head=None, raw_out=None,
              mask_mod_on: cutlass.Constexpr[bool] = True):
        """Raw S tile -> transformed scores (softcap or score_mod), masked entries -inf.  ``row_qpos``: query
        position of each of this thread's rows; ``tScS_mn``/``t0ScS_mn``: (row, col) coordinates of this thread's
        / thread 0's accumulator elements.  With mods: ``row_head`` is the query head of each row (a tensor like
        ``row_qpos``) or of all rows (a scalar); ``raw_out`` (backward with score_mod_bwd) receives the scaled
        scores before the score_mod.  A mask_mod applies to every block it is called on, except with
        ``mask_mod_on=False`` (the forward's block-sparse "full" tiles) or a false ``mask_gate`` (the backward's)."""
        if const_expr(self.has_softcap):  # never with a score_mod (the host refuses the pair)
            acc_S.store(cute.math.tanh(acc_S.load() * self.softcap_prescale, fastmath=True))
        with_mod = const_expr(self.mods is not None and self.mods.mask_mod is not None and mask_mod_on)
        if const_expr(self.mods is not None and self.mods.score_mod is not None):
            self.apply_score_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, raw_out)
        if const_expr(with_mod and self.branches_on_gate()):
            # the mod alone behind the branch, the masks after it for every tile: fusing the sequence end into
            # the branch puts it in both arms, which costs the full tiles (most of them) more than it saves
            if self.mask_gate:
                self.mask_with_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, False, False)
            if const_expr(mask_seqlen or mask_right or mask_left):
                self.mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)
        elif const_expr(with_mod):
            self.mask_mod_and_masks(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, mask_seqlen,
                                    mask_right, mask_left, self.mask_gate is not None)
        elif const_expr(mask_seqlen or mask_right or mask_left):
            self.mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)

    @cute.jit
    def apply_backward(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
                       n_block: Int32, row_head, raw_out, needs_mask):
        """``apply`` for a backward tile: the sequence-end mask and (windowed) the causal / window masks, on every
        tile when ``needs_mask`` is None, else behind a branch on it (a runtime Boolean,
        ``BlockInfo.tile_needs_mask``), the other tiles getting no mask at all."""
        if const_expr(needs_mask is None):
            self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, True, self.windowed, self.windowed, row_head,
                       raw_out)
        else:
            if needs_mask:
                self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, True, self.windowed, self.windowed,
                           row_head, raw_out)
            else:
                self.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, False, False, False, row_head, raw_out)

    @cute.jit
    def mask_mod_and_masks(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block,
                           mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
                           mask_left: cutlass.Constexpr[bool], gated: cutlass.Constexpr[bool]):
        """The mask_mod and the masks: the sequence-end mask joins the mod's pass (``mask_with_mod``); causal /
        window masks run after it as their own pass (``mask``), as fusing their bounds in too costs the d128
        dK/dV tile with a windowed aux-reading mod its last registers (spills)."""
        fuse = const_expr(not (mask_right or mask_left))
        self.mask_with_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, mask_seqlen and fuse, gated)
        if const_expr(not fuse):
            self.mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)

    def branches_on_gate(self) -> bool:
        """Trace time: whether a block-sparse backward tile (a runtime ``mask_gate``) puts its mask_mod behind a
        branch on the gate: when the mods read aux tensors, so "full" tiles issue none of the mod's loads.  A mod
        without aux tensors reads no memory: it runs on every tile, the gate joining its predicate
        (``mask_with_mod``), and no branch splits the tile's code."""
        return self.mask_gate is not None and (self.aux is not None or self.gate_branch)

    @cute.jit
    def apply_score_mod(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, raw_out):
        """The score_mod, with upstream flash-attn-4's call convention (the mask_mod: ``mask_with_mod``):
        ``score_mod(scores, b, h, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` on TensorSSA vectors of
        ``score_vec`` consecutive keys of one row (scores already times the softmax scale).  Indices are logical:
        batch entry, query head, position in the query sequence, position in the key sequence.  With aux
        tensors, indices past the sequence ends (entries masked anyway) are clamped to the last position, so a
        mod that indexes an aux tensor by position never reads outside it."""
        mods = self.mods
        s_mn = self.mn(acc_S)
        nrow = const_expr(cute.size(s_mn, mode=[0]))
        ncol = const_expr(cute.size(s_mn, mode=[1]))
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        clamp = const_expr(self.aux is not None)
        q_last = cutlass.max(self.seq.seqlen_q - 1, 0)
        k_last = cutlass.max(self.seq.seqlen_k - 1, 0)
        aux = self.aux if const_expr(self.aux is not None) else ()
        vec = const_expr(mods.score_vec)
        for r in cutlass.range_constexpr(nrow):
            q = row_qpos[r]
            if const_expr(clamp):
                q = cutlass.min(q, q_last)
            h = self.row_head(tScS_mn, r, row_head)
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
                out = mods.score_mod(sv.load(), _ssa(self.seq.batch, vec), _ssa(h, vec), q_idx=_ssa(q, vec),
                                     kv_idx=kv.load(), seqlen_info=self.seq, aux_tensors=aux)
                sv.store(out.to(Float32))
                for j in cutlass.range_constexpr(vec):
                    s_mn[r, c0 + j] = sv[j]

    @cute.jit
    def mask_with_mod(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block,
                      mask_seqlen: cutlass.Constexpr[bool], gated: cutlass.Constexpr[bool]):
        """The mask_mod, and with ``mask_seqlen`` the sequence-end mask, in one pass: an element is dropped when
        the mod does not keep it or it lies past seqlen_k, one select per element (not one per pass).
        ``mask_mod(b, h, q_idx, kv_idx, seqlen_info, aux_tensors)`` gets size-1 Int32 vectors (True = keep), the
        indices logical and clamped with aux tensors as for the score_mod (``apply_score_mod``).
        ``gated``: the mod's verdict counts only where ``mask_gate`` is true (``branches_on_gate``: a mod without
        aux tensors on a block-sparse backward tile), in place of a branch around the mod: no branch splits the
        tile's code, so ptxas interleaves the mod's integer work with the mma that follows (what the causal /
        window masks of ``for_sparse_block`` already get from runtime bounds).  Such a mod reads no memory, so
        running it on a "full" tile only spends a few integer instructions there."""
        s_mn = self.mn(acc_S)
        nrow = const_expr(cute.size(s_mn, mode=[0]))
        ncol = const_expr(cute.size(s_mn, mode=[1]))
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        hi = self.seq.seqlen_k - col_base
        clamp = const_expr(self.aux is not None)
        q_last = cutlass.max(self.seq.seqlen_q - 1, 0)
        k_last = cutlass.max(self.seq.seqlen_k - 1, 0)
        aux = self.aux if const_expr(self.aux is not None) else ()
        b_ssa = _ssa(self.seq.batch)
        for r in cutlass.range_constexpr(nrow):
            q = row_qpos[r]
            if const_expr(clamp):
                q = cutlass.min(q, q_last)
            h = _ssa(self.row_head(tScS_mn, r, row_head))
            q_ssa = _ssa(q)
            for c in cutlass.range_constexpr(ncol):
                col = t0ScS_mn[0, c][1]
                k = col_base + col
                if const_expr(clamp):
                    k = cutlass.min(k, k_last)
                keep = self.mods.mask_mod(b_ssa, h, q_ssa, _ssa(k), self.seq, aux)
                # bitwise on i1 (``and``/``or`` lower to chains of selects)
                drop = ~cutlass.Boolean(keep[0])
                if const_expr(gated):
                    drop = drop & self.mask_gate
                if const_expr(mask_seqlen):
                    drop = drop | (col >= hi)
                if drop:
                    s_mn[r, c] = -Float32.inf

    @cute.jit
    def row_head(self, tScS_mn, r: cutlass.Constexpr[int], row_head):
        """Query head of this thread's row ``r``: ``row_head`` when given (the backward's one head), else from the
        forward tile's (first row, first head, pack): a packed row is (position, head-in-group)."""
        if const_expr(row_head is not None):
            return row_head
        row0, head0, pack = self.head_rows
        row = row0 + tScS_mn[r, 0][0]
        return head0 + row - (row // pack) * pack

    @cute.jit
    def mask(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen: cutlass.Constexpr[bool],
             mask_right: cutlass.Constexpr[bool], mask_left: cutlass.Constexpr[bool]):
        """Columns are compared as compile-time offsets of thread 0 against limits shifted by this thread's first
        column."""
        seqlen_k = self.seq.seqlen_k
        diag = self.diag
        s_mn = self.mn(acc_S)
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
        s_mn, p_mn = self.mn(acc_S), self.mn(acc_P)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            p_mn[r, None].store(cute.math.exp2(s_mn[r, None].load() * self.scale_log2 - lse_log2[r], fastmath=True))

    @cute.jit
    def backward_ds(self, acc_S: cute.Tensor, acc_P: cute.Tensor, acc_dP: cute.Tensor, dpsum: cute.Tensor):
        """dS = P (dP - D) * d(apply)/dS, in place of dP (P from ``backward_p``).  With a score_mod the chain
        rule through it is ``backward_mods`` (the caller runs it after this)."""
        s_mn, p_mn, dp_mn = self.mn(acc_S), self.mn(acc_P), self.mn(acc_dP)
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
        s_mn, dp_mn = self.mn(acc_S), self.mn(acc_dP)
        p_mn = self.mn(acc_P)
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

    @cute.jit
    def backward_mods(self, acc_dS: cute.Tensor, acc_raw: cute.Tensor, tScS_mn, t0ScS_mn, row_qpos, row_head,
                      n_block):
        """Chain rule through the score_mod, in place of dS: ``score_mod_bwd(grad, score, b, h, q_idx=, kv_idx=,
        seqlen_info=, aux_tensors=)`` gets the gradient w.r.t. the modded score and the scaled score before the
        mod (``raw_out`` of ``apply``) and returns the gradient w.r.t. that scaled score (upstream's convention;
        the kernels apply the softmax scale to dQ/dK as without mods).  Masked entries have P = 0, so their grad
        is 0 and stays 0 for any finite derivative; NaN from a mod evaluated at a masked entry is zeroed."""
        mods = self.mods
        if const_expr(mods is not None and mods.score_mod is not None):
            ds_mn, raw_mn = self.mn(acc_dS), self.mn(acc_raw)
            nrow = const_expr(cute.size(ds_mn, mode=[0]))
            ncol = const_expr(cute.size(ds_mn, mode=[1]))
            col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
            clamp = const_expr(self.aux is not None)
            q_last = cutlass.max(self.seq.seqlen_q - 1, 0)
            k_last = cutlass.max(self.seq.seqlen_k - 1, 0)
            aux = self.aux if const_expr(self.aux is not None) else ()
            vec = const_expr(mods.score_vec)
            for r in cutlass.range_constexpr(nrow):
                q = row_qpos[r]
                if const_expr(clamp):
                    q = cutlass.min(q, q_last)
                h = self.row_head(tScS_mn, r, row_head)
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
                    out = mods.score_mod_bwd(gv.load(), sv.load(), _ssa(self.seq.batch, vec), _ssa(h, vec),
                                             q_idx=_ssa(q, vec), kv_idx=kv.load(), seqlen_info=self.seq,
                                             aux_tensors=aux)
                    sv.store(out.to(Float32))
                    for j in cutlass.range_constexpr(vec):
                        g = sv[j]
                        ds_mn[r, c0 + j] = g if gv[j] != 0.0 else Float32(0.0)


@cute.jit
def _ssa(x, n: cutlass.Constexpr[int] = 1):
    """A scalar as a TensorSSA of ``n`` equal Int32 values (the index arguments of a mod)."""
    t = cute.make_rmem_tensor(n, Int32)
    for i in cutlass.range_constexpr(n):
        t[i] = x
    return t.load()
