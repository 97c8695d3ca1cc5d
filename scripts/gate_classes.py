"""The configuration classes the dispatcher can select, for the compile gate.

A class is (kernel, tile, dtype, head_dim, head_dim_v, mode): the kernel file that runs, its tile, and the mode that
changes its code beyond feature flags (split-KV, paged, block-sparse, dropout with its packed-row and high-p
variants for the forward; dropout and block sparsity for the backward).  Feature flags (window, softcap, sink,
varlen, seqused, seed tensor) add code inside a class; the gate builds each class at the lightest and the heaviest
flag set the dispatcher produced for it (``class_worklist``).  Score/mask mods are not classes here: a user's mods
compile at their first call, and the library mods are gated by gate_lists.mods_worklist.

``dispatcher_configs`` walks the dispatcher itself (plan.get_plan, the memoised selection every call goes
through) over dtypes, head-dim pairs, modes and every subset of the flags, so a class reachable only through an
intermediate flag set is found.  ``KERNEL_FILES`` maps each kernel kind to the files whose change makes CI rebuild
its classes (compile_gate --ci).
"""

from __future__ import annotations

import functools
import itertools

# kind -> its own kernel files under torch-ext/flash_attn_4_sm120/kernels/; a changed file listed under no kind
# (fwd_base.py, softmax.py, ...) is shared: every class is rebuilt
KERNEL_FILES = {
    "fwd_tma": ("fwd_tma.py",),
    "fwd_cpasync": ("fwd_cpasync.py",),
    "fwd_decode": ("fwd_decode.py", "fwd_cpasync.py"),
    "dkdv": ("bwd_dkdv.py", "dq_relay.py", "bwd_dkdv_vregs.py"),  # the d256 V-in-registers tile is a dkdv config
    "dkdv_kvrows": ("bwd_dkdv_kvrows.py", "bwd_dkdv.py", "dq_relay.py"),
    "dq": ("bwd_dq.py",),
    "dq_convert": ("bwd_dq_convert.py",),
    "combine": ("combine.py",),
    "bwd_pre": ("bwd_preprocess.py",),
}
# kernel files that every kind reads: a change of one rebuilds every class (gate_ci.kinds_to_rebuild).  Every file under
# kernels/ is a kind's (KERNEL_FILES), shared (here) or outside the full runs (gate_ci.FULL_RUN_EXCLUDED):
# tests/test_gate_classes.py fails on a new kernel file listed nowhere, which would otherwise count as shared and make
# compile_gate --refresh rebuild every kind (it did once, with a new backward kernel file, and ran out of time)
SHARED_KERNEL_FILES = ("__init__.py", "block_info.py", "block_sparse.py", "cute_utils.py", "fwd_base.py",
                       "kernel_state.py", "kv_source.py", "mods.py", "philox.py", "rows.py", "score.py",
                       "score_dropout.py", "score_mask.py", "seqlen_info.py", "softmax.py")
_FLAGS = ("windowed", "has_softcap", "has_sink", "varlen_q", "varlen_k", "seqused_q", "seqused_k",
          "dropout_seed_tensor", "sink_grad")


def kind(cfg) -> str:
    """The kernel kind of a configuration (the file that runs it; jit.kernel_class without importing CuTe-DSL)."""
    from flash_attn_4_sm120 import config, config_bwd, config_combine

    if isinstance(cfg, config_combine.CombineKernelConfig):
        return "combine"
    if isinstance(cfg, config_bwd.BwdPreKernelConfig):
        return "bwd_pre"
    if isinstance(cfg, config_bwd.DqConvertKernelConfig):
        return "dq_convert"
    if isinstance(cfg, config_bwd.DqKernelConfig):
        return "dq"
    if isinstance(cfg, config_bwd.BwdKernelConfig):
        return "dkdv_kvrows" if cfg.kv_rows else "dkdv"
    if isinstance(cfg, config.FwdKernelConfig):
        return "fwd_tma" if cfg.tile.tma else ("fwd_decode" if cfg.tile.kv_groups > 1 else "fwd_cpasync")
    raise ValueError(f"unknown configuration type {type(cfg).__name__}")


def class_key(cfg) -> tuple | None:
    """(kernel, tile, dtype, d, dv, mode) of an attention configuration; None for the combine and preprocess
    kernels (no tile, no head-dim pair) and for configurations with score/mask mods."""
    k = kind(cfg)
    if k in ("combine", "bwd_pre", "dq_convert") or getattr(cfg, "mods", None) is not None:
        return None
    if k.startswith("fwd"):
        mode = tuple(n for n, on in (("split", cfg.split_kv), ("paged", cfg.paged), ("sparse", cfg.block_sparse),
                                     ("dropout", cfg.has_dropout), ("dpack", cfg.dropout_packed),
                                     ("dhi", cfg.dropout_high_p)) if on)
        tile = cfg.tile.name()
    else:
        mode = tuple(n for n, on in (("dropout", cfg.has_dropout), ("sparse", cfg.block_sparse),
                                     ("fused", getattr(cfg, "fused_dq", False)),
                                     ("relay", getattr(cfg, "dq_relay", False))) if on)
        tile = (f"{cfg.tile_m}x{cfg.tile_n}w{cfg.num_warps}r{cfg.kv_warp_rows}s{getattr(cfg, 'kv_stages', 1)}"
                f"{'kw' if getattr(cfg, 'split_kv_wait', False) else ''}")
    return (k, tile, cfg.dtype, cfg.head_dim, cfg.head_dim_v, mode)


def _weight(cfg) -> int:
    return sum(bool(getattr(cfg, f, False)) for f in _FLAGS) + getattr(cfg, "sparse_q_ratio", 0)


def dispatcher_configs(tma: bool, pdl: bool, red_f32x2: bool = True):
    """Every attention configuration the dispatcher's plans produce on a device with (``tma``, ``pdl``): dtypes x
    head-dim pairs x modes x every subset of the flags in the plan key (window, softcap, sink, varlen q/k, seqused
    q/k), with and without grad, and the fused backward dispatch_bwd runs instead of the dK/dV + dQ pair (where the
    device has vector reductions), in both its forms (the default and ``deterministic=True``'s relay).  Yields FwdKernelConfig / BwdKernelConfig / DqKernelConfig."""
    from dataclasses import replace

    from flash_attn_4_sm120 import block_sparse as BS, compat, config, config_bwd, config_decode, plan as P

    for dtype in config.DTYPES:
        for d, dv in config.supported_head_dim_pairs():
            sparse_tiles = {w: config.reachable_sparse_tiles(d, dv, w, tma) for w in (False, True)}
            for flags in itertools.product((False, True), repeat=7):
                w = flags[0]
                args = (dtype, d, dv, *flags)
                modes = [dict(), dict(paged=True), dict(dropout=True), dict(dropout=True, dropout_packed=True),
                         dict(dropout=True, dropout_high_p=True), dict(dropout=True, dropout_packed=True,
                                                                       dropout_high_p=True)]
                if config.paged_tma_tile(d, dv, w, tma=tma) is not None:
                    modes.append(dict(paged=True, paged_tma=True))
                if pdl:
                    modes += [dict(split=True), dict(paged=True, split=True)]
                for rows in (16, 32, 64):
                    tile = config_decode.decode_tile(d, dv, rows)
                    if tile is not None:
                        modes += [dict(decode=tile.tile_m, paged=p, split=s) for p in (False, True)
                                  for s in ((False, True) if pdl else (False,))]
                for t in sparse_tiles[w]:  # the block sizes that select each tile, one and two tiles a side
                    for r in (1, 2):
                        block = (t.tile_m * r, t.tile_n * r)
                        modes.append(dict(sparse=(*BS.block_size_ratios(block, d, dv, w, tma), *block)))
                for mode in modes:
                    grads = [False]
                    if not any(mode.get(m) for m in ("paged", "split", "decode")):
                        grads.append(True)
                    for needs_grad in grads:
                        kw = dict(mode)
                        if needs_grad and "sparse" in kw:
                            kw["sparse_bwd"] = (kw["sparse"][0],) * 4
                        key = P.PlanKey(*args, needs_grad, 0, tma=tma, **kw)
                        if compat.plan_key_conflicts(key):  # a pair the call refuses first (compat.check_call)
                            continue
                        try:
                            plan = P.get_plan(key)
                        except ValueError:  # a feature x limit the planner refuses (it raises for the call too)
                            continue
                        cfg = plan.fwd_cfg
                        if cfg.has_dropout:
                            yield replace(cfg, dropout_seed_tensor=True)
                        yield cfg
                        if plan.bwd_cfg is not None:
                            yield plan.bwd_cfg
                            yield plan.dq_cfg
                            for relay in ((False, True) if red_f32x2 else ()):
                                fused = config_bwd.fused_for(plan.bwd_cfg, relay)
                                if fused is not None:
                                    yield fused[0]
                                    if fused[0].has_dropout:
                                        yield replace(fused[0], dropout_seed_tensor=True)
                            if plan.bwd_cfg.has_dropout:
                                yield replace(plan.bwd_cfg, dropout_seed_tensor=True)
                                yield replace(plan.dq_cfg, dropout_seed_tensor=True)


def selectable_classes(tma: bool, pdl: bool, red_f32x2: bool = True) -> set[tuple]:
    return {k for k in map(class_key, dispatcher_configs(tma, pdl, red_f32x2)) if k is not None}


@functools.lru_cache(maxsize=None)
def class_worklist(tma: bool, pdl: bool, red_f32x2: bool = True) -> tuple:
    """Per selectable class, the lightest and the heaviest configuration the dispatcher produced for it (by the
    number of feature flags on, block ratios included), in a deterministic order (memoised: the targets without
    TMA share one walk)."""
    light: dict[tuple, object] = {}
    heavy: dict[tuple, object] = {}
    for cfg in dispatcher_configs(tma, pdl, red_f32x2):
        key = class_key(cfg)
        if key is None:
            continue
        wt = _weight(cfg)
        if key not in light or wt < _weight(light[key]) or (wt == _weight(light[key]) and cfg.name() < light[key].name()):
            light[key] = cfg
        if key not in heavy or wt > _weight(heavy[key]) or (wt == _weight(heavy[key]) and cfg.name() < heavy[key].name()):
            heavy[key] = cfg
    out, seen = [], set()
    for key in sorted(light, key=repr):
        for cfg in (light[key], heavy[key]):
            if cfg.name() not in seen:
                seen.add(cfg.name())
                out.append(cfg)
    return tuple(out)
