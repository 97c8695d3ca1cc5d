"""Proof of the prebuilt set on a GPU (the H100 proxy: sm_90a), through the same build path as the publish step.

    python scripts/prebuilt_proof.py [--jobs 15] [--bundle DIR]

1. builds the bundle with the prebuilt set of this device's arch (``build_bundle.build(..., prebuilt=...)``, the
   function ``publish.py --prebuilt`` calls) into a temporary directory and serves it from the local Hub server
   (tests/packaging/hub_server.py);
2. in a fresh process with an empty user cache, loads it through transformers (``attn_implementation=<repo>``,
   i.e. ``kernels.get_kernel``) and runs the Llama scenario of tests/packaging/tf_scenarios.py: forward (dense and
   left-padded), a training step (loss.backward) and greedy generate, with the bundle's compiler replaced by one
   that raises: the run must compile nothing;
3. runs the same in a fresh process with the prebuilt set switched off (``FA4_SM120_PREBUILT=0``, empty cache:
   JIT) and checks logits, loss, every gradient and the generated tokens are bitwise equal; then times the same
   model's first forward with transformers' SDPA in a fresh process (``sdpa_floor``: what a first forward costs
   without this bundle: cuBLAS set-up, CUDA's lazy module loads).  The prebuilt step reports the time spent
   inside ``prebuilt.load`` during the first forward and the second forward's time, so the first forward's
   excess splits into loading, the GPU's first launches, and the model's own first-call costs;
4. damages the bundle (one object's bytes; then the manifest's cutlass-dsl version) and checks, loaded from the
   local path (``LOCAL_KERNELS``), that the run warns naming the file (one line for the version) and compiles
   the damaged configuration only (every configuration for the version), with outputs still bitwise equal.

Prints one JSON line per step and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT / "tests" / "packaging")]
REPO = "kernels-test/flash-attn-4-sm120"


# -- the child: one fresh process -----------------------------------------------------------------------------------
def floor_child() -> None:
    """The same model's first forward with transformers' own SDPA attention, in a fresh process: what the first
    forward costs without this bundle (cuBLAS and CUDA's lazy module loads, the model's other ops)."""
    import torch

    import tf_scenarios as tf

    cfg = tf.make_config("llama")
    model = tf.build(cfg, "sdpa", torch.bfloat16, "cuda")
    ids, mask = tf.inputs(cfg, "cuda", padded=False)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    torch.cuda.synchronize()
    first = time.perf_counter() - t1
    t1 = time.perf_counter()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    torch.cuda.synchronize()
    print(json.dumps({"first_forward_s": first, "second_forward_s": time.perf_counter() - t1}))


def child(out: Path, forbid_compile: bool) -> None:
    import logging

    import torch

    import tf_scenarios as tf

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname}: {record.getMessage()}")

    logging.getLogger("flash_attn_4_sm120").addHandler(Keep())
    logging.getLogger("flash_attn_4_sm120").setLevel(logging.INFO)
    cfg = tf.make_config("llama")
    t0 = time.perf_counter()
    model = tf.build(cfg, REPO, torch.bfloat16, "cuda")
    from transformers import modeling_flash_attention_utils as mfau

    bundle = sys.modules[mfau._flash_varlen_fn.__module__.rsplit(".", 1)[0]]
    import importlib

    jit = importlib.import_module(bundle.__name__ + ".jit")  # no CuTe-DSL import
    compiles = []
    real = jit.compile_kernel

    def counted(cfg, **kw):
        compiles.append(cfg.name())
        if forbid_compile:
            raise RuntimeError(f"the CuTe-DSL compiler was invoked for {cfg.name()}")
        return real(cfg, **kw)

    jit.compile_kernel = counted
    prebuilt = importlib.import_module(bundle.__name__ + ".prebuilt")
    in_load = [0.0]  # seconds inside prebuilt.load during the first forward (manifest, sha256, tvm-ffi, dlopen)
    real_load = prebuilt.load

    def timed_load(*a, **kw):
        t = time.perf_counter()
        try:
            return real_load(*a, **kw)
        finally:
            in_load[0] += time.perf_counter() - t

    prebuilt.load = timed_load
    res: dict = {"load_s": time.perf_counter() - t0}
    ids, mask = tf.inputs(cfg, "cuda", padded=False)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    with torch.no_grad():
        res["logits_dense"] = model(ids, attention_mask=mask).logits
    torch.cuda.synchronize()
    res["first_forward_s"] = time.perf_counter() - t1
    res["first_forward_prebuilt_load_s"] = in_load[0]
    t1 = time.perf_counter()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    torch.cuda.synchronize()
    res["second_forward_s"] = time.perf_counter() - t1
    ids, mask = tf.inputs(cfg, "cuda", padded=True)
    with torch.no_grad():
        res["logits_padded"] = model(ids, attention_mask=mask).logits
    model.train()
    out_ = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out_.loss.backward()
    res["loss"] = out_.loss.detach()
    res["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    ids, mask = tf.inputs(cfg, "cuda", padded=True, batch=3, seq=40)
    with torch.no_grad():
        res["generated"] = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                          do_sample=False, pad_token_id=cfg.pad_token_id)
    torch.cuda.synchronize()
    used = sorted(repr(k) for k in jit._MEMORY)
    torch.save(res, out)
    print(json.dumps({"compiles": compiles, "used_keys": used, "log": records,
                      "cutlass_imported": "cutlass" in sys.modules, "load_s": res["load_s"],
                      "first_forward_s": res["first_forward_s"], "bundle_file": bundle.__file__,
                      "first_forward_prebuilt_load_s": res["first_forward_prebuilt_load_s"],
                      "second_forward_s": res["second_forward_s"]}))


# -- the parent --------------------------------------------------------------------------------------------------
def run_child(env: dict, out: Path | None, forbid: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve())]
    cmd += ["--child", str(out)] + (["--forbid-compile"] if forbid else []) if out is not None else ["--floor"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


def same(a: Path, b: Path) -> list[str]:
    import torch

    x, y = torch.load(a), torch.load(b)
    bad = [k for k in ("logits_dense", "logits_padded", "loss", "generated") if not torch.equal(x[k], y[k])]
    bad += [f"grad {n}" for n in y["grads"] if n not in x["grads"] or not torch.equal(x["grads"][n], y["grads"][n])]
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--forbid-compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--bundle", type=Path, default=None,
                    help="a build directory: used as it is when it holds this arch's prebuilt set (e.g. from "
                         "build_bundle.py --prebuilt --arch sm_90a --out DIR), else built there and kept")
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child, args.forbid_compile)
        return 0
    if args.floor:
        floor_child()
        return 0

    import torch

    import build_bundle
    from hub_server import LocalHub
    from hubtools import isolated_env, seed_bundle

    sys.path.insert(0, str(ROOT / "torch-ext"))
    from flash_attn_4_sm120 import device

    arch = device.device_caps(0).arch
    work = Path(tempfile.mkdtemp(prefix="prebuilt-proof-"))
    failures: list[str] = []

    def report(step, **kw):
        print(json.dumps({"step": step, **kw}), flush=True)

    build_dir = args.bundle or work / "build"
    variant = build_dir / build_bundle.VARIANT
    t0 = time.time()
    if (variant / "prebuilt" / arch / "manifest.json").is_file():
        meta = json.loads((variant / "metadata.json").read_text())
    else:
        meta = build_bundle.build(ROOT, build_dir, prebuilt=dict(archs=[arch], jobs=args.jobs))
    manifest = json.loads((variant / "prebuilt" / arch / "manifest.json").read_text())
    size = sum(e["bytes"] for e in manifest["entries"].values())
    report("build", arch=arch, configurations=len(manifest["entries"]), mb=round(size / 1e6, 2),
           seconds=round(time.time() - t0, 1), id=meta["id"])

    def env_for(name, **extra):
        home = work / name
        home.mkdir()
        return isolated_env(home, FA4_SM120_CACHE_DIR=str(home / "fa4cache"), **extra)

    with LocalHub(work / "hub") as hub:
        seed_bundle(hub.store, REPO, build_dir)
        pre = run_child(env_for("prebuilt", HF_ENDPOINT=hub.endpoint), work / "prebuilt.pt", forbid=True)
        report("prebuilt", compiles=len(pre["compiles"]), kernels=len(pre["used_keys"]),
               cutlass_imported=pre["cutlass_imported"], first_forward_s=round(pre["first_forward_s"], 3),
               first_forward_prebuilt_load_s=round(pre["first_forward_prebuilt_load_s"], 3),
               second_forward_s=round(pre["second_forward_s"], 4), log=pre["log"])
        if pre["compiles"]:
            failures.append(f"prebuilt run compiled {pre['compiles']}")
        ref = run_child(env_for("jit", HF_ENDPOINT=hub.endpoint, FA4_SM120_PREBUILT="0"), work / "jit.pt",
                        forbid=False)
        report("jit", compiles=len(ref["compiles"]), first_forward_s=round(ref["first_forward_s"], 3))
        floor = run_child(env_for("sdpa"), None, forbid=False)
        report("sdpa_floor", first_forward_s=round(floor["first_forward_s"], 3),
               second_forward_s=round(floor["second_forward_s"], 4))
        diff = same(work / "prebuilt.pt", work / "jit.pt")
        report("bitwise", equal=not diff, differs=diff)
        if diff:
            failures.append(f"prebuilt vs JIT differ: {diff}")

    import hashlib

    used = pre["used_keys"]
    for damage in ("corrupt", "version"):
        copy = work / f"build-{damage}"
        shutil.copytree(build_dir, copy, symlinks=False)
        d = copy / build_bundle.VARIANT / "prebuilt" / arch
        m = json.loads((d / "manifest.json").read_text())
        if damage == "corrupt":
            victim = d / m["entries"][hashlib.sha256(used[0].encode()).hexdigest()[:32]]["file"]
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        else:
            m["cutlass_dsl"] = "0.0.0"
            (d / "manifest.json").write_text(json.dumps(m))
        r = run_child(env_for(damage, LOCAL_KERNELS=f"{REPO}={copy}"), work / f"{damage}.pt", forbid=False)
        warn = [ln for ln in r["log"] if "prebuilt" in ln]
        diff = same(work / f"{damage}.pt", work / "jit.pt")
        report(damage, compiles=len(r["compiles"]), kernels=len(r["used_keys"]), log=warn, equal=not diff)
        want = 1 if damage == "corrupt" else len(r["used_keys"])
        if len(r["compiles"]) != want or len(warn) != 1 or diff:
            failures.append(f"{damage}: {len(r['compiles'])} compiles (want {want}), log {warn}, differs {diff}")
        if damage == "corrupt" and not any(victim.name in ln for ln in warn):
            failures.append(f"corrupt: the warning does not name {victim}")
    report("done", ok=not failures, failures=failures, device=torch.cuda.get_device_name())
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
