"""Join the shard files of one full compile-gate run into the full-run file CI reads.

A full run of the three targets (~6400 configurations, ~36000 core-seconds) does not fit one 10-minute device call
on a 32-core machine, so it is built as ``compile_gate.py --arch A --shard I/N --json F`` for I = 0..N-1, each
shard in its own call, and joined here::

    python scripts/gate_merge.py --out benchmarks/results/gate_full_sm_120a.jsonl _g/sm_120a.*.jsonl

Each shard file is a real build; this only checks that the shards belong to one run and cover it, then writes one
record (the shards' common record, ``configs`` the total, ``shards`` N, ``jobs`` the largest) and the rows sorted
by name.  It refuses shards of different targets, CuTe-DSL versions or libs, commits or source hashes, a name
built twice, and a missing shard (every index 0..N-1 must be given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout root: scripts.gate_ci
from scripts.gate_ci import read_run  # noqa: E402

_SAME = ("arch", "cutlass_dsl", "libs", "commit", "sources")


def merge(paths: list[Path], shards: int) -> tuple[dict, list[dict]]:
    """(the joined record, the rows); ValueError naming the file and the field where the shards disagree."""
    if len(paths) != shards:
        raise ValueError(f"{len(paths)} shard files given for --shards {shards}: every shard 0..{shards - 1} must "
                         "be given once")
    first, rows, seen = None, [], {}
    for p in paths:
        meta, named = read_run(p)
        mine = list(named.values())
        if meta is None:
            raise ValueError(f"{p} has no run record (first line): not a compile_gate.py --json file")
        if first is None:
            first = meta
        for key in _SAME:
            if meta.get(key) != first.get(key):
                raise ValueError(f"{p}: {key} differs from {paths[0]} ({meta.get(key)!r:.80} vs "
                                 f"{first.get(key)!r:.80}): not shards of one run")
        for r in mine:
            if r["config"] in seen:
                raise ValueError(f"{r['config']} is in both {seen[r['config']]} and {p}")
            seen[r["config"]] = p
        rows += mine
    rows.sort(key=lambda r: r["config"])
    record = dict(first, configs=len(rows), shards=shards, jobs=max(1, first.get("jobs") or 1))
    return record, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="the shard files (compile_gate.py --shard I/N --json)")
    ap.add_argument("--shards", type=int, required=True, help="N, the shard count the files were built with")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        record, rows = merge(args.files, args.shards)
    except ValueError as e:
        print(f"gate_merge: {e}", file=sys.stderr)
        return 2
    args.out.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": record}, *rows]))
    bad = sum(1 for r in rows if r.get("problems"))
    print(f"gate_merge: {args.out}: {len(rows)} configurations from {args.shards} shards, {bad} with problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
