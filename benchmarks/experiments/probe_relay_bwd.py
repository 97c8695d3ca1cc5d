"""A/B of the deterministic backward in one process (a tuning aid for issue 30 item 2, not the peer benchmark): the
default fused backward, its relay form (``deterministic=True``, kernels/dq_relay.py) with each place of the turn's
release (config_bwd.DQ_RELAY_RELEASE "top" and "after_s"), and the atomic-free dK/dV + dQ pair (what
``deterministic=True`` ran before the relay, forced by hiding the fused kernel), on bench_bwd's cells.

    python benchmarks/experiments/probe_relay_bwd.py [--only mha-d64 ...] [--seqlens 1024 4096] [--rounds 3] [--out F]

Each round times every variant (CUDA-event medians after warm-up, bench_fwd.time_fn) of the backward alone
(torch.autograd.grad over one forward).  The relay's kernels of the two release places are compiled separately and
swapped into jit's memory cache (the disk cache and the prebuilt set are off: the place is not part of the compile
key).  Checked first, per cell: each relay variant gives bitwise-equal gradients on a second run, and agrees with the
pair to fp32 rounding (the rows record the largest difference).  Reported: ms and TFLOPS per variant (median over
rounds) and the ratios relay / default and pair / default.

Where the relay's time goes (``--variants relay_top relaxed nowait free``): copies of the relay with one part of the
ordering taken out (kernels/dq_relay.py ``RELAY_PROBE``: "relaxed" passes turns without the release fence, "nowait"
skips the waits, "free" both, leaving the descending walk and the counter traffic).  They break the ordering, so
they are timed, not checked.  ``--relay-dims 128``: add head dims to config_bwd.RELAY_HEAD_DIMS for the run, so
their relay runs on the default fused tile (d128's has no relay by default).  Session 38's rows were made by this
file's first copy (a separate probe script at commit 89851be), folded in here since.  ``heads_inner``: the relay's
walk with query tiles outer and a GQA group's heads inner (config_bwd.RELAY_HEADS_INNER), checked as the relay is; the
shipped walk since session 40 (every other relay variant walks heads outer, the walk they were measured with).  Session 39 measured more
forms, with probe hooks in the kernels that were taken out again afterwards (their last state, with this file's
variants and the waits probe benchmarks/experiments/probe_relay_waits, is commit ce7456d): the workspace in planes, early and
single reads of the counter, one poller per CTA, the spin's sleep, the pass right after the adds, the wait before
the dQ mma, the ascending walk, a spin loop that never turns, per-CTA wait counts and timelines
(benchmarks/experiments/README.md, rows of this file; results/relay_*_h200_s39.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["FA4_SM120_DISK_CACHE"] = "0"  # the release place is not part of the compile key
os.environ["FA4_SM120_PREBUILT"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import EXTRA_CELLS, SEQLENS, SHAPES, TOKENS, append_jsonl, flops, time_fn  # noqa: E402

VARIANTS = ("default", "relay_top", "relay_after_s", "relaxed", "nowait", "free", "heads_inner", "pair")
# the variants' (release place, RELAY_PROBE): each pair's kernels are compiled once and kept in their own jit memory
PLACES = {"relay_after_s": ("after_s", None), "relaxed": ("top", "relaxed"), "nowait": ("top", "nowait"),
          "free": ("top", "free"), "heads_inner": ("top", None, True)}
CHECKED = ("relay_top", "relay_after_s", "heads_inner")  # the variants that keep the ordering


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="*", choices=VARIANTS, default=["relay_top", "relay_after_s"],
                    help="besides the default and the pair, always timed")
    ap.add_argument("--relay-dims", nargs="*", type=int, default=[])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd, jit
    from flash_attn_4_sm120.kernels import dq_relay

    variants = ["default", *[v for v in args.variants if v not in ("default", "pair")], "pair"]
    config_bwd.RELAY_HEAD_DIMS = frozenset(config_bwd.RELAY_HEAD_DIMS | set(args.relay_dims))
    memory = {}  # each (release place, probe)'s jit memory
    real_fused_plan = dispatch_bwd.fused_plan

    def set_variant(variant: str):
        place = PLACES.get(variant, ("top", None))
        place = place if len(place) == 3 else (*place, False)  # (release, probe, config_bwd.RELAY_HEADS_INNER)
        now = (config_bwd.DQ_RELAY_RELEASE, dq_relay.RELAY_PROBE, config_bwd.RELAY_HEADS_INNER)
        if place != now:
            memory.setdefault(now, {}).update(jit._MEMORY)
            config_bwd.DQ_RELAY_RELEASE, dq_relay.RELAY_PROBE, config_bwd.RELAY_HEADS_INNER = place
            jit._MEMORY.clear()
            dispatch_bwd.clear_caches()  # the plans (and the fused kernels they hold) refill from this memory
            jit._MEMORY.update(memory.get(place, {}))
        dispatch_bwd.fused_plan = (lambda plan, device, relay=False: None) if variant == "pair" else real_fused_plan

    cells = [(name, hq, hkv, d, s, max(1, TOKENS // s)) for name, (hq, hkv, d) in SHAPES.items()
             if not args.only or name in args.only for s in args.seqlens]
    cells += [(name, hq, hkv, d, s, max(1, TOKENS // s)) for name, (hq, hkv, d, s) in EXTRA_CELLS.items()
              if not args.only or name in args.only]
    rows = []
    try:
        for name, hq, hkv, d, s, b in cells:
            for causal in (False, True):
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
                           device=torch.cuda.get_device_name())
                grads = {}
                for variant in variants:
                    set_variant(variant)
                    grads[variant] = call(variant)
                    if variant in CHECKED:
                        again = call(variant)
                        row[f"{variant}_bitwise"] = all(torch.equal(a, c) for a, c in zip(grads[variant], again))
                row["pair_maxabs"] = max(c.float().abs().max().item() for c in grads["pair"])
                for variant in ("default", *[v for v in variants if v in CHECKED]):
                    row[f"{variant}_vs_pair_maxdiff"] = max(
                        (a.float() - c.float()).abs().max().item() for a, c in zip(grads[variant], grads["pair"]))
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
                    if variant != "default":
                        row[f"{variant}_vs_default"] = round(row["default_ms"] / ms, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                append_jsonl(args.out, [row])
    finally:
        set_variant("default")
    for variant in variants[1:]:
        ratios = [r[f"{variant}_vs_default"] for r in rows]
        if ratios:
            geo = statistics.geometric_mean(ratios)
            worst = min(rows, key=lambda r: r[f"{variant}_vs_default"])
            print(f"{variant} / default: geomean {geo:.3f}, weakest {worst[f'{variant}_vs_default']:.3f} "
                  f"({worst['shape']} S={worst['seqlen']} causal={worst['causal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
