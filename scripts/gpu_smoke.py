"""One call per representative configuration against torch SDPA; prints compile and call times.  GPU only."""

import sys
import time

import torch
import torch.nn.functional as F

import flash_attn_4_sm120 as fa


def main():
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device")
        return 2
    print("device:", torch.cuda.get_device_name(), flush=True)
    bad = 0
    for d, dv, causal, hq, hkv in [(128, 128, False, 8, 2), (128, 128, True, 8, 8), (64, 64, True, 4, 4),
                                   (256, 256, False, 4, 4), (192, 128, True, 4, 4)]:
        q = torch.randn(2, 333, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 333, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 333, hkv, dv, device="cuda", dtype=torch.bfloat16)
        t0 = time.time()
        out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        t1 = time.time()
        kk = k.repeat_interleave(hq // hkv, 2).transpose(1, 2).float()
        vv = v.repeat_interleave(hq // hkv, 2).transpose(1, 2).float()
        if d == dv:
            ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kk, vv, is_causal=causal).transpose(1, 2)
        else:
            s = (q.transpose(1, 2).float() @ kk.transpose(-1, -2)) / d ** 0.5
            if causal:
                s = s.masked_fill(torch.ones(333, 333, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
            ref = (s.softmax(-1) @ vv).transpose(1, 2)
        err = (out.float() - ref).abs().max().item()
        ok = err < 2e-2 and torch.isfinite(lse).all().item()
        bad += not ok
        print(f"d={d} dv={dv} causal={causal} hq/hkv={hq}/{hkv}: max err {err:.2e}, first call {t1 - t0:.2f} s "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
