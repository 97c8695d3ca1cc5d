"""Compile cache: frozen config -> compiled kernel, in memory and on disk.

* Kernels are compiled from fake tensors whose batch, lengths, head counts and strides are symbolic, so a new
  sequence length, batch size or model never recompiles; the key is (kernel class, frozen config, target arch).
* The disk cache holds exported objects (CuTe-DSL AOT export, ``<key>.o``) under a fingerprint of this package's
  sources, the cutlass-dsl and tvm-ffi versions and the Python version.  When a C compiler is available the
  object is also linked into ``<key>.so``, which a later process loads with tvm-ffi alone, without importing
  CuTe-DSL (whose import alone takes ~2 s); without a compiler, the ``.o`` is loaded through CuTe-DSL.  Files are
  written to a temporary name and renamed, so concurrent processes never see a half-written object, and a
  manifest (``<key>.json``: the key and the sha256 of each file) is written last.  An entry that does not match
  its manifest — truncated, zeroed, replaced by another configuration's kernel, or left without a manifest — is
  deleted before anything loads it, and the kernel is recompiled and rewritten: a corrupt cache heals itself.
  Files are fsynced before the rename and readable by their owner only (0600, directories 0700); a cache
  directory that another user owns or can write to is not used at all (one warning naming it and why; kernels
  are then compiled in memory).
* ``FA4_SM120_CACHE_DIR`` moves the disk cache (default ``~/.cache/flash_attn_4_sm120``);
  ``FA4_SM120_DISK_CACHE=0`` turns it off.

CuTe-DSL is imported on first use, never at package import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from .arguments import ArgRecord
from .config_combine import COMBINE_VEC, CombineKernelConfig
from .config_bwd import BwdKernelConfig, BwdPreKernelConfig, DqConvertKernelConfig, DqKernelConfig

log = logging.getLogger("flash_attn_4_sm120")

_EXPORT_NAME = "fa4sm120_fwd"
_MEMORY: dict[tuple, object] = {}
_LOCK = threading.Lock()
_FINGERPRINT: str | None = None
_RUNTIME_LIBS_LOADED = False


_REFUSED_DIRS: set[str] = set()


def disk_cache_dir() -> Path | None:
    if os.environ.get("FA4_SM120_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("FA4_SM120_CACHE_DIR") or os.path.join(Path.home(), ".cache", "flash_attn_4_sm120")
    return Path(root)


def _unsafe_reason(d: Path) -> str | None:
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


def _safe_dir(d: Path) -> bool:
    """True when the cache directory ``d`` (and the root above it) is this user's alone; otherwise warn once
    and do not use the disk cache: a kernel loaded from there runs with this process's rights."""
    for part in (d.parent, d):
        reason = _unsafe_reason(part)
        if reason is not None:
            if str(part) not in _REFUSED_DIRS:
                _REFUSED_DIRS.add(str(part))
                log.warning("not using the kernel cache in %s: %s; kernels are compiled in memory instead "
                            "(set FA4_SM120_CACHE_DIR to a directory of your own)", part, reason)
            return False
    return True


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def _source_fingerprint() -> str:
    global _FINGERPRINT
    if _FINGERPRINT is None:
        h = hashlib.sha256()
        h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
        h.update(f"cutlass={_dist_version('nvidia-cutlass-dsl')} tvm_ffi={_dist_version('apache-tvm-ffi')}".encode())
        pkg = Path(__file__).resolve().parent
        for src in sorted(pkg.rglob("*.py")):
            h.update(src.relative_to(pkg).as_posix().encode())
            h.update(src.read_bytes())
        _FINGERPRINT = h.hexdigest()[:16]
    return _FINGERPRINT


def target_arch() -> str:
    """The arch CuTe-DSL compiles for: CUTE_DSL_ARCH if set (the compile gate, without a GPU; on a GPU the call
    path checked it against the device first, device.device_caps), else the current device's target from the
    capability table (device.CAPABILITIES; a string for the compiler and the cache key, never compared)."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    from .device import device_caps

    return device_caps(None).arch


def fake_args(record: ArgRecord, cfg) -> tuple:
    """Fake arguments of a kernel, built from its declared record (arguments.py): every batch, length, head
    count and stride symbolic, so one compiled kernel serves every shape of its configuration."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .kernels.fwd_base import DTYPES

    dt = DTYPES.get(getattr(cfg, "dtype", None))
    all_dtypes = {**DTYPES, "fp32": Float32}

    def act(lead_dims: int, last: int, dtype=None):  # (…, last) with last contiguous and 16-byte aligned rows
        dtype = dtype or dt
        shape = tuple(cute.sym_int() for _ in range(lead_dims)) + (last,)
        stride = tuple(cute.sym_int64(divisibility=128 // dtype.width) for _ in range(lead_dims)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)

    def rowstat(rank: int):
        return cute.runtime.make_fake_tensor(
            Float32, tuple(cute.sym_int() for _ in range(rank)),
            stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=4)

    def rows(rank: int, dtype, last: int):  # (…, last), last contiguous, rows aligned to COMBINE_VEC elements
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (last,)
        stride = tuple(cute.sym_int64(divisibility=COMBINE_VEC) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=COMBINE_VEC * dtype.width // 8)

    def strided(rank: int):
        return cute.runtime.make_fake_tensor(Float32, tuple(cute.sym_int() for _ in range(rank)),
                                             stride=tuple(cute.sym_int64() for _ in range(rank)), assumed_align=4)

    def vec(dtype):
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=4)

    out = []
    for arg in record.args:
        if arg.when is not None and not getattr(cfg, arg.when):
            out.append(None)
            continue
        varlen = arg.varlen is not None and getattr(cfg, arg.varlen)
        split = arg.split is not None and getattr(cfg, arg.split)  # + a leading num_splits dim, fp32
        if arg.kind == "act":
            out.append(act((2 if varlen else 3) + split, getattr(cfg, arg.dim), Float32 if split else None))
        elif arg.kind == "rowstat":
            out.append(rowstat((2 if varlen else 3) + split))
        elif arg.kind == "rows":
            out.append(rows(arg.rank, all_dtypes[getattr(cfg, arg.dtype)], getattr(cfg, arg.dim)))
        elif arg.kind == "strided":
            out.append(strided(arg.rank))
        elif arg.kind == "dqacc":  # (blocks, H, tile_m * head_dim), contiguous: 16-byte aligned tiles
            per_tile = cfg.tile_m * cfg.head_dim
            out.append(cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), per_tile),
                                                     stride=(cute.sym_int64(), per_tile, 1), assumed_align=16))
        elif arg.kind == "i32vec":
            out.append(vec(cutlass.Int32))
        elif arg.kind == "i32mat":
            out.append(cute.runtime.make_fake_tensor(
                cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4))
        elif arg.kind == "i64vec":
            out.append(cute.runtime.make_fake_tensor(cutlass.Int64, (1,), stride=(1,), assumed_align=8))
        elif arg.kind == "i32nd":  # int32 strides (the host checks the extents), last dim contiguous
            out.append(cute.runtime.make_fake_tensor(
                cutlass.Int32, tuple(cute.sym_int() for _ in range(arg.rank)),
                stride=tuple(cute.sym_int() for _ in range(arg.rank - 1)) + (1,), assumed_align=4))
        elif arg.kind == "aux":
            aux_dtypes = {"fp32": Float32, "i32": cutlass.Int32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16,
                          "i64": cutlass.Int64}
            # int32 extents and strides (the host checks numel < 2**31), last dim contiguous: few registers
            out.append(tuple(cute.runtime.make_fake_tensor(
                aux_dtypes[name], tuple(cute.sym_int() for _ in range(rank)),
                stride=tuple(cute.sym_int() for _ in range(rank - 1)) + (1,),
                assumed_align=aux_dtypes[name].width // 8)
                for name, rank in cfg.mods.aux_sig))
        elif arg.kind == "f32vec":
            out.append(vec(Float32))
        elif arg.kind == "f32":
            out.append(Float32(1.0))
        elif arg.kind == "i32":
            out.append(Int32(1))
        else:
            raise ValueError(f"{record.kernel}: unknown argument kind {arg.kind!r} of {arg.name!r}")
    out.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return tuple(out)


def kernel_class(cfg):
    """The kernel class that serves ``cfg`` (by the config's type and tile; no arch comparisons)."""
    if isinstance(cfg, CombineKernelConfig):
        from .kernels.combine import FlashCombine

        return FlashCombine
    if isinstance(cfg, BwdPreKernelConfig):
        from .kernels.bwd_preprocess import FlashBwdPreprocess

        return FlashBwdPreprocess
    if isinstance(cfg, DqConvertKernelConfig):
        from .kernels.bwd_dq_convert import FlashBwdDqConvert

        return FlashBwdDqConvert
    if isinstance(cfg, DqKernelConfig):
        from .kernels.bwd_dq import FlashBwdDq

        return FlashBwdDq
    if isinstance(cfg, BwdKernelConfig) and cfg.kv_rows:
        from .kernels.bwd_dkdv_kvrows import FlashBwdDkdvKvRows

        return FlashBwdDkdvKvRows
    if isinstance(cfg, BwdKernelConfig):
        from .kernels.bwd_dkdv import FlashBwdDkdv

        return FlashBwdDkdv
    if cfg.tile.tma:  # paged too: the dispatcher picks a TMA tile only when page_size % tile_n == 0
        from .kernels.fwd_tma import FlashFwdTma

        return FlashFwdTma
    if cfg.tile.kv_groups > 1:  # decode tiles with the keys split between warp groups
        from .kernels.fwd_decode import FlashFwdDecode

        return FlashFwdDecode
    from .kernels.fwd_cpasync import FlashFwdCpAsync

    return FlashFwdCpAsync


def compile_kernel(cfg, with_kernel: bool = False):
    """Compile (no cache) and return the CuTe-DSL compiled function (and the kernel object, whose
    ``launch_smem_bytes`` is set at trace time); runs on a CPU-only machine too."""
    import cutlass.cute as cute

    from dataclasses import replace

    mods = getattr(cfg, "mods", None)
    if mods is not None:
        mods = mods.resolved()  # a library mod named by its recipe (the compile gate's workers) gets its callables
        cfg = replace(cfg, mods=mods)
    kernel = kernel_class(cfg)(cfg)
    if mods is None:
        fn = cute.compile(kernel, *fake_args(kernel.ARGS, cfg), options="--enable-tvm-ffi")
    else:
        try:
            fn = cute.compile(kernel, *fake_args(kernel.ARGS, cfg), options="--enable-tvm-ffi")
        except Exception as exc:  # name the user's mods: the DSL error alone points into this package
            raise ModCompileError(f"{cfg.name()}: the kernel with {mods.names} (aux tensors {mods.aux_sig}) failed "
                                  f"to compile: {type(exc).__name__}: {exc}") from exc
    return (fn, kernel) if with_kernel else fn


class ModCompileError(ValueError):
    """A score_mod / mask_mod / score_mod_bwd that CuTe-DSL could not compile (message names the mods)."""


def _load_runtime_libs():
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


def _disk_path(key: tuple) -> Path | None:
    root = disk_cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return root / _source_fingerprint() / f"{digest}.o"


def get_kernel(cfg):
    """Compiled kernel for ``cfg`` (a forward, dK/dV, dQ, preprocess or combine config) on the current target: memory, then disk
    cache, then compile."""
    return _get_kernel((kernel_class(cfg).__name__, cfg, target_arch()), cfg, compile_kernel)


def _sha256(path: Path) -> str:
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
                ok = manifest.get("sha256", {}).get(f.name) == _sha256(f)
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
        _link_shared(str(path), so)
        if so.exists():
            _write_manifest(key, path)
            return [so, path]
    except Exception as exc:  # the .o still works; the cache stays usable
        log.info("could not relink %s: %s", so, exc)
    return good


def _load_cached(key: tuple, cfg, path: Path):
    if not _safe_dir(path.parent):
        return None
    good = _relink_missing_so(key, path, _verified_files(key, path))
    for f in good:
        t0 = time.perf_counter()
        try:
            if f.suffix == ".so":
                import tvm_ffi

                fn = tvm_ffi.load_module(str(f))[_EXPORT_NAME]
            else:
                import cutlass.cute as cute

                _load_runtime_libs()
                fn = getattr(cute.runtime.load_module(str(f), enable_tvm_ffi=True), _EXPORT_NAME)
            log.debug("loaded %s from %s in %.3f s", cfg.name(), f, time.perf_counter() - t0)
            return fn
        except Exception as exc:  # e.g. the venv moved and the runtime library is elsewhere: try the next file
            log.info("could not load %s (%s)", f, exc)
    return None


def _get_kernel(key: tuple, cfg, compile_fn):
    fn = _MEMORY.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _MEMORY.get(key)
        if fn is not None:
            return fn
        t0 = time.perf_counter()
        mods = getattr(cfg, "mods", None)
        path = _disk_path(key) if mods is None or mods.disk_cacheable else None  # user mods: memory only
        if path is not None and not _safe_dir(path.parent):
            path = None
        if path is not None:
            fn = _load_cached(key, cfg, path)
        if fn is None:
            fn = compile_fn(cfg)
            log.debug("compiled %s in %.3f s", cfg.name(), time.perf_counter() - t0)
            if path is not None:
                _export(fn, key, path)
        _MEMORY[key] = fn
        return fn


def _export(fn, key: tuple, path: Path) -> None:
    """Write ``<key>.o`` (and ``<key>.so`` when a C compiler links it), then the manifest with their sha256 —
    last, each file through a temporary name and a rename, so a reader never trusts a half-written entry."""
    tmp = None
    try:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        _unlink(_manifest_path(path))  # the entry is untrusted until the new manifest lands
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=path.parent)  # mode 0600
        os.close(fd)
        fn.export_to_c(object_file_path=tmp, function_name=_EXPORT_NAME)
        _fsync(tmp)
        so = path.with_suffix(".so")
        _unlink(so)
        _link_shared(tmp, so)
        os.replace(tmp, path)
        tmp = None
        _write_manifest(key, path)
    except Exception as exc:  # the disk cache is an optimisation; never fail a call because of it
        log.warning("could not write kernel cache %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _write_manifest(key: tuple, path: Path) -> None:
    """The entry's manifest: its key and the sha256 of each of its files (``.so``, ``.o``) that exists."""
    digests = {f.name: _sha256(f) for f in (path.with_suffix(".so"), path) if f.exists()}
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


def _link_shared(obj: str, so_path: Path) -> None:
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
