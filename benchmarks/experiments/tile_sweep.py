"""Tile sweep for the forward kernel: time candidate tiles per head dim on representative cells.

    python benchmarks/experiments/tile_sweep.py --out benchmarks/experiments/results/tile_sweep_h100.jsonl

Candidates are compiled in parallel worker processes into the disk cache first (so the sweep also exercises
the export/load path), then each (tile, cell) is timed with CUDA events (median after warm-up).  The result
feeds the tile table in torch-ext/flash_attn_4_sm120/config.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import flops, time_fn  # noqa: E402

import flash_attn_4_sm120 as fa  # noqa: E402
from flash_attn_4_sm120 import config  # noqa: E402
from flash_attn_4_sm120.config import FwdKernelConfig, FwdTile  # noqa: E402

T = FwdTile
CANDIDATES = {
    64: [T(128, 128, 8, 2, True, True), T(128, 64, 8, 2, True, True, True), T(256, 64, 8, 2, False, True),
         T(128, 128, 8, 1, True, True)],
    128: [T(128, 64, 8, 2, True, True), T(128, 64, 8, 2, True, True, True), T(128, 64, 8, 2, False, True, True),
          T(256, 32, 8, 2, False, True)],
    256: [T(64, 64, 4, 1, False), T(128, 32, 8, 1, False, True), T(128, 32, 8, 1, False)],
}
CELLS = [  # (hq, hkv, seqlen, batch)
    (32, 8, 4096, 4),
    (32, 8, 1024, 16),
]


def _cfgs(d, tile):
    base = FwdKernelConfig("bf16", d, d, tile)
    return [base, replace(base, windowed=True)]


def _warm(cfg):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from flash_attn_4_sm120 import jit

    t0 = time.time()
    try:
        jit.get_kernel(cfg)
        return cfg.name(), round(time.time() - t0, 1), None
    except Exception as exc:  # noqa: BLE001 - report the tile as failing, keep sweeping
        return cfg.name(), round(time.time() - t0, 1), f"{type(exc).__name__}: {str(exc)[:300]}"


def warm_all(work, jobs, warm) -> set:
    """Compile ``work`` in ``jobs`` processes (``warm(cfg)`` -> (name, seconds, error)), printing each; returns
    the names that failed."""
    t0 = time.time()
    failed = set()
    with cf.ProcessPoolExecutor(jobs) as pool:
        for name, secs, err in pool.map(warm, work):
            print(f"compiled {name} in {secs} s" + (f"  ERROR {err}" if err else ""), flush=True)
            if err:
                failed.add(name)
    print(f"warm-up compile of {len(work)} kernels: {time.time() - t0:.1f} s", flush=True)
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--dims", nargs="*", type=int, default=list(CANDIDATES))
    args = ap.parse_args(argv)
    work = [c for d in args.dims for t in CANDIDATES[d] if not config.fwd_tile_problems(d, d, t) for c in _cfgs(d, t)]
    skipped = [(d, t.name(), config.fwd_tile_problems(d, d, t)) for d in args.dims for t in CANDIDATES[d]
               if config.fwd_tile_problems(d, d, t)]
    for s in skipped:
        print("skip (does not fit SM120):", s, flush=True)
    failed = warm_all(work, args.jobs, _warm)
    rows = []
    for d in args.dims:
        saved = config._TILE_PREFERENCE[d]
        saved_w = config._TILE_PREFERENCE_WINDOWED.pop(d, None)
        try:
            for tile in CANDIDATES[d]:
                if config.fwd_tile_problems(d, d, tile) or any(c.name() in failed for c in _cfgs(d, tile)):
                    continue
                config._TILE_PREFERENCE[d] = (tile,)
                config.clear_caches()
                for hq, hkv, s, b in CELLS:
                    if d == 64:
                        hq, hkv = 16, 16
                    if d == 256:
                        hq, hkv = 8, 8
                    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                    for causal in (False, True):
                        ms = time_fn(lambda: fa.flash_attn_func(q, k, v, causal=causal))
                        row = dict(d=d, tile=tile.name(), hq=hq, hkv=hkv, seqlen=s, batch=b, causal=causal,
                                   ms=ms, tflops=flops(b, hq, s, d, causal) / ms / 1e9)
                        rows.append(row)
                        print(json.dumps({k_: (round(v_, 2) if isinstance(v_, float) else v_)
                                          for k_, v_ in row.items()}), flush=True)
        finally:
            config._TILE_PREFERENCE[d] = saved
            if saved_w is not None:
                config._TILE_PREFERENCE_WINDOWED[d] = saved_w
            config.clear_caches()
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
