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
(the dK/dV kernel scales dV by 1/(1-p) once at the end).

Mask conventions: see block_info.py.  Only boundary blocks are masked (the caller says which masks a block
needs, as compile-time flags); the inner loop is one integer compare + select per element.
"""

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64, const_expr

from ..config import WINDOW_UNBOUNDED
from .cute_utils import LOG2_E, acc_mn_view
from .philox import DropoutRng, column_groups, row_pairs
from .seqlen_info import SeqInfo


def _regular_step(groups):
    """Trace time: the column step between consecutive Philox groups when they are evenly spaced, of one kind,
    and cover mn-view columns in order (group g = columns g * n ... g * n + n - 1); else None."""
    if not groups:
        return None
    kind, t00, cs0 = groups[0]
    n = len(cs0)
    step = groups[1][1] - t00 if len(groups) > 1 else 0
    for g, (k, t0, cs) in enumerate(groups):
        if k != kind or t0 != t00 + g * step or tuple(cs) != tuple(range(g * n, g * n + n)):
            return None
    return step if n * len(groups) <= 32 else None


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
    has_dropout: bool = False
    quad_ok: bool = True  # every thread's first accumulator column is even and < 8 mod 16 (see philox.py)
    rng: DropoutRng | None = None
    row_loop: bool = True  # dropout_bits: one row per iteration of a loop that is not unrolled (else unrolled)
    dropout_packed: bool = False  # forward with packed GQA rows: keep bits row by row (dropout_bits)
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
                         dropout_packed=getattr(cfg, "dropout_packed", False), group_loop=group_loop, mods=mods,
                         aux=aux if mods is not None else None)

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
        return self.mask_gate is not None and self.aux is not None

    @cute.jit
    def apply_score_mod(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, raw_out):
        """The score_mod, with upstream flash-attn-4's call convention (the mask_mod: ``mask_with_mod``):
        ``score_mod(scores, b, h, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` on TensorSSA vectors of
        ``score_vec`` consecutive keys of one row (scores already times the softmax scale).  Indices are logical:
        batch entry, query head, position in the query sequence, position in the key sequence.  With aux
        tensors, indices past the sequence ends (entries masked anyway) are clamped to the last position, so a
        mod that indexes an aux tensor by position never reads outside it."""
        mods = self.mods
        s_mn = acc_mn_view(acc_S)
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
                        acc_mn_view(raw_out)[r, c0 + j] = x
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
        s_mn = acc_mn_view(acc_S)
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

    # ---- dropout
    # The keep mask of a tile is produced as packed bits (``dropout_bits``: one bit per accumulator element of
    # this thread, 32 per Uint32 word) by the kernels *before* their S = Q K^T mma, when neither S nor dP is
    # live, so the Philox work never adds to the peak register pressure of the score / softmax / dS code (in the
    # PTX: ptxas may still move it, e.g. the d128 TMA forward's SASS interleaves it with the softmax, 0 spills); the
    # backward consumers read one bit per element, the forward (``dropout_fwd``, drop bits) two per PRMT + LOP3.
    def _dropout_groups(self, t0ScS_mn):
        """Trace time: this thread's accumulator columns grouped by Philox call (kernels/philox.py)."""
        ncols = cute.size(t0ScS_mn, mode=[1])
        return column_groups([t0ScS_mn[0, c][1] for c in range(ncols)], self.quad_ok)

    def dropout_num_words(self, tScS_mn) -> int:
        return -(-cute.size(tScS_mn) // 32)

    @cute.jit
    def _group_values(self, w, kind: cutlass.Constexpr, col: Int32):
        """The 32-bit words of a thread's columns in one Philox call: (w0, w1, w2, w3) for a quad; for a pair
        (columns j, j + 1 only) words 0/1 when j % 16 < 8, else 2/3."""
        if const_expr(kind == "quad"):
            return (w[0], w[1], w[2], w[3])
        else:
            hi = (col & 8) != 0
            return (w[2] if hi else w[0], w[3] if hi else w[1])

    @staticmethod
    def _place(bits: cute.Tensor, first: int, n: int, row: Uint32):
        """Trace time: OR ``n`` keep bits (bit c for element ``first + c``; nothing above bit n - 1) into the
        packed words."""
        if first % 32 + n <= 32:
            shifted = row if first % 32 == 0 else row << Uint32(first % 32)
            bits[first // 32] = bits[first // 32] | shifted
        else:
            for c in range(n):
                idx = first + c
                bits[idx // 32] = bits[idx // 32] | (((row >> Uint32(c)) & Uint32(1)) << Uint32(idx % 32))

    @staticmethod
    def _shift_in(acc: Uint32, x: Uint32) -> Uint32:
        """Trace time: ``acc`` moved up one bit with the sign bit of ``x`` as its new bit 0 (one funnel shift)."""
        return (acc << Uint32(1)) | (x >> Uint32(31))

    @staticmethod
    def _sign_word(xs) -> Uint32:
        """Trace time: a word whose bit i is the sign bit of ``xs[i]`` (at most 32 values): one funnel-shift chain
        per byte (8 dependent shifts, the chains independent of each other), the bytes then merged."""
        word = None
        for b0 in range(0, len(xs), 8):
            chunk = Uint32(0)
            for i in range(min(b0 + 8, len(xs)) - 1, b0 - 1, -1):
                chunk = ScoreHook._shift_in(chunk, xs[i])
            word = chunk if word is None else word | (chunk << Uint32(b0))
        return word

    @staticmethod
    def _keep_of(drop: Uint32, n: int) -> Uint32:
        """Trace time: keep bits of the ``n`` drop bits at the bottom of ``drop`` (one LOP3)."""
        return ~drop if n == 32 else ~drop & Uint32((1 << n) - 1)

    @cute.jit
    def _paired_bits(self, bits: cute.Tensor, pairs, groups, ncols: int, col_base: Int32, row_qpos: cute.Tensor,
                     row_bh, scalar_bh: cutlass.Constexpr, k0: Uint32, k1: Uint32, t: Uint32):
        """Keep bits of the thread's row pairs (mn rows r, r + 1 = tile rows g, g + 8 of an m16 atom), which are
        query positions i, i + 8 (i % 16 < 8) of one head: one Philox call per column group gives both rows (low
        halves row i, high halves row i + 8).  Several pairs are a loop that is not unrolled (as in
        ``_single_row_bits``) when the bits fit a 64-bit shift register and the kernel's ``dropout_row_loop``
        says so."""
        npairs = len(pairs)
        total = 2 * npairs * ncols
        if const_expr(npairs > 1 and total <= 64 and ncols <= 32 and self.row_loop):
            acc = Uint64(0)
            for pi in cutlass.range(npairs, unroll=1):
                qpos = row_qpos[pairs[0][0]]
                for pj in cutlass.range_constexpr(1, npairs):
                    qpos = row_qpos[pairs[pj][0]] if pi == pj else qpos
                bh = Int32(0)
                if const_expr(scalar_bh):
                    bh = row_bh
                else:
                    bh = row_bh[pairs[0][0]]
                    for pj in cutlass.range_constexpr(1, npairs):
                        bh = row_bh[pairs[pj][0]] if pi == pj else bh
                # shift register: pairs are rows (2k, 2k + 1); after the last pair, row r sits at [r * ncols, ...).
                # The rows' bits come from the compare-and-select test here, not the sign test: with the sign test
                # in this loop the forward's PRMT application (dropout_fwd) zeroed wrong elements of the first
                # pair's rows on the H100 (d64 256x64 tile, two m16 atoms per warp; either part alone was exact,
                # test_kernel_mask_is_the_emulated_mask), a cause not found
                lo_row, hi_row = replace(self, sign_test=False)._pair_rows(groups, col_base, qpos, bh, k0, k1, t)
                acc = (acc >> Uint64(2 * ncols)) | (Uint64(lo_row) << Uint64(total - 2 * ncols)) | (
                    Uint64(hi_row) << Uint64(total - ncols))
            bits[0] = Uint32(acc)
            if const_expr(total > 32):
                bits[1] = Uint32(acc >> Uint64(32))
        else:
            for pi in cutlass.range_constexpr(npairs):
                ra, rb = pairs[pi]
                bh = row_bh if const_expr(scalar_bh) else row_bh[ra]
                if const_expr(rb == ra + 1 and 2 * ncols <= 32 and self.sign_test):
                    both = self._pair_keep(groups, ncols, col_base, row_qpos[ra], bh, k0, k1, t)
                    self._place(bits, ra * ncols, 2 * ncols, both)
                else:
                    lo_row, hi_row = self._pair_rows(groups, col_base, row_qpos[ra], bh, k0, k1, t)
                    self._place(bits, ra * ncols, ncols, lo_row)
                    self._place(bits, rb * ncols, ncols, hi_row)

    # The keep test of a 16-bit value x against the threshold t (<= 2**16): x - t as a 32-bit integer is negative
    # exactly when x is dropped, so its sign bit is the drop bit (high half: (w >> 16) - t, one LEA.HI; low half:
    # (w & 0xFFFF) - t, LOP3 + IADD3), moved into a drop word by one funnel shift per element (``_sign_word``); the
    # keep bits are the complement, one LOP3 per word (none where the caller asks for drop bits).
    @cute.jit
    def _pair_keep(self, groups, ncols: cutlass.Constexpr[int], col_base: Int32, qpos: Int32, bh: Int32, k0: Uint32,
                   k1: Uint32, t: Uint32) -> Uint32:
        """Keep bits of query rows qpos (i % 16 < 8) at bits [0, ncols) and qpos + 8 at [ncols, 2 ncols) (bit c
        of each for mn-view column c; 2 ncols <= 32): the Philox calls unrolled, as in ``_pair_rows``, and one
        word for both rows."""
        col_word = [None] * ncols
        for gi in cutlass.range_constexpr(len(groups)):
            kind, t0, cs = groups[gi]
            w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
            mine = self._group_values(w, kind, col_base + t0)
            for e in cutlass.range_constexpr(len(cs)):
                col_word[cs[e]] = mine[e]
        drop = self._sign_word([(v & Uint32(0xFFFF)) - t for v in col_word] + [(v >> Uint32(16)) - t for v in col_word])
        return self._keep_of(drop, 2 * ncols)

    @cute.jit
    def _pair_rows(self, groups, col_base: Int32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32, t: Uint32):
        """Keep bits (bit c for mn-view column c) of query rows qpos (i % 16 < 8) and qpos + 8.  With
        ``group_loop`` (a kernel choice, where the unrolled calls spill) and evenly spaced groups, the column
        groups are a loop that is not unrolled: one Philox call in flight, bits shifted in per group."""
        lo_row = Uint32(0)
        hi_row = Uint32(0)
        ncols = sum(len(cs) for _, _, cs in groups)
        step = _regular_step(groups)
        if const_expr(self.group_loop and step is not None and len(groups) > 1):
            kind = groups[0][0]
            per = len(groups[0][2])
            for gi in cutlass.range(len(groups), unroll=1):
                col = col_base + gi * step
                w = self.rng.words(col, qpos, bh, k0, k1)
                mine = self._group_values(w, kind, col)
                lo_g = Uint32(0)
                hi_g = Uint32(0)
                if const_expr(self.sign_test):
                    for e in cutlass.range_constexpr(per - 1, -1, -1):
                        lo_g = self._shift_in(lo_g, (mine[e] & Uint32(0xFFFF)) - t)
                        hi_g = self._shift_in(hi_g, (mine[e] >> Uint32(16)) - t)
                else:  # drop bits, as the sign test's
                    for e in cutlass.range_constexpr(per):
                        lo_g = lo_g | (Uint32(1 << e) if (mine[e] & Uint32(0xFFFF)) < t else Uint32(0))
                        hi_g = hi_g | (Uint32(1 << e) if (mine[e] >> Uint32(16)) < t else Uint32(0))
                # shift register of drop bits: after the last group, group g's bits sit at [g * per, (g + 1) * per)
                lo_row = (lo_row >> Uint32(per)) | (lo_g << Uint32(ncols - per))
                hi_row = (hi_row >> Uint32(per)) | (hi_g << Uint32(ncols - per))
        else:
            col_word = [None] * ncols
            for gi in cutlass.range_constexpr(len(groups)):
                kind, t0, cs = groups[gi]
                w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
                mine = self._group_values(w, kind, col_base + t0)
                for e in cutlass.range_constexpr(len(cs)):
                    if const_expr(self.sign_test):
                        col_word[cs[e]] = mine[e]
                    else:
                        lo_row = lo_row | (Uint32(1 << cs[e]) if (mine[e] & Uint32(0xFFFF)) >= t else Uint32(0))
                        hi_row = hi_row | (Uint32(1 << cs[e]) if (mine[e] >> Uint32(16)) >= t else Uint32(0))
            if const_expr(self.sign_test):
                lo_row = self._keep_of(self._sign_word([(v & Uint32(0xFFFF)) - t for v in col_word]), ncols)
                hi_row = self._keep_of(self._sign_word([(v >> Uint32(16)) - t for v in col_word]), ncols)
        if const_expr(self.group_loop and step is not None and len(groups) > 1):
            lo_row = self._keep_of(lo_row, ncols)
            hi_row = self._keep_of(hi_row, ncols)
        return lo_row, hi_row

    @cute.jit
    def _row_bits(self, groups, col_base: Int32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32,
                  t: Uint32) -> Uint32:
        """Keep bits of one row on its own (bit c for mn-view column c, ncols <= 32): the row's half of each
        Philox call, the other half unused (rows that do not pair up: packed GQA in the forward)."""
        ncols = sum(len(cs) for _, _, cs in groups)
        col_word = [None] * ncols
        row = Uint32(0)
        shift = Uint32((qpos & 8) << 1)  # 0 for i % 16 < 8 (low half), 16 otherwise
        for gi in cutlass.range_constexpr(len(groups)):
            kind, t0, cs = groups[gi]
            w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
            mine = self._group_values(w, kind, col_base + t0)
            for e in cutlass.range_constexpr(len(cs)):
                if const_expr(self.sign_test):
                    col_word[cs[e]] = mine[e]
                else:
                    row = row | (Uint32(1 << cs[e]) if ((mine[e] >> shift) & Uint32(0xFFFF)) >= t else Uint32(0))
        if const_expr(self.sign_test):
            row = self._keep_of(self._sign_word([((v >> shift) & Uint32(0xFFFF)) - t for v in col_word]), ncols)
        return row

    @cute.jit
    def _single_row_bits(self, bits: cute.Tensor, groups, nrows: int, ncols: int, col_base: Int32,
                         row_qpos: cute.Tensor, row_bh, scalar_bh: cutlass.Constexpr, k0: Uint32, k1: Uint32,
                         t: Uint32):
        """Keep bits row by row (one Philox call per row and column group).  The rows are a loop that is not
        unrolled when the bits fit one 64-bit shift register and the kernel's ``dropout_row_loop`` says so: ptxas
        then cannot interleave the Philox calls of every row for ILP, which would need ~10 registers per call in
        flight."""
        total = nrows * ncols
        if const_expr(total <= 64 and ncols <= 32 and self.row_loop):
            acc = Uint64(0)
            for r in cutlass.range(nrows, unroll=1):
                qpos = row_qpos[0]
                for rr in cutlass.range_constexpr(1, nrows):
                    qpos = row_qpos[rr] if r == rr else qpos
                bh = Int32(0)
                if const_expr(scalar_bh):
                    bh = row_bh
                else:
                    bh = row_bh[0]
                    for rr in cutlass.range_constexpr(1, nrows):
                        bh = row_bh[rr] if r == rr else bh
                row = self._row_bits(groups, col_base, qpos, bh, k0, k1, t)
                # shift register: after the last row, row r sits at bits [r * ncols, (r + 1) * ncols)
                acc = (acc >> Uint64(ncols)) | (Uint64(row) << Uint64(total - ncols))
            bits[0] = Uint32(acc)
            if const_expr(total > 32):
                bits[1] = Uint32(acc >> Uint64(32))
        else:
            for r in cutlass.range_constexpr(nrows):
                bh = row_bh if const_expr(scalar_bh) else row_bh[r]
                self._place(bits, r * ncols, ncols, self._row_bits(groups, col_base, row_qpos[r], bh, k0, k1, t))

    @cute.jit
    def dropout_bits(self, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor, row_bh,
                     n_block: Int32, as_drop: cutlass.Constexpr[bool] = False) -> cute.Tensor:
        """Keep bits of this thread's elements of an S tile: bit ``e % 32`` of word ``e // 32`` for element
        ``e = r * ncols + c`` of the mn view.  ``row_bh``: (batch << 16) | query head, one per row (an rmem tensor,
        forward with packed GQA) or one for all rows (an Int32, backward).  ``as_drop``: the complement (drop
        bits; the bits past the last element of the last word are then undefined), which the test forms first.

        A thread's rows g and g + 8 of each m16 atom are query positions i, i + 8 (i % 16 < 8) of one head in the
        backward kernels and in the forward without GQA packing: one Philox call then decides 8 elements, all
        this thread's.  A forward compiled for packed GQA rows (``dropout_packed``: a row is a (position, head)
        pair; the dispatcher picks that config whenever pack > 1) makes each row on its own, using half of each
        call."""
        nrows = cute.size(tScS_mn, mode=[0])
        ncols = cute.size(tScS_mn, mode=[1])
        groups = self._dropout_groups(t0ScS_mn)
        pairs = row_pairs([t0ScS_mn[r, 0][0] for r in range(nrows)])
        bits = cute.make_rmem_tensor(self.dropout_num_words(tScS_mn), Uint32)
        bits.fill(0)
        k0, k1 = self.rng.key()
        t = Uint32(self.rng.threshold)
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        scalar_bh = isinstance(row_bh, (int, cutlass.Numeric))
        hook = replace(self, sign_test=as_drop)
        if const_expr(pairs is None or self.dropout_packed):
            hook._single_row_bits(bits, groups, nrows, ncols, col_base, row_qpos, row_bh, scalar_bh, k0, k1, t)
        else:
            hook._paired_bits(bits, pairs, groups, ncols, col_base, row_qpos, row_bh, scalar_bh, k0, k1, t)
        if const_expr(as_drop):
            for i in cutlass.range_constexpr(cute.size(bits)):
                bits[i] = ~bits[i]
        return bits

    @staticmethod
    def _kept(bits: cute.Tensor, idx: int):
        """Element ``idx``'s keep bit (``idx`` is trace-time)."""
        return (bits[idx // 32] & Uint32(1 << (idx % 32))) != Uint32(0)

    @cute.jit
    def dropout_fwd(self, acc_P: cute.Tensor, drop: cute.Tensor):
        """Zero the dropped probabilities of a P tile (16-bit, after the online softmax summed them); ``drop``: the
        tile's drop bits (``dropout_bits(..., as_drop=True)``).  Columns (c, c + 1) of a row are one 32-bit register
        of the compact 16-bit tile: one LOP3 clears it with a mask whose halves are the two drop bits replicated
        (one PRMT in sign-replicate mode, from copies of the bit word shifted so that each bit sits at the top of
        a byte: one shift per copy, 7 per word)."""
        p_mn = acc_mn_view(acc_P)
        nrows = cute.size(p_mn, mode=[0])
        ncols = cute.size(p_mn, mode=[1])
        if const_expr(ncols % 2 == 0 and acc_P.element_type.width == 16 and self._pairs_adjacent(p_mn)):
            p32 = cute.make_tensor(cute.recast_ptr(acc_P.iterator, dtype=Uint32),
                                   cute.make_layout(cute.size(acc_P) // 2))
            copies = {}
            for r in cutlass.range_constexpr(nrows):
                for c in cutlass.range_constexpr(0, ncols, 2):
                    e = r * ncols + c
                    word, pos = e // 32, e % 32  # e even: bits pos, pos + 1 lie in byte pos // 8
                    lo = self._bits_copy(copies, drop, word, 7 - pos % 8)
                    hi = self._bits_copy(copies, drop, word, 6 - pos % 8)
                    b = pos // 8
                    # result bytes 0-1: top bit of byte b of lo replicated; bytes 2-3: of byte b of hi (4 + b)
                    sel = (8 | b) | ((8 | b) << 4) | ((12 | b) << 8) | ((12 | b) << 12)
                    mask = Uint32(cute.arch.prmt(lo, hi, Int32(sel)))
                    i = cute.crd2idx((r, c), p_mn.layout) // 2
                    p32[i] = p32[i] & ~mask
        else:
            for r in cutlass.range_constexpr(nrows):
                for c in cutlass.range_constexpr(ncols):
                    dropped = self._kept(drop, r * ncols + c)
                    p_mn[r, c] = p_mn.element_type(0.0) if dropped else p_mn[r, c]

    @staticmethod
    def _pairs_adjacent(p_mn) -> bool:
        """Trace time: every even mn-view column c of a row is an even register index and c + 1 the next one."""
        for r in range(cute.size(p_mn, mode=[0])):
            for c in range(0, cute.size(p_mn, mode=[1]), 2):
                i = cute.crd2idx((r, c), p_mn.layout)
                if i % 2 or cute.crd2idx((r, c + 1), p_mn.layout) != i + 1:
                    return False
        return True

    @staticmethod
    def _bits_copy(copies: dict, bits: cute.Tensor, word: int, k: int) -> Uint32:
        """Trace time: bit word ``word`` shifted left by ``k``, formed once per (word, k)."""
        if (word, k) not in copies:
            copies[(word, k)] = bits[word] if k == 0 else bits[word] << Uint32(k)
        return copies[(word, k)]

    @cute.jit
    def _ds_dropout(self, s, p, dp, d_r, keep):
        """(dS, P * keep) of one element: dS = P (keep dP / (1-p) - D) * d(apply)/dS."""
        dp_eff = dp * self.rng.scale if keep else Float32(0.0)
        ds = p * (dp_eff - d_r)
        if const_expr(self.has_softcap):
            ds = ds * cute.arch.fmax(1.0 - s * s, 0.0)
        return ds, (p if keep else Float32(0.0)), dp_eff

    @cute.jit
    def backward_ds_dropout(self, acc_S: cute.Tensor, acc_P: cute.Tensor, acc_dP: cute.Tensor, dpsum: cute.Tensor,
                            bits: cute.Tensor):
        """``backward_ds`` with dropout: dS in place of dP, and P * keep in place of P (for dV; the 1/(1-p) scale
        of dV is applied once by the caller)."""
        s_mn, p_mn, dp_mn = acc_mn_view(acc_S), acc_mn_view(acc_P), acc_mn_view(acc_dP)
        ncols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(ncols):
                keep = self._kept(bits, r * ncols + c)
                ds, p_kept, _ = self._ds_dropout(s_mn[r, c], p_mn[r, c], dp_mn[r, c], dpsum[r], keep)
                dp_mn[r, c] = ds
                p_mn[r, c] = p_kept

    @cute.jit
    def backward_p_ds_dropout(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, lse_log2: cute.Tensor,
                              dpsum: cute.Tensor, pdp: cute.Tensor, bits: cute.Tensor):
        """``backward_p_ds`` (dQ kernel: dS in place of dP, per-row sums of P dP into pdp) with dropout; dP is
        the dropped and scaled one, so pdp stays D = rowsum(dO * O) exactly."""
        s_mn, dp_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        ncols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(ncols):
                keep = self._kept(bits, r * ncols + c)
                p = cute.math.exp2(s_mn[r, c] * self.scale_log2 - lse_log2[r], fastmath=True)
                ds, _, dp_eff = self._ds_dropout(s_mn[r, c], p, dp_mn[r, c], dpsum[r], keep)
                pdp[r] = pdp[r] + p * dp_eff
                dp_mn[r, c] = ds

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
        """dS = P (dP - D) * d(apply)/dS, in place of dP (P from ``backward_p``).  With a score_mod the chain
        rule through it is ``backward_mods`` (the caller runs it after this)."""
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
            ds_mn, raw_mn = acc_mn_view(acc_dS), acc_mn_view(acc_raw)
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
