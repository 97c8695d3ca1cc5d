"""JIT latency: the first call of a configuration in a fresh process, from the prebuilt set, from a warm disk cache
and compiled (cold JIT).  GPU only.

    python benchmarks/bench_jit.py [--prebuilt-dir DIR] [--out FILE]

Each measurement is a new interpreter.  The call is a cell of the benchmark grid (Llama-3-8B shaped, B=4, S=4096,
causal, bf16), so its forward and backward configurations are in the declared prebuilt set:

* ``first_forward_s``: the first ``flash_attn_func`` call (what a notebook waits for), synchronised;
* ``first_fwd_bwd_s``: in another new process, the first forward and ``backward`` together;

for three sources: ``cold_jit`` (empty disk cache, prebuilt off: compile), ``warm_disk`` (the cache the cold run
left, prebuilt off) and ``prebuilt`` (empty disk cache, the set in ``--prebuilt-dir``: a bundle's
``prebuilt`` directory built for this device's arch, e.g. by ``scripts/build_bundle.py --prebuilt --arch
sm_90a --out DIR``, which leaves it in ``DIR/torch-cuda/prebuilt``).  Without ``--prebuilt-dir`` the prebuilt row is skipped.  The child
also reports how many configurations it compiled and whether it imported CuTe-DSL.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import jit
compiles = []
real = jit.compile_kernel
jit.compile_kernel = lambda cfg, **kw: compiles.append(cfg.name()) or real(cfg, **kw)
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda h: torch.randn(4, 4096, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
q, k, v = mk(32), mk(8), mk(8)
BWD = sys.argv[1] == "bwd"
if BWD:
    q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
torch.cuda.synchronize()
t0 = time.perf_counter()
out, _ = fa.flash_attn_func(q, k, v, causal=True)
if BWD:
    out.backward(torch.ones_like(out))
torch.cuda.synchronize()
t1 = time.perf_counter()
print("RESULT " + json.dumps(dict(seconds=t1 - t0, compiles=compiles, cutlass_imported="cutlass" in sys.modules)))
"""


def run(env_extra: dict, which: str) -> dict:
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD, which], env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(line[0][len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuilt-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="append the row to this jsonl file")
    args = ap.parse_args(argv)
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("fwd", "bwd"):
            cache = str(Path(tmp) / f"cache-{which}")
            off = dict(FA4_SM120_CACHE_DIR=cache, FA4_SM120_PREBUILT="0")
            rows.append(dict(source="cold_jit", call=which, **run(off, which)))
            rows.append(dict(source="warm_disk", call=which, **run(off, which)))
            if args.prebuilt_dir is not None:
                empty = str(Path(tmp) / f"empty-{which}")
                rows.append(dict(source="prebuilt", call=which, **run(
                    dict(FA4_SM120_CACHE_DIR=empty, FA4_SM120_PREBUILT_DIR=str(args.prebuilt_dir)), which)))
    res = dict(kind="first_call", device=torch.cuda.get_device_name(), torch=torch.__version__,
               shape="B=4 S=4096 Hq=32 Hkv=8 d=128 causal bf16",
               rows=[{**r, "seconds": round(r["seconds"], 3), "compiles": len(r["compiles"])} for r in rows])
    print(json.dumps(res))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
