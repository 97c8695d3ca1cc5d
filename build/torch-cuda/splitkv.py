"""Host side of the split-KV forward: the ``num_splits`` rule, the automatic choice, the fp32 partials and the
combine launch.

``num_splits``: None (the default of flash_attn_func / flash_attn_varlen_func) picks N automatically for an
inference call, as FlashAttention-2 does in its flash_attn_func, and 1 for every other call
(``default_num_splits``); 1 runs one split; N > 1 runs exactly N; 0 or less picks N from the problem size and the
SM count.  Split-KV is
inference-only: a forced N > 1 with inputs that require grad raises; the automatic choice is 1 there (training
calls never split).  The choice reads only shapes and the device's SM count (cached per device): no
device->host sync, and a CUDA-graph capture records the N chosen at capture.

Each split's CTAs (grid z folds (batch, split)) write fp32 partial O and LSE of their KV range; an empty range
writes O = 0 and LSE = -inf, and q rows outside every sequence get LSE = -inf in every split, so the combine
(kernels/combine.py) gives them O = 0 and LSE = -inf, the unsplit rule.  A learnable sink joins the denominator
in split 0 only (the kernel gives the other splits a -inf sink), which is exact.
"""

from __future__ import annotations

import functools

import torch

from .combine import launch_combine
from .compat import refuse
from .config_combine import COMBINE_MAX_SPLITS, combine_head_dim_problem
from .device import split_problem
from .launch import sm_count

MAX_GRID_Z = 65535  # CUDA's limit on grid z, which holds batch * num_splits
AUTO_MAX_SPLITS = 64  # more splits cost the combine more than they save (benchmarks/experiments/results/
#                       decode_splits_h100_s26.jsonl: 96 or 128 never beat 64, MQA decode)


# Whether the default (num_splits=None) splits inference calls automatically (True) or means 1, no split (False).
# On since the split path's host work was cut and the default got its AUTO_MIN_KEYS rule: through transformers'
# greedy generate (Llama-3-8B-shaped, 2 layers, B=1) the default then matched no split at 4K (it does not split
# there) and gave more tokens/s at 16K, with no host sync and no compile per step (the H100 rows of
# benchmarks/results/generate_h100.jsonl with the ``ours_default`` impl, session 32, and
# benchmarks/experiments/results/split_generate_probe_h100_s32.jsonl).  Before that cut it lost (the earlier rows).
DEFAULT_SPLITS_AUTO = True

# The default splits only a call whose KV walk per CTA is at least this many keys: below it the split path's fixed
# cost (a second launch, the fp32 workspace, the combine) exceeds the kernel time it saves.  Derived from
# benchmarks/experiments/results/split_generate_probe_h200_s31.jsonl (B=1, Hq 32 / Hkv 8, d128, one call with a
# synchronize): unsplit 105.5 us at 4K keys and 213.8 us at 16K, i.e. ~69 us + 8.8 us per 1K keys; split
# 137.5-146.9 us at both, flat; the two cross at ~8K keys.  The grid-fill condition (an unsplit grid that leaves
# SMs idle) is auto_num_splits'.  An explicit num_splits (0 included) is not subject to it.
AUTO_MIN_KEYS = 8192


def default_kv_walk(q, k, *, page_table=None, cu_seqlens_k=None, max_seqlen_k=None, causal=False,
                    window_size=None) -> int | None:
    """Keys one CTA of the unsplit kernel walks at most, from shapes and the caller-given ``max_seqlen_k`` (never a
    device value): the KV extent (k's sequence dim; pages per sequence x page size with a page table;
    ``max_seqlen_k`` with cu_seqlens_k), capped by a window bounded on both sides (left + right + query rows).
    None when it cannot be told from those (cu_seqlens_k without max_seqlen_k) or an argument is malformed (the
    call's validation names it)."""
    try:
        if max_seqlen_k is not None:
            if max_seqlen_k.__class__ is not int:  # a tensor would be read on the host (a sync): not here
                return None
            kv = max_seqlen_k
        elif cu_seqlens_k is not None:
            return None
        elif page_table is not None:
            kv = int(page_table.shape[1]) * int(k.shape[1])
        else:
            kv = int(k.shape[-3])
        if window_size is not None:
            left, right = window_size
            right = 0 if causal else right
            if isinstance(left, int) and isinstance(right, int) and left >= 0 and right >= 0:
                kv = min(kv, left + right + max(int(q.shape[-3]), 1))
        return kv
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def default_for_call(q, k, kw: dict, p: float, needs_grad: bool, block_sparse: bool, compiling: bool) -> int:
    """``default_num_splits`` for one attention call's arguments (``kw``: the entry point's keyword dict; ``p``: its
    checked dropout probability), asking in the cheap order: the flags, then the KV walk from shapes, and only for a
    call long enough to split whether the stream is capturing (a host query every call otherwise).  Positional:
    every call of an entry point without ``num_splits`` comes here."""
    if not DEFAULT_SPLITS_AUTO or needs_grad or p > 0.0 or block_sparse or compiling:
        return 1
    cu_k, max_k = kw.get("cu_seqlens_k"), kw.get("max_seqlen_k")
    walk = default_kv_walk(q, k, page_table=kw.get("page_table"), cu_seqlens_k=cu_k, max_seqlen_k=max_k,
                           causal=kw["causal"], window_size=kw["window_size"])
    if walk is not None and walk < AUTO_MIN_KEYS:
        return 1
    return default_num_splits(
        needs_grad=False, dropout=False, block_sparse=False, compiling=False,
        capturing=torch.cuda.is_available() and torch.cuda.is_current_stream_capturing(),
        kv_extent_static=cu_k is None and max_k is None, kv_walk=walk)


def default_num_splits(*, needs_grad: bool, dropout: bool, block_sparse: bool, compiling: bool, capturing: bool,
                       kv_extent_static: bool, kv_walk: int | None = None) -> int:
    """What ``num_splits=None`` means for one call: 0 (automatic: ``auto_num_splits`` splits only a grid that
    leaves SMs idle, from shapes and the SM count) or 1 (no split).  1 for a training call (needs grad), a call with
    dropout or block sparsity (neither runs split), under torch.compile (the compiled op runs one split), under
    CUDA-graph capture when the KV extent is a caller-given ``max_seqlen_k`` rather than a tensor shape (the count
    would be frozen for a length the caller may change between replays), and when the keys a CTA walks
    (``kv_walk``, ``default_kv_walk``; from shapes, never device values) are fewer than ``AUTO_MIN_KEYS``.
    With ``DEFAULT_SPLITS_AUTO = False``: always 1."""
    if not DEFAULT_SPLITS_AUTO or needs_grad or dropout or block_sparse or compiling:
        return 1
    if capturing and not kv_extent_static:
        return 1
    if kv_walk is not None and kv_walk < AUTO_MIN_KEYS:
        return 1
    return 0


def check_num_splits(num_splits) -> int:
    """``num_splits`` must be an int (not a bool, not a float); None is the default, checked as 1 (it is resolved
    per call by ``default_num_splits``)."""
    if num_splits is None:
        return 1
    if num_splits.__class__ is not int and (not isinstance(num_splits, int) or isinstance(num_splits, bool)):
        raise ValueError(f"num_splits must be an int, got {num_splits!r}")
    return int(num_splits)


@functools.lru_cache(maxsize=4096)  # a pure function of four ints, called once per decode step: memoised
def auto_num_splits(ctas: int, n_blocks: int, num_sms: int, max_splits: int, min_waves: int = 1) -> int:
    """Splits that fill the GPU: 1 when the unsplit grid (``ctas``) already fills ~80% of the SMs; otherwise,
    among the split counts that change the blocks per split, the smallest whose wave efficiency (waves /
    ceil(waves)) is within 85% of the best one's and that gives at least ``min_waves`` waves when any can, at most
    ``max_splits`` and ``n_blocks`` (KV blocks per tile).  Paged calls ask for two waves: their row-by-row loads
    need more CTAs in flight to cover the latency (B=1 KV 32K page 64, 16 against 32 splits:
    benchmarks/experiments/results/decode_tiles_h100.jsonl)."""
    if ctas <= 0 or ctas * 5 >= num_sms * 4 or n_blocks < 2:
        return 1
    limit = max(1, min(max_splits, n_blocks, AUTO_MAX_SPLITS))
    candidates, effs = [], []
    for n in range(1, limit + 1):
        if n > 1 and -(-n_blocks // n) == -(-n_blocks // (n - 1)):
            continue  # the same blocks per split as n - 1: only more, emptier CTAs
        waves = ctas * n / num_sms
        candidates.append(n)
        effs.append(waves / -(-waves // 1))
    best = max(effs)
    ok = [n for n, e in zip(candidates, effs) if e >= 0.85 * best]
    filled = [n for n in ok if ctas * n >= min_waves * num_sms * 0.85]
    return (filled or ok[-1:])[0]


def resolve_num_splits(num_splits: int, *, needs_grad: bool, batch: int, ctas: int, n_blocks: int, dv: int,
                       device: torch.device, paged: bool = False, caps=None) -> int:
    """The split count of a call (1: no split).  Raises ValueError for a forced count that cannot run.
    ``caps``: the device's record (device.DeviceCaps); where it has no programmatic dependent launch the
    automatic count is 1 and a forced one raises."""
    no_split = None if caps is None else split_problem(caps)
    if num_splits == 1 or (num_splits <= 0 and (needs_grad or combine_head_dim_problem(dv) or no_split)):
        return 1
    if num_splits > 1:
        if no_split:
            refuse("split_pdl", n=num_splits, problem=no_split)
        if num_splits > COMBINE_MAX_SPLITS:
            refuse("split_max", n=num_splits, limit=COMBINE_MAX_SPLITS)
        if batch * num_splits > MAX_GRID_Z:
            refuse("split_grid", batch=batch, n=num_splits, product=batch * num_splits, limit=MAX_GRID_Z)
        problem = combine_head_dim_problem(dv)
        if problem:
            refuse("split_head_dim_v", n=num_splits, problem=problem)
        return num_splits
    return auto_num_splits(ctas, n_blocks, sm_count(device), min(COMBINE_MAX_SPLITS, MAX_GRID_Z // max(batch, 1)),
                           2 if paged else 1)


@functools.lru_cache(maxsize=256)  # per (splits, shapes): fixed for every step of a decode loop but the split count
def _workspace_geometry(num_splits: int, out_shape: tuple, lse_shape: tuple, varlen_q: bool) -> tuple:
    """(floats, o view, lse view, o view for the combine, lse view for the combine) of one fp32 workspace holding
    the partial O (offset 0; rows stay 16-byte aligned) then the partial LSE; each view is (shape, stride, offset),
    read off the same view ops on a meta tensor, so every stride is the one those ops give."""
    o_numel = num_splits
    for n in out_shape:
        o_numel *= n
    l_numel = num_splits
    for n in lse_shape:
        l_numel *= n
    ws = torch.empty(o_numel + l_numel, dtype=torch.float32, device="meta")
    o, lp = ws[:o_numel].view(num_splits, *out_shape), ws[o_numel:].view(num_splits, *lse_shape)
    if varlen_q:  # (splits, total, H, D), (splits, H, total) -> batch 1
        oc, lc = o.unsqueeze(1), lp.transpose(1, 2).unsqueeze(1)
    else:
        oc, lc = o, lp.transpose(2, 3)

    def geo(t):
        return tuple(t.shape), t.stride(), t.storage_offset()

    return o_numel + l_numel, geo(o), geo(lp), (None if oc is o else geo(oc)), geo(lc)


def partials(out: torch.Tensor, lse: torch.Tensor, num_splits: int, varlen_q: bool = False) -> tuple:
    """fp32 partial O and LSE in the forward kernel's layouts, with a leading num_splits dim, and the same two in the
    combine kernel's layouts: (o, lse, o_combine, lse_combine), views of one allocation (one torch.empty per call;
    the views' geometry is memoised per shape)."""
    floats, o_v, l_v, oc_v, lc_v = _workspace_geometry(num_splits, tuple(out.shape), tuple(lse.shape), varlen_q)
    ws = torch.empty(floats, dtype=torch.float32, device=out.device)
    o = ws.as_strided(*o_v)
    return o, ws.as_strided(*l_v), (o if oc_v is None else ws.as_strided(*oc_v)), ws.as_strided(*lc_v)


def combine_into(o_comb: torch.Tensor, lse_comb: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 varlen_q: bool) -> None:
    """Combine the partials (``partials``' combine views) into the call's out/lse (the forward's layouts: lse
    (B, Hq, Sq) or (Hq, total_q))."""
    if varlen_q:
        launch_combine(o_comb, lse_comb, out.unsqueeze(0), lse.t().unsqueeze(0))
    else:
        launch_combine(o_comb, lse_comb, out, lse.transpose(1, 2))
