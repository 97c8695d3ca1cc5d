"""Device code (CuTe-DSL), one kernel or shared role per file.  Imported only when a kernel is compiled, never at
package import.

Kernels:
    fwd_tma.py      forward, warp-specialised: a TMA producer warp + 8 mma.sync warps (d <= 192)
    fwd_cpasync.py  forward, all warps load (cp.async) and compute (d = 256, paged K/V, and the fallback)
    fwd_decode.py   forward for decode tiles with few rows: the cp.async kernel with each K/V tile's keys split
                    between warp groups, merged in the epilogue
    bwd_dkdv.py     backward dK/dV, KV-stationary
    bwd_dq.py       backward dQ, Q-stationary (no atomics)
    bwd_preprocess.py  backward D = rowsum(dO * O) - dLSE in fp32 (no matmul)
    combine.py      split-KV combine of fp32 partial outputs/LSEs (no matmul)
Shared per-tile device state, one implementation used by all four:
    seqlen_info.py  SeqInfo: sequence bounds of a batch entry, clamped to the tensors
    block_info.py   BlockInfo: KV blocks of a query tile / query blocks of a KV tile, and the visiting order
    kv_source.py    ContiguousKV / PagedKV: the K/V address providers
    score.py        ScoreHook: scale, softcap / score_mod, P (forward and backward) and dS of the backward; it holds
    score_mask.py   Mask: sequence end, causal / window, mask_mod, block-sparse gating
    score_dropout.py  Dropout: Philox parameters, keep bits, their application to the forward's P
    kernel_state.py KernelState/KernelStateMixin: builds the four above, the same way in every kernel
    rows.py         row loads/stores through the providers above
    fwd_base.py     what both forwards share (Q load, P from S, epilogue)
    softmax.py, cute_utils.py   online softmax and mma/ldmatrix/copy building blocks
"""
