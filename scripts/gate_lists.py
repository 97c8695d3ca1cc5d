"""The compile gate's hand-made worklists: per tile, head-dim pair or kernel, the feature sets the gate builds
(scripts/compile_gate.py; the class sweep beside them is scripts/gate_classes.py).

They used to live in the runtime modules (config, config_bwd, config_decode, config_combine, modspec); only the
gate and the tests read them, so they live here, and no module of the bundle imports this one
(tests/test_gate_lists.py checks both).  ``hand_worklist`` is what ``compile_gate --no-classes`` builds before the
per-target filtering (compile_gate._worklist).  Nothing here imports CuTe-DSL: the gate's main process builds the
lists before its workers fork.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

if "flash_attn_4_sm120" not in sys.modules:  # the sources under torch-ext/, as the gate checks them
    from scripts.compile_gate import _package

    _package()

from flash_attn_4_sm120 import config, config_bwd, modspec  # noqa: E402
from flash_attn_4_sm120.config import (  # noqa: E402
    DTYPES,
    HEAD_DIMS,
    FwdKernelConfig,
    FwdTile,
    dropout_fwd_tile,
    paged_tma_tile,
    reachable_sparse_tiles,
    select_fwd_tile,
    split_tile,
    supported_head_dim_pairs,
)
from flash_attn_4_sm120.config_bwd import (  # noqa: E402
    BwdKernelConfig,
    BwdPreKernelConfig,
    DqKernelConfig,
    dq_convert_config,
    select_bwd_config,
    select_dq_config,
    select_fused_config,
)
from flash_attn_4_sm120.config_combine import COMBINE_SPLIT_GROUPS, CombineKernelConfig  # noqa: E402
from flash_attn_4_sm120.config_decode import decode_tiles  # noqa: E402


def hand_worklist() -> list:
    """Every hand-made list, in the gate's order (duplicates kept: compile_gate._worklist drops them)."""
    items = []
    for dtype, d, dv, tile in all_fwd_tile_configs():
        items += gate_configs(dtype, d, dv, tile)
    items += paged_gate_worklist()
    items += sparse_gate_worklist()
    items += decode_gate_worklist()
    items += sparse_bwd_gate_worklist()
    for dtype in DTYPES:
        for d, dv in supported_head_dim_pairs():
            items += bwd_gate_configs(dtype, d, dv)
    items += dropout_gate_worklist()
    items += fused_gate_worklist()
    items += fused_trial_worklist()
    items += combine_gate_configs()
    items += bwd_pre_gate_configs()
    items += mods_worklist()
    return items


# ---- forward ---------------------------------------------------------------------------------------------------
def all_fwd_tile_configs(tma: bool = True) -> list[tuple[str, int, int, FwdTile]]:
    """Every (dtype, head_dim, head_dim_v, tile) the dispatcher can select — the compile gate's worklist
    (``tma``: on a device with TMA or without)."""
    out = []
    for dtype in DTYPES:
        for d, dv in supported_head_dim_pairs():
            for windowed in (False, True):
                tile = select_fwd_tile(d, dv, windowed, tma=tma)
                item = (dtype, d, dv, tile)
                if item not in out:
                    out.append(item)
    return out


def gate_configs(dtype: str, d: int, dv: int, tile: FwdTile) -> list[FwdKernelConfig]:
    """Feature variants the compile gate builds per tile: the lightest and the heaviest in registers/code, and the
    heaviest split-KV variant (dropout variants: ``dropout_gate_configs``).  Feature flags only add code on boundary
    tiles, the epilogue or the prologue; the heaviest variant bounds register pressure from above."""
    base = FwdKernelConfig(dtype, d, dv, tile)
    heavy = replace(
        base, windowed=True, has_softcap=True, has_sink=True, varlen_q=True, varlen_k=True, seqused_q=True,
        seqused_k=True,
    )
    # split-KV changes the epilogue (fp32 partials from the accumulators, the sink in split 0) and the block plan;
    # bf16 only (fp16 differs in the mma type alone, and bf16 is the one nearer the register limit)
    out = [base, heavy]
    if dtype == "bf16":
        out.append(replace(heavy, split_kv=True, tile=split_tile(tile)))
    return out


def dropout_gate_configs(dtype: str, d: int, dv: int, tile: FwdTile) -> list[FwdKernelConfig]:
    """The dropout variants the compile gate builds for a forward tile: the lightest and the heaviest feature set
    with dropout (Philox work on every tile), on the tile ``dropout_fwd_tile`` gives."""
    base, heavy = gate_configs(dtype, d, dv, tile)[:2]
    dtile = dropout_fwd_tile(d, dv, tile)
    return [replace(base, tile=dtile, has_dropout=True),
            replace(heavy, tile=dtile, has_dropout=True, dropout_seed_tensor=True)]


def dropout_packed_gate_config(dtype: str, d: int, dv: int, tile: FwdTile) -> FwdKernelConfig:
    """The heaviest dropout set with packed GQA rows (the row-by-row keep bits) on a forward tile."""
    return replace(dropout_gate_configs(dtype, d, dv, tile)[1], dropout_packed=True)


def paged_gate_configs(dtype: str, d: int, dv: int) -> list[FwdKernelConfig]:
    """Paged-KV variants the compile gate builds per head-dim pair: for each distinct paged tile (cp.async), the
    lightest (paged only) and the heaviest feature set (paged with every flag it combines with; ``varlen_k`` is
    excluded, a page table replaces cu_seqlens_k), and the heaviest split-KV one; for each distinct TMA-paged
    tile (``paged_tma_tile``), the lightest and the heaviest (never split: split and decode calls keep the
    cp.async tiles)."""
    out = []
    for windowed in (False, True):
        tile = select_fwd_tile(d, dv, windowed, paged=True)
        base = FwdKernelConfig(dtype, d, dv, tile, paged=True)
        heavy = replace(base, windowed=True, has_softcap=True, has_sink=True, varlen_q=True, seqused_q=True,
                        seqused_k=True)
        out += [c for c in (base, heavy, replace(heavy, split_kv=True, tile=split_tile(tile))) if c not in out]
    for windowed in (False, True):
        tile = paged_tma_tile(d, dv, windowed)
        if tile is not None:
            base = FwdKernelConfig(dtype, d, dv, tile, paged=True)
            heavy = replace(base, windowed=True, has_softcap=True, has_sink=True, varlen_q=True, seqused_q=True,
                            seqused_k=True)
            out += [c for c in (base, heavy) if c not in out]
    return out


def sparse_gate_worklist() -> list[FwdKernelConfig]:
    """The block-sparse configurations the compile gate builds: bf16, per distinct sparse tile a block size can
    select (TMA or cp.async), at the largest head_dim_v that runs it (dv == d but for the d192 TMA tile with Q in
    registers, which serves dv < 192), the lightest (1x1 blocks, no other flag) and the heaviest (2x2 blocks with
    every flag sparsity combines with)."""
    out = []
    seen = set()
    for d, dv in sorted(supported_head_dim_pairs(), key=lambda p: (p[0], -p[1])):
        for windowed in (False, True):
            for tile in reachable_sparse_tiles(d, dv, windowed):
                if (d, tile) in seen:
                    continue
                seen.add((d, tile))
                base = FwdKernelConfig("bf16", d, dv, tile, sparse_q_ratio=1, sparse_kv_ratio=1)
                heavy = replace(base, windowed=True, has_softcap=True, has_sink=True, varlen_q=True, varlen_k=True,
                                seqused_q=True, seqused_k=True, sparse_q_ratio=2, sparse_kv_ratio=2)
                out += [base, heavy]
    return out


def paged_gate_worklist() -> list[FwdKernelConfig]:
    """The paged configurations the compile gate builds: bf16 (fp16 differs only in the mma type), head-dim pairs
    with dv == d (the most registers and shared memory of each tile), lightest and heaviest feature set."""
    out = []
    for d, dv in supported_head_dim_pairs():
        if d == dv:
            out += paged_gate_configs("bf16", d, dv)
    return out


# ---- decode and combine ----------------------------------------------------------------------------------------
def decode_gate_worklist() -> list[FwdKernelConfig]:
    """The decode tiles' configurations the compile gate builds: bf16, dv == d at the largest head dim of each
    decode tile (and d=192, the other user of the 64x32 one): contiguous and paged, the lightest feature set and
    the heaviest with and without split-KV."""
    out = []
    for d in (128, 192, 256):
        for tile in decode_tiles(d, d):
            base = FwdKernelConfig("bf16", d, d, tile, seqused_k=True)
            heavy = replace(base, windowed=True, has_softcap=True, has_sink=True, varlen_q=True, varlen_k=True,
                            seqused_q=True)
            out += [base, heavy, replace(heavy, varlen_k=False, split_kv=True), replace(base, paged=True),
                    replace(heavy, varlen_k=False, paged=True, split_kv=True)]
    return out


def combine_gate_configs() -> list[CombineKernelConfig]:
    """Combine variants the compile gate builds: fp32 partials (what the split forward writes) into each output
    dtype, at the head dims of the forward (lightest: no LSE; heaviest: largest head dim with LSE)."""
    items = [CombineKernelConfig("fp32", "bf16", d, True) for d in HEAD_DIMS]
    items += [CombineKernelConfig("fp32", "fp32", 128, False), CombineKernelConfig("fp32", "fp16", 256, True),
              CombineKernelConfig("bf16", "bf16", 128, True)]
    items += [CombineKernelConfig("fp32", "bf16", d, True, COMBINE_SPLIT_GROUPS) for d in (64, 128, 256)]
    items += [CombineKernelConfig("fp32", "fp32", 32, False, COMBINE_SPLIT_GROUPS)]
    # a head dim of few 16-byte vectors (2 threads per row): the LSE walk that does not fit registers
    items += [CombineKernelConfig("fp32", "bf16", 40, True)]
    return items


# ---- backward --------------------------------------------------------------------------------------------------
_BWD_HEAVY = dict(windowed=True, has_softcap=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)


def bwd_gate_configs(dtype: str, d: int, dv: int) -> list[BwdKernelConfig]:
    """Backward variants the compile gate builds per head-dim pair: lightest and heaviest feature set of the dK/dV
    kernel and of the dQ kernel (dropout variants: ``dropout_gate_worklist``)."""
    out = []
    for cfg in (select_bwd_config(dtype, d, dv), select_dq_config(dtype, d, dv)):
        heavy = dict(_BWD_HEAVY, sink_grad=True) if isinstance(cfg, DqKernelConfig) else _BWD_HEAVY
        out += [cfg, replace(cfg, **heavy)]
    return out


def dropout_gate_worklist() -> list:
    """The dropout configurations the compile gate builds: per tile of every kernel (forward TMA and cp.async on the
    tile ``dropout_fwd_tile`` gives, dK/dV, dQ), the lightest dropout set (``has_dropout`` alone) and the heaviest
    (every feature, seed tensor) in bf16 at the head-dim pair of that tile with the largest (d, dv); the heaviest
    also at the largest d with the smallest dv (d256/dv32 was the dQ kernel's register peak, not d256/dv256), in
    fp16 at the largest pair (fp16 differs in the mma type only), and (forward) with packed GQA rows and with the
    complement keep test of p > 0.96875 (``dropout_high_p``).  Dropout adds the same Philox code to every
    pair of a tile, so the pairs between these add nothing the gate would not see."""
    groups: dict[tuple, list] = {}
    for dtype, d, dv, tile in all_fwd_tile_configs():
        if dtype == "bf16":
            groups.setdefault(("fwd", dropout_fwd_tile(d, dv, tile)), []).append((d, dv, tile))
    for d, dv in supported_head_dim_pairs():
        for sel in (select_bwd_config, select_dq_config):
            c = sel("bf16", d, dv, has_dropout=True)  # the tile a dropout call runs
            groups.setdefault((sel.__name__, c.tile_m, c.tile_n, c.num_warps, c.kv_warp_rows, c.kv_rows,
                               getattr(c, "kv_stages", 1)), []).append((d, dv, None))
    out = []
    for key, pairs in groups.items():
        big = max(pairs, key=lambda x: (x[0], x[1]))
        thin = min((x for x in pairs if x[0] == big[0]), key=lambda x: x[1])
        picks = [("bf16", big, False), ("bf16", big, True), ("fp16", big, True)]
        if key[0] == "fwd":
            picks += [("bf16", big, "packed"), ("bf16", big, "high_p")]
        if thin != big:
            picks.append(("bf16", thin, True))
        for dtype, (d, dv, tile), heavy in picks:
            if key[0] == "fwd" and heavy == "packed":
                out.append(dropout_packed_gate_config(dtype, d, dv, tile))
            elif key[0] == "fwd" and heavy == "high_p":  # the complement keep test (p > 0.96875)
                out.append(replace(dropout_gate_configs(dtype, d, dv, tile)[1], dropout_high_p=True))
            elif key[0] == "fwd":
                light, hv = dropout_gate_configs(dtype, d, dv, tile)
                out.append(hv if heavy else light)
            else:
                sel = select_bwd_config if key[0] == "select_bwd_config" else select_dq_config
                flags = dict(_BWD_HEAVY, dropout_seed_tensor=True) if heavy else {}
                if heavy and sel is select_dq_config:
                    flags["sink_grad"] = True
                cfg = sel(dtype, d, dv, has_dropout=True, **flags)
                out.append(cfg)
                if heavy and cfg.kv_rows != key[5]:  # the tile refuses softcap with dropout (_BWD_SPILLING)
                    out.append(sel(dtype, d, dv, has_dropout=True, **dict(flags, has_softcap=False)))
                if heavy and key[5] and dtype == "bf16":
                    # the causal training call (window, int seed): on the key-row tile an intermediate set, which
                    # spilled where the heavier ones did not
                    win = sel(dtype, d, dv, has_dropout=True, windowed=True)
                    if win.kv_rows:
                        out.append(win)
    return out


def sparse_bwd_gate_worklist() -> list[BwdKernelConfig]:
    """The block-sparse backward configurations the compile gate builds: bf16, dv == d, per distinct dK/dV and dQ
    tile at the largest head dim that runs it (the most registers), the lightest (1x1 blocks, no other flag) and
    the heaviest (2x2 blocks, windowed, so the mask / full branch is compiled, with every flag sparsity combines
    with)."""
    heavy = dict(windowed=True, has_softcap=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True,
                 sparse_q_ratio=2, sparse_kv_ratio=2)
    out, seen = [], set()
    for d, dv in sorted(supported_head_dim_pairs(), reverse=True):
        if d != dv:
            continue
        for select in (select_bwd_config, select_dq_config):
            base = select("bf16", d, dv, sparse_q_ratio=1, sparse_kv_ratio=1)  # the tile a sparse call runs
            tile = (type(base), base.tile_m, base.tile_n, base.num_warps, getattr(base, "kv_stages", 1),
                    base.kv_warp_rows, base.kv_rows)
            if tile in seen:
                continue
            seen.add(tile)
            sink = {"sink_grad": True} if select is select_dq_config else {}
            out += [base, select("bf16", d, dv, **heavy, **sink)]
    return out


def fused_gate_worklist() -> list:
    """The fused backward configurations the compile gate builds, with their convert kernels: per fused tile and
    walk, at the largest head-dim pair that tile serves and at the smallest dv beside its largest d, in bf16 the
    lightest set, the heaviest (every flag of the walk), dropout alone and with the heaviest set and a seed tensor;
    fp16 at the heaviest; each of them also in its relay form (``dq_relay``, what ``deterministic=True`` runs; its
    convert kernel is the same).  (Every intermediate class the dispatcher selects is in the class sweep,
    scripts/gate_classes.py.)"""
    groups: dict[tuple, list] = {}
    for d, dv in sorted(supported_head_dim_pairs()):
        for windowed in (False, True):
            cfg = select_fused_config("bf16", d, dv, windowed=windowed)
            if cfg is not None:
                groups.setdefault((cfg.tile_m, cfg.tile_n, cfg.num_warps, windowed), []).append((d, dv))
    out = []
    for (_, _, _, windowed), pairs in groups.items():
        big = max(pairs)
        thin = min((p for p in pairs if p[0] == big[0]), key=lambda p: p[1])
        heavy = dict(_BWD_HEAVY, windowed=windowed)
        for d, dv in sorted({big, thin}):
            for dtype, flags in (("bf16", dict(windowed=windowed)), ("bf16", heavy),
                                 ("bf16", dict(windowed=windowed, has_dropout=True)),
                                 ("bf16", dict(heavy, has_dropout=True, dropout_seed_tensor=True)), ("fp16", heavy)):
                cfg = select_fused_config(dtype, d, dv, **flags)
                if cfg is not None:
                    out += [cfg, dq_convert_config(cfg)] + _relay_of(cfg)
    return out


def fused_trial_worklist() -> list:
    """The fused tiles built but not selected by default (config_bwd._FUSED_TRIAL_TILES) and the V-in-registers tile
    (the d256 default), with their convert kernels (and relay forms where one serves, ``_relay_of``): per trial head dim, at its largest pair and its smallest dv
    the tile takes, causal (windowed) and not, in bf16 the lightest set, the heaviest (every flag of the walk),
    dropout alone and with the heaviest set and a seed tensor; fp16 at the lightest and the heaviest; at the largest
    pair the causal, document and relative-bias mods with the heaviest set they combine with."""
    out = []
    # the trial tiles' head dims, and those whose default tile is a V-in-registers one (its feature sets live here)
    vregs_dims = {d for d, entries in config_bwd._FUSED_TILES.items() if any(len(t) > 4 for t, _ in entries)}
    for dmax in sorted(set(config_bwd._FUSED_TRIAL_TILES) | vregs_dims):
        pairs = [p for p in supported_head_dim_pairs() if max(p) == dmax
                 and select_fused_config("bf16", *p, trial=True) is not None]
        if not pairs:
            continue
        big = max(pairs)
        thin = min((p for p in pairs if p[0] == big[0]), key=lambda p: p[1])
        for d, dv in sorted({big, thin}, reverse=True):
            for windowed in (False, True):
                heavy = dict(_BWD_HEAVY, windowed=windowed)
                for dtype, flags in (("bf16", dict(windowed=windowed)), ("bf16", heavy),
                                     ("bf16", dict(windowed=windowed, has_dropout=True)),
                                     ("bf16", dict(heavy, has_dropout=True, dropout_seed_tensor=True)),
                                     ("fp16", dict(windowed=windowed)), ("fp16", heavy)):
                    cfg = select_fused_config(dtype, d, dv, trial=True, **flags)
                    if cfg is not None and type(cfg) is not BwdKernelConfig:
                        out += [cfg, dq_convert_config(cfg)] + _relay_of(cfg)
        # the library's mask mods and its heaviest score mod, with every flag mods combine with (mods x dropout is
        # refused at d256), windowed and not
        heavy = {k: v for k, v in _BWD_HEAVY.items() if k != "has_softcap"}
        for factory, args, aux_sig, score in (_GATE_MODS[0], _GATE_MODS[2], _GATE_MODS[5]):
            full = modspec.recipe_placeholder(factory, args, aux_sig, score)
            for windowed in (True, False):
                cfg = select_fused_config("bf16", *big, trial=True, mods=full, **dict(heavy, windowed=windowed))
                if cfg is not None and type(cfg) is not BwdKernelConfig:
                    out += [cfg] + _relay_of(cfg)
    return out


def _relay_of(fused) -> list:
    """The relay form of a fused configuration, where the dispatcher can select it (config_bwd.fused_for: not on a
    tile whose relay form spills with the call's features, nor at a head dim where the pair runs it: relay_serves)."""
    relay = replace(fused, dq_relay=True)
    return [relay] if config_bwd.relay_serves(relay) else []


def bwd_pre_gate_configs() -> list[BwdPreKernelConfig]:
    """Preprocess variants the compile gate builds: the lightest (one vector per row, no dLSE), the largest head
    dim of the package with dLSE in both dtypes, and one head dim whose vectors do not fill a power of two."""
    return [BwdPreKernelConfig("bf16", 8, False), BwdPreKernelConfig("bf16", 128, False),
            BwdPreKernelConfig("bf16", 96, True), BwdPreKernelConfig("bf16", max(HEAD_DIMS), True),
            BwdPreKernelConfig("fp16", max(HEAD_DIMS), True)]


# ---- score / mask mods (the library's) -------------------------------------------------------------------------
# (factory, args, aux signature, has a score_mod) of each library mod the gate builds
_GATE_MODS = (
    ("causal", (), (), False),
    ("sliding_window", (128, 0), (), False),
    ("document", (True,), (("i32", 1),), False),
    ("prefix_lm", (None,), (("i32", 1),), False),
    ("alibi", (), (("fp32", 1),), True),
    ("relative_bias", (64,), (("fp32", 2),), True),
)


def mods_worklist() -> list:
    """The mod configurations the compile gate builds (bf16): every library mod's forward on the heaviest tile
    (d = 256, cp.async, with every flag mods combine with; relative bias also at d256/dv32, whose 64x32 fallback
    tile differs) and its backward (dK/dV and dQ) at d = 128; the score
    mods (whose backward also keeps the raw scores) forward on the lightest tile too (d = 64 TMA) and backward at
    d = 256; then the mods x dropout set (``mods_dropout_worklist``)."""
    out = []
    heavy = dict(windowed=True, has_sink=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)
    bwd_heavy = {k: v for k, v in heavy.items() if k != "has_sink"}
    for factory, args, aux_sig, score in _GATE_MODS:
        fwd = modspec.recipe_placeholder(factory, args, aux_sig, False)
        full = modspec.recipe_placeholder(factory, args, aux_sig, score)
        tile = config.mods_tile(config.select_fwd_tile(256, 256, True), 256, 256)
        out.append(replace(config.FwdKernelConfig("bf16", 256, 256, tile, mods=fwd), **heavy))
        if factory == "relative_bias":  # the 64x32 fallback where 64x16 does not fit the V copy (dv = 32)
            tile32 = config.mods_tile(config.select_fwd_tile(256, 32, True), 256, 32)
            out.append(replace(config.FwdKernelConfig("bf16", 256, 32, tile32, mods=fwd), **heavy))
        if score:
            out.append(config.FwdKernelConfig("bf16", 64, 64, config.select_fwd_tile(64, 64, False), mods=fwd))
        for d in ((128, 256) if score else (128,)):
            out.append(config_bwd.select_bwd_config("bf16", d, d, mods=full, **bwd_heavy))
            out.append(config_bwd.select_dq_config("bf16", d, d, mods=full, **bwd_heavy, sink_grad=True))
        out += _key_row_heaviest(full, bwd_heavy, {})
        # config_bwd._FUSED_TILES: every head dim with a fused tile, windowed and not (d64 and d96 plain walks were
        # missing: the d64 4 x 2 dK/dV grid spilled 6 STL/LDL there with the relative-bias mod, unbuilt by any gate;
        # benchmarks/results/gate_qgrid_s37.jsonl on branch h-qgrid)
        for d, windowed in ((64, False), (64, True), (96, False), (96, True), (128, False), (128, True)):
            fused = config_bwd.select_fused_config("bf16", d, d, mods=full, **dict(bwd_heavy, windowed=windowed))
            if fused is not None:
                out += [fused] + _relay_of(fused)  # and its relay form (deterministic=True)
    # mods with block sparsity (the mask_mod on "mask" blocks only): a mask mod without aux tensors (causal: the
    # key-row dK/dV kernel puts it behind a branch on the block kind, Mask.gate_branch), the heaviest
    # aux-reading mask mod and score mod on the sparse forward tiles (cp.async at d = 256, TMA and cp.async at 192, TMA at 128 and 64) and both
    # sparse backward kernels at the widest head dim, 2x2 blocks
    sparse = dict(sparse_q_ratio=2, sparse_kv_ratio=2)
    for factory, args, aux_sig, score in (_GATE_MODS[0], _GATE_MODS[2], _GATE_MODS[5]):
        fwd = modspec.recipe_placeholder(factory, args, aux_sig, False)
        full = modspec.recipe_placeholder(factory, args, aux_sig, score)
        for d in (256, 192, 128, 64):
            for t in config.reachable_sparse_tiles(d, d, True):  # d192: the TMA tile and the cp.async 128x32 one
                tile = config.mods_tile(config.select_sparse_tile(d, d, True, mods=True,
                                                                  block_size=(t.tile_m, t.tile_n)), d, d)
                out.append(replace(config.FwdKernelConfig("bf16", d, d, tile, mods=fwd, **sparse), **heavy))
        for d in (256, 192):  # the widest head dim whose dK/dV tile takes the pair (config_bwd._BWD_SPILLING)
            try:
                out.append(config_bwd.select_bwd_config("bf16", d, d, mods=full, **bwd_heavy, **sparse))
                break
            except ValueError:
                continue
        out.append(config_bwd.select_dq_config("bf16", 256, 256, mods=full, **bwd_heavy, **sparse, sink_grad=True))
        out.append(config_bwd.select_bwd_config("bf16", 128, 128, mods=full, **bwd_heavy, **sparse))  # 32x128 tile
        out += _key_row_heaviest(full, bwd_heavy, sparse)
    return out + mods_key_row_subset_worklist() + mods_dropout_worklist()


def mods_key_row_subset_worklist() -> list:
    """The key-row dK/dV tile at d = 128 (bf16) with dropout (seed tensor) and with the document mask mod (sparse
    or not), over every subset of (window, varlen q, varlen k, seqused q, seqused k) that the tile takes: on this
    tile an intermediate feature set spilled where the heaviest did not (config_bwd._BWD_SPILLING)."""
    doc = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
    names = ("windowed", "varlen_q", "varlen_k", "seqused_q", "seqused_k")
    out = []
    for bits in itertools.product((False, True), repeat=len(names)):
        flags = dict(zip(names, bits))
        for extra in (dict(has_dropout=True, dropout_seed_tensor=True), dict(mods=doc),
                      dict(mods=doc, sparse_q_ratio=1, sparse_kv_ratio=1)):
            cfg = config_bwd.select_bwd_config("bf16", 128, 128, **flags, **extra)
            if cfg.kv_rows:
                out.append(cfg)
    return out


def _key_row_heaviest(full, bwd_heavy: dict, extra: dict) -> list:
    """The heaviest feature sets of the key-row dK/dV tiles (d = 128: 32x128; d = 96: 64x128) with the mod
    ``full``: at d = 96 the call with every flag (``bwd_heavy``), and at both the same flags without the window
    where the call with every flag runs another tile (config_bwd._BWD_SPILLING: at d = 128 a windowed call with an
    aux-reading mod does; at d = 96 every call with one does, so there is nothing to add)."""
    out = []
    for d in (128, 96):
        heaviest = config_bwd.select_bwd_config("bf16", d, d, mods=full, **bwd_heavy, **extra)
        if heaviest.kv_rows:
            if d != 128:  # d128's is in the worklist already
                out.append(heaviest)
            continue
        lighter = config_bwd.select_bwd_config("bf16", d, d, mods=full, **dict(bwd_heavy, windowed=False), **extra)
        if lighter.kv_rows:
            out.append(lighter)
    return out


def mods_dropout_worklist() -> list:
    """The mods x dropout configurations the compile gate builds (bf16, every flag both combine with, seed from a
    tensor), on the tiles ``config.mods_dropout_fwd_tile`` gives: the heaviest library score mod (relative bias: a
    2-D aux table; its backward keeps the raw scores) forward at d = 64 and 128 (the TMA tile, unpacked and with
    packed GQA rows) and d = 192 (64x16 cp.async, and the 128x64 TMA tile at dv = 96), backward (dK/dV and dQ) at d = 64, 128,
    192; the heaviest mask mod (document: an aux lookup per element) forward at d = 192 and backward at d = 128.
    d = 256 refuses the pair (no forward tile without spills)."""
    heavy = dict(windowed=True, has_sink=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True,
                 has_dropout=True, dropout_seed_tensor=True)
    bwd_heavy = {k: v for k, v in heavy.items() if k != "has_sink"}
    score = ("relative_bias", (64,), (("fp32", 2),))
    mask = ("document", (True,), (("i32", 1),))
    out = []
    for (factory, args, aux_sig), fwd_pairs, packed, bwd_dims in (
            (score, ((64, 64), (128, 128), (192, 192), (192, 96)), ((64, 64), (192, 192)), (64, 128, 192)),
            (mask, ((192, 192),), (), (128,))):
        fwd = modspec.recipe_placeholder(factory, args, aux_sig, False)
        full = modspec.recipe_placeholder(factory, args, aux_sig, factory == score[0])
        for d, dv in fwd_pairs:
            cfg = replace(config.FwdKernelConfig("bf16", d, dv, config.mods_dropout_fwd_tile(d, dv), mods=fwd),
                          **heavy)
            out.append(cfg)
            if (d, dv) in packed:
                out.append(replace(cfg, dropout_packed=True))
        for d in bwd_dims:
            out.append(config_bwd.select_bwd_config("bf16", d, d, mods=full, **bwd_heavy))
            out.append(config_bwd.select_dq_config("bf16", d, d, mods=full, **bwd_heavy, sink_grad=True))
    return out
