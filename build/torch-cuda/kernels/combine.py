"""Split-KV combine: merge the partial outputs of ``num_splits`` KV ranges into one attention output.

Layouts (the host views a varlen call, (splits, total_q, H, D), as batch 1):
    out_partial  (splits, B, S, H, D)  fp32 (or bf16/fp16), D contiguous, rows 4-element aligned
    lse_partial  (splits, B, S, H)     fp32 natural-log LSE of each split, any strides
    out          (B, S, H, D)          fp32/bf16/fp16, D contiguous
    lse          (B, S, H)             fp32, any strides (optional: config.has_lse)

For one row (b, s, h) with split LSEs l_i and partial outputs O_i (each normalised by its own split's sum):
    m   = max_i l_i                  (0 when every l_i is -inf, so no -inf - -inf appears)
    LSE = m + log(sum_i exp(l_i - m))
    O   = sum_i exp(l_i - LSE) * O_i
An empty split (l_i = -inf) contributes exactly 0 and its O_i never reaches the result (it may hold anything); a row
whose splits are all empty gets O = 0 and LSE = -inf.  NaN is not hidden: a NaN LSE makes the row's LSE and O NaN, and a
NaN in the O_i of a non-empty split reaches O.

Work split: ``tpr`` threads (a power of two <= 32, config_combine.combine_threads_per_row) form a group; each holds
``D / (4 * tpr)`` 4-element vectors of a row.  A group reads the row's split LSEs (each lane all of its share at once,
into registers) and reduces max and sum with butterfly shuffles.  With ``split_groups`` G = 1 one group owns a row
and walks all its splits ``UNROLL`` at a time, scaling and adding the partial vectors.  The loads of a batch of
splits depend only on the split index (an empty split's partial is read and dropped by a select), and the first
batch is requested before the LSEs, so a row with few splits costs one memory round trip, not one for the LSE max,
one for the sum and one per batch (benchmarks/experiments/results/combine_one_round_trip_h100_s26.jsonl, MQA B=1
decode).  With G > 1 (few rows, many splits:
config_combine.combine_split_groups) G groups share a row: group g walks splits g*UNROLL.. in strides of G*UNROLL, the
groups' sums meet in shared memory and group 0 adds them in group order (a fixed order: reproducible) and stores.
Rows past the end are clamped to the last row (so every lane joins the shuffles and barriers) and not stored.  No
atomics; the number of splits is a runtime value.

Launch: programmatic dependent launch (``use_pdl``); the split forward releases it once all its CTAs have started
(fwd_base.release_dependents), and the kernel's first instruction waits for the forward's completion and memory
flush (griddepcontrol.wait), so the launch latency overlaps the forward's tail.  After any other kernel the wait
simply returns once that kernel has completed, as an ordinary stream dependency.

Profile: ncu --kernel-name regex:combine --section MemoryWorkloadAnalysis python benchmarks/... (a split call).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import COMBINE_ARGS
from ..config_combine import (COMBINE_MAX_SPLITS, COMBINE_THREADS, COMBINE_UNROLL, COMBINE_VEC, CombineKernelConfig,
                              combine_smem_bytes, combine_threads_per_row)
from .cute_utils import LN_2, LOG2_E

_DTYPES = {"fp32": Float32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
MAX_LSE_REGS = 32  # a lane holds its splits' LSEs in registers when COMBINE_MAX_SPLITS / tpr is at most this


class FlashCombine:
    ARGS = COMBINE_ARGS
    UNROLL = COMBINE_UNROLL

    def __init__(self, cfg: CombineKernelConfig):
        self.cfg = cfg
        self.partial_dtype = _DTYPES[cfg.partial_dtype]
        self.out_dtype = _DTYPES[cfg.out_dtype]
        self.d = cfg.head_dim
        self.tpr = combine_threads_per_row(cfg.head_dim)
        self.vecs = cfg.head_dim // (COMBINE_VEC * self.tpr)  # vectors per thread
        self.num_threads = COMBINE_THREADS
        self.groups = cfg.split_groups
        self.rows_per_cta = COMBINE_THREADS // (self.tpr * self.groups)
        self.launch_smem_bytes = combine_smem_bytes(cfg)  # group sums: a (vec, vecs) fp32 slot per thread

    @cute.jit
    def __call__(self, out_partial: cute.Tensor, lse_partial: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor | None, num_rows: Int32, stream):
        sAcc_l = cute.make_layout((COMBINE_VEC, self.vecs, COMBINE_THREADS))

        @cute.struct
        class SharedStorage:
            sAcc: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sAcc_l)], 16]

        self.kernel(out_partial, lse_partial, out, lse, num_rows, sAcc_l, SharedStorage).launch(
            grid=((num_rows + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1), block=(self.num_threads, 1, 1),
            smem=self.launch_smem_bytes, stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor | None,
               num_rows: Int32, sAcc_l: cute.Layout, SharedStorage: cutlass.Constexpr):
        # launched as a programmatic dependent (use_pdl): the split forward lets this grid start early; wait for
        # it (or for whatever ran before, which then simply completed) before reading a partial
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tpr = self.tpr
        lane = tidx % tpr
        group = tidx // tpr
        share = group % self.groups  # which share of the row's splits this group walks
        row = bidx * self.rows_per_cta + group // self.groups
        valid = row < num_rows
        row = cutlass.min(row, num_rows - 1)
        num_heads, seqlen = mO.shape[2], mO.shape[1]
        head = row % num_heads
        pos_b = row // num_heads
        pos = pos_b % seqlen
        batch = pos_b // seqlen
        num_splits = mOp.shape[0]
        lse_row = mLSEp[None, batch, pos, head]

        vec = COMBINE_VEC
        acc = cute.make_rmem_tensor((vec, self.vecs), Float32)
        acc.fill(0.0)
        frag = cute.make_rmem_tensor((vec, self.vecs, self.UNROLL), self.partial_dtype)
        lvals = cute.make_rmem_tensor((self.UNROLL,), Float32)
        first = share * self.UNROLL
        step = self.groups * self.UNROLL
        # the first batch of partials is requested before the row's LSE, whose loads then overlap them: every
        # load of a batch depends on nothing but the split index (an empty split's partial is read and dropped by
        # a select, never multiplied: it may hold NaN)
        self.load_batch(mOp, lse_row, batch, pos, head, lane, first, num_splits, frag, lvals)
        lse_final = self.combined_lse(lse_row, num_splits, lane)
        self.add_batch(acc, frag, lvals, lse_final)
        for i0 in cutlass.range(first + step, num_splits, step, unroll=1):
            self.load_batch(mOp, lse_row, batch, pos, head, lane, i0, num_splits, frag, lvals)
            self.add_batch(acc, frag, lvals, lse_final)

        if const_expr(self.groups > 1):  # group 0 of the row adds the other groups' sums, in group order
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sAcc = storage.sAcc.get_tensor(sAcc_l)
            cute.autovec_copy(acc, sAcc[None, None, tidx])
            cute.arch.barrier()
            if share == 0:
                part = cute.make_rmem_tensor((vec, self.vecs), Float32)
                for g in cutlass.range_constexpr(1, self.groups):
                    cute.autovec_copy(sAcc[None, None, tidx + g * tpr], part)
                    acc.store(acc.load() + part.load())

        if valid:
            if share == 0:
                res = cute.make_rmem_tensor((vec, self.vecs), self.out_dtype)
                res.store(acc.load().to(self.out_dtype))
                g = cute.tiled_divide(mO[batch, pos, head, None], (vec,))
                for j in cutlass.range_constexpr(self.vecs):
                    cute.autovec_copy(res[None, j], g[None, lane + j * tpr])
                if const_expr(self.cfg.has_lse):
                    if lane == 0:
                        mLSE[batch, pos, head] = lse_final

    @cute.jit
    def load_batch(self, mOp: cute.Tensor, lse_row: cute.Tensor, batch, pos, head, lane, i0, num_splits: Int32,
                   frag: cute.Tensor, lvals: cute.Tensor):
        """Request the partials and LSEs of splits i0 .. i0 + UNROLL - 1 (those past the last split read as empty:
        LSE -inf, partial 0), all independent loads."""
        vec = COMBINE_VEC
        for u in cutlass.range_constexpr(self.UNROLL):
            i = i0 + u
            lvals[u] = -Float32.inf
            frag[None, None, u].fill(0.0)
            if i < num_splits:
                lvals[u] = lse_row[i]
                g = cute.tiled_divide(mOp[i, batch, pos, head, None], (vec,))
                for j in cutlass.range_constexpr(self.vecs):
                    cute.autovec_copy(g[None, lane + j * self.tpr], frag[None, j, u])

    @cute.jit
    def add_batch(self, acc: cute.Tensor, frag: cute.Tensor, lvals: cute.Tensor, lse_final: Float32):
        """acc += exp(l_i - LSE) * O_i over a loaded batch; an empty split (l_i = -inf) adds exactly 0 whatever its
        partial holds (a select), a NaN LSE or a NaN in a non-empty split's partial reaches acc."""
        for u in cutlass.range_constexpr(self.UNROLL):
            l_i = lvals[u]
            if l_i != -Float32.inf:
                scale = cute.math.exp2((l_i - lse_final) * LOG2_E, fastmath=True)
                acc.store(acc.load() + frag[None, None, u].load().to(Float32) * scale)

    @cute.jit
    def combined_lse(self, lse_row: cute.Tensor, num_splits: Int32, lane: Int32) -> Float32:
        """LSE of the row over all splits (every lane of the row's group gets it); -inf when all are empty.  Each
        lane requests all of its splits' LSEs at once (ceil(COMBINE_MAX_SPLITS / tpr) predicated loads, one
        memory round trip), then reduces them in registers and across the group."""
        tpr = self.tpr
        per_lane = -(-COMBINE_MAX_SPLITS // tpr)
        in_regs = per_lane <= MAX_LSE_REGS
        vals = cute.make_rmem_tensor((per_lane if in_regs else 1,), Float32)
        m = Float32(-Float32.inf)
        if const_expr(in_regs):
            for k in cutlass.range_constexpr(per_lane):
                vals[k] = -Float32.inf
                i = lane + k * tpr
                if i < num_splits:
                    vals[k] = lse_row[i]
            for k in cutlass.range_constexpr(per_lane):
                m = cute.arch.fmax(m, vals[k])
        else:  # few threads per row (head dims of few 16-byte vectors): a strided walk, one load per step
            for split in cutlass.range(lane, num_splits, tpr, unroll=1):
                m = cute.arch.fmax(m, lse_row[split])
        m = self.group_reduce(m, True)
        m_safe = Float32(0.0) if m == -Float32.inf else m
        total = Float32(0.0)
        if const_expr(in_regs):
            for k in cutlass.range_constexpr(per_lane):
                total = total + cute.math.exp2((vals[k] - m_safe) * LOG2_E, fastmath=True)
        else:
            for split in cutlass.range(lane, num_splits, tpr, unroll=1):
                total = total + cute.math.exp2((lse_row[split] - m_safe) * LOG2_E, fastmath=True)
        total = self.group_reduce(total, False)
        # total is NaN when an LSE is NaN (fmax drops NaN, the sum does not): the NaN reaches LSE and O
        return -Float32.inf if total == 0.0 else m_safe + cute.math.log2(total, fastmath=True) * LN_2

    @cute.jit
    def group_reduce(self, x: Float32, is_max: cutlass.Constexpr[bool]) -> Float32:
        """Max or sum over the ``tpr`` lanes of one row (butterfly shuffles inside the aligned lane group)."""
        for k in cutlass.range_constexpr(self.tpr.bit_length() - 1):
            y = cute.arch.shuffle_sync_bfly(x, offset=self.tpr >> (k + 1))
            if const_expr(is_max):
                x = cute.arch.fmax(x, y)
            else:
                x = x + y
        return x
