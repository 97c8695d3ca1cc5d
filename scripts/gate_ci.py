"""What CI's compile gate builds, and whether the committed full runs still hold (compile_gate --ci).

The full gate (every selectable class at its lightest and heaviest flag set, scripts/gate_classes.py, plus the
hand-made worklists) does not fit CI's time (about four times today's worklist for sm_120a, and the targets
without TMA on top; sampled compile times: benchmarks/results/gate_timing_sample.jsonl and gate_sm8x_probe.jsonl),
so:

* a full run per target is committed as ``benchmarks/results/gate_full_<arch>.jsonl`` (``python
  scripts/compile_gate.py --arch <arch> --json benchmarks/results/gate_full_<arch>.jsonl``);
* CI fails when such a file is missing, lists a failing configuration, lacks a configuration of today's full
  worklist, or is older than the last commit that touched the kernels or a config table (``FULL_RUN_INPUTS``): the
  commit that last wrote it must descend from that commit;
* CI builds a deterministic shard of the full worklist (``CI_SHARDS``: shard ``HEAD mod N``, so successive commits
  rotate through the shards) plus every configuration whose kernel file differs from the last full run's commit
  (working tree included, so a local run with edited kernels rebuilds what the edit touches).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "torch-ext/flash_attn_4_sm120"
# the targets whose full run must be committed, and the shard count CI builds of each (None: none in CI)
FULL_ARCHS = ("sm_120a", "sm_80")  # 8.6 / 8.9 devices load sm_80 cubins (device.CAPABILITIES)
CI_SHARDS = {"sm_120a": 4, "sm_80": 8}
# a commit touching one of these makes the full runs stale
FULL_RUN_INPUTS = (f"{PKG}/kernels", f"{PKG}/config.py", f"{PKG}/config_bwd.py", f"{PKG}/config_decode.py",
                   f"{PKG}/config_combine.py", f"{PKG}/device.py")


def full_run_path(arch: str) -> Path:
    return ROOT / "benchmarks" / "results" / f"gate_full_{arch}.jsonl"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def last_commit(*paths: str) -> str:
    """The last commit touching any of ``paths`` ('' when none, or outside a git checkout)."""
    res = _git("log", "-1", "--format=%H", "--", *paths)
    return res.stdout.strip() if res.returncode == 0 else ""


def in_shard(name: str, index: int, count: int) -> bool:
    """Deterministic: a configuration's shard is a hash of its name (stable across processes and machines)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % count == index


def ci_shard_index(count: int) -> int:
    head = _git("rev-parse", "HEAD").stdout.strip()
    return int(head[:8], 16) % count if head else 0


def changed_kernel_files(since: str) -> list[str]:
    """Kernel files that differ between commit ``since`` and the working tree (all of them without a commit)."""
    kdir = ROOT / PKG / "kernels"
    if not since:
        return sorted(p.name for p in kdir.glob("*.py"))
    res = _git("diff", "--name-only", since, "--", f"{PKG}/kernels")
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", f"{PKG}/kernels").stdout.split()
    return sorted({Path(p).name for p in res.stdout.split() + untracked if p.endswith(".py")})


def kinds_to_rebuild(files: list[str]) -> set[str]:
    """The kernel kinds whose classes a change of ``files`` touches (a shared file: every kind)."""
    from scripts.gate_classes import KERNEL_FILES

    kinds = set()
    for f in files:
        owners = {k for k, fs in KERNEL_FILES.items() if f in fs}
        kinds |= owners if owners else set(KERNEL_FILES)
    return kinds


def full_run_problems(arch: str, names: list[str]) -> list[str]:
    """Why the committed full run of ``arch`` does not vouch for today's worklist ``names`` (empty: it does)."""
    path = full_run_path(arch)
    rel = path.relative_to(ROOT)
    redo = f"run `python scripts/compile_gate.py --arch {arch} --json {rel}` and commit the file"
    if not path.exists():
        return [f"{rel} is missing: {redo}"]
    full = last_commit(str(rel))
    if not full:
        return [f"{rel} is not committed: commit it"]
    inputs = last_commit(*FULL_RUN_INPUTS)
    if inputs and _git("merge-base", "--is-ancestor", inputs, full).returncode != 0:
        return [f"{rel} (last written in {full[:10]}) is older than {inputs[:10]}, the last commit touching the "
                f"kernels or a config table: {redo}"]
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["config"]] = row
    problems = []
    failing = sorted(n for n, r in rows.items() if r.get("problems"))
    if failing:
        problems.append(f"{rel} lists {len(failing)} failing configurations, e.g. {failing[0]}: "
                        f"{rows[failing[0]]['problems']}")
    missing = [n for n in names if n not in rows]
    if missing:
        problems.append(f"{rel} lacks {len(missing)} of today's {len(names)} configurations (e.g. {missing[0]}): "
                        f"{redo}")
    return problems
