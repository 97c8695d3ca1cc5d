"""What CI's compile gate builds, and whether the committed full runs still hold (compile_gate --ci).

The full gate (the hand-made worklists of scripts/gate_lists.py plus every selectable class at its lightest and
heaviest flag set, scripts/gate_classes.py) does not fit CI's time on two cores (README "Compile gate" gives the
counts), so:

* a full run per target in ``FULL_ARCHS`` is committed as ``benchmarks/results/gate_full_<arch>.jsonl``
  (``python scripts/compile_gate.py --arch <arch> --jobs N --json benchmarks/results/gate_full_<arch>.jsonl``).  Its
  first line records the run (``run_meta``): target, CuTe-DSL version and libs variant (cu12 / cu13), the commit,
  and the git blob hash of every source the gate builds from (``FULL_RUN_INPUTS``: the kernels and the config
  tables), so the check needs no git history on the machine that made the run;
* CI fails when such a file is missing or not committed, lacks that record, was made for another target or
  CuTe-DSL version, lists a failing configuration, lacks a configuration of today's full worklist, or is stale:
  a source of ``FULL_RUN_INPUTS`` at HEAD differs from the one the run built (so any commit touching the kernels or
  a config table after the run, and the file names the first such commit);
* CI builds a deterministic shard of each target's full worklist (``CI_SHARDS``: shard ``HEAD mod N`` of a hash
  of the configuration's name, so successive commits rotate through the shards and the CI machine's CuTe-DSL build
  re-checks a sample of the full run), plus, while the full run is fresh, every configuration whose kernel file
  differs in the working tree from the one the full run built (a local run with edited kernels rebuilds what the
  edit touches; a stale run fails instead, and rebuilding "everything changed" would take hours).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "torch-ext/flash_attn_4_sm120"
# the targets whose full run must be committed, one per compile target the bundle ships (device.CAPABILITIES):
# sm_120a (12.0: RTX 50xx, RTX PRO 6000), sm_80 (8.0, 8.6, 8.9: they load sm_80 cubins; the cp.async selection of a
# device without TMA) and sm_121a (12.1: DGX Spark, which compiles for itself at first use); and the shard count CI
# builds of each per commit (shard ``HEAD mod N``, so successive commits rotate through every target's list).
# Sized from the measured compile time, 5.9 core-seconds a configuration on CI's 2 cores
# (benchmarks/results/gate_timing_sample.jsonl): sm_120a keeps its ninth (about 290 configurations, ~14 min at 2
# jobs); sm_80 and sm_121a, whose full runs vouch for the rest, add a small rotating sample (about 50 and 70), which
# keeps the gate inside CI_GATE_BUDGET_S (tests/test_gate_classes.py checks the bound over today's worklists).
FULL_ARCHS = ("sm_120a", "sm_80", "sm_121a")
CI_SHARDS = {"sm_120a": 9, "sm_80": 40, "sm_121a": 48}
# the gate's share of `.ci/run` on 2 cores: the sm_120a shard took ~14 of its ~32 minutes before sm_80 and sm_121a
# joined; they may add ~8, for a run under ~40 minutes (issue 31: at most 45)
CI_GATE_BUDGET_S = 22 * 60
CI_CORE_S_PER_CONFIG = 5.9
# what a full run is built from, under PKG: a change of one of these makes the committed full runs stale
FULL_RUN_INPUTS = ("kernels/", "config/", "config*.py", "device.py")
# the FP8 forward's sources: built and checked by their own gate (scripts/gate_fp8.py, its committed results files),
# never by the full runs, so a change to them leaves the full runs fresh
FULL_RUN_EXCLUDED = ("kernels/fwd_fp8.py", "kernels/fp8_kv_loader.py", "kernels/fp8_ptx.py", "config_fp8.py")


def full_run_path(arch: str) -> Path:
    return ROOT / "benchmarks" / "results" / f"gate_full_{arch}.jsonl"


def _git(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except FileNotFoundError:  # no git on this machine
        return subprocess.CompletedProcess(args, 127, "", "git not found")


def last_commit(*paths: str) -> str:
    """The last commit touching any of ``paths`` ('' when none, or outside a git checkout)."""
    res = _git("log", "-1", "--format=%H", "--", *paths)
    return res.stdout.strip() if res.returncode == 0 else ""


def _is_input(rel: str) -> bool:
    """Whether ``rel`` (a path relative to PKG) is one of FULL_RUN_INPUTS."""
    import fnmatch

    return rel.endswith(".py") and rel not in FULL_RUN_EXCLUDED and any(
        rel.startswith(p) if p.endswith("/") else fnmatch.fnmatch(rel, p) for p in FULL_RUN_INPUTS)


def blob_hash(data: bytes) -> str:
    """git's object id of a file's content (so working-tree files and HEAD's tree compare without git)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_hashes() -> dict[str, str]:
    """{path under PKG: blob hash} of the working tree's FULL_RUN_INPUTS."""
    base = ROOT / PKG
    out = {}
    for p in sorted(base.rglob("*.py")):
        rel = p.relative_to(base).as_posix()
        if "__pycache__" not in rel and _is_input(rel):
            out[rel] = blob_hash(p.read_bytes())
    return out


def committed_hashes() -> dict[str, str] | None:
    """The same for HEAD's tree (None outside a git checkout)."""
    res = _git("ls-tree", "-r", "HEAD", "--", PKG)
    if res.returncode != 0:
        return None
    out = {}
    for line in res.stdout.splitlines():
        meta, path = line.split("\t", 1)
        rel = path[len(PKG) + 1:]
        if _is_input(rel):
            out[rel] = meta.split()[2]
    return out


def _differing(a: dict, b: dict) -> list[str]:
    """Inputs whose hash differs between two {path: hash} records (a path no longer an input is ignored)."""
    return sorted(k for k in set(a) | set(b) if _is_input(k) and a.get(k) != b.get(k))


def cutlass_dsl() -> tuple[str, str]:
    """(nvidia-cutlass-dsl version, libs variant: cu12 / cu13 / unknown) of this environment."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    libs = [v for v in ("cu13", "cu12") if version(f"nvidia-cutlass-dsl-libs-{v}")]
    return version("nvidia-cutlass-dsl") or "unknown", "+".join(libs) or "unknown"


def run_meta(arch: str, configs: int, jobs: int) -> dict:
    """The record a --json gate run writes first: enough to tell later what it built, where and from what."""
    head = _git("rev-parse", "HEAD")
    given = os.environ.get("FA4_GATE_COMMIT")  # a copy of a checkout whose git state is not its own (GPU machine)
    commit = given or (head.stdout.strip() if head.returncode == 0 else "unknown")
    dirty = None
    if head.returncode == 0 and not given:
        dirty = bool(_git("status", "--porcelain", "--", PKG).stdout.strip())
    version, libs = cutlass_dsl()
    return {"meta": {"arch": arch, "cutlass_dsl": version, "libs": libs, "commit": commit, "dirty": dirty,
                     "configs": configs, "jobs": jobs, "cpus": os.cpu_count(), "sources": source_hashes()}}


def row_passes(row: dict) -> bool:
    """A full run's row vouches for its configuration: no problem, or problems only with the libs that built the
    run and none when ``compile_gate.py --recheck`` rebuilt it with CI's (``row["recheck"]``: the other ptxas can
    spill where CI's does not; the README counts such rows)."""
    recheck = row.get("recheck")
    return not row.get("problems") or (recheck is not None and not recheck.get("problems"))


def read_run(path: Path) -> tuple[dict | None, dict[str, dict]]:
    """(the run's record or None, {configuration name: row})."""
    meta, rows = None, {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "meta" in row:
                meta = row["meta"]
            else:
                rows[row["config"]] = row
    return meta, rows


def in_shard(name: str, index: int, count: int) -> bool:
    """Deterministic: a configuration's shard is a hash of its name (stable across processes and machines)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % count == index


def shard_index_of(commit: str, count: int) -> int:
    """The shard CI builds at ``commit`` (a hex sha; '' outside a git checkout: shard 0)."""
    return int(commit[:8], 16) % count if commit else 0


def ci_shard_index(count: int) -> int:
    return shard_index_of(_git("rev-parse", "HEAD").stdout.strip(), count)


def changed_kernel_files(meta: dict | None) -> list[str]:
    """Kernel files (names under kernels/) whose working-tree content differs from the one the run of ``meta``
    built, new and removed ones included (all of them without a record)."""
    now = {k: v for k, v in source_hashes().items() if k.startswith("kernels/")}
    if not meta:
        return sorted(Path(k).name for k in now)
    then = {k: v for k, v in meta.get("sources", {}).items() if k.startswith("kernels/")}
    return sorted({Path(k).name for k in _differing(now, then)})


# config files whose content reaches only some kernel kinds: config_bwd.py defines the backward's compile keys and
# tile tables and is imported by the backward kernels only (config.py, which every kind reads, does not import it).
# compile_gate --refresh rebuilds these kinds after such a change; any other config file or device.py needs a full run
CONFIG_KINDS = {"config_bwd.py": ("dkdv", "dkdv_kvrows", "dq", "dq_convert", "bwd_pre")}


def kinds_to_rebuild(files: list[str]) -> set[str]:
    """The kernel kinds whose classes a change of ``files`` touches (a shared file: every kind)."""
    from scripts.gate_classes import KERNEL_FILES

    kinds = set()
    for f in files:
        if f in CONFIG_KINDS:
            kinds |= set(CONFIG_KINDS[f])
            continue
        owners = {k for k, fs in KERNEL_FILES.items() if f in fs}
        kinds |= owners if owners else set(KERNEL_FILES)
    return kinds


def full_run_problems(arch: str, names: list[str]) -> list[str]:
    """Why the committed full run of ``arch`` does not vouch for today's worklist ``names`` (empty: it does)."""
    path = full_run_path(arch)
    rel = path.relative_to(ROOT)
    redo = (f"run `python scripts/compile_gate.py --arch {arch} --jobs N --json {rel}` (README \"Compile gate\") "
            "and commit the file")
    if not path.exists():
        return [f"{rel} is missing: {redo}"]
    if not last_commit(str(rel)):
        return [f"{rel} is not committed: commit it"]
    meta, rows = read_run(path)
    if meta is None:
        return [f"{rel} has no record of its run (its first line): {redo}"]
    problems = []
    if meta.get("arch") != arch:
        problems.append(f"{rel} was made for {meta.get('arch')}, not {arch}: {redo}")
    version, _ = cutlass_dsl()
    if meta.get("cutlass_dsl") != version:
        problems.append(f"{rel} was built with nvidia-cutlass-dsl {meta.get('cutlass_dsl')}, this environment has "
                        f"{version}: {redo}")
    head = committed_hashes()
    stale = _differing(head if head is not None else source_hashes(), meta.get("sources", {}))
    if stale:
        since = last_commit(*(f"{PKG}/{s}" for s in stale))
        problems.append(f"{rel} (run at commit {str(meta.get('commit'))[:10]}) is stale: {len(stale)} of the sources "
                        f"it builds from differ at HEAD (e.g. {', '.join(stale[:3])}; last changed in "
                        f"{since[:10] or 'the working tree'}): {redo}")
    failing = sorted(n for n, r in rows.items() if not row_passes(r))
    if failing:
        problems.append(f"{rel} lists {len(failing)} failing configurations, e.g. {failing[0]}: "
                        f"{rows[failing[0]]['problems']}")
    missing = [n for n in names if n not in rows]
    if missing:
        problems.append(f"{rel} lacks {len(missing)} of today's {len(names)} configurations (e.g. {missing[0]}): "
                        f"{redo}")
    return problems
