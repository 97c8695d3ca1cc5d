"""The disk cache of compiled kernels: exported objects under a fingerprint, verified before they are loaded.

* The cache holds exported objects (CuTe-DSL AOT export, ``<key>.o``) under a fingerprint of this package's
  sources, the cutlass-dsl and tvm-ffi versions and the Python version.  When a C compiler is available the
  object is also linked into ``<key>.so``, which a later process loads with tvm-ffi alone, without importing
  CuTe-DSL (whose import is most of a cold first call).  Files are written to a temporary name and renamed, so
  concurrent processes never see a half-written object, and a manifest (``<key>.json``: the key and the sha256
  of each file) is written last.  An entry that does not match its manifest — truncated, zeroed, replaced by
  another configuration's kernel, or left without a manifest — is deleted before anything loads it, and the
  kernel is recompiled and rewritten: a corrupt cache heals itself.  Files are fsynced before the rename and
  readable by their owner only (0600, directories 0700); a cache directory that another user owns or can write
  to is not used at all (one warning naming it and why; kernels are then compiled in memory).
* ``FA4_SM120_CACHE_DIR`` moves the disk cache (default ``~/.cache/flash_attn_4_sm120``);
  ``FA4_SM120_DISK_CACHE=0`` turns it off.

``jit.get_kernel`` asks this module (``entry_path``, ``load``, ``store``) before compiling.
CuTe-DSL is imported on first use, never at import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("flash_attn_4_sm120")

EXPORT_NAME = "fa4sm120_fwd"  # the symbol every exported kernel is written under (one kernel per file)
_FINGERPRINT: str | None = None
_SOURCE_DIGEST: str | None = None  # this package's, hashed once per process (prebuilt.py and fingerprint share it)
_VERSIONS: dict[str, str] = {}
_RUNTIME_LIBS_LOADED = False
_REFUSED_DIRS: set[str] = set()


def disk_cache_dir() -> Path | None:
    if os.environ.get("FA4_SM120_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("FA4_SM120_CACHE_DIR") or os.path.join(Path.home(), ".cache", "flash_attn_4_sm120")
    return Path(root)


def unsafe_reason(d: Path) -> str | None:
    """Why another user could plant a kernel in ``d`` (another owner, group- or world-writable), else None.
    A missing directory is safe: it is created owner-only."""
    if not hasattr(os, "getuid"):  # no POSIX ownership to check
        return None
    try:
        st = d.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"it cannot be inspected ({exc})"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"other users can write to it (mode {oct(st.st_mode & 0o777)}; `chmod go-w {d}` fixes it)"
    return None


def safe_dir(d: Path) -> bool:
    """True when the cache directory ``d`` (and the root above it) is this user's alone; otherwise warn once
    and do not use the disk cache: a kernel loaded from there runs with this process's rights."""
    for part in (d.parent, d):
        reason = unsafe_reason(part)
        if reason is not None:
            if str(part) not in _REFUSED_DIRS:
                _REFUSED_DIRS.add(str(part))
                log.warning("not using the kernel cache in %s: %s; kernels are compiled in memory instead "
                            "(set FA4_SM120_CACHE_DIR to a directory of your own)", part, reason)
            return False
    return True


def dist_version(name: str) -> str:
    """The installed version of distribution ``name`` ("?" when absent), looked up once per process (the
    prebuilt manifest check and the disk cache's fingerprint both ask)."""
    if name not in _VERSIONS:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _VERSIONS[name] = version(name)
        except PackageNotFoundError:
            _VERSIONS[name] = "?"
    return _VERSIONS[name]


def source_digest(pkg: Path | None = None) -> str:
    """sha256 of the Python sources (relative path and bytes of each, sorted) of this package, or of the package
    directory ``pkg``.  The path is not resolved: in the Hub cache each file is a symlink into a blob store, and
    the package is the directory of the links.  This package's digest is computed once per process (the modules
    it describes are the ones already imported)."""
    global _SOURCE_DIGEST
    if pkg is None and _SOURCE_DIGEST is not None:
        return _SOURCE_DIGEST
    h = hashlib.sha256()
    root = pkg or Path(__file__).absolute().parent
    for src in sorted(root.rglob("*.py")):
        h.update(src.relative_to(root).as_posix().encode())
        h.update(src.read_bytes())
    if pkg is None:
        _SOURCE_DIGEST = h.hexdigest()
        return _SOURCE_DIGEST
    return h.hexdigest()


def fingerprint() -> str:
    """The disk cache's directory name: Python version, cutlass-dsl and tvm-ffi versions and the sources' digest
    (shared with the prebuilt check, so a first call that misses the prebuilt set hashes the sources once)."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        h = hashlib.sha256()
        h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
        h.update(f"cutlass={dist_version('nvidia-cutlass-dsl')} tvm_ffi={dist_version('apache-tvm-ffi')}".encode())
        h.update(source_digest().encode())
        _FINGERPRINT = h.hexdigest()[:16]
    return _FINGERPRINT


def load_runtime_libs():
    """Exported objects resolve CuTe-DSL runtime symbols globally; load those libraries once, on demand."""
    global _RUNTIME_LIBS_LOADED
    if _RUNTIME_LIBS_LOADED:
        return
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _RUNTIME_LIBS_LOADED = True


def entry_path(key: tuple) -> Path | None:
    root = disk_cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return root / fingerprint() / f"{digest}.o"



def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _verified_files(key: tuple, path: Path) -> list[Path]:
    """The cached files of ``key`` that match the manifest written after them (the ``.so`` first, then the
    ``.o``).  Anything else under this key — no manifest, another key's manifest, a truncated, zeroed or replaced
    file — is deleted, so a corrupt entry is never loaded (a truncated ``.so`` would SIGBUS in dlopen, a damaged
    cubin would fail at its first launch) and the recompile overwrites it for every later process."""
    files = [p for p in (path.with_suffix(".so"), path) if p.exists()]
    if not files:
        return []
    manifest = None
    try:
        manifest = json.loads(_manifest_path(path).read_text())
    except (OSError, ValueError):
        pass
    good = []
    for f in files:
        ok = False
        if isinstance(manifest, dict) and manifest.get("key") == repr(key):
            try:
                ok = manifest.get("sha256", {}).get(f.name) == sha256_file(f)
            except OSError:
                ok = False
        if ok:
            good.append(f)
        else:
            log.warning("kernel cache entry %s does not match its manifest (corrupt, stale or another "
                        "configuration's); removing it", f)
            _unlink(f)
    if not good:
        _unlink(_manifest_path(path))
    return good


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _relink_missing_so(key: tuple, path: Path, good: list[Path]) -> list[Path]:
    """A verified ``.o`` whose ``.so`` was missing or removed: link the ``.so`` again (so later processes load
    it without CuTe-DSL) and record it in the manifest."""
    so = path.with_suffix(".so")
    if so in good or path not in good:
        return good
    try:
        link_shared(str(path), so)
        if so.exists():
            _write_manifest(key, path)
            return [so, path]
    except Exception as exc:  # the .o still works; the cache stays usable
        log.info("could not relink %s: %s", so, exc)
    return good


def load(key: tuple, cfg, path: Path):
    if not safe_dir(path.parent):
        return None
    good = _relink_missing_so(key, path, _verified_files(key, path))
    for f in good:
        t0 = time.perf_counter()
        try:
            if f.suffix == ".so":
                import tvm_ffi

                fn = tvm_ffi.load_module(str(f))[EXPORT_NAME]
            else:
                import cutlass.cute as cute

                load_runtime_libs()
                fn = getattr(cute.runtime.load_module(str(f), enable_tvm_ffi=True), EXPORT_NAME)
            log.debug("loaded %s from %s in %.3f s", cfg.name(), f, time.perf_counter() - t0)
            return fn
        except Exception as exc:  # e.g. the venv moved and the runtime library is elsewhere: try the next file
            log.info("could not load %s (%s)", f, exc)
    return None



def store(fn, key: tuple, path: Path) -> None:
    """Write ``<key>.o`` (and ``<key>.so`` when a C compiler links it), then the manifest with their sha256 —
    last, each file through a temporary name and a rename, so a reader never trusts a half-written entry."""
    tmp = None
    try:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _unlink(_manifest_path(path))  # the entry is untrusted until the new manifest lands
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=path.parent)  # mode 0600
        os.close(fd)
        fn.export_to_c(object_file_path=tmp, function_name=EXPORT_NAME)
        _fsync(tmp)
        so = path.with_suffix(".so")
        _unlink(so)
        link_shared(tmp, so)
        os.replace(tmp, path)
        tmp = None
        _write_manifest(key, path)
    except Exception as exc:  # the disk cache is an optimisation; never fail a call because of it
        log.warning("could not write kernel cache %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _write_manifest(key: tuple, path: Path) -> None:
    """The entry's manifest: its key and the sha256 of each of its files (``.so``, ``.o``) that exists."""
    digests = {f.name: sha256_file(f) for f in (path.with_suffix(".so"), path) if f.exists()}
    _write_atomic(_manifest_path(path), json.dumps({"key": repr(key), "sha256": digests}))


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync(path) -> None:
    """Flush a file to disk before it is renamed into place (a crash then leaves the old entry or the new one,
    never a renamed-but-empty file) and make it readable by its owner only."""
    os.chmod(path, 0o600)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_shared(obj: str, so_path: Path) -> None:
    """Link an exported object into a shared library loadable by tvm-ffi alone (skipped without a C compiler)."""
    import shutil
    import subprocess

    import cutlass.cute as cute

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return
    libs = [Path(p) for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True) if Path(p).exists()]
    args = [cc, "-shared", "-o", None, obj]
    for lib in libs:
        args += [f"-L{lib.parent}", f"-Wl,-rpath,{lib.parent}", f"-l:{lib.name}"]
    fd, tmp_so = tempfile.mkstemp(suffix=".so", dir=so_path.parent)
    os.close(fd)
    args[3] = tmp_so
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp_so)
        log.info("not linking %s (%s): %s", so_path.name, cc, res.stderr.strip()[:300])
        return
    _fsync(tmp_so)
    os.replace(tmp_so, so_path)