"""Host cost per call: ours vs SDPA FLASH and flash-attn-4 (SM120 path forced), one process, one tiny problem.

    python benchmarks/bench_host.py --out benchmarks/results/host_h100.jsonl
    # old vs new in one run (a copy of the old package directory renamed flash_attn_4_sm120_base under DIR):
    python benchmarks/bench_host.py --path DIR --baseline-module flash_attn_4_sm120_base
    # (a quick look; the new/old verdict, blocks alternated at random with per-block ratios: bench_host_ab.py)

Problem: B=1, S=128, Hq=8, Hkv=2, D=128, bf16, causal -- small enough that the GPU work is a few µs and the
per-call cost is what the host spends (argument checks, kernel lookup, launch, and any device->host sync).
Every method first gets ``--warmup`` calls (compiles); then ``--reps`` rounds, each timing ``--calls`` calls of
every method in turn (interleaved, so a slow spell of the machine hits all methods alike), back to back with
time.perf_counter up to and including a final synchronize; µs/call of each repetition and their median.  ``host_us_per_call`` stops the clock before the final synchronize: when it is close to ``us_per_call`` the
host is the bottleneck (or waits for the GPU inside the call).

Methods (each recorded with an error string instead of a number when it fails):
  ours_dense_fwd        flash_attn_func(q, k, v, causal=True)
  ours_varlen_fwd       flash_attn_varlen_func on the packed single sequence, cu_seqlens and max_seqlen given
  ours_fwd_bwd          out = flash_attn_func(...) with requires_grad inputs; out.backward(g)
  sdpa_flash_fwd[_bwd]  SDPA under sdpa_kernel(FLASH_ATTENTION), BHSD, GQA K/V expanded outside the timed region
  fa4_sm120_*           flash_attn.cute.interface (4.0.0b36) with _get_device_arch -> 120: dense, varlen, fwd+bwd
  base_*                the --baseline-module copy of this package: dense, varlen, fwd+bwd (new/old ratios)
Targets: ours <= 1.5x SDPA FLASH and <= 0.5x flash-attn-4 SM120 for each pair (dense fwd, varlen fwd against
SDPA's dense fwd, fwd+bwd).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_table import METHOD_LABELS, PAIRS, TARGETS  # noqa: E402

PROBLEM = dict(batch=1, seqlen=128, hq=8, hkv=2, head_dim=128, dtype="bfloat16", causal=True)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def time_rep(fn, calls: int):
    """One timed repetition: (µs/call incl. the final sync, µs/call before it)."""
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / calls * 1e6, (t1 - t0) / calls * 1e6


class Problem:
    """Inputs shared by every method (same tensors, same sizes)."""

    def __init__(self):
        p = PROBLEM
        b, s, hq, hkv, d = p["batch"], p["seqlen"], p["hq"], p["hkv"], p["head_dim"]
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        self.causal = p["causal"]
        self.q, self.k, self.v = mk(b, s, hq, d), mk(b, s, hkv, d), mk(b, s, hkv, d)
        self.gout = mk(b, s, hq, d)
        # varlen: the same single sequence, packed (total, H, D)
        self.qp, self.kp, self.vp = self.q[0], self.k[0], self.v[0]
        self.cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
        self.s = s
        # leaves for fwd+bwd (BSHD for ours / fa4)
        self.qg, self.kg, self.vg = (t.clone().requires_grad_() for t in (self.q, self.k, self.v))
        # SDPA: BHSD, K/V expanded to Hq heads here, outside any timed region
        rep = hq // hkv
        self.qt = self.q.transpose(1, 2).contiguous()
        self.kt = self.k.repeat_interleave(rep, dim=2).transpose(1, 2).contiguous()
        self.vt = self.v.repeat_interleave(rep, dim=2).transpose(1, 2).contiguous()
        self.gt = self.gout.transpose(1, 2).contiguous()
        self.qtg, self.ktg, self.vtg = (t.clone().requires_grad_() for t in (self.qt, self.kt, self.vt))


def _fwd_bwd(call, leaves, gout):
    def run():
        for t in leaves:
            t.grad = None
        out = _first(call())
        out.backward(gout)

    return run


def methods_for_package(prefix: str, mod, P: Problem) -> dict:
    c, s = P.causal, P.s
    return {
        f"{prefix}_dense_fwd": lambda: mod.flash_attn_func(P.q, P.k, P.v, causal=c),
        f"{prefix}_varlen_fwd": lambda: mod.flash_attn_varlen_func(
            P.qp, P.kp, P.vp, cu_seqlens_q=P.cu, cu_seqlens_k=P.cu, max_seqlen_q=s, max_seqlen_k=s, causal=c),
        f"{prefix}_fwd_bwd": _fwd_bwd(lambda: mod.flash_attn_func(P.qg, P.kg, P.vg, causal=c),
                                      (P.qg, P.kg, P.vg), P.gout),
    }


def methods_sdpa(P: Problem) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(P.qt, P.kt, P.vt, is_causal=P.causal)

    def fwd_grad():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(P.qtg, P.ktg, P.vtg, is_causal=P.causal)

    return {"sdpa_flash_fwd": fwd, "sdpa_flash_fwd_bwd": _fwd_bwd(fwd_grad, (P.qtg, P.ktg, P.vtg), P.gt)}


def methods_fa4(P: Problem, notes: list) -> dict:
    try:
        import flash_attn.cute.interface as fi

        fi._get_device_arch = lambda: 120  # upstream's SM120 path (forward and backward) on any GPU
    except Exception as exc:  # noqa: BLE001 - a missing peer is a note, not a failure
        notes.append(f"flash-attn-4 SM120 path skipped: flash_attn.cute not importable ({type(exc).__name__}: {exc})")
        return {}
    return methods_for_package("fa4_sm120", fi, P)


def load_module(name: str, paths):
    for p in reversed(paths or []):
        sys.path.insert(0, str(Path(p).resolve()))
    return importlib.import_module(name)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def compute_summary(results: dict, args, notes: list) -> dict:
    """Ratios (ours µs / peer µs, lower is better) per pair, and whether each meets its target."""
    def us(name):
        r = results.get(name)
        return None if r is None or r.get("error") else r["us_per_call"]

    def ratio(a, b):
        ua, ub = us(a), us(b)
        return ua / ub if ua is not None and ub else None

    ratios = {"ours_vs_sdpa_flash": {}, "ours_vs_fa4_sm120": {}}
    if args.baseline_module:
        ratios["new_vs_old"] = {}
    for key, _label, ours, sdpa, fa4, base in PAIRS:
        ratios["ours_vs_sdpa_flash"][key] = ratio(ours, sdpa)
        ratios["ours_vs_fa4_sm120"][key] = ratio(ours, fa4)
        if args.baseline_module:
            ratios["new_vs_old"][key] = ratio(ours, base)
    met = {group: {k: (None if r is None else r <= TARGETS[group]) for k, r in ratios[group].items()}
           for group in TARGETS}
    flags = [m for group in met.values() for m in group.values() if m is not None]
    return dict(
        kind="summary", device=torch.cuda.get_device_name(), torch=torch.__version__, module=args.module,
        baseline_module=args.baseline_module, problem=PROBLEM, calls=args.calls, reps=args.reps, warmup=args.warmup,
        ratios=ratios, targets={g: {"max_ratio": t} for g, t in TARGETS.items()}, targets_met=met,
        all_targets_met=(all(flags) if flags else None), notes=notes,
    )


def print_table(rows, summ):
    print()
    print(f"{'method':<50} {'µs/call':>10} {'min':>10} {'host µs':>10}")
    for r in rows:
        label = METHOD_LABELS.get(r["method"], r["method"])
        if r.get("error"):
            print(f"{label:<50} FAILED: {r['error'][:100]}")
        else:
            print(f"{label:<50} {r['us_per_call']:>10.1f} {min(r['us_per_call_reps']):>10.1f} "
                  f"{r['host_us_per_call']:>10.1f}")
    print()
    for group, vals in summ["ratios"].items():
        tgt = TARGETS.get(group)
        for key, val in vals.items():
            met = summ["targets_met"].get(group, {}).get(key)
            txt = "n/a" if val is None else f"{val:.2f}x"
            extra = "" if tgt is None or val is None else f"  (target <= {tgt}x: {'met' if met else 'NOT met'})"
            print(f"{group:<20} {key:<12} {txt}{extra}")
    print()


def _record_error(row: dict, exc: Exception) -> None:
    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        torch.cuda.synchronize()
    except Exception as sync_exc:  # noqa: BLE001 - a broken context fails every later method too
        row["error"] += f" (then synchronize failed: {type(sync_exc).__name__}: {str(sync_exc)[:200]})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="JSONL: one row per method plus a summary row")
    ap.add_argument("--calls", type=int, default=300, help="calls per timed repetition (default 300)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions; the median is reported (default 5)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    ap.add_argument("--module", default="flash_attn_4_sm120", help="module name of ours (default flash_attn_4_sm120)")
    ap.add_argument("--path", action="append", default=[], metavar="DIR",
                    help="directory added to sys.path before importing the modules (repeatable)")
    ap.add_argument("--baseline-module", default=None, metavar="NAME",
                    help="another copy of the package to measure too (e.g. flash_attn_4_sm120_base); "
                         "adds base_* rows and new/old ratios")
    ap.add_argument("--no-fa4", action="store_true", help="skip flash-attn-4")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host: no CUDA GPU available; this benchmark needs one (nothing measured)", file=sys.stderr)
        return 2
    notes: list[str] = []
    fa = load_module(args.module, args.path)
    base = None
    if args.baseline_module:
        try:
            base = load_module(args.baseline_module, [])
        except Exception as exc:  # noqa: BLE001
            notes.append(f"baseline module {args.baseline_module} not importable ({type(exc).__name__}: {exc})")
    P = Problem()
    methods = methods_for_package("ours", fa, P)
    if base is not None:
        methods.update(methods_for_package("base", base, P))
    methods.update(methods_sdpa(P))
    if not args.no_fa4:
        methods.update(methods_fa4(P, notes))
    else:
        notes.append("flash-attn-4 skipped (--no-fa4)")
    for n in notes:
        print("note:", n, flush=True)

    # one correctness look before timing (recorded, not fatal): every forward against SDPA's
    ref = methods["sdpa_flash_fwd"]().transpose(1, 2)
    rows, results = [], {}
    t0 = time.time()
    live = {}
    for name, fn in methods.items():  # correctness look and warm-up (compiles) of every method first
        row = dict(kind="method", method=name, device=torch.cuda.get_device_name(), us_per_call_reps=[],
                   host_us_per_call_reps=[])
        try:
            if name.endswith("_fwd") and not name.startswith("sdpa"):
                out = _first(fn())
                out = out.view(ref.shape) if out.dim() == 3 else out
                row["max_abs_diff_vs_sdpa"] = max_diff(out, ref)
                if not row["max_abs_diff_vs_sdpa"] <= 0.05:
                    notes.append(f"{name} differs from SDPA by {row['max_abs_diff_vs_sdpa']:.3g}")
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - a method failing is recorded, not fatal
            _record_error(row, exc)
        rows.append(row)
        results[name] = row
    # repetitions interleaved across methods, so a slow spell of the machine hits every method alike
    for _ in range(args.reps):
        for name, fn in list(live.items()):
            try:
                total, host = time_rep(fn, args.calls)
                results[name]["us_per_call_reps"].append(round(total, 3))
                results[name]["host_us_per_call_reps"].append(round(host, 3))
            except Exception as exc:  # noqa: BLE001
                _record_error(results[name], exc)
                del live[name]
    for row in rows:
        if row["us_per_call_reps"] and "error" not in row:
            row["us_per_call"] = statistics.median(row["us_per_call_reps"])
            row["host_us_per_call"] = statistics.median(row["host_us_per_call_reps"])
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    summ = compute_summary(results, args, notes)
    summ["seconds"] = round(time.time() - t0, 1)
    print_table(rows, summ)
    print(json.dumps(summ), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows + [summ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
