"""Host side of ``flash_attn_with_kvcache``: argument checks, the append of new keys/values into the cache, and
the mapping of every cache layout onto the forward's inputs.  Host only (torch ops, no CuTe-DSL).

Cache layouts (FlashAttention-2/3):
  * contiguous: k_cache/v_cache (B_cache, S_cache, Hkv, D); batch entry b uses cache row ``cache_batch_idx[b]``
    (default b).  Without ``cache_batch_idx`` the forward reads the first B rows directly (dense K/V with
    seqused_k); with it, the cache is read as a paged cache of B_cache pages of S_cache rows and the page table
    ``cache_batch_idx[:, None]`` (no copy of the cache).
  * paged: k_cache/v_cache (num_pages, page_size, Hkv, D) with ``page_table`` (alias ``block_table``).

The append (k/v given) writes row i of the new keys of batch entry b at position ``cache_seqlens[b] + i``, with
torch's indexed writes: no device->host sync, CUDA-graph capturable.  Positions are the caller's contract as in
FlashAttention; torch's index bounds checks stop an out-of-range write (a device-side assert), so nothing is ever
written outside the cache.  The attention then sees ``cache_seqlens + new`` keys.
"""

from __future__ import annotations

import torch

from . import validate as V


def check_cache_seqlens(cache_seqlens, batch: int, capacity: int, new: int, device: torch.device):
    """``cache_seqlens`` (int or int32 (B,) tensor) as an int32 (B,) tensor (None stays None)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        V.check_index_tensor("cache_seqlens", cache_seqlens, batch, device)
        return cache_seqlens
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},), got "
                         f"{type(cache_seqlens).__name__}")
    if not 0 <= cache_seqlens <= capacity - new:
        raise ValueError(f"cache_seqlens={cache_seqlens} with {new} new keys does not fit the cache of {capacity} "
                         f"keys per sequence (need 0 <= cache_seqlens <= {capacity - new})")
    return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)


def check_new_kv(k, v, k_cache, v_cache, batch: int, device: torch.device) -> int:
    """New keys/values (B, S_new, Hkv, D|Dv) in the cache's dtype and heads; returns S_new (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values to append) must be given together")
    if k is None:
        return 0
    V.check_tensor("k", k, 4, device)
    V.check_tensor("v", v, 4, device)
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[1] != v.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch={batch}, S_new, Hkv, D) with "
                         "one S_new")
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if new.dtype != cache.dtype:
            raise ValueError(f"{name} has dtype {new.dtype} but {name}_cache has {cache.dtype}")
        if new.shape[2:] != cache.shape[2:]:
            raise ValueError(f"{name} {tuple(new.shape)} must have the heads and head dim of {name}_cache "
                             f"{tuple(cache.shape)}")
    return k.shape[1]


def append(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx) -> None:
    """Write k/v (B, S_new, ...) into the cache at positions cache_seqlens[b] + i (in place, no host sync)."""
    batch, new = k.shape[0], k.shape[1]
    if new == 0:
        return
    pos = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)[None, :]  # (B, S_new)
    # torch wraps negative indices; send them out of range instead, where the bounds check stops them
    capacity = page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]
    pos = pos.masked_fill(pos < 0, capacity)
    if page_table is not None:
        page_size = k_cache.shape[1]
        col = torch.div(pos, page_size, rounding_mode="floor")
        page = page_table.long().gather(1, col)
        idx = (page.masked_fill(page < 0, k_cache.shape[0]), pos - col * page_size)
    else:
        rows = (torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.long())
        idx = (rows[:, None].expand(batch, new), pos)
    k_cache.index_put_(idx, k)
    v_cache.index_put_(idx, v)
