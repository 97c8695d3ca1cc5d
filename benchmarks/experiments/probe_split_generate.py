"""Why the automatic split default ran slower than no split through transformers' generate (issue 31; results
benchmarks/results/generate_h100.jsonl): a decode step's attention call as generate makes it (B=1, Hq 32, Hkv 8,
d128, q_len 1, the KV growing by one row per step), timed per step on the host clock with a synchronize, for the
default with ``DEFAULT_SPLITS_AUTO`` on and off; counts compiles and records the split counts chosen.

    python benchmarks/experiments/probe_split_generate.py --contexts 4096 16384 --steps 128
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
from flash_attn_4_sm120 import jit, splitkv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    compiles = [0]
    real_compile = jit.compile_kernel

    def counting(*args, **kw):
        compiles[0] += 1
        return real_compile(*args, **kw)

    jit.compile_kernel = counting
    chosen = []
    real_resolve = splitkv.resolve_num_splits

    def spy(*args, **kw):
        n = real_resolve(*args, **kw)
        chosen.append(n)
        return n

    splitkv.resolve_num_splits = spy
    import flash_attn_4_sm120.dispatch as dispatch
    if hasattr(dispatch, "resolve_num_splits"):
        dispatch.resolve_num_splits = spy
    rows = []
    torch.manual_seed(0)
    for ctx in a.contexts:
        kf = torch.randn(1, ctx + a.steps, 8, 128, dtype=torch.bfloat16, device="cuda")
        vf = torch.randn_like(kf)
        q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
        for auto in (True, False, True, False):
            splitkv.DEFAULT_SPLITS_AUTO = auto
            compiles[0] = 0
            chosen.clear()
            times = []
            for s in range(a.steps):
                k, v = kf[:, : ctx + s], vf[:, : ctx + s]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fa.flash_attn_func(q, k, v, causal=True)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
            row = {"context": ctx, "auto": auto, "median_us": round(statistics.median(times), 1),
                   "mean_us": round(statistics.mean(times), 1), "max_us": round(max(times), 1),
                   "compiles": compiles[0], "splits": sorted(set(chosen))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"device": torch.cuda.get_device_name(), **r}) + "\n")


if __name__ == "__main__":
    main()
