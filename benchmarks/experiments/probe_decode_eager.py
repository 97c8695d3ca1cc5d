"""Where the time of an eager decode call goes (issue 8: eager MQA calls measured 120-220 us per call against
~50 us for GQA at the same bytes): torch.profiler over back-to-back eager flash_attn_with_kvcache calls, CPU ops
and CUDA kernels, MQA and GQA side by side.

    python benchmarks/experiments/probe_decode_eager.py [--calls 50] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import append_jsonl  # noqa: E402

CASES = (("mqa", 8, 8192, 32, 1, 128), ("gqa", 8, 8192, 32, 8, 128), ("mqa", 1, 32768, 32, 1, 128))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for name, b, kv, hq, hkv, d in CASES:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, kv, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        sl = torch.full((b,), kv, dtype=torch.int32, device="cuda")

        def call():
            return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, num_splits=0)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        host_us = (time.perf_counter() - t0) / args.calls * 1e6  # host time per call, before the sync
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / args.calls * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        top = []
        for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]:
            top.append((ev.key[:50], round(ev.self_cpu_time_total / args.calls, 1), ev.count // args.calls))
        kern = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if t and ev.count:
                kern.append((ev.key[:50], round(t / args.calls, 2), ev.count // args.calls))
        row = dict(case=name, batch=b, kv_len=kv, hq=hq, hkv=hkv, d=d, host_us=round(host_us, 1),
                   wall_us=round(wall_us, 1), cpu_self_us_per_call=top, device_us_per_call=kern,
                   device=torch.cuda.get_device_name())
        rows.append(row)
        print(json.dumps(row), flush=True)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
