"""Pieces shared by the forward kernels (CuTe-DSL device code): the per-tile state (sequence info, block
schedule, score hook, K/V source), per-row addressing with packed GQA, the Q load, P from S, and the epilogue
(softmax finalisation, LSE and O stores).

Subclasses provide ``compute_sync()`` (a barrier over the threads that own accumulators) and the main loop.
Variants override the class attributes: ``block_info_cls`` (the KV-block schedule) and ``kv_source_cls`` (where
K/V rows live).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import FWD_ARGS
from .. import config as _config
from ..config import FwdKernelConfig, fwd_smem_bytes
from . import cute_utils as cu
from .kernel_state import KernelState, KernelStateMixin
from .rows import load_rows, store_row_pairs_from_acc, store_rows_from_smem
from .score import ScoreHook
from .seqlen_info import SeqInfo
from .softmax import online_softmax_step, softmax_finalize

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


@dataclass(frozen=True)
class TileState(KernelState):
    """The kernel state (``seq``, ``block``, ``score``, ``kv``) plus the coordinates of this forward tile."""

    head_group: Int32
    m_block: Int32
    pack: Int32
    num_rows: Int32

    def q_head(self, row):
        """(position, query head) of tile row ``row`` (absolute row index within the batch entry)."""
        pos = row // self.pack
        return pos, self.head_group * self.pack + (row - pos * self.pack)

    def q_row(self, mX, row):
        pos, head = self.q_head(row)
        return self.seq.q_row(mX, pos, head)


class FwdKernelBase(KernelStateMixin):
    ARGS = FWD_ARGS

    def __init__(self, cfg: FwdKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.d = cfg.head_dim
        self.dv = cfg.head_dim_v
        t = cfg.tile
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        self.num_warps, self.num_stages, self.q_in_regs = t.num_warps, t.num_stages, t.q_in_regs
        # key split (fwd_decode.py): warps along M per group, and the keys of a K/V tile each group's S tile holds
        self.kv_groups, self.mma_warps = t.kv_groups, t.mma_warps
        self.s_tile_n = t.tile_n // t.kv_groups
        self.num_mma_threads = t.num_warps * 32
        self.smem_bytes = fwd_smem_bytes(self.d, self.dv, t)
        # the 64x32 cp.async tile (d256/dv256 with dropout) spills on sm_120a with the row loop of
        # Dropout.bits in its heaviest feature set, not when unrolled (compile gate)
        self.dropout_row_loop = not (t.tile_n == 32 and not t.tma)
        # the d192 TMA tile reading Q from shared memory (128x64, one stage) spilled on sm_120a in its lightest
        # dropout set (d192/dv192) with a row pair's four Philox calls unrolled (compile gate)
        self.dropout_group_loop = t.tma and t.tile_m == 128 and t.tile_n == 64 and t.num_stages == 1 and not t.q_in_regs
        # causal / windowed tiles: every (head group, batch)'s longest tile launches before any second-longest one
        # (``cta_coords``; config.FWD_LPT_ORDER)
        self.lpt_order = _config.FWD_LPT_ORDER and cfg.windowed and not cfg.block_sparse and not cfg.split_kv

    def compute_sync(self):
        raise NotImplementedError

    @cute.jit
    def cta_coords(self):
        """(grid column, head group, grid z) of this CTA.  The grid is (tile columns, head groups, batch); CTAs
        launch with x varying fastest.  With ``lpt_order``, on grids of config.FWD_LPT_MIN_COLUMNS to
        FWD_LPT_MAX_COLUMNS columns, the same set of coordinates is dealt in another order: the CTA that launches
        k-th takes column k // (head groups x batch), so every causal or windowed (head group, batch)'s first
        column (its longest tile: the run_tile kernels reverse the columns) launches before any second column, and
        the shortest tiles fill the tail (longest-processing-time order).  The varlen extra column, past the tile
        columns, launches last.  Other grids keep a head's tiles together (their K/V stays in L2).  Warp-uniform."""
        bx, by, bz = cute.arch.block_idx()
        col, head_group, z = bx, by, bz
        if const_expr(self.lpt_order):
            gx, gy, gz = cute.arch.grid_dim()
            if gx >= _config.FWD_LPT_MIN_COLUMNS and gx <= _config.FWD_LPT_MAX_COLUMNS:
                lin = bx + gx * (by + gy * bz)
                per = gy * gz
                col = cute.arch.make_warp_uniform(lin // per)
                rest = lin - col * per
                z = cute.arch.make_warp_uniform(rest // gy)
                head_group = cute.arch.make_warp_uniform(rest - z * gy)
        return col, head_group, z

    @property
    def grid_x_extra(self) -> int:
        """1 when q rows can lie outside every sequence (varlen q, seqused_q): a last grid column of CTAs, past
        the ``num_m_blocks`` tile columns, writes them (``fill_unused_rows``)."""
        return 1 if self.cfg.varlen_q or self.cfg.seqused_q else 0

    def split_coords(self, bz, mO):
        """(batch, split) of this CTA: split-KV folds (batch, split) into grid z, ``split`` = (index, count) with
        the count read from the partials' leading extent (no runtime argument); otherwise (bz, None)."""
        if const_expr(not self.cfg.split_kv):
            return bz, None
        num_splits = mO.shape[0]
        # uniform over the CTA: in uniform registers, off the mma warps' budget (in general registers the
        # quotient, live to the epilogue, made the d256 tile spill)
        batch = cute.arch.make_warp_uniform(bz // num_splits)
        return batch, (cute.arch.make_warp_uniform(bz - batch * num_splits), num_splits)

    def release_dependents(self):
        """Split-KV: let the combine kernel, launched as a programmatic dependent of this grid, place its CTAs once
        every CTA of this grid has started (it waits in griddepcontrol.wait for this grid to finish and its
        writes to be visible before it reads a partial): its launch overlaps this grid's tail instead of
        following it.  Nothing without split-KV."""
        if const_expr(self.cfg.split_kv):
            cute.arch.griddepcontrol_launch_dependents()

    def split_slice(self, mX):
        """This CTA's split of a split-KV partial (O or LSE), else ``mX``.  The split index is recomputed from the
        block index where the slice is used (the epilogue), so no sliced pointer stays live across the main loop."""
        if const_expr(not self.cfg.split_kv):
            return mX
        _, _, bz = cute.arch.block_idx()
        return mX[(bz % mX.shape[0], *((None,) * (cute.rank(mX) - 1)))]

    def tile_state(self, batch, head_group, m_block, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                   mSeqUsedK, scale_log2, softcap_prescale, window_left, window_right, pack, mK=None,
                   mPageTable=None, split=None, dropout=None, aux=None) -> TileState:
        st = self.kernel_state(batch, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, scale_log2,
                               softcap_prescale, window_left, window_right, pack, mK, mPageTable, split, dropout, aux)
        score = st.score
        if const_expr(getattr(self.cfg, "mods", None) is not None):  # mods see (position, head) of packed rows
            score = score.with_head_rows((m_block * self.tile_m, head_group * pack, pack))
        return TileState(st.seq, st.block, score, st.kv, head_group, m_block, pack, st.seq.seqlen_q * pack)

    @cute.jit
    def load_q(self, mQ, sQ, copy_q, tidx, ts: TileState):
        """cp.async the Q tile, row by row (a tile row is (position, head-in-group) under packed GQA)."""
        load_rows(lambda row: ts.q_row(mQ, row), sQ, copy_q, tidx, ts.m_block * self.tile_m, ts.num_rows,
                  (self.tile_m, self.d), False)

    @cute.jit
    def row_coords(self, tiled_mma, tidx, m_block, pack):
        """This thread's accumulator coordinates (and thread 0's, for compile-time column offsets) and the query
        position of each of its rows."""
        cS = cute.make_identity_tensor((self.tile_m, self.s_tile_n))
        tScS_mn = cu.acc_mn_view(tiled_mma.get_slice(tidx).partition_C(self.group_cols(cS)))
        t0ScS_mn = cu.acc_mn_view(tiled_mma.get_slice(0).partition_C(cS))
        num_rows = cute.size(tScS_mn, mode=[0])
        row_qpos = cute.make_rmem_tensor(num_rows, Int32)
        for r in cutlass.range_constexpr(num_rows):
            row_qpos[r] = (m_block * self.tile_m + tScS_mn[r, 0][0]) // pack
        return tScS_mn, t0ScS_mn, row_qpos

    def group_cols(self, cS):
        """The (row, key column) coordinates of this thread's S tile: a key-split kernel's groups start at their
        first key."""
        return cS

    @cute.jit
    def row_bh(self, ts: TileState, tScS_mn):
        """Dropout's per-row Philox counter word, (batch << 16) | query head, of this thread's rows (None without
        dropout)."""
        res = None
        if const_expr(self.cfg.has_dropout):
            num_rows = cute.size(tScS_mn, mode=[0])
            res = cute.make_rmem_tensor(num_rows, Int32)
            for r in cutlass.range_constexpr(num_rows):
                _, head = ts.q_head(ts.m_block * self.tile_m + tScS_mn[r, 0][0])
                res[r] = (ts.seq.batch << 16) | head
        return res

    def dropout_apply(self, score: ScoreHook, tScS_mn, t0ScS_mn, row_qpos, row_bh, n_block):
        """Trace time: this KV block's dropout, as a function ``apply(rP)`` that zeroes the dropped elements of the
        16-bit P tile (None without dropout).  Where ``Dropout.fwd_direct_ok``, ``apply`` makes the keep masks
        from the Philox words after the softmax (``Dropout.apply_fwd_direct``); elsewhere (packed GQA rows, the group
        loop) the drop bits are made here, before the S mma, while S is not live, and ``apply`` reads them."""
        drop = score.dropout
        if drop is None:
            return None
        # a P tile's layout: the mma accumulator ((2, 2), MMA_M, MMA_N) of this thread, in the input dtype
        nrows, ncols = cute.size(tScS_mn, mode=[0]), cute.size(tScS_mn, mode=[1])
        probe = cute.make_rmem_tensor(((2, 2), nrows // 2, ncols // 2), self.dtype)
        if drop.fwd_direct_ok(probe, t0ScS_mn):
            return lambda rP: drop.apply_fwd_direct(rP, tScS_mn, t0ScS_mn, row_qpos, row_bh, n_block)
        bits = drop.bits(tScS_mn, t0ScS_mn, row_qpos, row_bh, n_block, as_drop=True)
        return lambda rP: drop.apply_fwd(rP, bits)

    @cute.jit
    def scores_to_p(
        self, score: ScoreHook, acc_S, acc_O, state_max, state_sum, tScS_mn, t0ScS_mn, row_qpos, dropout, n_block,
        is_first: cutlass.Constexpr[bool], mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool], mask_mod_on: cutlass.Constexpr[bool] = True,
    ):
        """S tile -> score hook (softcap, mods, masks) -> online softmax (rescales acc_O) -> dropout (after the row
        sums took the undropped P) -> P in the input dtype, returned as the A operand of the P V mma.
        ``mask_mod_on=False``: a block-sparse "full" tile, which skips the mask_mod."""
        score.apply(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left,
                    mask_mod_on=mask_mod_on)
        online_softmax_step(acc_S, acc_O, state_max, state_sum, score, is_first)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        if const_expr(dropout is not None):  # on the 16-bit P: the fp32 S is dead by then (fewer live registers)
            dropout(rP)
        return cu.acc_as_operand_a(rP)

    @cute.jit
    def epilogue(self, ts: TileState, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx,
                 tScS_mn):
        cfg = self.cfg
        num_my_rows = cute.size(state_max)
        lse = cute.make_rmem_tensor(num_my_rows, Float32)
        sink = cute.make_rmem_tensor(num_my_rows, Float32)
        if const_expr(cfg.has_sink):
            for r in cutlass.range_constexpr(num_my_rows):
                row = ts.m_block * self.tile_m + tScS_mn[r, 0][0]
                sink[r] = Float32(mSink[ts.head_group * ts.pack + row % ts.pack])
                if const_expr(cfg.split_kv):
                    # the sink joins the denominator once: in split 0 (even an empty one: O = 0, LSE = sink); the
                    # other splits see -inf (softmax_finalize adds nothing for it)
                    _, _, bz = cute.arch.block_idx()
                    if bz % mO.shape[0] != 0:
                        sink[r] = -Float32.inf
        if const_expr(cfg.has_dropout):  # O accumulated P * keep: the 1/(1-p) of the kept ones, once
            acc_O.store(acc_O.load() * ts.score.dropout.scale)
        softmax_finalize(acc_O, state_max, state_sum, ts.score.scale_log2, lse, sink, cfg.has_sink)
        self.store_lse(ts, self.split_slice(mLSE), lse, tScS_mn)
        if const_expr(self.o_via_smem()):  # split-KV stores from registers: smem is not reused
            self.compute_sync()  # every warp is done reading Q/K/V smem before O overwrites it
        self.store_o(ts, self.split_slice(mO), acc_O, sO, tiled_mma, copy_o, tidx)

    @cute.jit
    def tile_or_fill(self, bx, num_m_blocks, tile, mO, mLSE, mCuSeqlensQ, mSeqUsedQ, rows_q, pack,
                     num_threads: cutlass.Constexpr[int]):
        """One CTA's work: its tile (``tile()``), or, in the extra grid column, the out-of-sequence q rows."""
        if const_expr(self.grid_x_extra):
            if bx == num_m_blocks:
                self.fill_unused_rows(mO, mLSE, mCuSeqlensQ, mSeqUsedQ, rows_q, pack, num_threads)
            else:
                tile()
        else:
            tile()

    @cute.jit
    def fill_unused_rows(self, mO, mLSE, mCuSeqlensQ, mSeqUsedQ, rows_q, pack,
                         num_threads: cutlass.Constexpr[int]):
        """Rows of q inside no sequence (varlen padding before ``cu_seqlens_q[0]`` or after ``cu_seqlens_q[-1]``,
        rows past ``seqused_q``) get O = 0 and LSE = -inf, the rule of a row with no keys, so no output row keeps
        what ``torch.empty`` held.  Run by the extra grid column (``grid_x_extra``): one CTA per head group and
        batch entry, one element per thread and step (such rows are rare: the loop is empty for packed, fully used
        inputs).  A CTA of its own, so the tile kernels' register budget is untouched.  Split-KV: each split's CTA
        fills its own partial (LSE = -inf in every split, so the combine gives such a row O = 0 and LSE = -inf)."""
        cfg = self.cfg
        if const_expr(cfg.varlen_q or cfg.seqused_q):
            tidx, _, _ = cute.arch.thread_idx()
            _, head_group, bz = self.cta_coords()
            _, _, num_batch = cute.arch.grid_dim()
            batch, _ = self.split_coords(bz, mO)
            if const_expr(cfg.split_kv):
                num_batch = num_batch // mO.shape[0]
            mO, mLSE = self.split_slice(mO), self.split_slice(mLSE)
            out_dtype = Float32 if cfg.split_kv else self.dtype
            offset_q, seqlen_q = SeqInfo._bounds(cfg.varlen_q, cfg.seqused_q, batch, rows_q, mCuSeqlensQ,
                                                 mSeqUsedQ)
            seq = SeqInfo(batch, offset_q, Int32(0), seqlen_q, Int32(0), cfg.varlen_q, False)
            tail, lead = seq.unused_q_positions(batch, num_batch, rows_q, mCuSeqlensQ)
            n_items = (tail + lead) * pack * self.dv
            zero = Float32(0.0).to(out_dtype)
            for e in cutlass.range(tidx, n_items, num_threads, unroll=1):
                row = e // self.dv
                col = e - row * self.dv
                p = row // pack
                head = head_group * pack + (row - p * pack)
                pos = seqlen_q + p
                if p >= tail:
                    pos = p - tail - lead
                if const_expr(cfg.varlen_q):  # the addressing of SeqInfo.q_row / row_stat_index
                    mO[offset_q + pos, head, col] = zero
                    if col == 0:
                        mLSE[head, offset_q + pos] = -Float32.inf
                else:
                    mO[batch, pos, head, col] = zero
                    if col == 0:
                        mLSE[batch, head, pos] = -Float32.inf

    @cute.jit
    def store_lse(self, ts: TileState, mLSE, lse, tScS_mn):
        if tScS_mn[0, 0][1] == 0:  # one lane of each quad owns the row
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = ts.m_block * self.tile_m + tScS_mn[r, 0][0]
                if row < ts.num_rows:
                    pos, head = ts.q_head(row)
                    mLSE[ts.seq.row_stat_index(head, pos)] = lse[r]

    @cute.jit
    def store_o(self, ts: TileState, mO, acc_O, sO, tiled_mma, copy_o, tidx):
        """acc_O -> bf16/fp16 -> smem (swizzled) -> 16-byte coalesced row stores; or (``o_via_smem`` false:
        split-KV's fp32 partials, key-split tiles) straight from the accumulators, two columns per store."""
        if const_expr(not self.o_via_smem()):
            store_row_pairs_from_acc(lambda row: ts.q_row(mO, row), acc_O, tiled_mma.get_slice(tidx),
                                     ts.m_block * self.tile_m, ts.num_rows, (self.tile_m, self.dv),
                                     Float32 if self.cfg.split_kv else self.dtype)
        else:
            self.store_o_smem(ts, mO, acc_O, sO, tiled_mma, copy_o, tidx)

    def o_via_smem(self) -> bool:
        """Whether O leaves through shared memory (16-byte row stores after a CTA barrier), or straight from the
        accumulators: split-KV partials (fp32, decode tiles have few rows) and key-split tiles, whose epilogue
        runs in one warp group only."""
        return not self.cfg.split_kv and self.kv_groups == 1

    @cute.jit
    def store_o_smem(self, ts: TileState, mO, acc_O, sO, tiled_mma, copy_o, tidx):
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        st_thr = cute.make_tiled_copy_C(st_atom, tiled_mma).get_slice(tidx)
        cute.copy(st_atom, st_thr.retile(rO), st_thr.partition_D(sO))
        self.compute_sync()
        store_rows_from_smem(lambda row: ts.q_row(mO, row), sO, copy_o, tidx, ts.m_block * self.tile_m,
                             ts.num_rows, (self.tile_m, self.dv), self.dtype)
