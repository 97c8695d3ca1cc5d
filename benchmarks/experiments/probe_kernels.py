"""Per-kernel GPU times (torch.profiler) of single calls, for deciding where the time of an issue's case goes
(a tuning aid, not a peer benchmark).

    python benchmarks/experiments/probe_kernels.py decode [--splits 0 32 64 128 256]  # MQA/GQA: attention vs combine
    python benchmarks/experiments/probe_kernels.py mods        # causal/document block masks, fwd+bwd
    python benchmarks/experiments/probe_kernels.py dropout [--rounds 10]  # d128 S4K dropout fwd (see --rounds)

``dropout --rounds R`` compiles the kernels with R Philox rounds (an experiment: the shipped contract is
dropout.PHILOX_ROUNDS); run each R in its own process with its own FA4_SM120_CACHE_DIR, since the compile key
does not hold the round count.  Rows go to stdout as JSON lines (and to --out when given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import time_fn  # noqa: E402


def kernel_times(fn):
    """us per call of every CUDA kernel ``fn`` launches (torch profiler, 5 calls after one warm-up), names without
    the package prefix."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return {e.key.replace("kernel_cutlass_kernel_flash_attn_4_sm120kernels", "")[:48]:
            round(e.device_time_total / e.count, 2)
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count}


def _emit(rows, row):
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def probe_decode(args, rows):
    import flash_attn_4_sm120 as fa
    from bench_decode import copy_gbps, make_cache, time_graph

    copy_bw = copy_gbps()
    cases = (("mqa", 1, 32768, 32, 1, 128, 0), ("mqa", 8, 8192, 32, 1, 128, 0), ("mqa", 64, 2048, 32, 1, 128, 0),
             ("d128", 1, 32768, 32, 8, 128, 0), ("d128_p16", 1, 32768, 32, 8, 128, 16))
    with torch.no_grad():
        for case, b, kv, hq, hkv, d, ps in cases:
            gen = torch.Generator(device="cuda").manual_seed(0)
            kc, vc, table = make_cache(b, kv, hkv, d, ps, gen)
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            kv_bytes = b * kv * hkv * d * 4
            ref = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, num_splits=1)
            for n in args.splits:
                def fn(n=n, kc=kc, vc=vc, table=table):
                    return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                                      num_splits=n)
                err = (fn().float() - ref.float()).abs().max().item()
                g_ms = time_graph(fn)
                _emit(rows, dict(probe="decode", case=case, batch=b, kv_len=kv, hkv=hkv, page_size=ps or None,
                                 splits=n, max_err=err, graph_ms=g_ms,
                                 graph_pct_of_copy=kv_bytes / g_ms / 1e6 / copy_bw, kernels_us=kernel_times(fn)))
            del kc, vc, table
            torch.cuda.empty_cache()


def probe_mods(args, rows):
    import flash_attn_4_sm120 as fa
    from bench_mods import _blocks_causal, document_case
    from flash_attn_4_sm120 import mods

    h, d, bs, n = 16, 128, 128, 16384
    g = torch.Generator(device="cuda").manual_seed(0)

    def both(tag, fn, q, k, v, gout):
        with torch.no_grad():
            fwd = kernel_times(lambda: fn(q, k, v))
        out = fn(q, k, v)[0]
        bwd = kernel_times(lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True))
        _emit(rows, dict(probe="mods", case=tag, fwd_kernels_us=fwd, bwd_kernels_us=bwd,
                         fwd_total_us=round(sum(fwd.values()), 1), bwd_total_us=round(sum(bwd.values()), 1)))

    s = 4096
    b = n // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    gout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    diag, below = _blocks_causal(s, bs)
    bst = fa.block_sparse_from_mask(diag, (bs, bs), full_mask=below)
    both("causal=True", lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, causal=True), q, k, v, gout)
    both("causal_blocks+mask_mod", lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, block_sparse_tensors=bst,
                                                                         **mods.causal()), q, k, v, gout)
    both("causal_blocks+causal", lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, block_sparse_tensors=bst,
                                                                       causal=True), q, k, v, gout)
    offsets, lens, q, k, v, gout, ids, bst = document_case(n, h, d, bs, g)
    mx = max(lens)
    both("documents_varlen", lambda q_, k_, v_: fa.flash_attn_varlen_func(
        q_[0], k_[0], v_[0], cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=mx, max_seqlen_k=mx),
        q, k, v, gout[0])
    both("documents_blocks+mask_mod", lambda q_, k_, v_: fa.flash_attn_func(
        q_, k_, v_, block_sparse_tensors=bst, aux_tensors=[ids], **mods.document()), q, k, v, gout)
    # the same blocks without the mask_mod (mask blocks unmasked: a wrong result, timed only to split the cost
    # of the block walk and granularity from the cost of the mask_mod)
    both("documents_blocks_no_mod", lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, block_sparse_tensors=bst),
         q, k, v, gout)


def probe_dropout(args, rows):
    from flash_attn_4_sm120 import dropout as drop_mod

    drop_mod.PHILOX_ROUNDS = args.rounds  # before the kernels' modules import it (first compile)
    import flash_attn_4_sm120 as fa
    from bench_fwd import flops

    b, s, h, d = 4, 4096, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for causal in (False, True):
        res = {}
        with torch.no_grad():
            for p in (0.0, 0.1):
                res[p] = time_fn(lambda: fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p), iters=30)
        f = flops(b, h, s, d, causal)
        _emit(rows, dict(probe="dropout", rounds=args.rounds, causal=causal, ms_no_dropout=res[0.0],
                         ms_dropout=res[0.1], ratio=res[0.0] / res[0.1], tflops_dropout=f / res[0.1] / 1e9,
                         device=torch.cuda.get_device_name()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("decode", "mods", "dropout"))
    ap.add_argument("--splits", nargs="*", type=int, default=[0, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_kernels: no CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    dict(decode=probe_decode, mods=probe_mods, dropout=probe_dropout)[args.what](args, rows)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
