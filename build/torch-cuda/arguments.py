"""The declared argument record of each kernel (host only: no CuTe-DSL import).

A record lists a kernel's arguments by name, in the order of its ``__call__`` (a CPU test checks that the names
match).  Everything that passes arguments to a kernel goes through its record:

  * the compile step builds the fake (symbolic) arguments from it (``jit.fake_args``);
  * the host launches by name: ``launch(fn, RECORD, q=q, k=k, ...)`` packs the values in record order and
    raises on a missing or unknown name, so an argument can never bind to the wrong parameter.

Kinds:
  act     a (…, D) activation in the kernel's dtype: rank 4 (B, S, H, D), or rank 3 (total, H, D) when the config
          flag named by ``varlen`` is on; D is the config attribute named by ``dim``.  When the config flag named
          by ``split`` is on: fp32 with a leading num_splits dim (split-KV partials)
  rowstat a per-row fp32 tensor (LSE, D): (B, H, S), or (H, total) when ``varlen`` is on (a leading num_splits
          dim when ``split`` is on)
  i32vec  a 1-D int32 tensor (cu_seqlens, seqused)
  i32mat  a 2-D int32 tensor, last dim contiguous (page table)
  i64vec  a 1-D int64 tensor (dropout seed on the device)
  f32vec  a 1-D fp32 tensor (learnable sink)
  i32nd   an int32 tensor of ``rank`` dims, last dim contiguous, int32 strides (block-sparse counts and indices)
  aux     the mods' aux tensors: a tuple of tensors, dtype and rank from the config's ``mods.aux_sig``, every
          extent and stride dynamic
  f32/i32 a runtime scalar
  rows    a (…, D) tensor of ``rank`` dims in the dtype named by the config attribute ``dtype``, D contiguous and
          static (the config attribute named by ``dim``), rows 4-element aligned (combine kernel)
  dqacc   the fused backward's fp32 dQ workspace (blocks, H, tile_m * head_dim): contiguous, the last extent static
  strided an fp32 tensor of ``rank`` dims with every stride dynamic (the combine kernel's LSE views, the
          preprocess kernel's dLSE)
  record  a group of arguments passed as one NamedTuple (``record``), its ``fields`` declared as above: the
          dropout scalars (``DropoutParams``) and the block-sparse lists (``BlockSparseLists``)
``when`` names a config flag: the argument is None when the flag is off (an optional tensor, or a whole record).

Why a NamedTuple and not a dataclass: CuTe-DSL flattens both into the kernel's parameters (the same parameters,
in the same order, as the fields spelled out one by one: the SASS does not change,
benchmarks/results/sass_compare_grouped_args_c279b00.txt), but a compiled function
loaded from the disk cache or the prebuilt set (``tvm_ffi.load_module``) is called positionally, without the
wrapper that unpacks a dataclass; a NamedTuple is a tuple, which that call takes as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class DropoutParams(NamedTuple):
    """The kernels' dropout arguments (``dropout.DropoutArgs.kernel_params`` builds them; kernels/philox.py
    ``DropoutRng`` reads them): keep threshold (uint32 bits as int32), 1/(1-p), Philox seed and offset as 32-bit
    halves (int32 bit patterns), and the (1,) int64 seed tensor that replaces the scalar seed under CUDA graphs
    (config.dropout_seed_tensor; None otherwise)."""

    threshold: Any
    scale: Any
    seed_lo: Any
    seed_hi: Any
    offset_lo: Any
    offset_hi: Any
    seed: Any = None


class BlockSparseLists(NamedTuple):
    """The block lists a block-sparse kernel walks (block_sparse.py checks and builds them): counts (B|1, H|1,
    blocks) and indices (B|1, H|1, blocks, width), int32, last dim contiguous.  The forward and the dQ kernel take
    the Q-major lists (per query block, its KV blocks), the dK/dV kernel the KV-major ones (per KV block, its
    query blocks); "full" blocks skip the masks, "mask" blocks get them."""

    mask_block_cnt: Any
    mask_block_idx: Any
    full_block_cnt: Any
    full_block_idx: Any


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str
    dim: str | None = None
    varlen: str | None = None
    when: str | None = None
    rank: int = 0  # kinds "rows" / "strided"
    dtype: str | None = None  # kind "rows": the config attribute holding the dtype name
    split: str | None = None  # kinds "act" / "rowstat": the config flag that makes it a split-KV partial
    record: type | None = None  # kind "record": the NamedTuple the fields are passed in
    fields: tuple["Arg", ...] = ()  # kind "record": its fields, in the NamedTuple's order


@dataclass(frozen=True)
class ArgRecord:
    kernel: str
    args: tuple[Arg, ...]

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(a.name for a in self.args))

    def pack(self, values: dict) -> tuple:
        """Values in record order; TypeError naming a missing or unknown argument."""
        names = self.names
        try:
            if len(values) == len(names):
                return tuple(map(values.__getitem__, names))
        except KeyError:
            pass
        unknown = sorted(set(values) - set(names))
        missing = [n for n in names if n not in values]
        raise TypeError(f"{self.kernel} launch: missing arguments {missing}, unknown arguments {unknown}")


def _act(name, dim, varlen):
    return Arg(name, "act", dim=dim, varlen=varlen)


_SEQ_META = (
    Arg("cu_seqlens_q", "i32vec", when="varlen_q"),
    Arg("cu_seqlens_k", "i32vec", when="varlen_k"),
    Arg("seqused_q", "i32vec", when="seqused_q"),
    Arg("seqused_k", "i32vec", when="seqused_k"),
)

# Dropout (config.has_dropout): one DropoutParams; the seed tensor replaces the scalar seed when
# config.dropout_seed_tensor.  None without dropout, so the p = 0 kernel is the kernel without dropout.
_DROPOUT = Arg("dropout", "record", when="has_dropout", record=DropoutParams, fields=(
    Arg("threshold", "i32"),
    Arg("scale", "f32"),
    Arg("seed_lo", "i32"),
    Arg("seed_hi", "i32"),
    Arg("offset_lo", "i32"),
    Arg("offset_hi", "i32"),
    Arg("seed", "i64vec", when="dropout_seed_tensor"),
))

# Block sparsity (config flag ``block_sparse``): one BlockSparseLists, counts rank 3, indices rank 4.  The forward
# and the dQ kernel take the Q-major lists (per query block, the KV blocks it sees), the dK/dV kernel the KV-major
# ones (per KV block, the query blocks that see it).  None without block sparsity.
_SPARSE = Arg("sparse", "record", when="block_sparse", record=BlockSparseLists, fields=(
    Arg("mask_block_cnt", "i32nd", rank=3),
    Arg("mask_block_idx", "i32nd", rank=4),
    Arg("full_block_cnt", "i32nd", rank=3),
    Arg("full_block_idx", "i32nd", rank=4),
))

FWD_ARGS = ArgRecord("forward", (
    _act("q", "head_dim", "varlen_q"),
    _act("k", "head_dim", "varlen_k"),
    _act("v", "head_dim_v", "varlen_k"),
    Arg("out", "act", dim="head_dim_v", varlen="varlen_q", split="split_kv"),
    Arg("lse", "rowstat", varlen="varlen_q", split="split_kv"),
    *_SEQ_META,
    Arg("page_table", "i32mat", when="paged"),
    Arg("sink", "f32vec", when="has_sink"),
    _SPARSE,
    Arg("aux_tensors", "aux", when="has_aux"),
    Arg("scale_log2", "f32"),
    Arg("softcap_prescale", "f32"),
    Arg("window_left", "i32"),
    Arg("window_right", "i32"),
    Arg("pack", "i32"),
    Arg("qheads_per_kvhead", "i32"),
    Arg("num_m_blocks", "i32"),
    Arg("num_head_groups", "i32"),
    Arg("num_batch", "i32"),
    _DROPOUT,
))

# The two backward kernels share their inputs; each adds its outputs and grid extents.
_BWD_INPUTS = (
    _act("q", "head_dim", "varlen_q"),
    _act("k", "head_dim", "varlen_k"),
    _act("v", "head_dim_v", "varlen_k"),
    _act("dout", "head_dim_v", "varlen_q"),
    Arg("lse", "rowstat", varlen="varlen_q"),
    Arg("dpsum", "rowstat", varlen="varlen_q"),
)
_BWD_SCALARS = (
    Arg("scale_log2", "f32"),
    Arg("softcap_prescale", "f32"),
    Arg("softmax_scale", "f32"),
    Arg("window_left", "i32"),
    Arg("window_right", "i32"),
    Arg("qheads_per_kvhead", "i32"),
)

BWD_DKDV_ARGS = ArgRecord("backward dK/dV", (
    *_BWD_INPUTS,
    _act("dk", "head_dim", "varlen_k"),
    _act("dv", "head_dim_v", "varlen_k"),
    Arg("dq_accum", "dqacc", when="fused_dq"),
    # the relay's turn counters (config dq_relay): int32 (workspace tiles, Hq), zeroed with the workspace
    Arg("dq_turns", "i32nd", rank=2, when="dq_relay"),
    *_SEQ_META,
    _SPARSE,
    Arg("aux_tensors", "aux", when="has_aux"),
    *_BWD_SCALARS,
    Arg("num_n_blocks", "i32"),
    Arg("num_kv_heads", "i32"),
    Arg("num_batch", "i32"),
    _DROPOUT,
))

BWD_DQ_ARGS = ArgRecord("backward dQ", (
    *_BWD_INPUTS,
    _act("dq", "head_dim", "varlen_q"),
    Arg("pdpsum", "rowstat", varlen="varlen_q", when="sink_grad"),
    *_SEQ_META,
    _SPARSE,
    Arg("aux_tensors", "aux", when="has_aux"),
    *_BWD_SCALARS,
    Arg("num_m_blocks", "i32"),
    Arg("num_heads", "i32"),
    Arg("num_batch", "i32"),
    _DROPOUT,
))

# The fused backward's dQ convert: the fp32 workspace (blocks, Hq, tile_m * D) -> dq (B, Sq, Hq, D) or (total_q, Hq, D),
# scaled by the softmax scale; grid (query tiles, Hq, B).
DQ_CONVERT_ARGS = ArgRecord("backward dQ convert", (
    Arg("dq_accum", "dqacc"),
    _act("dq", "head_dim", "varlen_q"),
    Arg("cu_seqlens_q", "i32vec", when="varlen_q"),
    Arg("seqused_q", "i32vec", when="seqused_q"),
    Arg("softmax_scale", "f32"),
    Arg("num_m_blocks", "i32"),
    Arg("num_heads", "i32"),
    Arg("num_batch", "i32"),
))

# Split-KV combine: out_partial (splits, B, S, H, D) and lse_partial (splits, B, S, H) -> out (B, S, H, D), lse
# (B, S, H); varlen calls are viewed with B = 1 on the host.
COMBINE_ARGS = ArgRecord("combine", (
    Arg("out_partial", "rows", dim="head_dim", rank=5, dtype="partial_dtype"),
    Arg("lse_partial", "strided", rank=4),
    Arg("out", "rows", dim="head_dim", rank=4, dtype="out_dtype"),
    Arg("lse", "strided", rank=3, when="has_lse"),
    Arg("num_rows", "i32"),
))

# Backward preprocess: dout, out (B, S, H, Dv) -> dpsum (B, H, S) = rowsum(dout * out) - dlse; varlen calls are
# viewed with B = 1 on the host ((1, total, H, Dv) and (1, H, total)).  dlse may have any strides (0 included: an
# expanded gradient is read in place).
BWD_PRE_ARGS = ArgRecord("backward preprocess", (
    Arg("dout", "act", dim="head_dim_v"),
    Arg("out", "act", dim="head_dim_v"),
    Arg("dpsum", "rowstat"),
    Arg("dlse", "strided", rank=3, when="has_dlse"),
    Arg("num_rows", "i32"),
))
