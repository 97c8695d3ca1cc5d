"""Nsight Compute sections of one FP8-cache decode step (issue 34's cells) beside the bf16 cache's, for the question
why the e4m3 cache reads at 59-75% of copy bandwidth where the bf16 cache reads at 90-95%.

    python benchmarks/experiments/profile_fp8_decode_ncu.py --out-dir DIR [--cells b8_kv8k b64_kv2k]

For each (cell, path) it runs itself once under ``ncu --profile-from-start off --clock-control none --csv`` with the
sections below; the child builds bench_fp8_decode.py's inputs, warms the call up (compiles, fills the caches),
then profiles one call between torch.cuda.profiler.start() and stop(): every kernel of that call (the split
forward and the combine).  The CSV of each run is kept as DIR/<cell>_<path>.csv, and a summary line per kernel
(duration, DRAM throughput % of peak, achieved occupancy, registers, shared memory, the top warp stall reasons) is
printed and written to DIR/summary.jsonl.  Paths: ``fp8`` (e4m3 cache, bf16 query, the default call), ``fp8_p16``
(the same over shuffled pages of 16), ``bf16`` (the bf16 cache, default call), ``fp8_e4m3q`` (the e4m3 cache with
a query quantized beforehand, fp8_quant.quantize_query: the e4m3-query kernel).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELLS = {"b8_kv8k": (8, 8192), "b64_kv2k": (64, 2048)}
PATHS = ("fp8", "fp8_p16", "bf16", "fp8_e4m3q")
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis",
            "SchedulerStats")


def child(cell: str, path: str) -> int:
    import torch

    sys.path.insert(0, str(HERE.parent))
    from bench_fp8_decode import HKV, HQ, D, page_table, paged  # noqa: E402

    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import fp8_quant as Q

    b, kv = CELLS[cell]
    gen = torch.Generator(device="cuda").manual_seed(b * 100003 + kv)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, k8, v8, _, kd, vd = Q.quantize_qkv(q, kc, vc)
    seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
    if path == "bf16":
        def fn():
            return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    elif path == "fp8":
        def fn():
            return fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    elif path == "fp8_e4m3q":  # the query quantized beforehand per (batch, KV head): the e4m3-query kernel
        q8, qd = Q.quantize_query(q, HKV)

        def fn():
            return fa.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, q_descale=qd, k_descale=kd,
                                              v_descale=vd)
    else:
        table = page_table(b, kv, gen)
        k8p, v8p = paged(k8, table), paged(v8, table)

        def fn():
            return fa.flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=seqlens, page_table=table, k_descale=kd,
                                              v_descale=vd)
    with torch.no_grad():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def summarize(text: str) -> list[dict]:
    """Per kernel: a few numbers of ncu's --csv section output (one row per kernel, section and metric)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    kernels: dict[str, dict] = {}
    for r in rows:
        key = f"{r.get('ID')}:{r.get('Kernel Name', '')[:60]}"
        k = kernels.setdefault(key, {"kernel": r.get("Kernel Name", "")[:120], "stalls": {}})
        name, val, unit = r.get("Metric Name", ""), r.get("Metric Value", ""), r.get("Metric Unit", "")
        try:
            num = float(val.replace(",", ""))
        except ValueError:
            continue
        if name.startswith("Stall ") or name.endswith("Stall"):
            k["stalls"][name] = num
        else:
            k[f"{name} [{unit}]" if unit else name] = num
    out = []
    for k in kernels.values():
        top = sorted(k.pop("stalls").items(), key=lambda kv: -kv[1])[:6]
        k["top_stalls"] = top
        out.append(k)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "fp8_decode_ncu")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = args.out_dir / "summary.jsonl"
    for cell in args.cells:
        for path in args.paths:
            cmd = [args.ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv"]
            for s in SECTIONS:
                cmd += ["--section", s]
            cmd += [sys.executable, __file__, "--child", cell, path]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            (args.out_dir / f"{cell}_{path}.csv").write_text(res.stdout)
            if res.returncode:
                print(f"{cell} {path}: ncu rc={res.returncode}\n{res.stderr[-2000:]}", flush=True)
            for k in summarize(res.stdout):
                line = {"cell": cell, "path": path, **k}
                print(json.dumps(line), flush=True)
                with summary.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
