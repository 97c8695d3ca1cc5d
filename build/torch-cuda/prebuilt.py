"""Prebuilt kernels shipped in the bundle: ``prebuilt/<arch>/<digest>.so`` with ``prebuilt/<arch>/manifest.json``.

The publish step (``scripts/build_bundle.py --prebuilt``) compiles the declared set of configurations
(``prebuilt_set.json``, derived from the transformers scenarios, the README examples and the benchmark grids by
``scripts/prebuilt_set.py``) for each arch and writes, per arch, the exported objects linked into shared libraries
that name no library path (the CuTe-DSL runtime and tvm-ffi are loaded into the process first, by name from the
installed packages), and a manifest: the arch, the cutlass-dsl and tvm-ffi versions and a digest of the package
sources they were built with, and per configuration its key, its file and the file's sha256.

``jit.get_kernel`` asks ``load`` at the first use of a key in a process, before the user's disk cache and the
compiler:

* the manifest of the running arch is read once per process; when its versions or sources differ from the
  running ones, or the directory can be written by another user (the disk cache's rule), the whole set is
  ignored with one log line, and so is an arch the bundle has no set for;
* a file is loaded only after its sha256 matches the manifest; a missing or damaged file is skipped with a
  warning that names it, and that configuration alone falls back to the disk cache or the compiler;
* nothing here ever writes to the bundle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from . import compile_cache

log = logging.getLogger("flash_attn_4_sm120")

FORMAT = 1
MANIFEST = "manifest.json"
_STATE: dict[str, dict | None] = {}  # arch -> {"dir", "entries"} of a usable set, or None (checked once)
_WARNED: set[str] = set()
_LOCK = threading.Lock()
_RUNTIME_READY = False


def root() -> Path:
    """Where the bundle keeps its prebuilt sets (``FA4_SM120_PREBUILT_DIR`` overrides it, for tests).  Not
    resolved: in the Hub cache the package's files are symlinks into a blob store (compile_cache.source_digest)."""
    forced = os.environ.get("FA4_SM120_PREBUILT_DIR")
    return Path(forced) if forced else Path(__file__).absolute().parent / "prebuilt"


def key_digest(key: tuple) -> str:
    """The file stem of a key (the disk cache names its entries the same way)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def source_digest() -> str:
    """sha256 of the package's Python sources (not of the prebuilt objects): a prebuilt kernel is used only with
    the sources it was compiled from."""
    return compile_cache.source_digest()


def runtime_versions() -> dict:
    return {"cutlass_dsl": compile_cache.dist_version("nvidia-cutlass-dsl"),
            "tvm_ffi": compile_cache.dist_version("apache-tvm-ffi")}


def _untrusted(d: Path) -> str | None:
    """Why ``d`` may hold a file another user planted (the disk cache's rule, except that root may own it: a
    system-wide install), else None."""
    if not hasattr(os, "getuid"):  # no POSIX ownership to check
        return None
    try:
        st = d.stat()
    except OSError as exc:
        return f"it cannot be inspected ({exc})"
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}) or root"
    if st.st_mode & 0o022:
        return f"other users can write to it (mode {oct(st.st_mode & 0o777)})"
    return None


def _open_set(arch: str) -> dict | None:
    base = root()
    d = base / arch
    manifest_path = d / MANIFEST
    if not manifest_path.is_file():
        if base.is_dir():
            have = sorted(p.name for p in base.iterdir() if (p / MANIFEST).is_file())
            log.info("no prebuilt kernels for %s in this bundle (it has %s); kernels compile on first use",
                     arch, ", ".join(have) or "none")
        return None
    for part in (base, d):
        reason = _untrusted(part)
        if reason is not None:
            log.warning("not using the prebuilt kernels in %s: %s; kernels compile on first use", part, reason)
            return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("not using the prebuilt kernels in %s: %s is unreadable (%s)", d, manifest_path, exc)
        return None
    want = {**runtime_versions(), "sources": source_digest(), "arch": arch, "format": FORMAT}
    built = {k: manifest.get(k) for k in want}
    if built != want:
        diff = ", ".join(f"{k} {built[k]} (running {want[k]})" for k in want if built[k] != want[k])
        log.warning("not using the prebuilt kernels in %s: built for %s; kernels compile on first use", d, diff)
        return None
    return {"dir": d, "entries": manifest.get("entries", {})}


def _ready_runtime() -> None:
    """Load the CuTe-DSL runtime and tvm-ffi libraries globally (the prebuilt objects name no library path).
    Found from the installed packages without importing CuTe-DSL; if that fails, CuTe-DSL is asked."""
    global _RUNTIME_READY
    if _RUNTIME_READY:
        return
    import ctypes
    import importlib.util

    import tvm_ffi  # noqa: F401  (loads libtvm_ffi)

    libs = []
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        libs += sorted(Path(loc).glob("cu*/lib/libcute_dsl_runtime.so"))
    if len(libs) != 1:  # none, or one per CUDA major: let CuTe-DSL pick
        import cutlass.cute as cute

        libs = [Path(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)]
    for lib in libs:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    _RUNTIME_READY = True


def _warn_once(path: Path, what: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("prebuilt kernel %s %s; compiling this configuration instead", path, what)


def load(key: tuple, cfg):
    """The prebuilt kernel of ``key``, verified against the manifest, or None (not in the set, no usable set, a
    missing or damaged file)."""
    arch = key[-1]
    with _LOCK:
        if arch not in _STATE:
            _STATE[arch] = _open_set(arch)
    state = _STATE[arch]
    if state is None:
        return None
    entry = state["entries"].get(key_digest(key))
    if entry is None or entry.get("key") != repr(key):
        return None
    path = state["dir"] / entry["file"]
    t0 = time.perf_counter()
    try:
        ok = compile_cache.sha256_file(path) == entry["sha256"]
    except OSError:
        _warn_once(path, "is missing or unreadable")
        return None
    if not ok:
        _warn_once(path, "does not match the sha256 in its manifest (damaged or replaced)")
        return None
    try:
        _ready_runtime()
        import tvm_ffi

        fn = tvm_ffi.load_module(str(path))[compile_cache.EXPORT_NAME]
    except Exception as exc:  # e.g. a runtime library that does not resolve its symbols
        _warn_once(path, f"could not be loaded ({type(exc).__name__}: {exc})")
        return None
    log.debug("loaded prebuilt %s from %s in %.3f s", cfg.name(), path, time.perf_counter() - t0)
    return fn


def reset() -> None:
    """Forget what was read (tests; a process reads each arch's manifest once)."""
    _STATE.clear()
    _WARNED.clear()
