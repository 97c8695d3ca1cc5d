"""Same-run comparison of two builds of this package (e.g. a refactor against the code before it), forward and
backward, on the benchmark grid of bench_fwd.py / bench_bwd.py.

    python benchmarks/experiments/compare_versions.py --path /tmp/base --baseline flash_attn_4_sm120_base \
        --out benchmarks/experiments/results/refactor_vs_previous_h100.jsonl

The baseline is a copy of the package under another module name (``--path`` is added to sys.path).  Each cell is
timed alternately (baseline then new, new then baseline, ...; ``--rounds`` rounds of CUDA-event medians) so drift in
clocks affects both alike; the ratio is new TFLOPS / baseline TFLOPS of the medians over rounds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import SEQLENS, SHAPES, TOKENS, flops, time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--baseline", default="flash_attn_4_sm120_base")
    ap.add_argument("--module", default="flash_attn_4_sm120")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--varlen", action="store_true",
                    help="the same tokens packed as a varlen batch (cu_seqlens, equal lengths, max_seqlen given)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compare_versions: no CUDA GPU", file=sys.stderr)
        return 2
    for p in args.path:
        sys.path.insert(0, p)
    new = importlib.import_module(args.module)
    old = importlib.import_module(args.baseline)
    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        for s in args.seqlens:
            b = max(1, TOKENS // s)
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(0)
                mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
                q, k, v = mk(hq), mk(hkv), mk(hkv)
                gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                row = dict(shape=name, hq=hq, hkv=hkv, d=d, seqlen=s, batch=b, causal=causal, varlen=args.varlen)
                fl = flops(b, hq, s, d, causal)
                for phase in ("fwd", "bwd"):
                    if phase == "bwd" and args.no_bwd:
                        continue
                    fns = {}
                    for tag, mod in (("old", old), ("new", new)):
                        call = _varlen_call(mod, b, s, causal) if args.varlen else (
                            lambda m: lambda q_, k_, v_: m.flash_attn_func(q_, k_, v_, causal=causal))(mod)
                        if phase == "fwd":
                            fns[tag] = (lambda c: lambda: c(q, k, v))(call)
                        else:
                            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                            out, _ = call(qg, kg, vg)
                            fns[tag] = (lambda o, ins: lambda: torch.autograd.grad(o, ins, gout.view_as(o), retain_graph=True))(
                                out, (qg, kg, vg))
                    times = {"old": [], "new": []}
                    for rnd in range(args.rounds):  # alternate who goes first, so neither gets the warmer GPU
                        for tag in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                            times[tag].append(time_fn(fns[tag]))
                    mult = 2.5 if phase == "bwd" else 1.0
                    for tag in ("old", "new"):
                        ms = statistics.median(times[tag])
                        row[f"{phase}_{tag}_ms"] = ms
                        row[f"{phase}_{tag}_tflops"] = mult * fl / ms / 1e9
                    row[f"{phase}_new_vs_old"] = row[f"{phase}_new_tflops"] / row[f"{phase}_old_tflops"]
                    del fns
                rows.append(row)
                print(json.dumps({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}),
                      flush=True)
    summ = dict(kind="summary", device=torch.cuda.get_device_name(), torch=torch.__version__,
                rounds=args.rounds, varlen=args.varlen)
    for phase in ("fwd", "bwd"):
        vals = [r[f"{phase}_new_vs_old"] for r in rows if f"{phase}_new_vs_old" in r]
        if vals:
            summ[f"{phase}_min_new_vs_old"] = min(vals)
            summ[f"{phase}_geomean_new_vs_old"] = statistics.geometric_mean(vals)
            summ[f"{phase}_cells_below_0_97"] = sum(v < 0.97 for v in vals)
    print(json.dumps(summ), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows + [summ]))
    return 0


def _varlen_call(mod, b, s, causal):
    """(B, S, H, D) tensors viewed as (B*S, H, D) with cu_seqlens of B equal sequences."""
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")

    def call(q, k, v):
        flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
        return mod.flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                                          causal=causal)
    return call


if __name__ == "__main__":
    sys.exit(main())
