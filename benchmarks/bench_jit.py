"""First-call latency: the first call of a configuration in a fresh process, from the prebuilt set, from a warm disk
cache and compiled (cold JIT).  GPU only.

    python benchmarks/bench_jit.py --build-prebuilt DIR [--jobs 15] [--repeat 3] [--out FILE]
    python benchmarks/bench_jit.py --prebuilt-dir DIR/torch-cuda/prebuilt [--repeat 3] [--out FILE]

Each measurement is a new interpreter with an empty user cache.  The call is a cell of the benchmark grid
(Llama-3-8B shaped, B=4, S=4096, causal, bf16), so its forward and backward configurations are in the declared
prebuilt set of every arch (tests/packaging/test_first_call.py checks it):

* ``fwd``: the first ``flash_attn_func`` call (what a notebook waits for), synchronised;
* ``fwd_bwd``: in another new process, the first forward and ``backward(grad)`` together.  torch's first
  backward given an explicit grad imports sympy (``torch.autograd._make_grads``: 2.7 s on the loaded 2-core CPU
  machine, ``benchmarks/experiments/results/prebuilt_first_call_cpu_s32.jsonl``; any attention pays it); the child
  pays it on a one-element tensor before the clock starts and reports it as ``torch_autograd_first_s``.

for the sources ``cold_jit`` (empty disk cache, prebuilt off: compile, once), ``warm_disk`` (the cache the cold run
left, prebuilt off), ``prebuilt`` (empty disk cache, the set of ``--prebuilt-dir``) and ``sdpa`` (torch's
``scaled_dot_product_attention`` in a fresh process: what any attention's first call costs on this machine: CUDA's
lazy module loading and the allocator).  ``--build-prebuilt DIR`` first builds the bundle with this device's
arch's set into DIR through the publish path (``build_bundle.build(..., prebuilt=...)``, what ``publish.py
--prebuilt`` calls), unless DIR already holds it, and uses ``DIR/torch-cuda/prebuilt``.

Each child also reports where its time went: ``load_s`` (inside ``prebuilt.load`` / ``compile_cache.load``, of which
``runtime_s``, for the prebuilt set, imports tvm-ffi and loads the CuTe-DSL runtime library), ``compile_s``
(compile, export and link into the disk cache) and the rest (launches, allocation, the GPU's first module
loads), the number of configurations compiled and loaded from the set, whether CuTe-DSL was imported, and the
second call's time.  Rows: the median run of each (source, call) and every run's seconds.
The README's first-call table (``scripts/readme_sections.py``) reads the last line of
``benchmarks/results/first_call_h100.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(batch=4, seqlen=4096, heads=32, kv_heads=8, head_dim=128)
SHAPE_TEXT = "B=4 S=4096 Hq=32 Hkv=8 d=128 causal bf16"
CALLS = ("fwd", "fwd_bwd")


# -- the child: one fresh process -----------------------------------------------------------------------------------
def child(call: str, impl: str) -> dict:
    t_start = time.perf_counter()
    import torch

    spent = {"load_s": 0.0, "runtime_s": 0.0, "compile_s": 0.0}
    counts = {"compiles": 0, "prebuilt_loaded": 0, "disk_loaded": 0}
    if impl == "ours":
        import flash_attn_4_sm120 as fa
        from flash_attn_4_sm120 import compile_cache, jit, prebuilt

        def timed(mod, name, field, count=None, hit=lambda r: r is not None):
            real = getattr(mod, name)

            def wrapper(*a, **kw):
                t = time.perf_counter()
                try:
                    r = real(*a, **kw)
                finally:
                    spent[field] += time.perf_counter() - t
                if count is not None and hit(r):
                    counts[count] += 1
                return r

            setattr(mod, name, wrapper)

        timed(prebuilt, "load", "load_s", "prebuilt_loaded")
        timed(prebuilt, "_ready_runtime", "runtime_s")
        timed(compile_cache, "load", "load_s", "disk_loaded")
        timed(compile_cache, "load_runtime_libs", "runtime_s")
        timed(jit, "compile_kernel", "compile_s", "compiles", hit=lambda r: True)
        timed(compile_cache, "store", "compile_s")  # export and link into the disk cache: part of a cold call
    import_s = time.perf_counter() - t_start
    b, s, h, hkv, d = (SHAPE[k] for k in ("batch", "seqlen", "heads", "kv_heads", "head_dim"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    bwd = call == "fwd_bwd"
    autograd_first = None
    if bwd:
        for t in (q, k, v):
            t.requires_grad_()
        x = torch.ones(1, device="cuda", requires_grad=True)
        t = time.perf_counter()
        (x * 2).backward(torch.ones_like(x))  # an explicit grad: torch's one-time sympy import, not attention's
        torch.cuda.synchronize()
        autograd_first = time.perf_counter() - t
    grad = torch.ones(b, s, h, d, device="cuda", dtype=torch.bfloat16) if bwd else None
    torch.cuda.synchronize()

    def once() -> float:
        t0 = time.perf_counter()
        if impl == "ours":
            out, _ = fa.flash_attn_func(q, k, v, causal=True)
        else:  # SDPA takes (B, H, S, D)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        if bwd:
            out.backward(grad)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = once()
    second = once()
    res = {"seconds": first, "second_s": second, "import_s": import_s, "torch_autograd_first_s": autograd_first}
    if impl == "ours":
        res.update(**spent, **counts, cutlass_imported="cutlass" in sys.modules)
    # tvm-ffi's fast torch exchange: torch's own C API (torch >= 2.10), or an addon tvm-ffi builds with a C++
    # compiler at its first import with an empty ~/.cache/tvm-ffi (a compile inside the first load) on older torch
    res["torch_dlpack_c_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    dl = sys.modules.get("tvm_ffi._optional_torch_c_dlpack")
    res["tvm_ffi_addon_loaded"] = None if dl is None else getattr(dl, "_LIB", None) is not None
    return res


# -- the parent --------------------------------------------------------------------------------------------------
def run_child(call: str, impl: str, env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "torch-ext"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", call, "--impl", impl],
                          env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"child {call}/{impl} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(line[0][len("RESULT "):])


def summarize(source: str, call: str, runs: list[dict]) -> dict:
    """The row of one (source, call): the run with the median first-call time, rounded, plus every run's time."""
    order = sorted(runs, key=lambda r: r["seconds"])
    med = order[(len(order) - 1) // 2]
    row = {"source": source, "call": call, "runs": len(runs), "all_s": [round(r["seconds"], 3) for r in runs]}
    for key, val in med.items():
        row[key] = round(val, 4) if isinstance(val, float) else val
    if "load_s" in med:
        row["rest_s"] = round(med["seconds"] - med["load_s"] - med["compile_s"], 4)
    return row


def build_set(build_dir: Path, jobs: int | None) -> tuple[Path, dict]:
    """The bundle with this device's arch's prebuilt set, built through the publish path into ``build_dir``
    (reused when it already holds that set); returns (the prebuilt dir, a summary)."""
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "torch-ext")]
    import build_bundle
    from flash_attn_4_sm120 import device

    arch = device.device_caps(0).arch
    prebuilt_dir = build_dir / build_bundle.VARIANT / "prebuilt"
    t0 = time.perf_counter()
    if not (prebuilt_dir / arch / "manifest.json").is_file():
        build_bundle.build(ROOT, build_dir, prebuilt=dict(archs=[arch], jobs=jobs))
    manifest = json.loads((prebuilt_dir / arch / "manifest.json").read_text())
    size = sum(e["bytes"] for e in manifest["entries"].values())
    return prebuilt_dir, {"arch": arch, "configurations": len(manifest["entries"]), "mb": round(size / 1e6, 2),
                          "build_s": round(time.perf_counter() - t0, 1)}


def measure(prebuilt_dir: Path | None, repeat: int, say=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for call in CALLS:
            cache = str(Path(tmp) / f"cache-{call}")
            off = dict(FA4_SM120_CACHE_DIR=cache, FA4_SM120_PREBUILT="0")
            plan = [("cold_jit", "ours", 1, lambda i: off),
                    ("warm_disk", "ours", repeat, lambda i: off)]
            if prebuilt_dir is not None:
                plan.append(("prebuilt", "ours", repeat, lambda i: dict(
                    FA4_SM120_CACHE_DIR=str(Path(tmp) / f"empty-{call}-{i}"), FA4_SM120_PREBUILT="1",
                    FA4_SM120_PREBUILT_DIR=str(prebuilt_dir))))
            plan.append(("sdpa", "sdpa", repeat, lambda i: {}))
            for source, impl, n, env in plan:
                runs = [run_child(call, impl, env(i)) for i in range(n)]
                rows.append(summarize(source, call, runs))
                say(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=CALLS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("ours", "sdpa"), default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--prebuilt-dir", type=Path, default=None,
                    help="a bundle's prebuilt directory (<build>/torch-cuda/prebuilt) holding this device's arch")
    ap.add_argument("--build-prebuilt", type=Path, default=None, metavar="DIR",
                    help="build the bundle with this device's arch's set into DIR (kept; reused when present)")
    ap.add_argument("--jobs", type=int, default=None, help="compile workers of --build-prebuilt")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per warm_disk / prebuilt / sdpa row")
    ap.add_argument("--out", type=Path, default=None, help="append the run as one line to this jsonl file")
    args = ap.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child, args.impl)))
        return 0
    if args.prebuilt_dir is not None and args.build_prebuilt is not None:
        ap.error("give --prebuilt-dir or --build-prebuilt, not both")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    import torch

    if not torch.cuda.is_available():
        print("bench_jit needs a CUDA device", file=sys.stderr)
        return 2
    prebuilt_dir, built = args.prebuilt_dir, None
    if args.build_prebuilt is not None:
        prebuilt_dir, built = build_set(args.build_prebuilt.resolve(), args.jobs)
        print(json.dumps({"prebuilt_set": built}), flush=True)
    rows = measure(prebuilt_dir, args.repeat)
    res = dict(kind="first_call", device=torch.cuda.get_device_name(), torch=torch.__version__, shape=SHAPE_TEXT,
               prebuilt_set=built, rows=rows)
    print(json.dumps(res))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
