"""Key-split forward kernel for decode tiles (CuTe-DSL device code): few query rows, every warp busy.

A decode CTA holds q_len x the packed GQA group rows: 32 for MQA (Hq 32 / Hkv 1), 4 for GQA 4:1.  On the 64-row
decode tile, warps stacked along M would compute padding rows, and the CTA would stream K/V at the pace of the
one or two warps that hold real rows.  Here the ``num_warps`` warps form ``kv_groups`` groups of
``num_warps / kv_groups`` warps stacked along M (config.FwdTile.kv_groups):

* loads are those of the cp.async kernel (fwd_cpasync.py): every thread copies its share of each whole K/V tile
  through the same two-stage pipeline and barriers;
* group g multiplies its rows by keys [g * tile_n / kv_groups, (g + 1) * tile_n / kv_groups) of each tile:
  S = Q K_g^T, the masks (its columns carry the group's first key, so the sequence-end, causal and window limits
  are exact), its own online softmax, O_g += P_g V_g;
* after the last tile, groups 1.. park their O accumulators, row max and row sums (per lane) in the K/V stages'
  shared memory; group 0 merges them with the usual rescaling, m = max(m_0, m_g), O = O_0 e^(m_0 - m) +
  O_g e^(m_g - m), l likewise, and runs the epilogue (sink, LSE, O stores from registers) alone.

Everything else (block schedule, split-KV ranges, paged K/V rows, sequence bounds, the sink in split 0) is the
cp.async kernel's.  No dropout and no score/mask mods (the dispatcher runs those calls on the prefill tiles).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from . import cute_utils as cu
from .fwd_cpasync import FlashFwdCpAsync


class FlashFwdDecode(FlashFwdCpAsync):
    """cp.async forward with the keys of each K/V tile split between warp groups (``cfg.tile.kv_groups`` > 1)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.group_threads = self.mma_warps * 32

    def group_of(self, tidx):
        """(group, thread index inside the group): warp-uniform, so the group's branches never diverge a warp."""
        group = cute.arch.make_warp_uniform(tidx // self.group_threads)
        return group, tidx - group * self.group_threads

    def mma_operands(self, tidx, sK, sVt):
        """The group's keys: rows of the K stages (s_tile_n of them from the group's first key) and the matching
        columns of V^T.  A group's first key is a multiple of 16 rows, whole swizzle atoms: the slices are plain
        offsets."""
        group, gtidx = self.group_of(tidx)
        sK_g = cute.local_tile(sK, (self.s_tile_n, self.d, self.num_stages), (group, 0, 0))
        sVt_g = cute.local_tile(sVt, (self.dv, self.s_tile_n, self.num_stages), (0, group, 0))
        return gtidx, sK_g, sVt_g

    def group_cols(self, cS):
        tidx, _, _ = cute.arch.thread_idx()
        group, _ = self.group_of(tidx)
        return cute.domain_offset((0, group * self.s_tile_n), cS)

    @cute.jit
    def tile_epilogue(self, storage, ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx,
                      mma_tidx, tScS_mn):
        group, _ = self.group_of(tidx)
        self.merge_groups(storage, acc_O, state_max, state_sum, ts.score.scale_log2, group, mma_tidx)
        if group == 0:
            self.epilogue(ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, mma_tidx,
                          tScS_mn)

    @cute.jit
    def merge_groups(self, storage, acc_O, state_max, state_sum, scale_log2: Float32, group, gtidx):
        """Groups 1.. hand their (O, row max, per-lane row sum) to group 0 through shared memory (the K/V stages,
        free once every warp is past the last tile: config.key_split_merge_bytes), laid out [group][value][thread]
        so a warp's accesses are consecutive words.  Rows no group saw keep max -inf: their factors are 0 and the
        epilogue gives them O = 0, LSE = -inf (or the sink)."""
        o_mn = cu.acc_mn_view(acc_O)
        nrow = const_expr(cute.size(o_mn, mode=[0]))
        ncol = const_expr(cute.size(o_mn, mode=[1]))
        n_o = const_expr(nrow * ncol)
        vals = const_expr(n_o + 2 * nrow)
        buf = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                               cute.make_layout((self.group_threads, vals, self.kv_groups - 1)))
        cute.arch.barrier()  # every warp is done reading the last K/V stage
        if group > 0:
            mine = buf[gtidx, None, group - 1]
            for r in cutlass.range_constexpr(nrow):
                for c in cutlass.range_constexpr(ncol):
                    mine[r * ncol + c] = o_mn[r, c]
                mine[n_o + r] = state_max[r]
                mine[n_o + nrow + r] = state_sum[r]
        cute.arch.barrier()
        if group == 0:
            for g in cutlass.range_constexpr(1, self.kv_groups):
                theirs = buf[gtidx, None, g - 1]
                for r in cutlass.range_constexpr(nrow):
                    m_other = theirs[n_o + r]
                    m_new = cute.arch.fmax(state_max[r], m_other)
                    safe = 0.0 if m_new == -Float32.inf else m_new
                    c_mine = cute.math.exp2((state_max[r] - safe) * scale_log2, fastmath=True)
                    c_other = cute.math.exp2((m_other - safe) * scale_log2, fastmath=True)
                    state_sum[r] = state_sum[r] * c_mine + theirs[n_o + nrow + r] * c_other
                    state_max[r] = m_new
                    for c in cutlass.range_constexpr(ncol):
                        o_mn[r, c] = o_mn[r, c] * c_mine + theirs[r * ncol + c] * c_other
