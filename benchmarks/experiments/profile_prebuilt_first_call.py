"""Where the host time of a first call from the prebuilt set goes, without a GPU (issue 33's 0.3 s target).

    python benchmarks/experiments/profile_prebuilt_first_call.py --prebuilt-dir DIR [--arch sm_120a] [--repeat 3]
                                                                 [--out FILE]

``DIR`` is a bundle's prebuilt directory (``build_bundle.py --prebuilt --sample 3 --out B`` leaves it in
``B/torch-cuda/prebuilt``).  Every measurement is a fresh interpreter (``CUTE_DSL_ARCH`` names the arch, nothing is
launched, the user cache is empty):

* ``phases``: the steps ``prebuilt.load`` takes at its first use, one after the other: the manifest read and
  parsed, the runtime versions (importlib.metadata), the digest of the package sources, the ownership checks, then
  per object its sha256, tvm-ffi's import and the CuTe-DSL runtime library's dlopen (first object only) and
  ``tvm_ffi.load_module``;
* ``get_kernel``: ``jit.get_kernel`` of every configuration of the set with the compiler made to raise (the sum the
  phases should add up to, and each load's time);
* ``host``: the package import, and the first and second ``flash_attn_func`` (forward; forward + backward) of the
  bench_jit cell with the device, compiler and launches stubbed (tests/plan_grid.py): the host work a first call
  adds besides loading kernels, with torch's first-backward setup timed apart;
* ``manifest_parse_full_s``: json parse of the committed ``prebuilt_set.json`` (both archs' key texts: an upper
  bound of a full manifest's parse).

The GPU part of a first call (the CUDA module load, allocation, launches) is not here: bench_jit.py measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PHASES = r"""
import json, sys, time, os
from pathlib import Path
T = {}
t = time.perf_counter(); import torch; T["import_torch_s"] = time.perf_counter() - t
t = time.perf_counter(); import flash_attn_4_sm120; T["import_package_s"] = time.perf_counter() - t
from flash_attn_4_sm120 import compile_cache, prebuilt
arch = os.environ["CUTE_DSL_ARCH"]
d = prebuilt.root() / arch
t = time.perf_counter(); m = json.loads((d / prebuilt.MANIFEST).read_text()); T["manifest_s"] = time.perf_counter() - t
t = time.perf_counter(); prebuilt.runtime_versions(); T["versions_s"] = time.perf_counter() - t
t = time.perf_counter(); prebuilt.source_digest(); T["source_digest_s"] = time.perf_counter() - t
t = time.perf_counter(); prebuilt._untrusted(prebuilt.root()); prebuilt._untrusted(d); T["trust_s"] = time.perf_counter() - t
T["sha256_s"], T["load_module_s"] = [], []
for i, e in enumerate(m["entries"].values()):
    t = time.perf_counter(); compile_cache.sha256_file(d / e["file"]); T["sha256_s"].append(time.perf_counter() - t)
    if i == 0:
        t = time.perf_counter(); import tvm_ffi; T["import_tvm_ffi_s"] = time.perf_counter() - t
        t = time.perf_counter(); prebuilt._ready_runtime(); T["runtime_lib_s"] = time.perf_counter() - t
    t = time.perf_counter(); tvm_ffi.load_module(str(d / e["file"]))[compile_cache.EXPORT_NAME]
    T["load_module_s"].append(time.perf_counter() - t)
T["cutlass_imported"] = "cutlass" in sys.modules
print("RESULT " + json.dumps(T))
"""

GET_KERNEL = r"""
import json, sys, time, os
sys.path.insert(0, sys.argv[1])
import torch
import flash_attn_4_sm120
from flash_attn_4_sm120 import jit, prebuilt
import prebuilt_build
arch = os.environ["CUTE_DSL_ARCH"]
m = json.loads((prebuilt.root() / arch / prebuilt.MANIFEST).read_text())
keys = [prebuilt_build.key_from_text(e["key"]) for e in m["entries"].values()]
def refuse(cfg, **kw):
    raise RuntimeError("compiled " + cfg.name())
jit.compile_kernel = refuse
each = []
for key in keys:
    t = time.perf_counter(); jit.get_kernel(key[1]); each.append(time.perf_counter() - t)
print("RESULT " + json.dumps({"each_s": each, "total_s": sum(each), "cutlass_imported": "cutlass" in sys.modules}))
"""

HOST = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
t = time.perf_counter(); import torch; import_torch = time.perf_counter() - t
t = time.perf_counter(); import flash_attn_4_sm120 as fa; import_pkg = time.perf_counter() - t
import plan_grid
R = {"import_torch_s": import_torch, "import_package_s": import_pkg}
with plan_grid.stubbed(True, []):
    mk = lambda h: torch.randn(1, 256, h, 128, dtype=torch.bfloat16)
    q, k, v = mk(32), mk(8), mk(8)
    for name in ("fwd_first_s", "fwd_second_s"):
        t = time.perf_counter(); fa.flash_attn_func(q, k, v, causal=True); R[name] = time.perf_counter() - t
    x = torch.ones(1, requires_grad=True)
    t = time.perf_counter(); (x * 2).backward(torch.ones_like(x)); R["torch_autograd_first_s"] = time.perf_counter() - t
    for tt in (q, k, v):
        tt.requires_grad_()
    for name in ("fwd_bwd_first_s", "fwd_bwd_second_s"):
        t = time.perf_counter()
        out, _ = fa.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        R[name] = time.perf_counter() - t
print("RESULT " + json.dumps(R))
"""


def fresh(code: str, env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(line[0][len("RESULT "):])


def median_of(runs: list[dict]) -> dict:
    """Per field, the median over the runs (lists: per position)."""
    out = {}
    for key, val in runs[0].items():
        if isinstance(val, bool) or val is None:
            out[key] = val
        elif isinstance(val, list):
            out[key] = [round(statistics.median(r[key][i] for r in runs), 5) for i in range(len(val))]
        else:
            out[key] = round(statistics.median(r[key] for r in runs), 5)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuilt-dir", type=Path, required=True)
    ap.add_argument("--arch", default="sm_120a")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    env = dict(os.environ, CUTE_DSL_ARCH=args.arch, FA4_SM120_PREBUILT_DIR=str(args.prebuilt_dir.resolve()),
               FA4_SM120_DISK_CACHE="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "torch-ext"), os.environ.get("PYTHONPATH")])))
    manifest = json.loads((args.prebuilt_dir / args.arch / "manifest.json").read_text())
    row = {"kind": "prebuilt_first_call_host", "arch": args.arch, "objects": len(manifest["entries"]),
           "object_bytes": [e["bytes"] for e in manifest["entries"].values()], "repeat": args.repeat,
           "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}
    row["phases"] = median_of([fresh(PHASES, env) for _ in range(args.repeat)])
    row["get_kernel"] = median_of([fresh(GET_KERNEL, env, str(ROOT / "scripts")) for _ in range(args.repeat)])
    row["host"] = median_of([fresh(HOST, env, str(ROOT / "tests")) for _ in range(args.repeat)])
    import time

    text = (ROOT / "torch-ext" / "flash_attn_4_sm120" / "prebuilt_set.json").read_text()
    t = time.perf_counter()
    json.loads(text)
    row["manifest_parse_full_s"] = round(time.perf_counter() - t, 5)
    row["manifest_parse_full_bytes"] = len(text)
    print(json.dumps(row))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
