"""The fused backward's dQ convert kernel: the fp32 dQ workspace -> dQ in the input dtype, scaled by the softmax
scale.

Layouts: dq_accum (blocks, Hq, tile_m * D) fp32, each tile in the order the fused kernel's query-row mma holds it
(kernels/bwd_dkdv.py ``add_dq``: value pair j of thread t at (j * threads + t) * 2); dq (B, Sq, Hq, D) or
(total_q, Hq, D).  One CTA per (query tile, head, batch entry), with as many threads as the fused kernel: each thread
reads back exactly the values its namesake added (8-byte loads, a warp's 32 loads 256 contiguous bytes) and stores
them through the same mma partition, so the permutation is never spelled out twice.  Rows past the (clamped)
sequence are not written; a tile index past the workspace (lying varlen metadata) is skipped.

Constraints: fp16/bf16 output; the fused kernel's tile_m, num_warps and head dim (config_bwd.dq_convert_config).
Profile: ``ncu -k regex:kernel_cutlass_kernel.*FlashBwdDqConvert``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import DQ_CONVERT_ARGS
from ..config_bwd import DqConvertKernelConfig
from .bwd_dkdv import bwd_tiled_mma
from .fwd_base import DTYPES
from .rows import store_row_pairs_from_acc
from .seqlen_info import SeqInfo


class FlashBwdDqConvert:
    ARGS = DQ_CONVERT_ARGS

    def __init__(self, cfg: DqConvertKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.tile_m, self.d = cfg.tile_m, cfg.head_dim
        self.num_threads = cfg.num_warps * 32

    @cute.jit
    def __call__(self, dq_accum: cute.Tensor, dq: cute.Tensor, cu_seqlens_q: cute.Tensor | None,
                 seqused_q: cute.Tensor | None, softmax_scale: Float32, num_m_blocks: Int32, num_heads: Int32,
                 num_batch: Int32, stream):
        mma = bwd_tiled_mma(self.dtype, self.tile_m, self.cfg.num_warps)
        self.launch_smem_bytes = 0
        self.kernel(dq_accum, dq, cu_seqlens_q, seqused_q, softmax_scale, mma).launch(
            grid=(num_m_blocks, num_heads, num_batch), block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mDqAccum, mdQ, mCuSeqlensQ, mSeqUsedQ, softmax_scale: Float32, mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        cfg = self.cfg
        rows_q = mdQ.shape[1]
        if const_expr(cfg.varlen_q):
            rows_q = mdQ.shape[0]
        seq = SeqInfo.create(cfg, batch, rows_q, Int32(0), mCuSeqlensQ, None, mSeqUsedQ, None)
        first_q = m_block * self.tile_m
        if first_q < seq.seqlen_q:
            if const_expr(cfg.varlen_q):
                blk = seq.offset_q // self.tile_m + batch + m_block
            else:
                blk = batch * ((rows_q + self.tile_m - 1) // self.tile_m) + m_block
            if blk < mDqAccum.shape[0]:
                thr = mma.get_slice(tidx)
                acc = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_m, self.d)), Float32)
                addr = (mDqAccum[blk, head, None].iterator + tidx * 2).toint()
                atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
                for j in cutlass.range_constexpr(cute.size(acc) // 2):
                    src = cute.make_tensor(cute.make_ptr(Float32, addr + j * self.num_threads * 8,
                                                         cute.AddressSpace.gmem, assumed_align=8),
                                           cute.make_layout(2))
                    v = cute.make_rmem_tensor(2, Float32)
                    cute.copy(atom, src, v)
                    acc[2 * j] = v[0] * softmax_scale
                    acc[2 * j + 1] = v[1] * softmax_scale
                store_row_pairs_from_acc(lambda pos: seq.q_row(mdQ, pos, head), acc, thr, first_q, seq.seqlen_q,
                                         (self.tile_m, self.d), self.dtype)
