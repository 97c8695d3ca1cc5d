"""Warp-specialised forward kernel: one TMA producer warp + ``num_warps`` mma.sync consumer warps.

Layouts and features: as fwd_cpasync.py (same API, same masks, packed GQA, varlen, sink, softcap), and block
sparsity: the producer walks the listed KV tiles (kernels/block_sparse.py ``SparseBlockInfo.tile_of``) in the order
the consumers' ``run_kv_schedule`` visits them.

Why: in the all-warps cp.async kernel every KV block costs two CTA-wide barriers, which keep all warps in the
same phase, so their softmax never overlaps another warp's mma.  Here one warp streams K and V blocks with
CTA-scope TMA (cp.async.bulk.tensor, no multicast, no clusters: SM120 has both) into ``num_stages`` smem stages
guarded by mbarriers (full: TMA transaction bytes landed; empty: every consumer warp released the stage), and
the consumer warps only wait on the stage they need, so they drift apart and overlap each other's
softmax with mma.  Registers move from the producer to the consumers with setmaxnreg.

Q is loaded by the consumers with cp.async (rows are gathered per (position, head) under packed GQA), and kept in
registers when ``q_in_regs``.  TMA zero-fills rows past the end of K/V; rows past seqlen_k inside the tensor
(varlen, the rest of a last page) may hold anything: K columns there are masked by assignment, V rows zeroed in
shared memory (``zero_rows_past``).  O is staged in the Q buffer.

Paged K/V (config.paged_tma_tile: page_size % tile_n == 0, so every K/V tile lies inside one page): the same
descriptor over the pool viewed as (page_size, D, Hkv, num_pages); the producer reads the page of each tile from
the page table (kv_source.PagedKV.tma_box) and issues one box per K and per V tile.  Everything else is as above.

Profile:  ncu --set full -k regex:kernel_cutlass python benchmarks/bench_fwd.py --only llama3-8b --seqlens 4096
"""

from dataclasses import replace
from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..arguments import BlockSparseLists, DropoutParams
from . import cute_utils as cu
from .block_sparse import SparseBlockInfo
from .fwd_base import FwdKernelBase
from .kv_source import PagedKV

# setmaxnreg moves registers per whole warpgroup, so the producer warp comes with three idle warps that exit at
# once (otherwise ptxas drops the register reallocation).  8 mma warps x 240 + 4 x 24 = 64512 <= 65536.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
_COMPUTE_BARRIER_ID = 1


def tma_smem_atom(dtype, k_dim: int):
    """K-major smem atom with the widest TMA swizzle that divides a row."""
    row_bits = k_dim * dtype.width
    kind = (
        warpgroup.SmemLayoutAtomKind.K_SW128 if row_bits % 1024 == 0 else
        warpgroup.SmemLayoutAtomKind.K_SW64 if row_bits % 512 == 0 else
        warpgroup.SmemLayoutAtomKind.K_SW32
    )
    return warpgroup.make_smem_layout_atom(kind, dtype)


class FlashFwdTma(FwdKernelBase):
    def compute_sync(self):
        cute.arch.barrier(barrier_id=_COMPUTE_BARRIER_ID, number_of_threads=self.num_mma_threads)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor,
        cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None,
        seqused_q: cute.Tensor | None,
        seqused_k: cute.Tensor | None,
        page_table: cute.Tensor | None,  # paged K/V with page_size % tile_n == 0 (config.paged_tma_tile)
        sink: cute.Tensor | None,
        # block sparsity (config.select_sparse_tile): the listed KV blocks of each query block, else None
        sparse: BlockSparseLists | None,
        aux_tensors,  # the mods' aux tensors (a tuple) or None
        scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        pack: Int32,
        qheads_per_kvhead: Int32,
        num_m_blocks: Int32,
        num_head_groups: Int32,
        num_batch: Int32,
        dropout: DropoutParams | None,
        stream,
    ):
        mQ, mK, mV = q, k, v
        dt = self.dtype
        atom_q = tma_smem_atom(dt, self.d)
        atom_v = tma_smem_atom(dt, self.dv)
        sQ_layout = cute.tile_to_shape(atom_q, (self.tile_m, self.d), (0, 1))
        sK_layout = cute.tile_to_shape(atom_q, (self.tile_n, self.d, self.num_stages), (0, 1, 2))
        sV_layout = cute.tile_to_shape(atom_v, (self.tile_n, self.dv, self.num_stages), (0, 1, 2))
        sO_layout = cute.tile_to_shape(atom_v, (self.tile_m, self.dv), (0, 1))

        # TMA wants the tiled modes first: (seq, d, head[, batch]); paged: (page_size, d, head, page)
        order = [0, 2, 1] if const_expr(self.cfg.varlen_k) else [1, 3, 2, 0]
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=order))
        mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=order))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tK = cpasync.make_tiled_tma_atom(op, mK_t, cute.slice_(sK_layout, (None, None, 0)),
                                                (self.tile_n, self.d))
        tma_v, tV = cpasync.make_tiled_tma_atom(op, mV_t, cute.slice_(sV_layout, (None, None, 0)),
                                                (self.tile_n, self.dv))
        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]

        rows_q, rows_k = self.seq_rows(mQ, mK, page_table)
        tiled_mma = cu.tiled_mma_16816(dt, self.num_warps)
        copy_q = cu.gmem_tiled_copy(dt, self.d, self.num_mma_threads, is_async=True)
        copy_o = cu.gmem_tiled_copy(dt, self.dv, self.num_mma_threads, is_async=False)
        self.launch_smem_bytes = SharedStorage.size_in_bytes()  # read by the compile gate
        self.kernel(
            mQ, tK, tV, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, sink, sparse,
            aux_tensors,
            scale_log2, softcap_prescale, window_left, window_right, pack, qheads_per_kvhead, num_m_blocks,
            rows_q, rows_k, dropout,
            tma_k, tma_v, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_o, SharedStorage,
        ).launch(
            grid=(num_m_blocks + self.grid_x_extra, num_head_groups, num_batch),
            block=(self.num_mma_threads + 128, 1, 1),
            min_blocks_per_mp=1,  # lets ptxas honour setmaxnreg (it drops it without a per-thread register bound)
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self, mQ, tK, tV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink, sparse, mAux,
        scale_log2: Float32, softcap_prescale: Float32, window_left: Int32, window_right: Int32, pack: Int32,
        qheads_per_kvhead: Int32, num_m_blocks: Int32, rows_q: Int32, rows_k: Int32, dropout: DropoutParams | None,
        tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma,
        copy_q: cute.TiledCopy, copy_o: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        # thread and block indices are read inside each branch: live across the branch they would be spilled
        # around the producer's setmaxnreg
        bx, _, _ = self.cta_coords()
        tile = partial(
            self.run_tile, mQ, tK, tV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink,
            sparse, mAux,
            scale_log2,
            softcap_prescale, window_left, window_right, pack, qheads_per_kvhead, num_m_blocks, rows_q, rows_k,
            tma_k, tma_v, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_o, SharedStorage,
            dropout,
        )
        self.tile_or_fill(bx, num_m_blocks, tile, mO, mLSE, mCuSeqlensQ, mSeqUsedQ, rows_q, pack, self.num_mma_threads + 128)

    @cute.jit
    def run_tile(
        self, mQ, tK, tV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink, sparse, mAux,
        scale_log2, softcap_prescale, window_left, window_right, pack, qheads_per_kvhead, num_m_blocks, rows_q, rows_k,
        tma_k, tma_v, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_o,
        SharedStorage: cutlass.Constexpr, dropout,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bx, head_group, bz = self.cta_coords()
        batch, split = self.split_coords(bz, mO)
        self.release_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(cfg.windowed or cfg.block_sparse):
            m_block = num_m_blocks - 1 - bx  # longest tiles first (block lists: a causal-like mask's last rows)
        else:
            m_block = bx
        ts = self.tile_state(batch, head_group, m_block, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                             mSeqUsedK, scale_log2, softcap_prescale, window_left, window_right, pack,
                             split=split, dropout=dropout, aux=mAux)
        if const_expr(cfg.block_sparse):  # the listed KV blocks of this query block (kernels/block_sparse.py)
            ts = replace(ts, block=SparseBlockInfo.from_block(ts.block, cfg.sparse_q_ratio, cfg.sparse_kv_ratio,
                                                              sparse, ts.seq.batch, head_group * pack, m_block))
        if m_block * self.tile_m < ts.num_rows:  # uniform over the CTA
            if warp_idx == self.num_warps:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_warps)
            elem_bytes = self.dtype.width // 8
            pipe_k = pipeline.PipelineTmaAsync.create(
                num_stages=self.num_stages, producer_group=producer, consumer_group=consumers,
                tx_count=self.tile_n * self.d * elem_bytes, barrier_storage=storage.mbar_k.data_ptr(),
                defer_sync=True,
            )
            pipe_v = pipeline.PipelineTmaAsync.create(
                num_stages=self.num_stages, producer_group=producer, consumer_group=consumers,
                tx_count=self.tile_n * self.dv * elem_bytes, barrier_storage=storage.mbar_v.data_ptr(),
            )  # the second create fences and syncs the CTA once for both pipelines
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
            kv_head = (head_group * pack) // qheads_per_kvhead
            plan = ts.block.kv_plan(m_block)
            if warp_idx >= self.num_warps:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == self.num_warps:
                    self.produce(ts, tK, tV, sK, sV, tma_k, tma_v, pipe_k, pipe_v, kv_head, plan[0], plan[1],
                                 mPageTable)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                self.consume(ts, plan, mQ, mO, mLSE, mSink, sQ, sK, sV, sO, pipe_k, pipe_v, tiled_mma, copy_q,
                             copy_o, tidx)

    def kv_source(self, seq, mK, mPageTable):
        """Paged: none in the tile state; the producer warp builds its page lookup itself (``produce``), so no
        page-size value is live across the warp split."""
        if const_expr(self.is_paged()):
            return None
        return super().kv_source(seq, mK, mPageTable)

    def tma_tiles(self, tma, sX, head_view, cols: int):
        """(smem, gmem) TMA partitions of the (tile_n, cols) tiles of one head view (rows, cols)."""
        gX = cute.local_tile(head_view, (self.tile_n, cols), (None, 0))
        return cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                     cute.group_modes(gX, 0, 2))

    @cute.jit
    def produce(self, ts, tK, tV, sK, sV, tma_k, tma_v, pipe_k, pipe_v, kv_head, n_min, n_max, mPageTable):
        paged = None
        if const_expr(self.is_paged()):
            paged = PagedKV.create_tma(ts.seq, tK, mPageTable)
            head_k, head_v = tK[None, None, kv_head, 0], tV[None, None, kv_head, 0]  # page 0: the smem side only
        else:
            head_k, head_v = ts.kv.tma_head_view(tK, kv_head), ts.kv.tma_head_view(tV, kv_head)
        tKsK, tKgK = self.tma_tiles(tma_k, sK, head_k, self.d)
        tVsV, tVgV = self.tma_tiles(tma_v, sV, head_v, self.dv)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for i in cutlass.range(n_max - n_min, unroll=1):
            n_block = n_max - 1 - i
            if const_expr(paged is not None):
                # the page of this tile, read before the waits (its latency overlaps them); one box of the page
                page, box = paged.tma_box(n_block, self.tile_n)
                src_k = self.tma_tiles(tma_k, sK, tK[None, None, kv_head, page], self.d)[1][None, box]
                src_v = self.tma_tiles(tma_v, sV, tV[None, None, kv_head, page], self.dv)[1][None, box]
            else:
                if const_expr(self.cfg.block_sparse):  # virtual tile -> listed KV tile (past the end: zero-filled)
                    n_block = ts.block.tile_of(n_block)
                src_k, src_v = tKgK[None, n_block], tVgV[None, n_block]
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, src_k, tKsK[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, src_v, tVsV[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def consume(self, ts, plan, mQ, mO, mLSE, mSink, sQ, sK, sV, sO, pipe_k, pipe_v, tiled_mma, copy_q, copy_o,
                tidx):
        sVt = cu.transpose_view(sV)
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.dv)), Float32)
        acc_O.fill(0.0)
        ldsm_q = cute.make_tiled_copy_A(cu.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(tidx)
        ldsm_k = cute.make_tiled_copy_B(cu.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(tidx)
        ldsm_v = cute.make_tiled_copy_B(cu.ldmatrix_atom(self.dtype, True), tiled_mma).get_slice(tidx)
        tSsQ, tSsK, tOsVt = ldsm_q.partition_S(sQ), ldsm_k.partition_S(sK), ldsm_v.partition_S(sVt)

        tScS_mn, t0ScS_mn, row_qpos = self.row_coords(tiled_mma, tidx, ts.m_block, ts.pack)
        row_bh = self.row_bh(ts, tScS_mn)
        state_max = cute.make_rmem_tensor(cute.size(row_qpos), Float32)
        state_sum = cute.make_rmem_tensor(cute.size(row_qpos), Float32)
        state_max.fill(-Float32.inf)
        state_sum.fill(0.0)

        if plan[1] > plan[0]:
            self.load_q(mQ, sQ, copy_q, tidx, ts)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            self.compute_sync()
            if const_expr(self.q_in_regs):
                cute.copy(ldsm_q, tSsQ, ldsm_q.retile(tSrQ))
            step = partial(
                self.kv_step,
                pipe_k=pipe_k, pipe_v=pipe_v, tiled_mma=tiled_mma, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tSsQ=tSsQ,
                tSsK=tSsK, tOsVt=tOsVt, ldsm_q=ldsm_q, ldsm_k=ldsm_k, ldsm_v=ldsm_v, acc_O=acc_O,
                state_max=state_max, state_sum=state_sum, score=ts.score, tScS_mn=tScS_mn, t0ScS_mn=t0ScS_mn,
                row_qpos=row_qpos, row_bh=row_bh, sV=sV, tidx=tidx,
                kv_tile=ts.block.tile_of if const_expr(self.cfg.block_sparse) else None,
            )
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            ts.block.run_kv_schedule(step, state, plan)
        self.epilogue(ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx, tScS_mn)

    @cute.jit
    def kv_step(
        self, n_block: Int32, state,
        pipe_k, pipe_v, tiled_mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, ldsm_q, ldsm_k, ldsm_v, acc_O, state_max,
        state_sum, score, tScS_mn, t0ScS_mn, row_qpos, row_bh, sV, tidx, kv_tile,
        is_first: cutlass.Constexpr[bool], mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool], mask_mod_on: cutlass.Constexpr[bool] = True,
    ):
        """One KV block: wait K, S = Q K^T, release K, mask + online softmax, wait V, O += P V, release V.
        ``kv_tile``: None, or (block sparsity) the map from the schedule's virtual index ``n_block`` to the KV tile
        the producer loaded for it; ``mask_mod_on=False`` on block-sparse "full" tiles."""
        if const_expr(kv_tile is not None):
            n_block = kv_tile(n_block)
        dropout = self.dropout_apply(score, tScS_mn, t0ScS_mn, row_qpos, row_bh, n_block)
        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((self.tile_m, self.tile_n)), Float32)
        self.qk(acc_S, state.clone(), pipe_k, tiled_mma, tSrQ, tSrK, tSsQ, tSsK, ldsm_q, ldsm_k)
        tOrP = self.scores_to_p(score, acc_S, acc_O, state_max, state_sum, tScS_mn, t0ScS_mn, row_qpos, dropout,
                                n_block, is_first, mask_seqlen, mask_right, mask_left, mask_mod_on)
        if const_expr(mask_seqlen):
            # the block holding the end of the sequence: its V rows past seqlen_k are whatever the tensor holds
            # there (the next sequence, padding, NaN from torch.empty); P is 0 on them, but 0 * NaN is NaN.  A
            # listed block wholly past the end (block sparsity) has rows_valid <= 0: every row is zeroed
            pipe_v.consumer_wait(state)
            self.zero_rows_past(sV[None, None, state.index], score.seq.seqlen_k - n_block * self.tile_n, tidx)
        return self.pv(tOrP, state, pipe_v, tiled_mma, acc_O, tOrVt, tOsVt, ldsm_v)

    @cute.jit
    def zero_rows_past(self, sV_stage, rows_valid, tidx):
        """Zero the rows >= ``rows_valid`` of one landed V stage (the consumer warps split the work, then sync, so
        no warp's P V reads the stage before every row is clean).  Uniform over the CTA.  The stores are fenced
        against the async proxy: the producer's next TMA into this stage must land after them."""
        if rows_valid < self.tile_n:
            first = cutlass.max(rows_valid, 0) * self.dv
            for i in cutlass.range(first + tidx, self.tile_n * self.dv, self.num_mma_threads, unroll=1):
                r = i // self.dv
                sV_stage[r, i - r * self.dv] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()
            self.compute_sync()

    @cute.jit
    def qk(self, acc_S, k_state, pipe_k, tiled_mma, tSrQ, tSrK, tSsQ, tSsK, ldsm_q, ldsm_k):
        """acc_S = Q K^T for the stage ``k_state`` points at; releases that K stage and returns the next state."""
        acc_S.fill(0.0)
        pipe_k.consumer_wait(k_state)
        cu.mma_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, k_state.index], ldsm_q, ldsm_k,
                  self.q_in_regs)
        pipe_k.consumer_release(k_state)
        k_state.advance()
        return k_state

    @cute.jit
    def pv(self, tOrP, v_state, pipe_v, tiled_mma, acc_O, tOrVt, tOsVt, ldsm_v):
        """O += P V for the stage ``v_state`` points at; releases that V stage and returns the next state."""
        pipe_v.consumer_wait(v_state)
        cu.mma_rs(tiled_mma, acc_O, tOrP, tOrVt, tOsVt[None, None, None, v_state.index], ldsm_v)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        return v_state
