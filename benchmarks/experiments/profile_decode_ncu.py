"""Run one decode case of bench_decode.py a few times with nothing else on the GPU, for Nsight Compute (issue 8
tuning aid): the split forward and the combine of ``flash_attn_with_kvcache`` with the automatic split count.

    ncu --kernel-name regex:"decode|combine" --launch-skip 4 --launch-count 2 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --csv \\
        python benchmarks/experiments/profile_decode_ncu.py --case mqa
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_decode import make_cache  # noqa: E402

CASES = {  # batch, kv_len, hq, hkv, d (bench_decode's cases)
    "mqa": (1, 32768, 32, 1, 128),
    "mqa_b8": (8, 8192, 32, 1, 128),
    "d128": (1, 32768, 32, 8, 128),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="mqa")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode_ncu: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    b, kv, hq, hkv, d = CASES[args.case]
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v, _ = make_cache(b, kv, hkv, d, 0, g)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
    for _ in range(args.calls):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=0)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
