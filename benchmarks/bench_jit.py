"""JIT latency: first call of a new configuration in a fresh process with an empty disk cache (compile), then
in another fresh process with that cache warm (load).  GPU only.

    python benchmarks/bench_jit.py
"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import logging, time, torch
logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("flash_attn_4_sm120").setLevel(logging.DEBUG)
import flash_attn_4_sm120 as fa
q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t1 = time.perf_counter()
fa.flash_attn_func(q, k, k, causal=True)
torch.cuda.synchronize()
t2 = time.perf_counter()
fa.flash_attn_func(q[:, :333], k[:, :777], k[:, :777], causal=True)
torch.cuda.synchronize()
t3 = time.perf_counter()
import cutlass  # already imported by the first call: this just reads how long that import took
print("RESULT", t2 - t1, t3 - t2)
"""

IMPORT_ONLY = r"""
import time, torch
torch.cuda.init()
t0 = time.perf_counter()
import cutlass.cute, tvm_ffi
print("RESULT", time.perf_counter() - t0, 0.0)
"""


def run(cache_dir, code=CHILD):
    env = dict(os.environ, FA4_SM120_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    for ln in out.stderr.splitlines():
        if ln.startswith("flash_attn_4_sm120:"):
            print(ln, flush=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    first, other_shape = map(float, line[0].split()[1:])
    return first, other_shape


def main():
    with tempfile.TemporaryDirectory() as cache:
        cold, cold_new_len = run(cache)
        warm, warm_new_len = run(cache)
        import_s, _ = run(cache, IMPORT_ONLY)
    res = dict(kind="jit", cold_first_call_s=round(cold, 3), cold_new_lengths_call_s=round(cold_new_len, 4),
               warm_cache_first_call_s=round(warm, 3), warm_new_lengths_call_s=round(warm_new_len, 4),
               cutlass_dsl_import_s=round(import_s, 3),
               note="first-call times include importing cutlass-dsl (imported lazily on the first call)")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
