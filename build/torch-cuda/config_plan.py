"""Plan key in, kernel configurations out: the one place where the tile overrides of a call are chained.

The forward tile starts from the contiguous (or block-sparse) table row and is then overridden in a fixed order,
each step the reason its own function in the tile modules gives:

  1. block sparsity: the tile of the block size (``config.select_sparse_tile``), else the table row
     (``config.select_fwd_tile``);
  2. paged TMA: a paged prefill call whose pages hold whole K/V tiles runs the contiguous call's TMA tile
     (``config.paged_tma_tile``; never with split or decode, which keep their cp.async tiles);
  3. decode (``config_decode.decode_tile`` of the row bucket) or else split-KV (``config.split_tile``);
  4. dropout (``config.dropout_fwd_tile``: the tile of the path without dropout, except where that one spills);
  5. mods (``config.mods_dropout_fwd_tile`` with dropout, else ``config.mods_tile``).

The backward's configurations (dK/dV, dQ) are selected with the forward's when the call needs gradients, so an
unsupported backward raises at the forward, never half-way through a training step.

Host only; ``key`` is a ``plan.PlanKey`` (read by attribute, so this module imports nothing of the runtime).
"""

from __future__ import annotations

from .config import (FwdKernelConfig, dropout_fwd_tile, mods_dropout_fwd_tile, mods_tile, paged_tma_tile,
                     select_fwd_tile, select_sparse_tile, split_tile)
from .config_bwd import select_bwd_config, select_dq_config
from .config_decode import DECODE_MAX_ROWS, decode_tile


def fwd_tile(key):
    """The forward tile of a plan key (the chain of overrides in the module docstring)."""
    d, dv, windowed, tma = key.head_dim, key.head_dim_v, key.windowed, key.tma
    sparse = key.sparse
    if sparse[0]:
        tile = select_sparse_tile(d, dv, windowed, key.mods is not None, block_size=tuple(sparse[2:4]) or None,
                                  tma=tma)
    else:
        tile = select_fwd_tile(d, dv, windowed, key.paged, tma=tma)
    if key.paged_tma and key.paged and tma and not (key.split or key.decode):
        # the contiguous call's TMA tile (plan.paged_eligible_for_tma checked its tile_n against the page size)
        tile = paged_tma_tile(d, dv, windowed, tma=tma) or tile
    if key.decode:
        tile = decode_tile(d, dv, DECODE_MAX_ROWS if key.decode is True else key.decode)
    elif key.split:
        tile = split_tile(tile)
    if key.dropout:
        tile = dropout_fwd_tile(d, dv, tile, tma)
    if key.mods is not None:
        tile = mods_dropout_fwd_tile(d, dv, tma) if key.dropout else mods_tile(tile, d, dv)
    return tile


def kernel_configs(key):
    """(forward config, dK/dV config or None, dQ config or None) of a plan key; the backward's two only when
    ``key.needs_grad`` (ValueError now where no backward tile serves the call)."""
    mods = key.mods
    fwd = FwdKernelConfig(dtype=key.dtype, head_dim=key.head_dim, head_dim_v=key.head_dim_v, tile=fwd_tile(key),
                          windowed=key.windowed, has_softcap=key.softcap, has_sink=key.sink, varlen_q=key.varlen_q,
                          varlen_k=key.varlen_k, seqused_q=key.seqused_q, seqused_k=key.seqused_k, paged=key.paged,
                          split_kv=key.split, sparse_q_ratio=key.sparse[0], sparse_kv_ratio=key.sparse[1],
                          has_dropout=key.dropout, dropout_seed_tensor=key.seed_tensor,
                          dropout_packed=key.dropout_packed, dropout_high_p=key.dropout_high_p,
                          mods=None if mods is None else mods.forward_part())
    if not key.needs_grad:
        return fwd, None, None
    flags = dict(windowed=key.windowed, has_softcap=key.softcap, varlen_q=key.varlen_q, varlen_k=key.varlen_k,
                 seqused_q=key.seqused_q, seqused_k=key.seqused_k, has_dropout=key.dropout,
                 dropout_seed_tensor=key.seed_tensor, mods=mods)
    sb = key.sparse_bwd
    bwd = select_bwd_config(key.dtype, key.head_dim, key.head_dim_v, key.tma, **flags, sparse_q_ratio=sb[2],
                            sparse_kv_ratio=sb[3])
    dq = select_dq_config(key.dtype, key.head_dim, key.head_dim_v, key.tma, **flags, sparse_q_ratio=sb[0],
                          sparse_kv_ratio=sb[1], sink_grad=key.sink)
    return fwd, bwd, dq


__all__ = ["fwd_tile", "kernel_configs"]
