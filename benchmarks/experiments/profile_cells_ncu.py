"""Run one cell of bench_fwd.py / bench_bwd.py a few times with nothing else on the GPU, for Nsight Compute (issue
11): ours or SDPA FLASH (FlashAttention-2), forward or backward, so the two can be profiled side by side.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --csv \\
        --launch-skip 3 --launch-count 3 python benchmarks/experiments/profile_cells_ncu.py --shape mha-d64 \\
        --seqlen 1024 --causal --impl ours --direction fwd

``--calls`` calls after the first (warm-up and compile); the backward calls are torch.autograd.grad of one
forward graph (the forward itself runs once, before).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import EXTRA_CELLS, SHAPES, TOKENS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted({**SHAPES, **EXTRA_CELLS}), default="llama3-8b")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impl", choices=("ours", "sdpa_flash"), default="ours")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_cells_ncu: no CUDA GPU", file=sys.stderr)
        return 2
    hq, hkv, d = (SHAPES[args.shape] if args.shape in SHAPES else EXTRA_CELLS[args.shape][:3])
    s, b = args.seqlen, max(1, TOKENS // args.seqlen)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    if args.impl == "ours":
        import flash_attn_4_sm120 as fa

        def fwd():
            return fa.flash_attn_func(q, k, v, causal=args.causal)[0]
        inputs = (q, k, v)
    else:
        kk = k.detach().repeat_interleave(hq // hkv, 2).transpose(1, 2).requires_grad_()
        vv = v.detach().repeat_interleave(hq // hkv, 2).transpose(1, 2).requires_grad_()
        qt = q.detach().transpose(1, 2).requires_grad_()

        def fwd():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kk, vv, is_causal=args.causal)
        inputs = (qt, kk, vv)
    if args.direction == "fwd":
        with torch.no_grad():
            for _ in range(1 + args.calls):
                fwd()
    else:
        out = fwd()
        gout = torch.randn_like(out)
        for _ in range(1 + args.calls):
            torch.autograd.grad(out, inputs, gout, retain_graph=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
