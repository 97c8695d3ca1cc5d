"""Compile the declared prebuilt set into a bundle variant (``build_bundle.py --prebuilt`` and ``publish.py
--prebuilt`` call ``build_into``).

For each arch, each configuration of ``prebuilt_set.json`` (written by ``scripts/prebuilt_set.py``) is compiled
for that arch in a worker process, exported (``export_to_c``) and linked into ``prebuilt/<arch>/<digest>.so``
with no library path (the runtime loads the CuTe-DSL runtime and tvm-ffi into the process first:
``flash_attn_4_sm120/prebuilt.py``).  ``prebuilt/<arch>/manifest.json`` is written last: format, arch, the
cutlass-dsl and tvm-ffi versions, the digest of the package sources, and per configuration its key, name, file,
size and sha256.  The configurations are rebuilt from the committed key texts and checked to give the same text
back; ``--sample N`` builds a deterministic sample (one configuration of each kernel kind, cheapest kinds first),
what CI builds to prove the path.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_PARENT = ROOT / "torch-ext"
# cheapest to compile first: the sample takes one of each kind in this order
KIND_ORDER = ("FlashBwdPreprocess", "FlashBwdDqConvert", "FlashCombine", "FlashFwdDecode", "FlashFwdCpAsync",
              "FlashFwdTma", "FlashBwdDq", "FlashBwdDkdv", "FlashBwdDkdvKvRows")


class PrebuiltError(Exception):
    """The prebuilt set cannot be built; the message says what to do."""


def _package():
    if str(PACKAGE_PARENT) not in sys.path:
        sys.path.insert(0, str(PACKAGE_PARENT))
    import flash_attn_4_sm120

    return flash_attn_4_sm120


def key_from_text(text: str) -> tuple:
    """The compile key whose repr is ``text`` (only the package's frozen config classes can be named)."""
    import dataclasses

    _package()
    from flash_attn_4_sm120 import config, config_bwd, config_combine, config_decode, modspec

    names = {}
    for mod in (config, config_bwd, config_combine, config_decode, modspec):
        for name, value in vars(mod).items():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                names[name] = value
    try:
        key = eval(text, {"__builtins__": {}}, names)  # noqa: S307  (our own committed file, names restricted)
    except Exception as exc:
        raise PrebuiltError(f"prebuilt_set.json names a key that no longer builds ({exc}): {text[:200]}. Run "
                            "python scripts/prebuilt_set.py and commit it.") from None
    if repr(key) != text:
        raise PrebuiltError(f"prebuilt_set.json key does not round-trip: {text[:200]}. Run python "
                            "scripts/prebuilt_set.py and commit it.")
    return key


def set_entries(package_dir: Path, arch: str) -> list[dict]:
    path = package_dir / "prebuilt_set.json"
    if not path.is_file():
        raise PrebuiltError(f"{path} not found: run python scripts/prebuilt_set.py and commit it.")
    sets = json.loads(path.read_text())["sets"]
    if arch not in sets:
        raise PrebuiltError(f"{path} has no set for {arch} (it has {', '.join(sets)}); add the arch to "
                            "prebuilt_set.DEVICES and run python scripts/prebuilt_set.py.")
    return sets[arch]


def sample(entries: list[dict], n: int) -> list[dict]:
    """One entry of each kernel kind (cheapest kinds first, the first name of each kind), ``n`` in all."""
    picked = []
    for kind in KIND_ORDER:
        of_kind = sorted((e for e in entries if e["kernel"] == kind), key=lambda e: e["name"])
        if of_kind:
            picked.append(of_kind[0])
        if len(picked) == n:
            break
    return picked


def _compile_one(key_text: str, arch: str, dest: str) -> dict:
    """Worker: compile, export and link one configuration; returns its manifest entry."""
    os.environ["CUTE_DSL_ARCH"] = arch
    key = key_from_text(key_text)
    from flash_attn_4_sm120 import compile_cache, jit, prebuilt

    if key[-1] != arch or jit.kernel_key(key[1]) != key:
        raise PrebuiltError(f"{key_text[:200]} is not the key jit makes for it on {arch}")
    fn = jit.compile_kernel(key[1])
    digest = prebuilt.key_digest(key)
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / f"{digest}.o"
        fn.export_to_c(object_file_path=str(obj), function_name=compile_cache.EXPORT_NAME)
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise PrebuiltError("no C compiler (cc, gcc or $CC): the prebuilt objects are linked into shared "
                                "libraries; install one")
        so = Path(dest) / f"{digest}.so"
        res = subprocess.run([cc, "-shared", "-o", str(so), str(obj)], capture_output=True, text=True)
        if res.returncode != 0:
            raise PrebuiltError(f"{cc} could not link {key[1].name()}: {res.stderr.strip()[:500]}")
    return {"digest": digest, "key": key_text, "name": key[1].name(), "kernel": key[0], "file": so.name,
            "bytes": so.stat().st_size, "sha256": compile_cache.sha256_file(so)}


def build_arch(variant: Path, arch: str, entries: list[dict], jobs: int, say=print) -> dict:
    """Write ``variant/prebuilt/<arch>/`` (objects, then the manifest); returns the manifest."""
    _package()
    from flash_attn_4_sm120 import compile_cache, prebuilt

    dest = variant / "prebuilt" / arch
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    built = []
    # spawned, not forked: the caller may hold a CUDA context (the GPU proof), which a forked child must not use
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_compile_one, e["key"], arch, str(dest)) for e in entries]
        for i, fut in enumerate(futures):
            built.append(fut.result())
            say(f"  [{arch} {i + 1}/{len(entries)}] {built[-1]['name']}: {built[-1]['bytes']} bytes")
    sources = compile_cache.source_digest(variant)
    if sources != compile_cache.source_digest():
        raise PrebuiltError(f"the sources in {variant} differ from the package the kernels were compiled from "
                            f"({Path(compile_cache.__file__).parent}); build from one checkout")
    manifest = {"format": prebuilt.FORMAT, "arch": arch, **prebuilt.runtime_versions(), "sources": sources,
                "entries": {b.pop("digest"): b for b in sorted(built, key=lambda b: b["digest"])}}
    (dest / prebuilt.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def size_row(manifest: dict, *, sample_size: int | None, jobs: int, seconds: float) -> dict:
    """The results row of one built arch (``--report``; the README's prebuilt-size table reads the rows whose
    ``sample`` is None): objects, bytes in all and per kernel kind, the largest object, how long the build took
    on how many workers, and the versions and sources it was built from."""
    entries = list(manifest["entries"].values())
    total = sum(e["bytes"] for e in entries)
    kinds: dict[str, list[int]] = {}
    for e in entries:
        count_bytes = kinds.setdefault(e["kernel"], [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += e["bytes"]
    return {"kind": "prebuilt_size", "arch": manifest["arch"], "configurations": len(entries),
            "sample": sample_size, "bytes": total, "mb": round(total / 1e6, 2),
            "largest_kb": round(max((e["bytes"] for e in entries), default=0) / 1e3, 1),
            "by_kernel": {k: {"objects": c, "mb": round(b / 1e6, 2)} for k, (c, b) in sorted(kinds.items())},
            "build_s": round(seconds, 1), "jobs": jobs, "cpus": os.cpu_count(),
            "cutlass_dsl": manifest["cutlass_dsl"], "tvm_ffi": manifest["tvm_ffi"], "libs": _dsl_libs(),
            "sources": manifest["sources"][:16]}


def _dsl_libs() -> str:
    """Which CUDA major's CuTe-DSL libraries compiled the set (``cu12`` on CI's CPU, ``cu13`` on the GPU machines):
    the objects' bytes, and so the size, can differ between them."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    found = sorted({p.parent.parent.name for loc in locations for p in Path(loc).glob("cu*/lib/libcute_dsl_runtime.so")})
    return "+".join(found) or "?"


def build_into(variant: Path, archs: list[str], *, sample_size: int | None = None, jobs: int | None = None,
               report: Path | None = None, say=print) -> dict[str, dict]:
    """The prebuilt sets of ``archs`` into the rendered variant ``variant`` (its package files already copied);
    ``report``: a jsonl file that gets one ``size_row`` per arch appended."""
    import time

    jobs = jobs or max(1, (os.cpu_count() or 2) - 1)
    manifests = {}
    for arch in archs:
        entries = set_entries(variant, arch)
        if sample_size is not None:
            entries = sample(entries, sample_size)
        say(f"prebuilt {arch}: {len(entries)} configurations, {jobs} workers")
        t0 = time.perf_counter()
        manifests[arch] = build_arch(variant, arch, entries, jobs, say)
        row = size_row(manifests[arch], sample_size=sample_size, jobs=jobs, seconds=time.perf_counter() - t0)
        say(f"prebuilt {arch}: {row['configurations']} objects, {row['mb']:.1f} MB, {row['build_s']:.0f} s")
        if report is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            with open(report, "a") as f:
                f.write(json.dumps(row) + "\n")
    return manifests
