"""Decode benchmark (issue 8, Performance): K+V bandwidth of flash_attn_with_kvcache against a device-to-device copy
measured in the same process, and against upstream flash-attn-4's SM120 path.

    python benchmarks/bench_decode.py                     # writes benchmarks/results/decode_<gpu>.jsonl

Cases (bf16, q_len 1 unless noted, K/V lengths full):
  d128      Hq 32 / Hkv 8, d128: B=1 KV 32K, B=8 KV 8K, B=64 KV 2K; contiguous and paged (page sizes 16, 64)
  d256      the same three shapes at d256 (contiguous)
  mqa       Hq 32 / Hkv 1, d128 (contiguous)
  prefill   chunked prefill: q 512 over 8K keys, paged (page 64) vs contiguous, causal
Ours runs flash_attn_with_kvcache(num_splits=0) (what decode callers use: automatic split-KV) and, for reference,
num_splits=1.  The peer is flash-attn-4 b36's flash_attn_func with its SM120 path forced (_get_device_arch -> 120;
it runs one split there), on the contiguous cases.

Bandwidth = K+V bytes read / median time of CUDA-event timed calls after warm-up, two ways: ``graph`` replays a
CUDA graph of one call (what a serving engine that captures its decode step sees: GPU time only) and ``eager``
times back-to-back Python calls (it adds the host cost of every call, on the lent machine's slow CPU 50-150 us,
whenever that exceeds the GPU time).  ``layers`` (ours_auto_layers_*) replays one graph of LAYERS calls, each over
its own copy of the cache, and divides by LAYERS: what an engine that captures a whole decode step (one call per
layer) pays per call, with the graph launch shared and no cache reused from L2 between calls (the single-call graph
re-reads the same K/V on every replay, which a cache smaller than L2 may partly serve from it).  copy_gbps = (bytes read + bytes
written) / time of a >= 1 GiB device-to-device copy_; pct_of_copy = bandwidth / copy_gbps.  Before it is timed, every
output (ours split and unsplit, and the peer's) is checked against an fp32 reference computed in plain torch from the
same cache (benchmarks/refcheck.py, independent of every kernel timed; paged caches read back through the page table)
with the tests' bar (2 x the error of the same computation in bf16, plus a small atol): a result that fails is
recorded as ``<impl>_error`` and not timed; ``<impl>_max_err`` and ``check_bar`` record the passing ones.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import time_fn  # noqa: E402  (CUDA-event medians after warm-up, shared by every benchmark)
import refcheck  # noqa: E402  (fp32 reference in plain torch)

HQ, HKV = 32, 8
SHAPES = ((1, 32768), (8, 8192), (64, 2048))


def copy_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / ms / 1e6


def gpu_tag() -> str:
    name = torch.cuda.get_device_name().lower()
    m = re.search(r"(h100|h200|b200|rtx \w+ \d+|rtx \d+|gb10|a100|l40s?)", name)
    return re.sub(r"[^a-z0-9]+", "_", m.group(1) if m else name).strip("_")


def fa4_peer(notes):
    try:
        import flash_attn.cute.interface as fi
        from flash_attn.cute import flash_attn_func as fa4_func

        fi._get_device_arch = lambda: 120  # upstream's SM120 path (its SM80 kernel), forced
        return fa4_func
    except Exception as exc:  # noqa: BLE001 - report and skip the peer
        notes.append(f"fa4_sm120 skipped: flash-attn-4 not importable ({type(exc).__name__}: {exc})")
        return None


def make_cache(b, kv, hkv, d, page_size, gen):
    k = torch.randn(b, kv, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, kv, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if not page_size:
        return k, v, None
    pages = b * kv // page_size
    perm = torch.randperm(pages, device="cuda", generator=gen)
    table = perm.view(b, kv // page_size).to(torch.int32)
    kp = torch.empty(pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[perm] = k.view(pages, page_size, hkv, d)
    vp[perm] = v.view(pages, page_size, hkv, d)
    del k, v
    return kp, vp, table


def time_graph(fn, iters=30) -> float:
    """Median ms of replays of a CUDA graph holding one call (captured after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_fn(g.replay, warmup=5, iters=iters)


LAYERS = 8


def time_graph_layers(fns, iters=20) -> float:
    """Median ms per call of replays of one CUDA graph holding every call of ``fns`` (one per layer)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return time_fn(g.replay, warmup=3, iters=iters) / len(fns)


def run_case(fa, peer, case, b, kv, hq, hkv, d, page_size, sq, copy_bw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, table = make_cache(b, kv, hkv, d, page_size, gen)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
    causal = sq > 1

    def ours(n):
        return lambda: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, causal=causal,
                                                  num_splits=n)

    kv_bytes = b * kv * hkv * d * 2 * 2
    row = dict(case=case, batch=b, kv_len=kv, q_len=sq, hq=hq, hkv=hkv, d=d, page_size=page_size or None,
               kv_bytes=kv_bytes, copy_gbps=copy_bw, device=torch.cuda.get_device_name())
    # the reference reads the cache back through the page table: it shares nothing with the kernels timed
    kref, vref = (kc, vc) if table is None else (kc[table.long()].flatten(1, 2), vc[table.long()].flatten(1, 2))
    ref32 = refcheck.forward(q, kref, vref, causal)
    ref16 = refcheck.forward(q, kref, vref, causal, dtype=q.dtype)
    del kref, vref

    def checked(label, out) -> bool:
        err, bar, problem = refcheck.check("out", out, ref32, ref16)
        row["check_bar"] = bar
        if problem:
            row[f"{label}_error"] = "check failed: " + problem
            return False
        row[f"{label}_max_err"] = err
        return True

    for label, n in (("ours_auto", 0), ("ours_split1", 1)):
        fn = ours(n)
        if not checked(label, fn()):
            continue
        ms = time_graph(fn)
        row[f"{label}_ms"] = ms
        row[f"{label}_gbps"] = kv_bytes / ms / 1e6
        row[f"{label}_pct_of_copy"] = row[f"{label}_gbps"] / copy_bw
        row[f"{label}_eager_ms"] = time_fn(fn, warmup=5, iters=30)
        row[f"{label}_eager_gbps"] = kv_bytes / row[f"{label}_eager_ms"] / 1e6
    if "ours_auto_ms" in row:
        caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(LAYERS - 1)]
        fns = [lambda kc_=kc_, vc_=vc_: fa.flash_attn_with_kvcache(q, kc_, vc_, cache_seqlens=seqlens,
                                                                    page_table=table, causal=causal, num_splits=0)
               for kc_, vc_ in caches]
        ms = time_graph_layers(fns)
        row["ours_auto_layers_ms"] = ms
        row["ours_auto_layers_gbps"] = kv_bytes / ms / 1e6
        row["ours_auto_layers_pct_of_copy"] = row["ours_auto_layers_gbps"] / copy_bw
        del caches, fns
    if peer is not None and table is None:
        try:
            fn = lambda: peer(q, kc, vc, causal=causal)  # noqa: E731
            out = fn()
            out = out[0] if isinstance(out, (tuple, list)) else out
            if checked("fa4_sm120", out):
                ms = time_fn(fn, warmup=5, iters=30)
                row["fa4_sm120_eager_ms"] = ms
                if "ours_auto_eager_ms" in row:
                    row["speedup_vs_fa4_sm120_eager"] = ms / row["ours_auto_eager_ms"]
                try:  # the peer's graph time, when its call can be captured
                    ms = time_graph(fn)
                    row["fa4_sm120_ms"] = ms
                    row["fa4_sm120_gbps"] = kv_bytes / ms / 1e6
                    if "ours_auto_ms" in row:
                        row["speedup_vs_fa4_sm120"] = ms / row["ours_auto_ms"]
                except Exception as exc:  # noqa: BLE001 - recorded, the eager ratio stands
                    row["fa4_sm120_graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:  # noqa: BLE001 - a peer failing one cell is recorded, not fatal
            row["fa4_sm120_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.empty_cache()
    return row


def cases():
    """(case, batch, kv_len, hq, hkv, d, page_size or 0, q_len) of every run (scripts/prebuilt_set.py reads it)."""
    plan = []
    for b, kv in SHAPES:
        plan += [("d128", b, kv, HQ, HKV, 128, 0, 1), ("d128_p16", b, kv, HQ, HKV, 128, 16, 1),
                 ("d128_p64", b, kv, HQ, HKV, 128, 64, 1), ("d256", b, kv, HQ, HKV, 256, 0, 1),
                 ("mqa", b, kv, HQ, 1, 128, 0, 1)]
    plan += [("prefill", 1, 8192, HQ, HKV, 128, 64, 512), ("prefill_contiguous", 1, 8192, HQ, HKV, 128, 0, 512)]
    return plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="case names: d128 d128_p16 d128_p64 d256 mqa prefill")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    notes: list[str] = []
    peer = fa4_peer(notes)
    copy_bw = copy_gbps()
    print(json.dumps({"copy_gbps": round(copy_bw, 1), "device": torch.cuda.get_device_name()}), flush=True)
    plan = cases()
    rows = []
    with torch.no_grad():
        for case, b, kv, hq, hkv, d, ps, sq in plan:
            if args.only and case.split("_contiguous")[0] not in args.only:
                continue
            row = run_case(fa, peer, case, b, kv, hq, hkv, d, ps, sq, copy_bw)
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = args.out or Path(__file__).parent / "results" / f"decode_{gpu_tag()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for n in notes:
            f.write(json.dumps({"note": n}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for n in notes:
        print(n, file=sys.stderr)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
