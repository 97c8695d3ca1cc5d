"""Experiment: the fused backward's dK/dV warp grid (``kv_warp_rows`` 16 against 32 at d64) on the prefix-LM odd-shape
case of tests/test_mods_gpu.py (b=2, Sq=17, Sk=113, h=2, bf16), with seeded upstream gradients: each grid's error
against an fp32 reference as a ratio to PyTorch's bf16 error (the test's bar is 2x plus 1e-3), the gradients of the
keys no query sees, and whether the two grids' gradients are bitwise equal.

    PYTHONPATH=torch-ext:tests python benchmarks/experiments/probe_kv_grid_bitwise.py --out FILE

Results: benchmarks/experiments/results/mods_kv_grid_bitwise_h200_s37.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seeds", type=int, default=12)
    args = ap.parse_args(argv)
    import torch
    from reference import attention_ref
    from test_mods_gpu import _case, _rand

    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd as cb

    base = cb._FUSED_TILES[64]
    rows, grads = [], {}
    for kv_rows in (16, 32):
        cb._FUSED_TILES[64] = (((64, 128, 8, kv_rows), "all"),) + base[1:]
        for seed in range(args.seeds):
            gen = torch.Generator(device="cuda").manual_seed(1)
            q = _rand(2, 17, 2, 64, gen=gen, grad=True)
            k, v = (_rand(2, 113, 2, 64, gen=gen, grad=True) for _ in range(2))
            mods, _, mask, _ = _case("prefix_lm", 2, 17, 113, 2, gen)
            out = fa.flash_attn_func(q, k, v, **mods)[0]
            g_gen = torch.Generator(device="cuda").manual_seed(100 + seed)
            g = torch.randn(out.shape, device="cuda", generator=g_gen).to(out.dtype)
            ours = torch.autograd.grad(out, (q, k, v), g)
            ref_in = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
            pt_in = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            ref = torch.autograd.grad(attention_ref(*ref_in, mask=mask)[0], ref_in, g.float())
            pt = torch.autograd.grad(attention_ref(*pt_in, mask=mask, upcast=False)[0], pt_in, g)
            row = dict(kv_warp_rows=kv_rows, grad_seed=100 + seed)
            for name, a, b, c in zip(("dq", "dk", "dv"), ours, ref, pt):
                row[name] = float((a.float() - b).abs().max()) / max(float((c.float() - b).abs().max()), 1e-9)
                if name != "dq":  # keys 17.. are seen by no query (prefix 7, causal top-left)
                    row[f"{name}_masked_keys_max"] = float(a[:, 17:].abs().max())
            grads[(kv_rows, seed)] = [t.clone() for t in ours]
            rows.append(row)
    cb._FUSED_TILES[64] = base
    for seed in range(args.seeds):
        a, b = grads[(16, seed)], grads[(32, seed)]
        rows.append(dict(grad_seed=100 + seed, bitwise_16_vs_32=[bool(torch.equal(x, y)) for x, y in zip(a, b)]))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
