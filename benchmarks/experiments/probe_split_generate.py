"""Whether the automatic split default pays off per decode call as transformers' generate makes it (issue 31; results
benchmarks/results/generate_h100.jsonl, benchmarks/experiments/results/split_generate_probe_h200_s31.jsonl): B=1,
Hq 32, Hkv 8, d128, q_len 1, causal, the KV growing by one row per step, k/v viewed from transformers' (B, H, L, D)
cache layout (``--layout blhd``: a contiguous (B, L, H, D) tensor instead).

Three modes per context: ``off`` (num_splits=None with ``DEFAULT_SPLITS_AUTO`` off: no split), ``default`` (it on:
the shipped rule, ``splitkv.AUTO_MIN_KEYS`` included) and ``split`` (num_splits=0: the automatic count, no length
rule).  Per mode, over ``--steps`` steps:

* ``sync_us``: one call between two synchronizes (host + launch + kernel latency), median;
* ``host_us``: the host time of a call when calls are queued back to back (no synchronize inside the loop), the
  per-call cost a host-bound generate step sees; ``queued_us``: that loop's wall time per call, synchronized;
* ``no_sync``: the call ran under ``torch.cuda.set_sync_debug_mode("error")`` without a device->host sync;
* the split counts chosen and the compiles (first pass only: the second pass is the one reported).

Prints, per pair of contexts, where the ``off`` and ``split`` sync times cross (``break_even_keys``): the
measurement ``splitkv.AUTO_MIN_KEYS`` is derived from.

    python benchmarks/experiments/probe_split_generate.py --contexts 4096 16384 32768 --steps 128 \\
        --json benchmarks/experiments/results/split_generate_probe_<gpu>_s31b.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))

import flash_attn_4_sm120 as fa  # noqa: E402
from flash_attn_4_sm120 import jit, plan, splitkv  # noqa: E402

MODES = ("off", "default", "split")


def call(mode: str, q, k, v) -> None:
    if mode == "split":
        fa.flash_attn_func(q, k, v, causal=True, num_splits=0)
    else:
        splitkv.DEFAULT_SPLITS_AUTO = mode == "default"
        fa.flash_attn_func(q, k, v, causal=True)


def sync_free(mode: str, q, k, v) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(mode, q, k, v)
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--layout", choices=("bhld", "blhd"), default="bhld")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    compiles = [0]
    real_compile = jit.compile_kernel

    def counting(*args, **kw):
        compiles[0] += 1
        return real_compile(*args, **kw)

    jit.compile_kernel = counting
    chosen = []
    real_resolve = plan.resolve_num_splits  # launch_plan's name for it

    def spy(*args, **kw):
        n = real_resolve(*args, **kw)
        chosen.append(n)
        return n

    plan.resolve_num_splits = spy
    rows = []
    torch.manual_seed(0)
    with torch.no_grad():
        for ctx in a.contexts:
            n = ctx + a.steps
            if a.layout == "bhld":
                kf = torch.randn(1, 8, n, 128, dtype=torch.bfloat16, device="cuda")
                vf = torch.randn_like(kf)
                views = [(kf[:, :, : ctx + s].transpose(1, 2), vf[:, :, : ctx + s].transpose(1, 2))
                         for s in range(a.steps)]
            else:
                kf = torch.randn(1, n, 8, 128, dtype=torch.bfloat16, device="cuda")
                vf = torch.randn_like(kf)
                views = [(kf[:, : ctx + s], vf[:, : ctx + s]) for s in range(a.steps)]
            q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
            for rep in range(2):
                for mode in MODES:
                    compiles[0] = 0
                    chosen.clear()
                    times = []
                    for k, v in views:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        call(mode, q, k, v)
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for k, v in views:
                        call(mode, q, k, v)
                    t_host = time.perf_counter() - t0
                    torch.cuda.synchronize()
                    t_all = time.perf_counter() - t0
                    if rep == 0:
                        continue
                    row = {"context": ctx, "layout": a.layout, "mode": mode,
                           "sync_us": round(statistics.median(times), 1),
                           "host_us": round(t_host / a.steps * 1e6, 1), "queued_us": round(t_all / a.steps * 1e6, 1),
                           "no_sync": sync_free(mode, q, *views[-1]), "compiles": compiles[0],
                           "splits": sorted(set(chosen)), "auto_min_keys": splitkv.AUTO_MIN_KEYS}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    splitkv.DEFAULT_SPLITS_AUTO = False
    by = {(r["context"], r["mode"]): r["sync_us"] for r in rows}
    ctxs = sorted({r["context"] for r in rows})
    for c0, c1 in zip(ctxs, ctxs[1:]):  # where off(ctx) - split(ctx), linear between c0 and c1, crosses 0
        d0, d1 = by[c0, "off"] - by[c0, "split"], by[c1, "off"] - by[c1, "split"]
        cross = None if d0 == d1 or (d0 > 0) == (d1 > 0) else round(c0 + (c1 - c0) * -d0 / (d1 - d0))
        rows.append({"contexts": [c0, c1], "break_even_keys": cross, "off_minus_split_us": [round(d0, 1),
                                                                                              round(d1, 1)]})
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"device": torch.cuda.get_device_name(), **r}) + "\n")


if __name__ == "__main__":
    main()
