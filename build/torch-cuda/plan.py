"""One plan per call: the plan key of a validated call, the memoised plan it names, and the host values the
backward needs (``FwdMeta``).  Used by the forward (dispatch.run_forward) and the backward (dispatch_bwd).

``PlanKey`` is built once per call from the validated arguments and adjusted with ``_replace`` for the overrides
that follow from the call's shape (decode rows, split-KV, packed dropout rows); ``config_plan.kernel_configs``
turns it into the kernel configurations (the chain of tile overrides lives there, in the config layer).  A key is
a NamedTuple: a frozen record whose hash and equality run in C, where a frozen dataclass sets each field through
``object.__setattr__`` and hashes a fresh tuple per lookup (the plan lookup runs on every call: serving engines
call once per layer per decode step).

Everything that depends only on the key (tile choice, kernel configs, the compiled launchers, the backward's
feasibility) is memoised in a ``Plan``; the memo is dropped when the tile tables change (``config.table_version``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .config import paged_tma_tile, table_version
from .config_decode import DECODE_MAX_ROWS, decode_rows, decode_tile
from .config_plan import kernel_configs
from . import validate as V
from .dropout import DropoutArgs
from .launch import sm_count
from .splitkv import resolve_num_splits

_LOG2_E = math.log2(math.e)
_NO_SPARSE = (0, 0)
_NO_SPARSE_BWD = (0, 0, 0, 0)


class PlanKey(NamedTuple):
    """What selects a call's kernels.  ``split``: fp32 split-KV partials; ``sparse``: (q_ratio, kv_ratio,
    q_block, kv_block) of block sparsity, (0, 0) when off (config.select_sparse_tile of the block size, the first
    tile when it is left out); ``decode``: at most that many query rows per CTA (the tile_m of its decode tile;
    True: up to DECODE_MAX_ROWS), 0 otherwise; ``sparse_bwd``: (dq_q, dq_kv, dkdv_q, dkdv_kv) block ratios of
    the backward's kernels, zeros when off; ``dropout``/``seed_tensor``/``dropout_packed``/``dropout_high_p``:
    Philox dropout in the kernel, seed from a device tensor, packed GQA rows, p > 0.96875; ``mods``:
    modspec.ModSpec or None; ``paged_tma``: a paged prefill call whose pages hold whole K/V tiles of the TMA tile
    (``paged_eligible_for_tma``; ignored with split or decode); ``tma``: the device has TMA."""

    dtype: str
    head_dim: int
    head_dim_v: int
    windowed: bool = False
    softcap: bool = False
    sink: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    needs_grad: bool = False
    device_index: int | None = 0
    paged: bool = False
    split: bool = False
    sparse: tuple = _NO_SPARSE
    decode: int = 0
    sparse_bwd: tuple = _NO_SPARSE_BWD
    dropout: bool = False
    seed_tensor: bool = False
    dropout_packed: bool = False
    dropout_high_p: bool = False
    mods: object = None
    paged_tma: bool = False
    tma: bool = True


class Plan:
    """Memoised per key: the kernel configs (the backward's validated at forward time when gradients are needed,
    so a training step never fails half-way) and their compiled launchers, filled on first use."""

    __slots__ = ("fwd_cfg", "bwd_cfg", "dq_cfg", "fwd_fn", "bwd_fn", "dq_fn", "fused", "relay", "shapes")

    def __init__(self, fwd_cfg, bwd_cfg=None, dq_cfg=None):
        self.fwd_cfg, self.bwd_cfg, self.dq_cfg = fwd_cfg, bwd_cfg, dq_cfg
        self.fwd_fn = self.bwd_fn = self.dq_fn = None
        # the fused backward of bwd_cfg on the plan's device (dispatch_bwd.fused_plan): False until first asked,
        # then its (configs, compiled kernels) or None where the kernel pair runs the backward
        self.fused = False
        # the same for its deterministic form (config_bwd dq_relay), asked for by ``deterministic=True`` calls
        self.relay = False
        # launch_plan's choices that depend on the call's shapes but not on its KV length, per shape (_ShapePlan)
        self.shapes = {}


# PlanKey -> Plan, and (PlanKey, variant tag, argument) -> (variant key, its plan) (``_variant``)
_PLANS: dict = {}
_PLANS_VERSION = [-1]  # the tile-table version the memo was built under


def get_plan(key: PlanKey) -> Plan:
    """The plan of ``key`` (built on first use; ValueError where no tile serves it)."""
    version = table_version()
    if _PLANS_VERSION[0] != version:
        _PLANS.clear()
        _PLANS_VERSION[0] = version
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = Plan(*kernel_configs(key))
    return plan


def _variant(key: PlanKey, tag: str, arg, make) -> tuple[PlanKey, Plan]:
    """(``make(key)``, its plan), memoised beside the plans and cleared with them: ``make`` is a ``_replace`` of the
    many-field key, which costs more on the hot path of a decode, split or packed-dropout call than this lookup
    (benchmarks/results/host_ab_count_cpu.jsonl)."""
    memo = (key, tag, arg)
    hit = _PLANS.get(memo) if _PLANS_VERSION[0] == table_version() else None
    if hit is None:
        variant = make(key)
        plan = get_plan(variant)  # (clears a stale memo first)
        hit = _PLANS[memo] = (variant, plan)
    return hit


def clear() -> None:
    """Forget every plan (tests that replace the compiler or the launches)."""
    _PLANS.clear()


# ---- host values of one call -------------------------------------------------------------------------------------
class FwdMeta(NamedTuple):
    """What the backward needs besides the saved tensors (host values of one forward call).  A NamedTuple for the
    reason PlanKey is one: it is built on every forward, and a frozen dataclass sets each field through
    ``object.__setattr__`` (``_replace`` makes a changed copy)."""

    scale: float
    softcap: float
    left: int
    right: int
    windowed: bool
    batch: int
    max_q: int
    max_k: int
    sparse: object = None  # block_sparse.SparseGrad of a block-sparse call that needs grad
    dropout: DropoutArgs | None = None  # p > 0 only; the backward reuses its seed and offset
    mods: object = None  # modspec.ModSpec of the call (with score_mod_bwd when it needs grad), or None
    # the backward is bitwise reproducible: the fused kernel's relay form (its dQ adds in a fixed order), or the
    # atomic-free kernel pair where no fused tile serves the call
    deterministic: bool = False
    # the backward's PlanKey when the forward knew it (``backward_key``); None: the backward builds it
    plan_key: PlanKey | None = None

    def log2_scales(self) -> tuple[float, float]:
        """(scale_log2, softcap_prescale) of the score hook.  With a score_mod: (log2(e), softmax scale), the mod
        seeing the scaled scores (upstream's convention)."""
        if self.mods is not None and self.mods.score_mod is not None:
            return _LOG2_E, self.scale
        if self.softcap > 0:
            return self.softcap * _LOG2_E, self.scale / self.softcap
        return self.scale * _LOG2_E, 1.0

    def sparse_bwd_key(self) -> tuple:
        """The backward's block-sparse plan key (``sparse_bwd_key`` of the call's SparseGrad)."""
        return sparse_bwd_key(self.sparse)


def sparse_bwd_key(sg) -> tuple:
    """The backward's block-sparse plan key of a block_sparse.SparseGrad (the dQ and dK/dV ratios), zeros for
    None (no block sparsity, or no gradient)."""
    return _NO_SPARSE_BWD if sg is None else (*sg.dq_ratios, *sg.dkdv_ratios)


def backward_key(key: PlanKey) -> PlanKey | None:
    """The plan key dispatch_bwd.run_backward looks up for the backward of a forward call whose plan key (before
    launch_plan's per-call variants) is ``key``: the same fields, with ``dropout_high_p`` off (it changes only the
    forward's config; the backward has always keyed its plan without it).  None for a block-sparse or paged call:
    the backward builds that key itself, from the saved block sizes.  Saves the backward rebuilding the key field by
    field on every training step (benchmarks/results/host_ab_count_cpu.jsonl, host_ab_cpu_stub_s34.jsonl)."""
    if key.paged or key.sparse != _NO_SPARSE:
        return None
    return key._replace(dropout_high_p=False) if key.dropout_high_p else key


def forward_meta(q, k, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_size, softcap, debug_checks=None, page_table=None) -> FwdMeta:
    """The host values of a call (plan.FwdMeta), for the backward op, which has no forward meta to reuse."""
    return FwdMeta(*V.host_values(
        q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, debug_checks=debug_checks, page_table=page_table))


# ---- paged calls on the TMA kernel -------------------------------------------------------------------------------
# cuTensorMapEncodeTiled's limits on a global tensor: base address 16-byte aligned, every stride but the innermost
# a multiple of 16 bytes below 2**40 bytes
_TMA_MAX_STRIDE_BYTES = 1 << 40


def tma_views_ok(*tensors) -> bool:
    """Whether a TMA descriptor can be built over each tensor (last dim contiguous; base and every other stride
    16-byte aligned, positive, below 2**40 bytes).  k and v views of one fused cache ((2, num_pages, ...) or
    (num_pages, 2, ...)) qualify when each view does; a stride of 0 (an expanded tensor) does not."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        for st in t.stride()[:-1]:
            if st <= 0 or (st * es) % 16 or st * es >= _TMA_MAX_STRIDE_BYTES:
                return False
    return True


def paged_eligible_for_tma(k, v, d: int, dv: int, windowed: bool, mods=None, tma: bool = True) -> bool:
    """Whether a paged call (k/v (num_pages, page_size, Hkv, D|Dv)) runs the TMA kernel on its prefill tile: the
    contiguous call's tile is a TMA tile whose tile_n divides the page size (every K/V tile inside one page, one
    TMA box per tile), both views qualify for TMA (``tma_views_ok``), and the call has no score/mask mods (their
    paged TMA variants are not built by the compile gate).  Otherwise it runs the cp.async kernel, any page size.
    Split-KV and decode calls keep their cp.async tiles whatever this says (config_plan.fwd_tile).  ``tma``: the
    device has TMA (else False)."""
    if mods is not None or paged_tma_tile(d, dv, windowed, int(k.shape[1]), tma=tma) is None:
        return False
    return tma_views_ok(k, v)


# ---- the per-call choices ----------------------------------------------------------------------------------------
def choose_pack(pack_gqa, ratio: int, max_seqlen_q: int, tile_m: int) -> int:
    """Query heads per packed tile row block: ``pack_gqa`` None packs a KV group when a sequence alone fills less
    than half a tile."""
    if pack_gqa is None:
        return ratio if ratio > 1 and max_seqlen_q * 2 <= tile_m else 1
    if not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
    return ratio if pack_gqa else 1


def packed_dropout(key: PlanKey, plan: Plan, pack: int) -> tuple[PlanKey, Plan, int]:
    """(key, plan, pack) of a call with in-kernel dropout: packed rows make the keep bits row by row
    (FwdKernelConfig.dropout_packed), on every tile."""
    if pack > 1:
        key, plan = _variant(key, "packed_dropout", None, _packed)
    return key, plan, pack


def _packed(key: PlanKey) -> PlanKey:
    return key._replace(dropout_packed=True)


def decode_key(key: PlanKey, rows: int, grid: int, device):
    """The decode variant of ``key`` for ``rows`` query rows per CTA (query length x packed heads), or None when
    the call is not a decode call.  A key split runs unless the grid (``grid`` 64-row tiles) fills the device's
    SMs without it (config_decode.decode_rows).  Never with block sparsity, in-kernel dropout (their tiles are gated on
    the prefill tiles) or mods (the d256 decode tile is not gated with mods)."""
    bucket = _decode_bucket(key, rows, grid, device)
    return None if bucket is None else _decode_variant(key, bucket)


def _decode_bucket(key: PlanKey, rows: int, grid: int, device) -> int | None:
    """The row bucket (the decode tile's tile_m) of a decode call, or None (``decode_key``)."""
    if key.sparse[0] or key.dropout or key.mods is not None or rows > DECODE_MAX_ROWS:
        return None
    d, dv = key.head_dim, key.head_dim_v
    dtile = decode_tile(d, dv, rows)
    if dtile is not None and dtile.kv_groups > 1:
        dtile = decode_tile(d, dv, decode_rows(rows, grid, sm_count(device)))
    return None if dtile is None else dtile.tile_m


def _decode_variant(key: PlanKey, bucket: int) -> PlanKey:
    # the key carries the row bucket (the tile's tile_m), not the row count
    return key._replace(decode=bucket, sparse=_NO_SPARSE, sparse_bwd=_NO_SPARSE_BWD, paged_tma=False)


def split_key(key: PlanKey) -> PlanKey:
    """The split-KV variant of ``key`` (inference only; never with dropout or block sparsity)."""
    return key._replace(needs_grad=False, split=True, sparse=_NO_SPARSE, sparse_bwd=_NO_SPARSE_BWD, dropout=False,
                        seed_tensor=False, dropout_high_p=False, paged_tma=False)


class _ShapePlan:
    """What ``launch_plan`` derives from a plan and the call's shapes other than the KV length (packing, decode
    tile, m-blocks, CTAs, KV tile), and the split-KV plan once a call of these shapes splits: a decode loop, whose
    KV length grows every step, repeats none of it (memoised in ``Plan.shapes``)."""

    __slots__ = ("key", "plan", "pack", "num_m_blocks", "ctas", "tile_n", "split")

    def __init__(self, key, plan, pack, num_m_blocks, ctas, tile_n):
        self.key, self.plan, self.pack, self.num_m_blocks, self.ctas, self.tile_n = \
            key, plan, pack, num_m_blocks, ctas, tile_n
        self.split = None  # (split plan, its m-blocks), on the first call of these shapes that splits


_MAX_SHAPES = 256  # shape entries per plan (a serving loop's batch sizes); beyond it the memo starts over


def _shape_plan(key: PlanKey, plan: Plan, pack_gqa, ratio: int, heads: int, batch: int, max_q: int,
                num_splits: int, device) -> _ShapePlan:
    pack = 1 if key.sparse[0] else choose_pack(pack_gqa, ratio, max_q, plan.fwd_cfg.tile.tile_m)
    if key.dropout:
        key, plan, pack = packed_dropout(key, plan, pack)
    bucket = _decode_bucket(key, max_q * pack, batch * (heads // pack) * max(num_splits, 1), device)
    if bucket is not None:
        key, plan = _variant(key, "decode", bucket, lambda k: _decode_variant(k, bucket))
    num_m_blocks = -(-max_q * pack // plan.fwd_cfg.tile.tile_m)
    return _ShapePlan(key, plan, pack, num_m_blocks, num_m_blocks * (heads // pack) * batch, plan.fwd_cfg.tile.tile_n)


def launch_plan(key: PlanKey, plan: Plan, *, pack_gqa, ratio: int, heads: int, batch: int, max_q: int, max_k: int,
                num_splits: int, device, caps) -> tuple[Plan, int, int, int]:
    """(plan, pack, splits, m-blocks) of a call with work to do, from its plan: GQA packing, packed dropout rows,
    the decode tile of its row bucket, the split count (splitkv.resolve_num_splits: ValueError for a forced count
    the device cannot run) and the split tile.  Only the split count reads ``max_k``; the rest is memoised per
    shape in the plan (``_ShapePlan``)."""
    if pack_gqa is None or pack_gqa is True or pack_gqa is False:
        memo = (pack_gqa, ratio, heads, batch, max_q, max(num_splits, 1), device.index)
        sp = plan.shapes.get(memo)
        if sp is None:
            if len(plan.shapes) >= _MAX_SHAPES:
                plan.shapes.clear()
            sp = plan.shapes[memo] = _shape_plan(key, plan, pack_gqa, ratio, heads, batch, max_q, num_splits, device)
    else:  # not a valid value: choose_pack raises, naming it
        sp = _shape_plan(key, plan, pack_gqa, ratio, heads, batch, max_q, num_splits, device)
    splits = resolve_num_splits(num_splits, needs_grad=sp.key.needs_grad, batch=batch, ctas=sp.ctas,
                                n_blocks=-(-max_k // sp.tile_n), dv=sp.key.head_dim_v, device=device,
                                paged=sp.key.paged, caps=caps)
    if splits > 1:
        split = sp.split
        if split is None:
            splan = get_plan(split_key(sp.key))
            split = sp.split = (splan, -(-max_q * sp.pack // splan.fwd_cfg.tile.tile_m))
        return split[0], sp.pack, splits, split[1]
    return sp.plan, sp.pack, splits, sp.num_m_blocks


__all__ = ["FwdMeta", "Plan", "PlanKey", "backward_key", "choose_pack", "clear", "decode_key", "forward_meta", "get_plan", "launch_plan", "packed_dropout",
           "paged_eligible_for_tma", "sparse_bwd_key", "split_key", "tma_views_ok"]
