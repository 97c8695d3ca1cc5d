"""Backward tile sweep: time candidate dK/dV and dQ tiles per head dim, kernel by kernel.

    python benchmarks/experiments/bwd_tile_sweep.py --out benchmarks/experiments/results/bwd_tile_sweep_h100.jsonl

Each candidate replaces one kernel's tile (the other kernel keeps the shipped tile); the candidates are compiled in
parallel worker processes into the disk cache first, then every (candidate, cell) backward is run under
torch.profiler and the device time of each kernel is recorded (median over the profiled iterations), next to the
CUDA-event time of the whole backward.  Tiles that do not fit SM120 (config_bwd.bwd_problems) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import flops, time_fn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling experiments
from tile_sweep import warm_all  # noqa: E402

import flash_attn_4_sm120 as fa  # noqa: E402
from flash_attn_4_sm120 import config, config_bwd  # noqa: E402

DKDV = {  # (tile_m, tile_n, num_warps[, kv_warp_rows[, kv_rows]])
    32: [(64, 128, 8, 16, True), (64, 64, 4, 16, True), (32, 128, 8, 16, True)],
    64: [],
    128: [],
    96: [],
    192: [],
    256: [],
}
DQ = {  # (tile_m, tile_n, num_warps, kv_stages[, split_kv_wait])
    64: [],
    128: [(128, 64, 8, 1)],
    192: [(64, 64, 4, 1)],
    96: [],
    256: [(64, 32, 4, 1)],
}
CELLS = {32: [(16, 16, 4096, 4)], 64: [(16, 16, 4096, 4), (16, 16, 1024, 16)], 128: [(32, 8, 4096, 4), (32, 8, 1024, 16)],
         96: [(16, 16, 2048, 8)], 192: [(16, 16, 2048, 4)], 256: [(8, 8, 4096, 4)]}  # (hq, hkv, seqlen, batch)


def _variants(d):
    base_kv = tuple(config_bwd._BWD_TILES[d][0])
    base_q = config_bwd._DQ_TILES[d]
    out = [("base", base_kv, base_q)]
    out += [("dkdv", t, base_q) for t in DKDV.get(d, []) if t != base_kv]
    out += [("dq", base_kv, t) for t in DQ.get(d, []) if t != base_q]
    return out


def _cfgs(d, kv, q):
    c1 = config_bwd.BwdKernelConfig("bf16", d, d, *kv[:3], kv_warp_rows=kv[3] if len(kv) > 3 else 16,
                                    kv_rows=kv[4] if len(kv) > 4 else False)
    c2 = config_bwd.DqKernelConfig("bf16", d, d, *q[:3], kv_stages=q[3], split_kv_wait=len(q) > 4 and q[4])
    return [c1, c2] + [config.replace(c, windowed=True) for c in (c1, c2)]


def _fits(d, kv, q):
    c1, c2 = _cfgs(d, kv, q)[:2]
    return not config_bwd.bwd_problems(c1) and not config_bwd.dq_problems(c2)


def _warm(cfg):
    from flash_attn_4_sm120 import jit

    t0 = time.time()
    try:
        jit.get_kernel(cfg)
        return cfg.name(), round(time.time() - t0, 1), None
    except Exception as exc:  # noqa: BLE001 - report the tile as failing, keep sweeping
        return cfg.name(), round(time.time() - t0, 1), f"{type(exc).__name__}: {str(exc)[:300]}"


def kernel_times(fn, iters=5):
    """{kernel name: median device ms} of ``fn`` under torch.profiler."""
    fn()
    torch.cuda.synchronize()
    per = {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per.setdefault(ev.name, []).append(ev.device_time_total / 1e3 if hasattr(ev, "device_time_total")
                                               else ev.cuda_time_total / 1e3)
    out = {}
    for name, ts in per.items():
        short = ("dq" if "FlashBwdDq" in name else name[:60] if "FlashBwdPre" in name
                 else "dkdv" if "FlashBwd" in name else name[:60])
        n_per_call = max(1, len(ts) // iters)
        out[short] = out.get(short, 0.0) + statistics.median(ts) * n_per_call
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 64, 96, 192])
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    work, seen = [], set()
    for d in args.dims:
        for _, kv, q in _variants(d):
            if not _fits(d, kv, q):
                print("skip (does not fit SM120):", d, kv, q, flush=True)
                continue
            for c in _cfgs(d, kv, q):
                if c.name() not in seen:
                    seen.add(c.name())
                    work.append(c)
    failed = warm_all(work, args.jobs, _warm)
    rows = []
    for d in args.dims:
        saved_kv, saved_q = config_bwd._BWD_TILES[d], config_bwd._DQ_TILES[d]
        try:
            for which, kv, q in _variants(d):
                if not _fits(d, kv, q) or any(c.name() in failed for c in _cfgs(d, kv, q)):
                    continue
                config_bwd._BWD_TILES[d], config_bwd._DQ_TILES[d] = (kv,), q
                config.clear_caches()
                for hq, hkv, s, b in CELLS[d]:
                    g = torch.Generator(device="cuda").manual_seed(0)
                    mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
                    qq, kk, vv = mk(hq), mk(hkv), mk(hkv)
                    gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    for causal in (False, True):
                        out = fa.flash_attn_func(qq, kk, vv, causal=causal)
                        out = out[0] if isinstance(out, tuple) else out
                        fn = lambda: torch.autograd.grad(out, (qq, kk, vv), gout, retain_graph=True)  # noqa: E731
                        ms = time_fn(fn)
                        kt = kernel_times(fn)
                        row = dict(d=d, vary=which, dkdv=kv, dq=q, hq=hq, hkv=hkv, seqlen=s, batch=b, causal=causal,
                                   ms=ms, tflops=2.5 * flops(b, hq, s, d, causal) / ms / 1e9,
                                   dkdv_ms=kt.get("dkdv"), dq_ms=kt.get("dq"),
                                   other_ms=sum(v for k_, v in kt.items() if k_ not in ("dkdv", "dq")),
                                   device=torch.cuda.get_device_name())
                        rows.append(row)
                        print(json.dumps({k_: (round(v_, 3) if isinstance(v_, float) else v_)
                                          for k_, v_ in row.items()}), flush=True)
        finally:
            config_bwd._BWD_TILES[d], config_bwd._DQ_TILES[d] = saved_kv, saved_q
            config.clear_caches()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
