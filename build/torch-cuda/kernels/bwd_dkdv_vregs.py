"""The fused backward's V-in-registers tile (config ``BwdVRegsKernelConfig``) — KV-stationary, cp.async, SM120's 99 KB.

Same algorithm, arguments, walk and dQ workspace as the fused form of bwd_dkdv.py (one CTA = ``tile_n`` keys of one
KV head, every query head of its group and every query block that sees them; dK/dV summed over the group in
registers and stored once; dQ = dS K added into the fp32 workspace with ``red.global.add.v2.f32``, in the order
kernels/bwd_dq_convert.py reads it back), for head dims up to 256 where that kernel's P/dS tile does not fit 64
keys (config_bwd's budget table, above ``BwdVRegsKernelConfig``).  The relay form (``dq_relay``) is traced here too,
but it spilled on sm_120a, so config_bwd.vregs_problems refuses it and ``deterministic=True`` runs the kernel pair.

  * S and dP run with the warps side by side along the keys (``sdp_tiled_mma``: 8 keys x every query row per
    warp), so a warp's share of V is 8 keys x dv;

  * V is read once into registers (the B operand of dP = dO V^T), and its shared memory then holds P and dS;
  * the block's LSE and D per query row go through a small shared buffer and are read on use (``SmemRows``), and
    the query positions are computed on use (``RowPos``): held in registers across the block they made ptxas
    spill loop invariants (results file below);
  * every product over a head dim (dV += P^T dO, dK += dS^T Q, dQ = dS K) runs in column chunks
    (config_bwd.vregs_chunk_cols): the dK/dV accumulators are one register tensor per chunk, and dQ is computed
    and added one chunk at a time (``dq_chunk_cols``), so only one chunk's dQ and operands are live beside dK, dV
    and V.

Per query block: S = Q K^T, the score hook, P; dP = dO V^T (V from registers); dS; P and dS to shared memory; one
barrier; dV chunks (then dO of the next block loads), dK chunks (then its Q), dQ chunks with their adds.

Layouts (torch order) and constraints: bwd_dkdv.py's; the tile is 32x64 with 8 warps (config_bwd.vregs_problems),
head dims multiples of 64, no block sparsity (the fused path never takes it).  Compile-gate rows: the fused
backward's (scripts/gate_lists.py ``fused_trial_worklist``; benchmarks/results/gate_vregs_sm120a_d256.jsonl).
Profile: ``ncu -k regex:kernel_cutlass_kernel.*FlashBwdDkdvVRegs``.
"""

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..config_bwd import vregs_chunk_cols
from . import cute_utils as cu
from .bwd_dkdv import FlashBwdDkdv, bwd_tiled_mma
from .rows import load_rows, store_rows_from_acc


class RowPos:
    """Query positions of this thread's accumulator rows, computed on use (``pos[r]`` = first + offsets[r], r a
    trace-time int) instead of held in a register per row across the block."""

    def __init__(self, first, offsets):
        self.first = first
        self.offsets = list(offsets)

    def __getitem__(self, r: int):
        return self.first + self.offsets[r]


def sdp_tiled_mma(dtype, tile_n: int, num_warps: int):
    """S = Q K^T and dP = dO V^T with the warps side by side along the keys, 8 each (``tile_n`` = 8 x warps), all
    query rows per warp: a warp's share of V (its B operand) is 8 keys x dv, half of what the 16-row query grid
    of bwd_tiled_mma keeps (2 x 4 warps, 16 keys each), for Q and dO read by every warp."""
    return cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (1, num_warps, 1),
                               permutation_mnk=(16, 8 * num_warps, 16))


def row_part(row: cute.Tensor, width: int, c: int) -> cute.Tensor:
    """Elements [c * width, (c + 1) * width) of one (D,) row."""
    return cute.local_tile(row, (width,), (c,))


def row_chunk(t: cute.Tensor, width: int, c: int) -> cute.Tensor:
    """Rows [c * width, (c + 1) * width) of a (rows, cols) tensor (a transposed view's head-dim chunk)."""
    return cute.local_tile(t, (width, t.shape[1]), (c, 0))


class FlashBwdDkdvVRegs(FlashBwdDkdv):
    def smem_plan(self):
        """Q, dO, K, and V's region, which P and dS (one (tile_m, tile_n, 2) tensor) take once V is in registers.
        The P/dS layout takes the parent signature's P slot."""
        dt = self.dtype
        a = cu.smem_layout_atom
        sQ_l = cute.tile_to_shape(a(dt, self.d), (self.tile_m, self.d), (0, 1))
        sdO_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_m, self.dv), (0, 1))
        sK_l = cute.tile_to_shape(a(dt, self.d), (self.tile_n, self.d), (0, 1))
        sV_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_n, self.dv), (0, 1))
        sPS_l = cute.tile_to_shape(a(dt, self.tile_n), (self.tile_m, self.tile_n, 2), (0, 1, 2))
        region = max(cute.cosize(sV_l), cute.cosize(sPS_l))

        def smem(size):
            return cute.struct.Align[cute.struct.MemRange[dt, size], 1024]

        fields = {"sQ": smem(cute.cosize(sQ_l)), "sdO": smem(cute.cosize(sdO_l)), "sK": smem(cute.cosize(sK_l)),
                  "sV": smem(region),
                  # the block's LSE (log2) and D per query row, read on use (``RowStats``)
                  "sRows": cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.tile_m], 1024]}
        return (sQ_l, sdO_l, sK_l, sV_l, sPS_l), cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def chunk_cols(self, dim: int) -> int:
        """Columns per chunk of the dV / dK products (config_bwd.vregs_chunk_cols)."""
        return vregs_chunk_cols(dim)

    def dq_chunk_cols(self, dim: int) -> int:
        """Columns per chunk of the dQ product: 64 (the narrowest the query-row grid takes), except with dropout,
        whose feature sets compiled without spills on sm_120a only with the whole width in one chunk, where the sets
        without dropout spilled 3-24 STL/LDL with chunks of 128 or the whole width (the compile-gate rows of the
        docstring's results file)."""
        if self.cfg.has_dropout:
            return dim
        return 64

    def __init__(self, cfg):
        super().__init__(cfg)
        # S and dP: every warp takes all the block's query rows and 8 keys (sdp_tiled_mma), so a thread's
        # columns are one pair (c, c+1) and each Philox call serves a pair
        self.dropout_quad_ok = False

    def tiled_mmas(self):
        """(S and dP: every warp all ``tile_m`` query rows x 8 keys, ``sdp_tiled_mma``; key rows: dV, dK with
        ``kv_warp_rows`` per warp).  dQ runs on the query-row grid of bwd_dkdv.py (``process``), the one the
        convert kernel reads the workspace with."""
        dt = self.dtype
        return (sdp_tiled_mma(dt, self.tile_n, self.num_warps),
                bwd_tiled_mma(dt, self.tile_n, self.num_warps, self.cfg.kv_warp_rows))

    def branch_masks(self) -> bool:
        """Only the tiles a mask cuts are masked on dense walks without mods (as the fused tiles of bwd_dkdv.py)."""
        return self.cfg.mods is None

    @cute.jit
    def add_dq_chunk(self, mDqAccum, relay, acc, seq, rows_q, head, m_block, n_block, tidx,
                     first_pair: cutlass.Constexpr[int], wait: cutlass.Constexpr[bool]):
        """``FlashBwdDkdv.add_dq`` for one column chunk of dQ: its value pair j is pair ``first_pair + j`` of the
        whole tile's fragment (``process`` checks that at trace time), so the workspace keeps the layout the
        convert kernel reads.  With the relay, only the first chunk (``wait``) waits for the turn; returns the
        counter offset to pass on (-1: none)."""
        blk = self.dq_tile(seq, rows_q, m_block)
        pend = Int32(-1)
        if blk < mDqAccum.shape[0]:
            if const_expr(relay is not None):
                pend = relay.offset(blk, head)
                if const_expr(wait):
                    relay.wait(pend, relay.turn(n_block, m_block))
            addr = (mDqAccum[blk, head, None].iterator + tidx * 2).toint()
            for j in cutlass.range_constexpr(cute.size(acc) // 2):
                cu.red_add_f32x2(addr + (first_pair + j) * self.num_threads * 8, acc[2 * j], acc[2 * j + 1])
        return pend

    def check_chunk_order(self, mma_m, width: int):
        """Trace time: the dQ fragment of column chunk c, offset by c * width columns, is the slice of the whole
        tile's fragment that starts at value c * size(chunk) (what ``add_dq_chunk`` assumes), for thread 0 and
        the last thread (the value order is the same for every thread).  Raises where the partition differs."""
        whole = (self.tile_m, self.d)
        for t in (0, self.num_threads - 1):
            thr = mma_m.get_slice(t)
            full = thr.partition_C(cute.make_identity_tensor(whole))
            part = thr.partition_C(cute.make_identity_tensor((self.tile_m, width)))
            n = cute.size(part)
            for c in range(self.d // width):
                for i in range(n):
                    r, col = part[i]
                    fr, fcol = full[c * n + i]
                    if (int(r), int(col) + c * width) != (int(fr), int(fcol)):
                        raise NotImplementedError(
                            f"{self.cfg.name()}: dQ chunk {c} value {i} of thread {t} is ({r}, {col} + {c * width}),"
                            f" the whole tile's value {c * n + i} is ({fr}, {fcol}): the workspace order would "
                            "differ from the convert kernel's")

    @cute.jit
    def process(
        self, seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdK, mdV, dq_ws, sparse, softmax_scale,
        qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, sPS_l, mma_m, mma_n, copy_d, copy_dv,
        SharedStorage: cutlass.Constexpr, tidx, n_block, kv_head,
    ):
        cfg = self.cfg
        dt = self.dtype
        mDqAccum, mTurns = dq_ws
        wk, wv, wq = self.chunk_cols(self.d), self.chunk_cols(self.dv), self.dq_chunk_cols(self.d)
        nk, nv, nq = self.d // wk, self.dv // wv, self.d // wq
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_l), storage.sdO.get_tensor(sdO_l)
        sK, sV = storage.sK.get_tensor(sK_l), storage.sV.get_tensor(sV_l)
        sPS = storage.sV.get_tensor(sPS_l)  # P and dS: V's region, written only after V is in registers
        sPSt = cu.transpose_view(sPS)
        sP, sdS = sPS[None, None, 0], sPS[None, None, 1]
        sPt, sdSt = sPSt[None, None, 0], sPSt[None, None, 1]
        sQt, sdOt, sKt = cu.transpose_view(sQ), cu.transpose_view(sdO), cu.transpose_view(sK)

        # V first, in its own cp.async group (it goes to registers before the walk); K joins the first Q / dO
        first_key = n_block * self.tile_n
        load_rows(lambda pos: kv.row(mV, pos, kv_head), sV, copy_dv, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.dv), True)
        cute.arch.cp_async_commit_group()
        load_rows(lambda pos: kv.row(mK, pos, kv_head), sK, copy_d, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.d), True)

        ld = cu.ldmatrix_atom
        ld2 = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=2), dt)
        # S = Q K^T, dP = dO V^T: rows = queries, 8 keys per warp (mma_m, sdp_tiled_mma); B (K, V) 8 x 16 per
        # k16 step: two 8x8 matrices per ldmatrix
        thr_m = mma_m.get_slice(tidx)
        acc_shape_s = thr_m.partition_shape_C((self.tile_m, self.tile_n))
        ops_S = cu.ss_operands(mma_m, tidx, ld(dt, False), ld2, sQ, sK)
        tPrdO, tPrV, tPsdO, tPsV, cpA_m, cpB_m = cu.ss_operands(mma_m, tidx, ld(dt, False), ld2, sdO, sV)
        # dQ = dS K: the query-row grid (16 rows per warp) of bwd_dkdv.py, whose value order the workspace keeps
        mma_q = bwd_tiled_mma(dt, self.tile_m, self.num_warps)
        self.check_chunk_order(mma_q, wq)
        thr_q = mma_q.get_slice(tidx)
        cpA_q = cute.make_tiled_copy_A(ld(dt, False), mma_q).get_slice(tidx)
        cpBt_q = cute.make_tiled_copy_B(ld(dt, True), mma_q).get_slice(tidx)
        tQrdS = thr_q.make_fragment_A(thr_q.partition_A(sdS))
        tQsdS = cpA_q.partition_S(sdS)
        dq_b = []  # per dQ chunk: (B fragment, its smem source) of K^T's rows of the chunk
        for c in cutlass.range_constexpr(nq):
            sKt_c = row_chunk(sKt, wq, c)
            dq_b.append((thr_q.make_fragment_B(thr_q.partition_B(sKt_c)), cpBt_q.partition_S(sKt_c)))
        acc_shape_dq = thr_q.partition_shape_C((self.tile_m, wq))
        # dV += P^T dO, dK += dS^T Q: rows = keys (mma_n), A and B read transposed, per column chunk
        thr_n = mma_n.get_slice(tidx)
        cpAt_n = cute.make_tiled_copy_A(ld(dt, True), mma_n).get_slice(tidx)
        cpBt_n = cute.make_tiled_copy_B(ld(dt, True), mma_n).get_slice(tidx)
        tVrPt, tVsPt = thr_n.make_fragment_A(thr_n.partition_A(sPt)), cpAt_n.partition_S(sPt)
        tKrdSt, tKsdSt = thr_n.make_fragment_A(thr_n.partition_A(sdSt)), cpAt_n.partition_S(sdSt)
        dv_b, dk_b, acc_dV, acc_dK = [], [], [], []
        for c in cutlass.range_constexpr(nv):
            sdOt_c = row_chunk(sdOt, wv, c)
            dv_b.append((thr_n.make_fragment_B(thr_n.partition_B(sdOt_c)), cpBt_n.partition_S(sdOt_c)))
            acc = cute.make_rmem_tensor(thr_n.partition_shape_C((self.tile_n, wv)), Float32)
            acc.fill(0.0)
            acc_dV.append(acc)
        for c in cutlass.range_constexpr(nk):
            sQt_c = row_chunk(sQt, wk, c)
            dk_b.append((thr_n.make_fragment_B(thr_n.partition_B(sQt_c)), cpBt_n.partition_S(sQt_c)))
            acc = cute.make_rmem_tensor(thr_n.partition_shape_C((self.tile_n, wk)), Float32)
            acc.fill(0.0)
            acc_dK.append(acc)
        rows_q, _ = self.seq_rows(mQ, mK)
        pend = Int32(-1)  # the relay: the counter whose turn this CTA passes on next (-1: none)
        relay, st_atom, st_m, tScS_mn, t0ScS_mn, num_rows = self.score_tile_views(mTurns, block, mma_m, dt, tidx)
        sRows = storage.sRows.get_tensor(cute.make_layout(2 * self.tile_m))
        row_offs = [tScS_mn[r, 0][0] for r in range(num_rows)]
        lse_log2 = cu.SmemRows(sRows, 0, row_offs)
        dpsum = cu.SmemRows(sRows, self.tile_m, row_offs)

        first_head = kv_head * qheads_per_kvhead
        m_min, m_max = block.q_range(n_block)
        num_m = cutlass.max(m_max - m_min, 0)
        num_iters = num_m * qheads_per_kvhead
        where = partial(self.dense_entry, first_head, m_min, num_m, qheads_per_kvhead)
        # the entry carried from one iteration to the next (advanced by increment), except with dropout (as
        # bwd_dkdv.py: the carried pair cost registers there)
        carry = const_expr(not cfg.has_dropout)
        if const_expr(carry):
            cur_head, cur_m_block = first_head, Int32(0)
            if num_iters > 0:
                cur_head, cur_m_block, _ = where(Int32(0))
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, cur_head, cur_m_block, True, True)
            else:
                cute.arch.cp_async_commit_group()
        else:
            if num_iters > 0:
                head0, m_block0, _ = where(Int32(0))
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, head0, m_block0, True, True)
            else:
                cute.arch.cp_async_commit_group()
        # V (the first group) to registers, once; the barrier at the top of the first iteration orders these reads
        # before the first P / dS writes into its region
        cute.arch.cp_async_wait_group(1)
        cute.arch.barrier()
        tPrV_view = cpB_m.retile(tPrV)
        for k in cutlass.range_constexpr(cute.size(tPsV.shape[2])):
            cute.copy(cpB_m, tPsV[None, None, k], tPrV_view[None, None, k])

        for it in cutlass.range(num_iters, unroll=1):
            if const_expr(carry):
                head, m_block = cur_head, cur_m_block
            else:
                head, m_block, _ = where(it)
            first_q = m_block * self.tile_m
            row_qpos = RowPos(first_q, row_offs)
            # the block's row statistics into sRows, one row per thread of the first tile_m (the barrier below
            # orders them before every read; the previous block's last reads were before its dV barrier)
            if tidx < self.tile_m:
                pos = first_q + tidx
                lse_r, d_r = Float32.inf, Float32(0.0)
                if pos < seq.seqlen_q:
                    idx = seq.row_stat_index(head, pos)
                    lse_r = score.lse_log2(mLSE[idx])
                    d_r = mDpsum[idx]
                sRows[tidx] = lse_r
                sRows[self.tile_m + tidx] = d_r
            if const_expr(carry and cfg.dq_relay):  # descending (dense_entry)
                cur_head, cur_m_block = head, m_block - 1
                if cur_m_block < m_min:
                    cur_head, cur_m_block = head + 1, m_max - 1
            elif const_expr(carry):
                cur_head, cur_m_block = head, m_block + 1
                if cur_m_block == m_max:
                    cur_head, cur_m_block = head + 1, m_min
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if const_expr(cfg.dq_relay and not self.relay_release_after_s):
                relay.pass_on(pend, tidx)

            # ---- S, then the score hook (softcap, masks), P
            drop_bits = None
            if const_expr(cfg.has_dropout):  # before the S mma: S and dP are not live yet (score.py)
                drop_bits = score.dropout.bits(tScS_mn, t0ScS_mn, row_qpos, (seq.batch << 16) | head, n_block)
            acc_S = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_S.fill(0.0)
            cu.mma_ss(mma_m, acc_S, *ops_S, False)
            if const_expr(self.relay_release_after_s):
                relay.pass_on(pend, tidx)
            acc_raw = None
            if const_expr(self.wants_raw_scores()):  # the scaled scores before the score_mod, for its backward
                acc_raw = cute.make_rmem_tensor(acc_shape_s, Float32)
            needs_mask = None
            if const_expr(self.branch_masks()):
                needs_mask = block.tile_needs_mask(m_block, n_block)
            score.apply_backward(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, head, acc_raw, needs_mask)
            acc_P = cute.make_rmem_tensor(acc_shape_s, Float32)
            score.backward_p(acc_S, lse_log2, acc_P)
            # ---- dP = dO V^T with V from registers, dS
            acc_dP = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_dP.fill(0.0)
            cu.mma_sr(mma_m, acc_dP, tPrdO, tPrV, tPsdO, cpA_m)
            score.backward_ds(acc_S, acc_P, acc_dP, dpsum, drop_bits)
            if const_expr(self.wants_raw_scores()):
                score.backward_mods(acc_dP, acc_raw, tScS_mn, t0ScS_mn, row_qpos, head, n_block)
            rP = cute.make_rmem_tensor_like(acc_P, dt)
            rP.store(acc_P.load().to(dt))
            rdS = cute.make_rmem_tensor_like(acc_dP, dt)
            rdS.store(acc_dP.load().to(dt))
            cute.copy(st_atom, st_m.retile(rP), st_m.partition_D(sP))
            cute.copy(st_atom, st_m.retile(rdS), st_m.partition_D(sdS))
            cute.arch.barrier()

            # ---- dV += P^T dO by chunks, then the next dO; dK += dS^T Q by chunks, then the next Q
            for c in cutlass.range_constexpr(nv):
                cu.mma_ss(mma_n, acc_dV[c], tVrPt, dv_b[c][0], tVsPt, dv_b[c][1], cpAt_n, cpBt_n, False)
            cute.arch.barrier()
            if it + 1 < num_iters:
                if const_expr(carry):
                    next_head, next_m_block = cur_head, cur_m_block
                else:
                    next_head, next_m_block, _ = where(it + 1)
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, next_head, next_m_block, False, True)
            for c in cutlass.range_constexpr(nk):
                cu.mma_ss(mma_n, acc_dK[c], tKrdSt, dk_b[c][0], tKsdSt, dk_b[c][1], cpAt_n, cpBt_n, False)
            cute.arch.barrier()
            if it + 1 < num_iters:
                if const_expr(carry):
                    next_head, next_m_block = cur_head, cur_m_block
                else:
                    next_head, next_m_block, _ = where(it + 1)
                self.load_q_do(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, next_head, next_m_block, True, False)
            # ---- dQ = dS K by chunks (sdS and sK only), each added as soon as it is made
            for c in cutlass.range_constexpr(nq):
                acc_dQ = cute.make_rmem_tensor(acc_shape_dq, Float32)
                acc_dQ.fill(0.0)
                cu.mma_ss(mma_q, acc_dQ, tQrdS, dq_b[c][0], tQsdS, dq_b[c][1], cpA_q, cpBt_q, False)
                p = self.add_dq_chunk(mDqAccum, relay, acc_dQ, seq, rows_q, head, m_block, n_block, tidx,
                                      c * (cute.size(acc_dQ) // 2), c == 0)
                if const_expr(c == 0):
                    pend = p
            # the barrier at the top of the next iteration orders this block's reads of sdS before the next
            # block's writes of sP/sdS

        if const_expr(cfg.dq_relay):  # the last tile's turn, once every thread's adds are issued
            cute.arch.barrier()
            relay.pass_on(pend, tidx)

        # ---- dK (scaled), dV: one write per CTA, chunk by chunk
        for c in cutlass.range_constexpr(nk):
            acc_dK[c].store(acc_dK[c].load() * softmax_scale)
            store_rows_from_acc(lambda pos: row_part(kv.row(mdK, pos, kv_head), wk, c), acc_dK[c], thr_n,
                                first_key, seq.seqlen_k, (self.tile_n, wk), dt)
        for c in cutlass.range_constexpr(nv):
            if const_expr(cfg.has_dropout):  # dV = (P * keep / (1-p))^T dO: the 1/(1-p) once
                acc_dV[c].store(acc_dV[c].load() * score.dropout.scale)
            store_rows_from_acc(lambda pos: row_part(kv.row(mdV, pos, kv_head), wv, c), acc_dV[c], thr_n,
                                first_key, seq.seqlen_k, (self.tile_n, wv), dt)

