"""Experiment: the fused backward (default) against the two-kernel path (deterministic=True) and the peers, on
issue 30's 17 cells, one process, one GPU.

    python benchmarks/experiments/bwd_fused_ab.py --out benchmarks/experiments/results/bwd_fused_ab_<gpu>.jsonl
    # a fused tile built but not selected by default (config_bwd._FUSED_TRIAL_TILES), e.g. d256's V-in-registers
    # tile on the d256 cells; deterministic=True (ours_det) still runs the kernel pair there:
    FA4_SM120_BWD_FUSED_TRIAL=256 python benchmarks/experiments/bwd_fused_ab.py --cells 12 13 16
    # the d64 tile with its S/dP warps 2 x 4 (32 query rows each, config_bwd q_warp_rows) against the same tile's
    # 4 x 2 grid on the d64 cells (each variant in its own process, with its own peers):
    python benchmarks/experiments/bwd_fused_ab.py --cells 6 7 8 9 10 11 --fused-tile 64:64,128,8,32,q32
    python benchmarks/experiments/bwd_fused_ab.py --cells 6 7 8 9 10 11 --fused-tile 64:64,128,8,32

Backward only: ours, SDPA FLASH and flash-attn-4 (SM120 path forced) through torch.autograd.grad of a fixed forward
graph; FROST (cuDNN-frontend's SM120 backward, capability presented as 12.0) called directly with the forward's O
and LSE.  Every implementation's dQ, dK and dV are checked against an fp32 reference of batch 0 (all heads) for
cells up to S=4096; a failed check is recorded as an error and the cell's time is not used.  TFLOPS: 2.5x the
forward's FlashAttention-convention FLOPs.  Medians of CUDA-event timings after warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CELLS = [  # (name, Hq, Hkv, D, S, causal), batch 16384 // S
    *[("llama3-8b", 32, 8, 128, s, c) for s in (1024, 4096, 16384) for c in (False, True)],
    *[("mha-d64", 16, 16, 64, s, c) for s in (1024, 4096, 16384) for c in (False, True)],
    ("mha-d256", 8, 8, 256, 4096, False), ("mha-d256", 8, 8, 256, 4096, True),
    ("llama3-70b", 64, 8, 128, 2048, True), ("phi-d96", 16, 16, 96, 2048, True),
    ("gemma-d256-gqa", 16, 8, 256, 4096, True),
    ("phi-d96", 16, 16, 96, 2048, False),  # bench_bwd's other d96 cell (index 17)
]


def time_fn(fn, warmup=3, iters=15) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def reference(q, k, v, gout, causal):
    """fp32 gradients of batch 0 (math, GQA expanded)."""
    r = q.shape[2] // k.shape[2]
    q0, k0, v0 = (t[:1].detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    kk, vv = k0.repeat_interleave(r, 1), v0.repeat_interleave(r, 1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q0, kk, vv, is_causal=causal)
    return [g.transpose(1, 2) for g in torch.autograd.grad(o, (q0, k0, v0), gout[:1].float().transpose(1, 2))]


def check(name, grads, ref, bf16_err, row):
    """Error of each gradient (batch 0) against the fp32 reference; fails above 2x SDPA FLASH's + atol."""
    for g, r, tag in zip(grads, ref, ("dq", "dk", "dv")):
        err = (g[:1].float() - r).abs().max().item()
        row[f"{name}_{tag}_err"] = err
        if bf16_err is not None and not err <= 2 * bf16_err[tag] + 1e-2:
            row[f"{name}_error"] = f"{tag} error {err:.3g} > 2 x {bf16_err[tag]:.3g} + 1e-2"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cells", type=int, nargs="*", default=None, help="indices into CELLS")
    ap.add_argument("--fused-tile", default=None,  # e.g. 128:64,64,8 or 256:32,64,8,32,vregs or 64:64,128,8,32,q32
                    help="override the fused tile table for one head dim: 'd:tm,tn,warps[,rows[,tag...]]' (a variant;"
                         " tags: vregs, q<n> = query rows per warp of the S/dP mmas, config_bwd._fused_tile_config)")
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa

    variant = None
    if args.fused_tile:
        from flash_attn_4_sm120 import config_bwd

        d_, tile = args.fused_tile.split(":")
        config_bwd._FUSED_TILES[int(d_)] = ((tuple(int(x) if x.isdigit() else x for x in tile.split(",")), "all"),)
        variant = args.fused_tile  # every walk
    import os

    from flash_attn_4_sm120 import config_bwd as _cb

    trial = os.environ.get(_cb.FUSED_TRIAL_ENV) or None  # the trial tiles' head dims, recorded with each row

    fa4 = frost = None
    try:
        import flash_attn.cute.interface as fi
        from flash_attn.cute import flash_attn_func as fa4

        fi._get_device_arch = lambda: 120
    except Exception as exc:  # noqa: BLE001
        print("fa4 unavailable:", exc)
    try:
        from cudnn.sdpa.bwd.api_dsl import sdpa_bwd_wrapper_dsl_sm120 as frost
    except Exception as exc:  # noqa: BLE001
        print("frost unavailable:", exc)
    real_cap = torch.cuda.get_device_capability

    def as_sm120(fn):
        torch.cuda.get_device_capability = lambda *a, **k: (12, 0)
        try:
            return fn()
        finally:
            torch.cuda.get_device_capability = real_cap

    rows = []
    for i, (name, hq, hkv, d, s, causal) in enumerate(CELLS):
        if args.cells is not None and i not in args.cells:
            continue
        b = max(1, 16384 // s)
        g = torch.Generator(device="cuda").manual_seed(i)
        mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_()
        gout = mk(hq)
        fl = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
        row = dict(cell=name, hq=hq, hkv=hkv, d=d, seqlen=s, batch=b, causal=causal,
                   device=torch.cuda.get_device_name(), fused_tile_variant=variant, fused_trial=trial)
        ref = reference(q, k, v, gout, causal) if s <= 4096 else None
        impls = {}
        out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        impls["ours"] = lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)
        out_det, _ = fa.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        impls["ours_det"] = lambda: torch.autograd.grad(out_det, (q, k, v), gout, retain_graph=True)
        kk = k.detach().repeat_interleave(hq // hkv, 2).requires_grad_()
        vv = v.detach().repeat_interleave(hq // hkv, 2).requires_grad_()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            o_s = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                                 is_causal=causal)
        r_ = hq // hkv

        def sdpa():
            dq_, dk_, dv_ = torch.autograd.grad(o_s, (q, kk, vv), gout.transpose(1, 2), retain_graph=True)
            return dq_, dk_, dv_
        impls["sdpa_flash"] = sdpa
        if fa4 is not None and d <= 128:
            try:
                o4 = fa4(q, k, v, causal=causal)
                o4 = o4[0] if isinstance(o4, tuple) else o4
                impls["fa4_sm120"] = lambda: torch.autograd.grad(o4, (q, k, v), gout, retain_graph=True)
            except Exception as exc:  # noqa: BLE001
                row["fa4_sm120_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if frost is not None:
            o_d, lse_d = out.detach(), lse.detach().unsqueeze(-1).contiguous()  # (B, H, S, 1) natural log

            def frost_call():
                r = as_sm120(lambda: frost(q.detach().transpose(1, 2), k.detach().transpose(1, 2),
                                           v.detach().transpose(1, 2), o_d.transpose(1, 2), gout.transpose(1, 2),
                                           lse_d, is_causal=causal))
                return r["dq_tensor"], r["dk_tensor"], r["dv_tensor"]
            impls["frost"] = frost_call
        bf16_err = None
        for nm, fn in impls.items():
            try:
                grads = fn()
                if nm == "sdpa_flash":  # dK/dV per expanded head: sum over each group
                    grads = (grads[0], grads[1].unflatten(2, (hkv, r_)).sum(3), grads[2].unflatten(2, (hkv, r_)).sum(3))
                elif nm == "frost":
                    grads = tuple(t.transpose(1, 2) for t in grads)  # BHSD -> BSHD
                if ref is not None:
                    if nm == "sdpa_flash":
                        bf16_err = {t: (gg[:1].float() - rr).abs().max().item()
                                    for t, gg, rr in zip(("dq", "dk", "dv"), grads, ref)}
                    check(nm, grads, ref, bf16_err if nm != "sdpa_flash" else None, row)
                if f"{nm}_error" in row:
                    continue
                ms = as_sm120(lambda: time_fn(fn)) if nm == "frost" else time_fn(fn)
                row[f"{nm}_ms"] = ms
                row[f"{nm}_tflops"] = fl / ms / 1e9
            except Exception as exc:  # noqa: BLE001
                row[f"{nm}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for p in ("ours_det", "sdpa_flash", "fa4_sm120", "frost"):
            if f"{p}_tflops" in row and "ours_tflops" in row:
                row[f"ours_vs_{p}"] = row["ours_tflops"] / row[f"{p}_tflops"]
        rows.append(row)
        print(json.dumps({a: (round(x, 4) if isinstance(x, float) else x) for a, x in row.items()}), flush=True)

    def geo(key):
        xs = [r[key] for r in rows if key in r]
        return (math.exp(sum(map(math.log, xs)) / len(xs)), min(xs), len(xs)) if xs else None

    summ = dict(kind="summary", device=torch.cuda.get_device_name(), time=time.strftime("%Y-%m-%d %H:%M"),
                **{f"geomean_min_n_{p}": geo(f"ours_vs_{p}") for p in ("ours_det", "sdpa_flash", "fa4_sm120",
                                                                        "frost")},
                best_cell_tflops=max((r.get("ours_tflops", 0) for r in rows), default=None))
    print(json.dumps(summ), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows + [summ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
