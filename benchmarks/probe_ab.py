"""A/B of two builds of the bundle on bench_fwd's grid: times only our forward (and, with ``--bwd``, our backward)
per cell, labelled, so that two processes run with different ``PYTHONPATH`` (the working tree and an older
checkout of ``torch-ext``) can be compared cell by cell on one lease.  CUDA-event medians (bench_fwd.time_fn).

    PYTHONPATH=/tmp/base/torch-ext:$PYTHONPATH python benchmarks/probe_ab.py --label base --out ab.jsonl
    python benchmarks/probe_ab.py --label new --out ab.jsonl
    python benchmarks/probe_ab.py --compare ab.jsonl     # ratios base ms / new ms per cell, and their geomean
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import SEQLENS, SHAPES, TOKENS, append_jsonl, flops, time_fn  # noqa: E402


def measure(args) -> list[dict]:
    import torch

    import flash_attn_4_sm120 as fa

    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        for s in args.seqlens:
            b = max(1, TOKENS // s)
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(0)
                mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                           generator=g).requires_grad_()
                q, k, v = mk(hq), mk(hkv), mk(hkv)
                row = dict(label=args.label, shape=name, d=d, seqlen=s, batch=b, causal=causal,
                           device=torch.cuda.get_device_name(), time=time.strftime("%Y-%m-%d %H:%M"))
                with torch.no_grad():
                    row["fwd_ms"] = time_fn(lambda: fa.flash_attn_func(q, k, v, causal=causal))
                row["fwd_tflops"] = flops(b, hq, s, d, causal) / row["fwd_ms"] / 1e9
                if args.bwd:
                    out, _ = fa.flash_attn_func(q, k, v, causal=causal)
                    gout = torch.randn_like(out)
                    row["bwd_ms"] = time_fn(lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True))
                    row["bwd_tflops"] = 2.5 * flops(b, hq, s, d, causal) / row["bwd_ms"] / 1e9
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def compare(path: Path) -> None:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    labels = sorted({r["label"] for r in rows})
    if len(labels) != 2:
        raise SystemExit(f"need two labels, got {labels}")
    a, b = labels if labels[0] == "base" else labels[::-1]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["shape"], r["seqlen"], r["causal"]), {}).setdefault(r["label"], []).append(r)
    for key_ms in ("fwd_ms", "bwd_ms"):
        ratios = []
        for cell, by in sorted(cells.items()):
            if a in by and b in by and all(key_ms in r for r in by[a] + by[b]):
                ma = sorted(r[key_ms] for r in by[a])[len(by[a]) // 2]
                mb = sorted(r[key_ms] for r in by[b])[len(by[b]) // 2]
                ratios.append(ma / mb)
                print(f"{key_ms[:3]} {cell[0]:>12} S={cell[1]:>5} {'causal' if cell[2] else 'plain ':6} "
                      f"{a} {ma:.4f} {b} {mb:.4f} speedup {ma / mb:.3f}")
        if ratios:
            print(f"{key_ms[:3]} geomean speedup {b} over {a}: "
                  f"{math.exp(sum(math.log(x) for x in ratios) / len(ratios)):.3f} over {len(ratios)} cells")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="new")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="shape names")
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--compare", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return 0
    append_jsonl(args.out, measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
