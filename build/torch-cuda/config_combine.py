"""Host-only configuration of the split-KV combine kernel (kernels/combine.py): its compile key, thread layout,
shared memory and the row-group rule (its compile-gate worklist: scripts/gate_lists.py).  Split from ``config``
(forward, decode, split-KV).  Nothing here imports CuTe-DSL.
"""

from __future__ import annotations

from dataclasses import dataclass

COMBINE_DTYPES = ("fp32", "bf16", "fp16")
COMBINE_MAX_SPLITS = 256  # flash-attn-4's combine limit; the kernel's loop over splits is dynamic
COMBINE_MAX_HEAD_DIM = 512
COMBINE_VEC = 4  # elements per vector load/store of a thread (16 B of fp32 partials)
COMBINE_THREADS = 128
COMBINE_UNROLL = 8  # splits whose loads a row's threads issue together (32 fp32 registers of loads in flight)
COMBINE_SPLIT_GROUPS = 4  # row groups sharing a row's splits when rows are few (combine_split_groups)


@dataclass(frozen=True)
class CombineKernelConfig:
    """Compile key of the split-KV combine kernel (kernels/combine.py).  The number of splits, batch, sequence
    length, heads and every stride are runtime values: they never recompile."""

    partial_dtype: str  # dtype of out_partial: "fp32" | "bf16" | "fp16"
    out_dtype: str  # dtype of out
    head_dim: int
    has_lse: bool = True  # write the combined LSE
    # row groups sharing one row's splits (1: a row's threads walk every split; COMBINE_SPLIT_GROUPS: that many
    # groups each walk a share and sum through shared memory, for few rows with many splits: ``combine_split_groups``)
    split_groups: int = 1

    def name(self) -> str:
        return (f"combine_{self.partial_dtype}_{self.out_dtype}_d{self.head_dim}" + ("_lse" if self.has_lse else "")
                + (f"_g{self.split_groups}" if self.split_groups > 1 else ""))


def combine_threads_per_row(head_dim: int) -> int:
    """Threads sharing one (batch, position, head) row: the largest power of two (<= 32) dividing the number of
    vectors of the row, so a row's threads sit in one warp and read consecutive 16-byte vectors."""
    vectors = head_dim // COMBINE_VEC
    tpr = 1
    while tpr < 32 and vectors % (tpr * 2) == 0:
        tpr *= 2
    return tpr


def combine_smem_bytes(cfg: CombineKernelConfig) -> int:
    """Shared memory of the combine: with row groups, every thread's fp32 share of a row (head_dim / threads per
    row values) for group 0 to add; none otherwise."""
    if cfg.split_groups == 1:
        return 0
    return COMBINE_THREADS * (cfg.head_dim // combine_threads_per_row(cfg.head_dim)) * 4


def combine_split_groups(num_rows: int, num_splits: int, head_dim: int, num_sms: int) -> int:
    """Row groups per row of the combine: COMBINE_SPLIT_GROUPS when one group per row would leave the GPU short of
    CTAs (fewer than two per SM) and each group still walks at least one full unrolled batch of splits; else 1.
    With one group per row, MQA B=1 decode (32 rows x 64 splits) walks the 64 splits in 8 dependent rounds of
    loads on 8 CTAs, and the combine took most of the attention kernel's time
    (benchmarks/experiments/results/probe_session19_h100.jsonl, per-kernel times)."""
    rows_per_cta = COMBINE_THREADS // combine_threads_per_row(head_dim)
    ctas = -(-num_rows // rows_per_cta)
    if ctas < 2 * num_sms and num_splits >= COMBINE_SPLIT_GROUPS * COMBINE_UNROLL // 2:
        return COMBINE_SPLIT_GROUPS
    return 1


def combine_head_dim_problem(head_dim: int) -> str | None:
    """Why the combine kernel cannot take this head dim (None: it can)."""
    if head_dim <= 0 or head_dim % 8 != 0 or head_dim > COMBINE_MAX_HEAD_DIM:
        return f"head_dim={head_dim} must be a positive multiple of 8 and at most {COMBINE_MAX_HEAD_DIM}"
    return None
