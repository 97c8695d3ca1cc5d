"""A/B of the deterministic backward in one process (a tuning aid for issue 30 item 2, not the peer benchmark): the
default fused backward, the relay form (``deterministic=True``, kernels/dq_relay.py) as main had it and with each of
its switches, and the atomic-free dK/dV + dQ pair (what ``deterministic=True`` runs where the relay does not serve,
forced by hiding the fused kernel), on bench_bwd's cells.

    python benchmarks/experiments/probe_relay_bwd.py [--only mha-d64 ...] [--seqlens 1024 4096] [--rounds 3]
        [--variants default relay_main relay_new pair] [--causal both|0|1] [--group-kib N] [--min-pairs N]
        [--out F]

Relay variants (config_bwd switches; none is part of the compile key, so each variant's relay kernels are compiled
here and swapped into jit's memory cache, never taken from the disk cache or the prebuilt set; the other kernels
use both as usual, so a run after the GPU tests on the same machine compiles little besides the relay):
    relay_main      main's relay at 14e070b: the turn read right before the adds, the default's launch order
                    (DQ_RELAY_PREFETCH False, RELAY_GROUP_KIB 0), release "top"
    relay_after_s   relay_main with the release after the S mma (DQ_RELAY_RELEASE "after_s")
    relay_prefetch  the turn read early (before the dK mma), the default's launch order
    relay_order     the grouped launch order (RELAY_GROUP_KIB = --group-kib, RELAY_GROUP_MIN_PAIRS =
                    --min-pairs), the turn read at the adds
    relay_new       both (the committed defaults of config_bwd)
The relay runs at every fused tile here (config_bwd.RELAY_HEAD_DIMS widened to d64/d96/d128, as the tests'
wide_relay), so d96/d128 cells time it too.  Each round times every variant (CUDA-event medians after warm-up,
bench_fwd.time_fn) of the backward alone (torch.autograd.grad over one forward).  Checked first, per cell: each relay
variant gives bitwise-equal gradients on a second run, and agrees with the pair to fp32 rounding (the rows record the
largest difference).  Reported: ms and TFLOPS per variant (median over rounds), the ratios variant / default, and
relay_new / relay_main.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import EXTRA_CELLS, SEQLENS, SHAPES, TOKENS, append_jsonl, flops, time_fn  # noqa: E402

# variant -> (DQ_RELAY_RELEASE, DQ_RELAY_PREFETCH, grouped order); "default" and "pair" are not relay variants
RELAY_VARIANTS = {
    "relay_main": ("top", False, False),
    "relay_after_s": ("after_s", False, False),
    "relay_prefetch": ("top", True, False),
    "relay_order": ("top", False, True),
    "relay_new": ("top", True, True),
}
ALL_VARIANTS = ("default", *RELAY_VARIANTS, "pair")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(ALL_VARIANTS), choices=ALL_VARIANTS)
    ap.add_argument("--causal", choices=("both", "0", "1"), default="both")
    ap.add_argument("--group-kib", type=int, default=None, help="RELAY_GROUP_KIB of the grouped order "
                    "(default: config_bwd's)")
    ap.add_argument("--min-pairs", type=int, default=None, help="RELAY_GROUP_MIN_PAIRS of the grouped order "
                    "(default: config_bwd's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd, jit

    # the relay kernels depend on the switches, which their compile key does not hold: compiled here, never cached
    def is_relay(key) -> bool:
        return len(key) > 1 and getattr(key[1], "dq_relay", False)

    entry_path, prebuilt_load = jit.compile_cache.entry_path, jit.prebuilt.load
    jit.compile_cache.entry_path = lambda key: None if is_relay(key) else entry_path(key)
    jit.prebuilt.load = lambda key, cfg: None if is_relay(key) else prebuilt_load(key, cfg)
    variants = [v for v in ALL_VARIANTS if v in args.variants]
    for need in ("default", "pair"):  # the ratios' reference and the gradients' reference
        if need not in variants:
            variants.insert(0 if need == "default" else len(variants), need)
    saved = (config_bwd.DQ_RELAY_RELEASE, config_bwd.DQ_RELAY_PREFETCH, config_bwd.RELAY_GROUP_KIB,
             config_bwd.RELAY_GROUP_MIN_PAIRS, config_bwd.RELAY_HEAD_DIMS)
    if args.min_pairs is not None:  # every grouped variant's floor (restored with the rest at the end)
        config_bwd.RELAY_GROUP_MIN_PAIRS = args.min_pairs
    group_kib = args.group_kib if args.group_kib is not None else config_bwd.RELAY_GROUP_KIB
    config_bwd.RELAY_HEAD_DIMS = frozenset({64, 96, 128})
    memory = {}  # each switch setting's jit memory
    current = [None]
    real_fused_plan = dispatch_bwd.fused_plan

    def set_variant(variant: str):
        release, prefetch, grouped = RELAY_VARIANTS.get(variant, RELAY_VARIANTS["relay_main"])
        key = (release, prefetch, grouped)
        if variant in RELAY_VARIANTS and key != current[0]:
            # only the relay kernels depend on the switches: they are swapped, every other kernel is shared
            relay_keys = [k for k in jit._MEMORY if is_relay(k)]
            if current[0] is not None:
                memory[current[0]] = {k: jit._MEMORY[k] for k in relay_keys}
            for k in relay_keys:
                del jit._MEMORY[k]
            config_bwd.DQ_RELAY_RELEASE, config_bwd.DQ_RELAY_PREFETCH = release, prefetch
            config_bwd.RELAY_GROUP_KIB = group_kib if grouped else 0
            dispatch_bwd.clear_caches()  # the plans (and the fused kernels they hold) refill from this memory
            jit._MEMORY.update(memory.get(key, {}))
            current[0] = key
        dispatch_bwd.fused_plan = (lambda plan, device, relay=False: None) if variant == "pair" else real_fused_plan

    cells = [(name, hq, hkv, d, s, max(1, TOKENS // s)) for name, (hq, hkv, d) in SHAPES.items()
             if not args.only or name in args.only for s in args.seqlens]
    if not args.only:
        cells += [(name, hq, hkv, d, s, max(1, TOKENS // s)) for name, (hq, hkv, d, s) in EXTRA_CELLS.items()]
    rows = []
    causal_modes = {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]
    try:
        for name, hq, hkv, d, s, b in cells:
            for causal in causal_modes:
                g = torch.Generator(device="cuda").manual_seed(s + d)
                mk = lambda n, h: torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                              generator=g).requires_grad_()
                q, k, v = mk(s, hq), mk(s, hkv), mk(s, hkv)
                gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                outs = {det: fa.flash_attn_func(q, k, v, causal=causal, deterministic=det)[0] for det in (False, True)}

                def call(variant):
                    out = outs[variant != "default"]
                    return torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)

                row = dict(shape=name, hq=hq, hkv=hkv, d=d, seqlen=s, batch=b, causal=causal,
                           device=torch.cuda.get_device_name(), group_kib=group_kib,
                           min_pairs=config_bwd.RELAY_GROUP_MIN_PAIRS)
                grads = {}
                for variant in variants:
                    set_variant(variant)
                    grads[variant] = call(variant)
                    if variant in RELAY_VARIANTS:
                        again = call(variant)
                        row[f"{variant}_bitwise"] = all(torch.equal(a, c) for a, c in zip(grads[variant], again))
                scale = max(c.float().abs().max().item() for c in grads["pair"])
                for variant in variants:
                    if variant != "pair":
                        row[f"{variant}_vs_pair_maxdiff"] = max(
                            (a.float() - c.float()).abs().max().item() for a, c in zip(grads[variant], grads["pair"]))
                row["pair_maxabs"] = scale
                times = {v: [] for v in variants}
                for _ in range(args.rounds):
                    for variant in variants:
                        set_variant(variant)
                        times[variant].append(time_fn(lambda: call(variant)))
                fl = 2.5 * flops(b, hq, s, d, causal)
                for variant in variants:
                    ms = statistics.median(times[variant])
                    row[f"{variant}_ms"] = round(ms, 4)
                    row[f"{variant}_tflops"] = round(fl / ms / 1e9, 1)
                for variant in variants:
                    if variant != "default":
                        row[f"{variant}_vs_default"] = round(row["default_ms"] / row[f"{variant}_ms"], 3)
                if "relay_main" in variants and "relay_new" in variants:
                    row["relay_new_vs_relay_main"] = round(row["relay_main_ms"] / row["relay_new_ms"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        dispatch_bwd.fused_plan = real_fused_plan
        jit.compile_cache.entry_path, jit.prebuilt.load = entry_path, prebuilt_load
        (config_bwd.DQ_RELAY_RELEASE, config_bwd.DQ_RELAY_PREFETCH, config_bwd.RELAY_GROUP_KIB,
         config_bwd.RELAY_GROUP_MIN_PAIRS, config_bwd.RELAY_HEAD_DIMS) = saved
        dispatch_bwd.clear_caches()
    if args.out:
        append_jsonl(args.out, rows)
    for variant in variants:
        if variant == "default":
            continue
        ratios = [r[f"{variant}_vs_default"] for r in rows]
        if ratios:
            geo = statistics.geometric_mean(ratios)
            worst = min(rows, key=lambda r: r[f"{variant}_vs_default"])
            print(f"{variant} / default: geomean {geo:.3f}, weakest {worst[f'{variant}_vs_default']:.3f} "
                  f"({worst['shape']} S={worst['seqlen']} causal={worst['causal']})")
    bad = [(r["shape"], r["seqlen"], r["causal"], v) for r in rows for v in variants
           if v in RELAY_VARIANTS and not r[f"{v}_bitwise"]]
    if bad:
        print(f"NOT bitwise reproducible: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
