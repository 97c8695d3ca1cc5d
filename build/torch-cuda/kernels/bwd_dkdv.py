"""Backward attention kernel (dK, dV) for SM120/SM121 on mma.sync m16n8k16 — KV-stationary, cp.async.

Layouts (torch order): q, dout (B, Sq, Hq, D|Dv) or varlen (total_q, Hq, .); k, v, dk, dv (B, Sk, Hkv, .) or
(total_k, Hkv, .); lse and dpsum (B, Hq, Sq) / (Hq, total_q) fp32.

Algorithm (FlashAttention-2 backward): one CTA = one block of ``tile_n`` keys of one KV head.  K and V stay in
smem; the CTA walks every query head of the KV head's group (GQA: dK/dV are summed over the group in registers,
never with atomics) and every block of ``tile_m`` queries that can see these keys.  Per block:
    S  = Q K^T, P = exp2(S*c - LSE*log2e) (masked, softcapped), dP = dO V^T, dS = P * (dP - D)
    dV += P^T dO, dK += dS^T Q           (P and dS go through smem to change the mma partition)
dK/dV are scaled by the softmax scale at the end and stored once.  Rows past the sequence are zero-filled, so
their P and dS are exactly 0.

dQ, two ways:
  * fused (config ``fused_dq``, the default backward): dQ_tile = dS K is computed here, from the dS tile already in
    smem and the resident K, on the query-row warp grid, and added into an fp32 workspace with
    ``red.global.add.v2.f32``.  The workspace keeps each tile in the order the mma's threads hold it (value pair j
    of thread t at (j * threads + t) * 2), so one warp instruction adds 256 contiguous bytes; dQ comes after the dK
    mma (the next Q tile loads under it) and its adds drain under the next block's S mma.
    kernels/bwd_dq_convert.py scales and casts the workspace.  The order in which
    the CTAs of a query tile add varies from run to run, so dQ is not bitwise reproducible, except in the relay
    form (config ``dq_relay``, ``deterministic=True``; kernels/dq_relay.py): the CTAs of a query tile add in
    ascending key-tile order, taking turns on a counter per tile, and each CTA walks its query tiles in descending
    order, so the contributors of a tile reach it at about the same time.
  * otherwise kernels/bwd_dq.py (Q-stationary, no atomics) recomputes S and dP: bitwise reproducible
    (``deterministic=True``) and the path of a learnable sink, whose gradient needs that kernel's row sums.

Block sparsity (config ``block_sparse``): the CTA visits only the query blocks the KV-major lists give its KV block,
for each query head of the group (kernels/block_sparse.py SparseQList); mask blocks get the causal/window masks
when the call has them, full blocks only the sequence end.  A KV tile with no block writes dK = dV = 0.

Constraints: fp16/bf16; config.bwd_tile_problems (SM120's 99 KB).
"""

from dataclasses import dataclass
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import BlockSparseLists, BWD_DKDV_ARGS, DropoutParams
from .. import config_bwd as _config_bwd
from ..config_bwd import BwdKernelConfig, bwd_smem_bytes
from . import cute_utils as cu
from .fwd_base import DTYPES
from .block_sparse import SparseQList
from . import dq_relay as _dq_relay
from .dq_relay import DqRelay
from .kernel_state import KernelStateMixin
from .rows import load_rows, store_rows_from_acc


@dataclass(frozen=True)
class WalkTile:
    """Trace time: what every tile of the dK/dV walk reads (``FlashBwdDkdv.walk_tile``): the CTA's sequence, mask
    and score views, the global and shared tensors, the mmas with their operands, the accumulators, the rows'
    stats, and the walk's list of entries.  Frozen, so the DSL passes it through run-time branches unchanged."""
    seq: object
    block: object
    score: object
    mQ: object
    mdO: object
    mLSE: object
    mDpsum: object
    sQ: object
    sdO: object
    sP: object
    sdS: object
    copy_d: object
    copy_dv: object
    tidx: object
    n_block: object
    dt: object
    relay: object
    st_atom: object
    st_s: object
    tScS_mn: object
    t0ScS_mn: object
    num_rows: int
    row_qpos: object
    lse_log2: object
    dpsum: object
    mma_s: object
    mma_n: object
    mma_m: object
    acc_shape_s: object
    ops_S: tuple
    ops_dP: tuple
    ops_dV: tuple
    ops_dK: tuple
    acc_dV: object
    acc_dK: object
    where: object
    num_iters: object
    carry: bool
    first_head: object
    qheads: object
    qlist: object = None  # block sparsity
    m_min: object = None  # dense walks: the query tiles [m_min, m_max)
    m_max: object = None
    ops_dQ: tuple = None  # fused dQ


def bwd_tiled_mma(dtype, tile_rows: int, num_warps: int, warp_rows: int = 16):
    """Warps split over M (up to tile_rows/warp_rows: a warp's m16 atoms repeat every wm*16 rows) and N: each warp
    owns 16 adjacent columns per repetition (the N permutation puts a warp's two n8 atoms side by side), so every
    thread's columns come as (c, c+1, c+8, c+9) with c % 16 < 8 — one Philox call's quad of dropout columns."""
    wm = min(tile_rows // warp_rows, num_warps)
    wn = num_warps // wm
    perm_n = cute.make_layout((8, wn, 2), stride=(1, 16, 8)) if wn > 1 else 16
    return cute.make_tiled_mma(
        cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (wm, wn, 1), permutation_mnk=(wm * 16, perm_n, 16)
    )


class FlashBwdDkdv(KernelStateMixin):
    ARGS = BWD_DKDV_ARGS

    def __init__(self, cfg: BwdKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.num_warps = cfg.num_warps
        self.num_threads = cfg.num_warps * 32
        self.smem_bytes = bwd_smem_bytes(cfg)
        # every thread's S columns come in quads (c, c+1, c+8, c+9), c % 16 < 8 (bwd_tiled_mma's N permutation)
        self.dropout_quad_ok = True
        # measured on sm_120a (compile gate): the 64x128 tile (d64) spilled 2 STL/LDL in the fp16 d64/dv32 heaviest
        # dropout set with the Philox calls of a row unrolled, none with them in a loop
        self.dropout_group_loop = cfg.tile_m == 64 and cfg.tile_n == 128
        # causal / windowed walks: every (KV head, batch)'s longest key tile launches before any second-longest
        # (``cta_coords``; config_bwd.BWD_LPT_ORDER).  Not with mods or dropout: measured only without them
        # (benchmarks/experiments/results/lpt_bwd_h100_s33*.jsonl), and its index arithmetic made four heavy
        # windowed sets spill (d96 64x128 key-row with mods on sm_120a/sm_121a, d128 32x128 with dropout and a
        # document mask on sm_80: the full runs of 4f1bbf9, benchmarks/results/gate_full_*.jsonl)
        self.lpt_order = (_config_bwd.BWD_LPT_ORDER and cfg.windowed and not cfg.block_sparse and cfg.mods is None
                          and not cfg.has_dropout)
        # the relay (dq_relay): where a tile's turn is passed on, in the CTA's next iteration (config_bwd
        # DQ_RELAY_RELEASE: right after its first barrier, or after its S mma, which leaves the adds more time to
        # drain before the release's fence but makes the next CTA wait longer)
        self.relay_release_after_s = cfg.dq_relay and _config_bwd.DQ_RELAY_RELEASE == "after_s"
        # the relay's walk (one loop, ``process``; kernels/dq_relay.py "One loop") with query tiles outer and a GQA
        # group's heads inner (config_bwd.RELAY_HEADS_INNER, an A/B switch, not part of the compile key)
        self.relay_heads_inner = cfg.dq_relay and _config_bwd.RELAY_HEADS_INNER

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        dout: cute.Tensor,
        lse: cute.Tensor,
        dpsum: cute.Tensor,
        dk: cute.Tensor,
        dv: cute.Tensor,
        dq_accum: cute.Tensor | None,
        dq_turns: cute.Tensor | None,
        cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None,
        seqused_q: cute.Tensor | None,
        seqused_k: cute.Tensor | None,
        sparse: BlockSparseLists | None,
        aux_tensors,  # the mods' aux tensors (a tuple) or None
        scale_log2: Float32,
        softcap_prescale: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        qheads_per_kvhead: Int32,
        num_n_blocks: Int32,
        num_kv_heads: Int32,
        num_batch: Int32,
        dropout: DropoutParams | None,
        stream,
    ):
        dt = self.dtype
        (sQ_l, sdO_l, sK_l, sV_l, sP_l), SharedStorage = self.smem_plan()
        self.launch_smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            q, k, v, dout, lse, dpsum, dk, dv, dq_accum, dq_turns, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            sparse, aux_tensors, scale_log2, softcap_prescale, softmax_scale, window_left, window_right,
            qheads_per_kvhead, dropout,
            sQ_l, sdO_l, sK_l, sV_l, sP_l, *self.tiled_mmas(),
            cu.gmem_tiled_copy(dt, self.d, self.num_threads, is_async=True),
            cu.gmem_tiled_copy(dt, self.dv, self.num_threads, is_async=True),
            SharedStorage,
        ).launch(
            grid=(num_n_blocks, num_kv_heads, num_batch),
            block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def smem_plan(self):
        """Trace time: the shared-memory layouts (Q, dO, K, V, P/dS) and the SharedStorage struct of this kernel:
        one block of Q and dO, K and V of the CTA's keys, P and dS to change the mma partition."""
        dt = self.dtype
        a = cu.smem_layout_atom
        sQ_l = cute.tile_to_shape(a(dt, self.d), (self.tile_m, self.d), (0, 1))
        sdO_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_m, self.dv), (0, 1))
        sK_l = cute.tile_to_shape(a(dt, self.d), (self.tile_n, self.d), (0, 1))
        sV_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_n, self.dv), (0, 1))
        sP_l = cute.tile_to_shape(a(dt, self.tile_n), (self.tile_m, self.tile_n), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_l)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sP_l)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sP_l)], 1024]

        return (sQ_l, sdO_l, sK_l, sV_l, sP_l), SharedStorage

    def tiled_mmas(self):
        """Trace time: (mma over query rows: S, dP, dQ-like; mma over key rows: dV, dK)."""
        dt = self.dtype
        return (bwd_tiled_mma(dt, self.tile_m, self.num_warps),
                bwd_tiled_mma(dt, self.tile_n, self.num_warps, self.cfg.kv_warp_rows))

    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mdO, mLSE, mDpsum, mdK, mdV, mDqAccum, mTurns, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, sparse, mAux,
        scale_log2: Float32, softcap_prescale: Float32, softmax_scale: Float32, window_left: Int32,
        window_right: Int32, qheads_per_kvhead: Int32, dropout: DropoutParams | None,
        sQ_l: cute.ComposedLayout, sdO_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
        sP_l: cute.ComposedLayout, mma_m: cute.TiledMma, mma_n: cute.TiledMma, copy_d: cute.TiledCopy,
        copy_dv: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = self.cta_coords()
        st = self.kernel_state(batch, *self.seq_rows(mQ, mK), mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                               scale_log2, softcap_prescale, window_left, window_right, 1, dropout=dropout,
                               aux=mAux)
        seq, block, score, kv = st.seq, st.block, st.score, st.kv
        if n_block * self.tile_n < seq.seqlen_k:
            self.process(
                seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdK, mdV, (mDqAccum, mTurns), sparse,
                softmax_scale, qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, sP_l, mma_m, mma_n, copy_d, copy_dv, SharedStorage, tidx, n_block, kv_head,
            )

    @cute.jit
    def cta_coords(self):
        """(key tile, KV head, batch) of this CTA.  The grid is (key tiles, KV heads, batch) and CTAs launch with x
        varying fastest.  With ``lpt_order``, on grids of at least config_bwd.BWD_LPT_MIN_COLUMNS key
        tiles and at most BWD_LPT_MAX_PAIRS (KV head, batch) pairs, the CTA that launches k-th takes key tile
        k // (KV heads x batch): a causal walk's first key tile sees every query tile and its last the fewest, so
        every pair's longest walk launches before any second-longest and the shortest fill the tail of the last
        wave (longest-processing-time order).  Other grids keep a head's key tiles together.  Warp-uniform."""
        bx, by, bz = cute.arch.block_idx()
        n_block, kv_head, batch = bx, by, bz
        if const_expr(self.lpt_order):
            gx, gy, gz = cute.arch.grid_dim()
            if gx >= _config_bwd.BWD_LPT_MIN_COLUMNS and gy * gz <= _config_bwd.BWD_LPT_MAX_PAIRS:
                lin = bx + gx * (by + gy * bz)
                per = gy * gz
                n_block = cute.arch.make_warp_uniform(lin // per)
                rest = lin - n_block * per
                batch = cute.arch.make_warp_uniform(rest // gy)
                kv_head = cute.arch.make_warp_uniform(rest - batch * gy)
        return n_block, kv_head, batch

    @cute.jit
    def load_q_do(self, seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, head, m_block,
                  load_q: cutlass.Constexpr[bool], load_do: cutlass.Constexpr[bool]):
        """cp.async Q and/or dO of query tile ``m_block`` of query head ``head``."""
        first_q = m_block * self.tile_m
        if const_expr(load_q):
            load_rows(lambda pos: seq.q_row(mQ, pos, head), sQ, copy_d, tidx, first_q, seq.seqlen_q,
                      (self.tile_m, self.d), True)
        if const_expr(load_do):
            load_rows(lambda pos: seq.q_row(mdO, pos, head), sdO, copy_dv, tidx, first_q, seq.seqlen_q,
                      (self.tile_m, self.dv), True)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def dq_tile(self, seq, rows_q, m_block):
        """Index of query tile ``m_block``'s tile in the fp32 dQ workspace (``config_bwd.dq_accum_blocks``; the
        convert kernel reads the same layout): dense, after the tiles of the batch entries before; varlen, from tile
        cu_seqlens_q[b] // tile_m + b, so no two sequences share a tile.  Unclamped: callers check it against the
        workspace."""
        if const_expr(self.cfg.varlen_q):
            return seq.offset_q // self.tile_m + seq.batch + m_block
        return seq.batch * ((rows_q + self.tile_m - 1) // self.tile_m) + m_block

    @cute.jit
    def add_dq(self, mDqAccum, relay, acc_dQ, seq, rows_q, head, m_block, n_block, tidx):
        """Add this thread's dQ values of query tile ``m_block`` of ``head`` into the workspace: value pair j at
        (j * threads + tidx) * 2 of the tile, so a warp's 32 adds of one pair cover 256 contiguous bytes.  The
        tile index (``config_bwd.dq_accum_blocks``) is clamped to the workspace: lying varlen metadata may give
        wrong sums, never a write outside it.  With the relay (``relay`` not None; the walk has checked this key
        tile's turn, ``dq_turn_ready``) returns the offset of the tile's counter, to pass on once every thread's adds
        are issued (-1: nothing to pass on; the counters have the workspace's tiles, so the clamp covers both)."""
        blk = self.dq_tile(seq, rows_q, m_block)
        pend = Int32(-1)
        if blk < mDqAccum.shape[0]:
            if const_expr(relay is not None):  # the one-loop walk checked the turn (``dq_turn_ready``)
                pend = relay.offset(blk, head)
            tile = mDqAccum[blk, head, None]
            addr = (tile.iterator + tidx * 2).toint()
            for j in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
                cu.red_add_f32x2(addr + j * self.num_threads * 8, acc_dQ[2 * j], acc_dQ[2 * j + 1])
        return pend

    @cute.jit
    def dq_turn_ready(self, mDqAccum, relay, seq, rows_q, head, m_block, n_block):
        """The relay's one-loop walk: 1 when this key tile's turn on query tile ``m_block`` of ``head`` has come
        (lane 0's acquire read, broadcast to the warp, whose later operations bar.warp.sync orders after it), or
        when the tile needs no wait; else 0.  RELAY_PROBE "nowait" / "free": always 1 (timing only)."""
        if const_expr(_dq_relay.RELAY_PROBE in ("nowait", "free")):
            return Int32(1)
        blk = self.dq_tile(seq, rows_q, m_block)
        ready = Int32(1)
        if blk < mDqAccum.shape[0]:
            turn = relay.turn(n_block, m_block)
            if turn > 0:
                seen = Int32(0)
                if cute.arch.lane_idx() == 0:
                    seen = _dq_relay.ld_acquire_gpu_s32(relay.address(relay.offset(blk, head)))
                seen = cute.arch.shuffle_sync(seen, 0)
                cute.arch.sync_warp()
                if seen < turn:
                    ready = Int32(0)
        return ready

    def score_tile_views(self, mTurns, block, mma, dt, tidx) -> tuple:
        """Trace time, shared with the V-in-registers tile: the relay of a ``dq_relay`` configuration (else None),
        the store atom and this thread's copy of the S-shaped accumulators (P, dS) on ``mma`` into shared memory,
        the (query row, key) coordinates of this thread's and thread 0's S accumulator (``acc_mn_view``) and their
        row count."""
        relay = DqRelay(mTurns, block) if self.cfg.dq_relay else None
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = cu.acc_mn_view(mma.get_slice(tidx).partition_C(cS))
        t0ScS_mn = cu.acc_mn_view(mma.get_slice(0).partition_C(cS))
        return (relay, st_atom, cute.make_tiled_copy_C(st_atom, mma).get_slice(tidx), tScS_mn, t0ScS_mn,
                cute.size(tScS_mn, mode=[0]))

    @cute.jit
    def dense_entry(self, first_head, m_min, num_m, qheads, it):
        """(head, query tile, masked) of entry ``it`` of the dense walk: heads outer, query tiles of the window
        inner, ascending (the relay: descending, kernels/dq_relay.py; with config_bwd.RELAY_HEADS_INNER the
        relay's query tiles outer and the ``qheads`` heads of the group inner)."""
        if const_expr(self.relay_heads_inner):
            return first_head + it % qheads, m_min + num_m - 1 - it // qheads, Int32(1)
        if const_expr(self.cfg.dq_relay):
            return first_head + it // num_m, m_min + num_m - 1 - it % num_m, Int32(1)
        return first_head + it // num_m, m_min + it % num_m, Int32(1)

    @cute.jit
    def walk_tile(self, w, it, pend, acc_dQ, cur_head=None, cur_m_block=None, cur_masked=None):
        """Entry ``it`` of the walk, both walks' tile (``process``; ``w``: what the tile reads, trace time): S and
        dP, the score hook, dS, the P/dS stores, dV += P^T dO and dK += dS^T Q with the next entry's Q and dO
        prefetched behind them, and (fused dQ) dQ = dS K into ``acc_dQ``, which the caller adds.  ``pend``: the
        relay's counter whose turn is passed on after the first barrier; ``cur_*``: the carried entry (see
        ``process``).  Returns (the next carried entry, this tile's head and query tile)."""
        cfg = self.cfg
        # the rows' stats are written in run-time branches: as locals (writing through ``w`` would make the DSL
        # carry all of ``w`` through the branch)
        row_qpos, lse_log2, dpsum = w.row_qpos, w.lse_log2, w.dpsum
        if const_expr(w.carry):
            head, m_block, masked = cur_head, cur_m_block, cur_masked
        else:
            head, m_block, masked = w.where(it)
        first_q = m_block * self.tile_m
        for r in cutlass.range_constexpr(w.num_rows):
            pos = first_q + w.tScS_mn[r, 0][0]
            row_qpos[r] = pos
            lse_log2[r] = Float32.inf
            dpsum[r] = 0.0
            if pos < w.seq.seqlen_q:
                idx = w.seq.row_stat_index(head, pos)
                lse_log2[r] = w.score.lse_log2(w.mLSE[idx])
                dpsum[r] = w.mDpsum[idx]
        if const_expr(w.carry and cfg.block_sparse):
            cur_head, cur_m_block, cur_masked = w.qlist.next_entry(it + 1, head, m_block, masked)
        elif const_expr(w.carry and self.relay_heads_inner):  # heads inner (dense_entry)
            cur_head, cur_m_block = head + 1, m_block
            if cur_head == w.first_head + w.qheads:
                cur_head, cur_m_block = w.first_head, m_block - 1
        elif const_expr(w.carry and cfg.dq_relay):  # descending (dense_entry)
            cur_head, cur_m_block = head, m_block - 1
            if cur_m_block < w.m_min:
                cur_head, cur_m_block = head + 1, w.m_max - 1
        elif const_expr(w.carry):
            cur_head, cur_m_block = head, m_block + 1
            if cur_m_block == w.m_max:
                cur_head, cur_m_block = head + 1, w.m_min
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if const_expr(cfg.dq_relay and not self.relay_release_after_s):  # the previous tile's adds are
            w.relay.pass_on(pend, w.tidx)  # issued (barrier): pass its turn on

        # ---- S, then the score hook (softcap, masks)
        drop_bits = None
        if const_expr(cfg.has_dropout):  # before the S mma: S and dP are not live yet (score.py)
            drop_bits = w.score.dropout.bits(w.tScS_mn, w.t0ScS_mn, row_qpos, (w.seq.batch << 16) | head, w.n_block)
        acc_S = cute.make_rmem_tensor(w.acc_shape_s, Float32)
        acc_S.fill(0.0)
        cu.mma_ss(w.mma_s, acc_S, *w.ops_S, False)
        if const_expr(self.relay_release_after_s):
            w.relay.pass_on(pend, w.tidx)
        acc_raw = None
        if const_expr(self.wants_raw_scores()):  # the scaled scores before the score_mod, for its backward
            acc_raw = cute.make_rmem_tensor(w.acc_shape_s, Float32)
        hook = w.score
        if const_expr(cfg.block_sparse and (cfg.windowed or self.has_mask_mod())):  # on mask blocks only
            hook = w.score.for_sparse_block(masked != 0)
        needs_mask = None  # every tile masked, or (branch_masks) only those a mask cuts
        if const_expr(self.branch_masks()):
            needs_mask = w.block.tile_needs_mask(m_block, w.n_block)
        hook.apply_backward(acc_S, w.tScS_mn, w.t0ScS_mn, row_qpos, w.n_block, head, acc_raw, needs_mask)
        acc_P = cute.make_rmem_tensor(w.acc_shape_s, Float32)
        w.score.backward_p(acc_S, lse_log2, acc_P)
        # ---- dP, dS
        acc_dP = cute.make_rmem_tensor(w.acc_shape_s, Float32)
        acc_dP.fill(0.0)
        cu.mma_ss(w.mma_s, acc_dP, *w.ops_dP, False)
        # dS; with dropout (drop_bits) from the dropped, rescaled dP, and acc_P becomes P * keep (for dV)
        w.score.backward_ds(acc_S, acc_P, acc_dP, dpsum, drop_bits)
        if const_expr(self.wants_raw_scores()):
            w.score.backward_mods(acc_dP, acc_raw, w.tScS_mn, w.t0ScS_mn, row_qpos, head, w.n_block)
        rP = cute.make_rmem_tensor_like(acc_P, w.dt)
        rP.store(acc_P.load().to(w.dt))
        rdS = cute.make_rmem_tensor_like(acc_dP, w.dt)
        rdS.store(acc_dP.load().to(w.dt))
        cute.copy(w.st_atom, w.st_s.retile(rP), w.st_s.partition_D(w.sP))
        cute.copy(w.st_atom, w.st_s.retile(rdS), w.st_s.partition_D(w.sdS))
        cute.arch.barrier()

        # ---- dV += P^T dO, dK += dS^T Q (each followed by the prefetch of the next block into the freed buffer)
        cu.mma_ss(w.mma_n, w.acc_dV, *w.ops_dV, False)
        cute.arch.barrier()
        # without the carry, the next entry is recomputed at each prefetch (not kept live across the dK mma:
        # registers)
        if it + 1 < w.num_iters:
            if const_expr(w.carry):
                next_head, next_m_block = cur_head, cur_m_block
            else:
                next_head, next_m_block, _ = w.where(it + 1)
            self.load_q_do(w.seq, w.mQ, w.mdO, w.sQ, w.sdO, w.copy_d, w.copy_dv, w.tidx, next_head, next_m_block, False, True)
        cu.mma_ss(w.mma_n, w.acc_dK, *w.ops_dK, False)
        cute.arch.barrier()
        if it + 1 < w.num_iters:
            if const_expr(w.carry):
                next_head, next_m_block = cur_head, cur_m_block
            else:
                next_head, next_m_block, _ = w.where(it + 1)
            self.load_q_do(w.seq, w.mQ, w.mdO, w.sQ, w.sdO, w.copy_d, w.copy_dv, w.tidx, next_head, next_m_block, True, False)
        if const_expr(cfg.fused_dq):
            # dQ = dS K after dK, Q's last reader: the next Q tile loads under this mma, and the adds drain
            # under the next block's S mma.  dQ reads sdS and sK only, and the barrier at the top of the next
            # iteration orders its sdS reads before the next block's writes
            acc_dQ.fill(0.0)
            cu.mma_ss(w.mma_m, acc_dQ, *w.ops_dQ, False)
        return cur_head, cur_m_block, cur_masked, head, m_block

    def branch_masks(self) -> bool:
        """Trace time: whether the walk masks only the tiles that need it (``BlockInfo.tile_needs_mask``, a branch
        per tile) instead of every tile: dense windowed walks without mods (block-sparse walks mask by block kind)
        up to head dim 128, where it measured faster per kernel on the H100 proxy
        (benchmarks/experiments/results/bwd_mask_branch_h100_s28.jsonl).  Walks
        that are not windowed keep masking the sequence end on every tile (only the last key block is cut, the same
        for the whole CTA; the branch cost the key-row kernel 4% there with dropout)."""
        cfg = self.cfg
        if cfg.fused_dq:  # every dense walk without mods: the fused tiles measured faster with the branch
            return not cfg.block_sparse and cfg.mods is None
        return (not cfg.block_sparse and cfg.mods is None and cfg.windowed
                and max(cfg.head_dim, cfg.head_dim_v) <= 128)

    @cute.jit
    def process(
        self, seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdK, mdV, dq_ws, sparse, softmax_scale,
        qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, sP_l, mma_m, mma_n, copy_d, copy_dv, SharedStorage: cutlass.Constexpr, tidx,
        n_block, kv_head,
    ):
        cfg = self.cfg
        mDqAccum, mTurns = dq_ws  # the fused dQ workspace and the relay's turn counters (None when off)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_l), storage.sdO.get_tensor(sdO_l)
        sK, sV = storage.sK.get_tensor(sK_l), storage.sV.get_tensor(sV_l)
        sP, sdS = storage.sP.get_tensor(sP_l), storage.sdS.get_tensor(sP_l)
        sPt, sdSt = cu.transpose_view(sP), cu.transpose_view(sdS)
        sQt, sdOt = cu.transpose_view(sQ), cu.transpose_view(sdO)
        dt = self.dtype

        # K and V of this block stay in smem for the whole CTA
        first_key = n_block * self.tile_n
        load_rows(lambda pos: kv.row(mK, pos, kv_head), sK, copy_d, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.d), True)
        load_rows(lambda pos: kv.row(mV, pos, kv_head), sV, copy_dv, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.dv), True)
        cute.arch.cp_async_commit_group()

        ld = cu.ldmatrix_atom
        # S = Q K^T and dP = dO V^T: rows = queries, on the grid of q_warp_rows query rows per warp (mma_s; 16: the
        # query-row grid mma_m that dQ uses too).  Everything that reads the S accumulator's layout (the score hook,
        # the rows' LSE / D, the P/dS stores to shared memory) takes it from mma_s; dQ reads dS from shared memory
        mma_s = mma_m
        if const_expr(cfg.q_warp_rows != 16):
            mma_s = bwd_tiled_mma(dt, self.tile_m, self.num_warps, cfg.q_warp_rows)
        thr_s = mma_s.get_slice(tidx)
        acc_shape_s = thr_s.partition_shape_C((self.tile_m, self.tile_n))
        ops_S = cu.ss_operands(mma_s, tidx, ld(dt, False), ld(dt, False), sQ, sK)
        ops_dP = cu.ss_operands(mma_s, tidx, ld(dt, False), ld(dt, False), sdO, sV)
        # dV = P^T dO, dK = dS^T Q: rows = keys (mma_n), A and B read transposed
        thr_n = mma_n.get_slice(tidx)
        ops_dV = cu.ss_operands(mma_n, tidx, ld(dt, True), ld(dt, True), sPt, sdOt)
        ops_dK = cu.ss_operands(mma_n, tidx, ld(dt, True), ld(dt, True), sdSt, sQt)
        acc_dV = cute.make_rmem_tensor(thr_n.partition_shape_C((self.tile_n, self.dv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_n.partition_shape_C((self.tile_n, self.d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # dQ = dS K (fused): rows = queries (mma_m), A = dS, B = K read transposed
        if const_expr(cfg.fused_dq):
            sKt = cu.transpose_view(sK)
            thr_m = mma_m.get_slice(tidx)
            ops_dQ = cu.ss_operands(mma_m, tidx, ld(dt, False), ld(dt, True), sdS, sKt)
            acc_shape_dq = thr_m.partition_shape_C((self.tile_m, self.d))
            rows_q, _ = self.seq_rows(mQ, mK)
        pend = Int32(-1)  # the relay: the counter whose turn this CTA passes on next (-1: none)
        relay, st_atom, st_s, tScS_mn, t0ScS_mn, num_rows = self.score_tile_views(mTurns, block, mma_s, dt, tidx)
        row_qpos = cute.make_rmem_tensor(num_rows, Int32)
        lse_log2 = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)

        first_head = kv_head * qheads_per_kvhead
        # the (query head, query tile) pairs to visit, as a flat list of num_iters entries, entry ``it`` given by
        # ``where(it)`` -> (head, m_block, masked): every query tile of the window for each head of the group, or
        # (block sparsity) the listed query blocks of this KV block (kernels/block_sparse.py SparseQList)
        if const_expr(cfg.block_sparse):
            qlist = SparseQList.create(cfg.sparse_q_ratio, cfg.sparse_kv_ratio, self.tile_m, sparse, seq.batch,
                                       first_head, qheads_per_kvhead, n_block, seq.seqlen_q)
            num_iters = qlist.num_tiles()
            where = qlist.locate
        else:
            m_min, m_max = block.q_range(n_block)
            num_m = cutlass.max(m_max - m_min, 0)
            num_iters = num_m * qheads_per_kvhead
            where = partial(self.dense_entry, first_head, m_min, num_m, qheads_per_kvhead)
        # prologue: Q and dO of the first (head, query block); later ones are prefetched inside the loop as soon
        # as the previous block's last reader of sdO (dV) / sQ (dK) is done, overlapping dK and the next S/dP.
        # Block sparsity with several query tiles per block carries the entry from one iteration to the next
        # (cur_*) and looks the next one up once, at the top of the iteration: the list's dependent loads (counts,
        # then an index) then overlap the Q cp.async in flight instead of stalling both prefetches, and a query
        # tile inside the block of the previous one needs no load at all (SparseQList.next_entry).  With one tile
        # per block every entry needs the walk anyway, and carrying it cost the d256 tile 60 spills (compile gate,
        # sm_120a): that case looks entries up by index.  The dense walk carries its entry too, advanced by
        # increment (dividing the entry index cost the key-row kernel 10% at d64 causal,
        # bwd_tile_sweep_h100_v5.jsonl), except with dropout: the carried pair cost the d128 tile with dropout and a
        # relative-bias score_mod 2 STL/LDL (compile gate)
        carry = const_expr((not cfg.block_sparse and not cfg.has_dropout) or cfg.sparse_q_ratio > 1)
        if const_expr(carry):
            cur_head, cur_m_block, cur_masked = first_head, Int32(0), Int32(0)
            if num_iters > 0:
                cur_head, cur_m_block, cur_masked = where(Int32(0))
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, cur_head, cur_m_block, True, True)
        else:
            if num_iters > 0:
                head0, m_block0, _ = where(Int32(0))
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, head0, m_block0, True, True)
        # what every tile of the walk reads (trace time; ``walk_tile``)
        by_walk = {}
        if const_expr(cfg.block_sparse):
            by_walk["qlist"] = qlist
        else:
            by_walk["m_min"], by_walk["m_max"] = m_min, m_max
        if const_expr(cfg.fused_dq):
            by_walk["ops_dQ"] = ops_dQ
        w = WalkTile(
            seq=seq, block=block, score=score, mQ=mQ, mdO=mdO, mLSE=mLSE, mDpsum=mDpsum, sQ=sQ, sdO=sdO, sP=sP,
            sdS=sdS, copy_d=copy_d, copy_dv=copy_dv, tidx=tidx, n_block=n_block, dt=dt, relay=relay, st_atom=st_atom,
            st_s=st_s, tScS_mn=tScS_mn, t0ScS_mn=t0ScS_mn, num_rows=num_rows, row_qpos=row_qpos, lse_log2=lse_log2,
            dpsum=dpsum, mma_s=mma_s, mma_n=mma_n, mma_m=mma_m, acc_shape_s=acc_shape_s, ops_S=ops_S, ops_dP=ops_dP,
            ops_dV=ops_dV, ops_dK=ops_dK, acc_dV=acc_dV, acc_dK=acc_dK, where=where, num_iters=num_iters,
            carry=carry, first_head=first_head, qheads=qheads_per_kvhead, **by_walk)
        if const_expr(cfg.dq_relay):
            # the relay's walk, one loop without a spin loop inside (a spin loop in the walk's body made ptxas
            # compile the body worse, 12-20% on the H200 proxy: benchmarks/experiments/README.md, session 39): a
            # tile's dQ waits in registers for its turn and is added at the start of a later trip; a trip whose warp
            # finds the turn not yet passed only sleeps.  Warps may take different numbers of trips: the barriers
            # are all inside the tile's part of a trip, so every warp passes each of them once per tile
            it = Int32(0)
            has = Int32(0)  # acc_dQ holds a tile's dQ awaiting its turn
            p_head, p_m = Int32(0), Int32(0)
            acc_dQ = cute.make_rmem_tensor(acc_shape_dq, Float32)
            while (num_iters - it) + has > 0:
                ready = Int32(1)
                if has != 0:
                    ready = self.dq_turn_ready(mDqAccum, relay, seq, rows_q, p_head, p_m, n_block)
                if ready == 0:
                    _dq_relay.nanosleep(_dq_relay.SPIN_SLEEP_NS)
                else:
                    if has != 0:
                        pend = self.add_dq(mDqAccum, relay, acc_dQ, seq, rows_q, p_head, p_m, n_block, tidx)
                        has = Int32(0)
                    if it < num_iters:
                        if const_expr(carry):
                            cur_head, cur_m_block, cur_masked, p_head, p_m = self.walk_tile(
                                w, it, pend, acc_dQ, cur_head, cur_m_block, cur_masked)
                        else:
                            p_head, p_m = self.walk_tile(w, it, pend, acc_dQ)[3:]
                        has = Int32(1)
                        it = it + 1
        else:
            for it in cutlass.range(num_iters, unroll=1):
                acc_dQ = None
                if const_expr(cfg.fused_dq):
                    acc_dQ = cute.make_rmem_tensor(acc_shape_dq, Float32)
                if const_expr(carry):
                    cur_head, cur_m_block, cur_masked, head, m_block = self.walk_tile(
                        w, it, pend, acc_dQ, cur_head, cur_m_block, cur_masked)
                else:
                    head, m_block = self.walk_tile(w, it, pend, acc_dQ)[3:]
                if const_expr(cfg.fused_dq):
                    pend = self.add_dq(mDqAccum, relay, acc_dQ, seq, rows_q, head, m_block, n_block, tidx)
            # the barrier at the top of the next iteration orders this block's reads of sdS before the next
            # block's writes of sP/sdS

        if const_expr(cfg.dq_relay):  # the last tile's turn, once every thread's adds are issued
            cute.arch.barrier()
            relay.pass_on(pend, tidx)

        # ---- dK (scaled), dV: one write per CTA
        acc_dK.store(acc_dK.load() * softmax_scale)
        if const_expr(cfg.has_dropout):  # dV = (P * keep / (1-p))^T dO: the 1/(1-p) once
            acc_dV.store(acc_dV.load() * score.dropout.scale)
        store_rows_from_acc(lambda pos: kv.row(mdK, pos, kv_head), acc_dK, thr_n, first_key, seq.seqlen_k,
                            (self.tile_n, self.d), dt)
        store_rows_from_acc(lambda pos: kv.row(mdV, pos, kv_head), acc_dV, thr_n, first_key, seq.seqlen_k,
                            (self.tile_n, self.dv), dt)
