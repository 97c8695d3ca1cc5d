"""Where the time of a short decode call goes (issue 8, MQA): the per-call cost of a decode call as the KV length
grows, in bench_decode's 8-call CUDA graph (each call over its own copy of the cache), against the floor of any
two-kernel call (two dependent tiny kernels per call in the same kind of graph).

    python benchmarks/experiments/probe_decode_floor.py [--out benchmarks/experiments/results/decode_floor_h100.jsonl]

Per case (Hq 32, d128, bf16, q_len 1, contiguous cache) and KV length: ms per call with the automatic split count,
the K+V bytes read and their rate.  A least-squares line over the KV lengths gives a fixed cost per call (its
intercept) and a streaming rate (the inverse of its slope); the row ``fit`` reports them with the time the issue's
target (a share of the copy bandwidth) allows for the largest case.  Kernel times (torch.profiler) of the largest
call split the forward from the combine.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_decode import LAYERS, copy_gbps, make_cache, time_graph_layers  # noqa: E402
from bench_fwd import append_jsonl  # noqa: E402

CASES = {  # name: (batch, Hkv, KV lengths, target share of copy bandwidth)
    "mqa_b1": (1, 1, (512, 1024, 2048, 4096, 8192, 16384, 32768), 0.70),
    "mqa_b8": (8, 1, (256, 512, 1024, 2048, 4096, 8192), 0.70),
    "gqa_b1": (1, 8, (512, 2048, 8192, 32768), 0.80),
}


def floor_ms(n_kernels: int = 2) -> float:
    """Per call of an 8-call graph whose call is ``n_kernels`` dependent tiny kernels (the launch floor)."""
    x = torch.zeros(1024, device="cuda")

    def call():
        for _ in range(n_kernels):
            x.add_(1.0)

    return time_graph_layers([call] * LAYERS)


def kernel_split(fn) -> dict:
    """GPU time per kernel kind of one call (torch.profiler, 20 calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = "combine" if "ombine" in e.name else "forward" if "Fwd" in e.name else e.name[:40]
            per[name] += e.device_time_total / 20.0 if hasattr(e, "device_time_total") else e.cuda_time_total / 20.0
    return {k: round(v, 2) for k, v in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_floor: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    dev = torch.cuda.get_device_name()
    copy_bw = copy_gbps()
    rows = []
    for k in (1, 2):
        rows.append(dict(probe="floor", kernels_per_call=k, ms_per_call=floor_ms(k), device=dev))
        print(json.dumps(rows[-1]), flush=True)
    for case in args.cases:
        b, hkv, lengths, share = CASES[case]
        pts = []
        for kv in lengths:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            caches = [make_cache(b, kv, hkv, 128, 0, gen)[:2] for _ in range(LAYERS)]
            fns = [lambda kc=kc, vc=vc: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=0)
                   for kc, vc in caches]
            ref = fa.flash_attn_with_kvcache(q, caches[0][0], caches[0][1], cache_seqlens=seqlens, num_splits=1)
            err = (fns[0]().float() - ref.float()).abs().max().item()
            if not err <= 2e-2:
                raise RuntimeError(f"{case} kv {kv}: the split call differs from the unsplit one by {err}")
            ms = time_graph_layers(fns)
            nbytes = b * kv * hkv * 128 * 2 * 2
            row = dict(probe="decode", case=case, batch=b, hkv=hkv, kv_len=kv, kv_bytes=nbytes, ms_per_call=ms,
                       gbps=nbytes / ms / 1e6, pct_of_copy=nbytes / ms / 1e6 / copy_bw, copy_gbps=copy_bw, device=dev)
            if kv == lengths[-1]:
                row["kernel_us"] = kernel_split(fns[0])
            rows.append(row)
            pts.append((nbytes, ms))
            print(json.dumps(row), flush=True)
            del caches, fns
            torch.cuda.empty_cache()
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fixed_ms = my - slope * mx
        big = pts[-1][0]
        rows.append(dict(probe="fit", case=case, fixed_us=fixed_ms * 1e3, stream_gbps=1.0 / slope / 1e6,
                         largest_bytes=big, target_share=share,
                         target_us_largest=big / (share * copy_bw * 1e6) * 1e3, copy_gbps=copy_bw, device=dev))
        print(json.dumps(rows[-1]), flush=True)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
