"""Does a refactor change any kernel?  Compile the compile gate's configurations (a name filter picks them) for
sm_120a from the working tree and from a git revision, and compare their SASS (addresses stripped).  No GPU needed.

    python scripts/sass_compare.py --base HEAD --filter 64x64w4s2        # exit 0: every kernel identical
    python scripts/sass_compare.py --base HEAD~3 --filter bwd_bf16_d128 dq_bf16_d128 --limit 6

A configuration the base revision cannot build (a new one) is reported, not compared.

Two full compile-gate runs (``compile_gate.py --json``, whose rows carry ``sass_sha256``), compared row by row by
configuration name; a run of a tree whose gate predates that field is hashed with ``--hash-tree`` (the tree's own
worklist and package, this script's normalisation, sass_check.sass_digest):

    python scripts/sass_compare.py --rows new.jsonl old.jsonl      # exit 0: no configuration differs
    python scripts/sass_compare.py --hash-tree /path/to/old/checkout --jobs 16 --json old.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dump(root: Path, names: list[str]) -> dict[str, str]:
    """In a worker process: {config name: sha256 of its normalised SASS} for the configurations of ``root``'s gate
    worklist named in ``names`` (missing names are left out)."""
    os.environ["CUTE_DSL_ARCH"] = "sm_120a"
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp())
    import importlib.util

    # this script's sass_check (its normalisation), loaded by path: ``scripts`` resolves to ``root``'s tree below
    own = importlib.util.spec_from_file_location("fa4_sass_check_of_compare", Path(__file__).with_name("sass_check.py"))
    sass_check = sys.modules[own.name] = importlib.util.module_from_spec(own)
    own.loader.exec_module(sass_check)
    spec = importlib.util.spec_from_file_location("fa4_gate_of_tree", root / "scripts" / "compile_gate.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)  # its ROOT is ``root``: the worklist and the package of that tree
    work = {c.name(): c for c in gate._worklist(None)}
    from flash_attn_4_sm120 import jit

    out = {}
    for name in names if names is not None else list(work):
        if name not in work:
            continue
        try:
            cubin = jit.compile_kernel(work[name]).__cubin__
        except Exception as exc:  # a configuration the tree itself cannot build: recorded, the chunk goes on
            out[name] = "error: " + " ".join(str(exc).split())[:300]
            continue
        if isinstance(cubin, str):
            cubin = Path(cubin).read_bytes()
        out[name] = sass_check.sass_digest(sass_check.disassemble(cubin))
    return out


def _run_dump(root: Path, names: list[str] | None) -> dict[str, str]:
    # this file loaded by path and ``root`` first on sys.path: the ``scripts`` package the tree's gate imports
    # (gate_lists, gate_classes) is ``root``'s own, not this checkout's
    code = (f"import importlib.util, json, pathlib, sys; sys.path.insert(0, {str(root)!r}); "
            "spec = importlib.util.spec_from_file_location('fa4_sass_compare_worker', "
            f"{str(Path(__file__).resolve())!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"print(json.dumps(m._dump(pathlib.Path({str(root)!r}), {names!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if res.returncode:
        raise SystemExit(f"compiling in {root} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def read_rows(path: Path) -> dict[str, str | None]:
    """{configuration: sass_sha256 or None} of a compile-gate JSON-lines file (its run record line skipped; a row
    of a run older than the field, or of a configuration that failed to compile, has None)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "config" in row:
                out[row["config"]] = row.get("sass_sha256") or None
    return out


def compare_rows(a: dict, b: dict) -> dict[str, list[str]]:
    """Configurations of two runs sorted into identical / differing / unhashed (a row without a digest) /
    only_a / only_b."""
    res = {k: [] for k in ("identical", "differing", "unhashed", "only_a", "only_b")}
    for name in sorted(set(a) | set(b)):
        if name not in b:
            res["only_a"].append(name)
        elif name not in a:
            res["only_b"].append(name)
        elif a[name] is None or b[name] is None:
            res["unhashed"].append(name)
        else:
            res["identical" if a[name] == b[name] else "differing"].append(name)
    return res


def _rows_main(path_a: Path, path_b: Path, show: int) -> int:
    res = compare_rows(read_rows(path_a), read_rows(path_b))
    for kind in ("differing", "unhashed", "only_a", "only_b"):
        for name in res[kind][:show]:
            print(f"  {kind:<10} {name}")
        if len(res[kind]) > show:
            print(f"  {kind:<10} ... and {len(res[kind]) - show} more")
    counts = {k: len(v) for k, v in res.items()}
    print(f"sass_compare --rows {path_a} {path_b}: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    print(json.dumps({"a": str(path_a), "b": str(path_b), **counts}))
    return 1 if res["differing"] or res["unhashed"] or res["only_a"] or res["only_b"] else 0


def _hash_tree(root: Path, pattern: str | None, jobs: int, out: Path | None) -> int:
    """Digest every configuration of ``root``'s own gate worklist (``pattern``: a name substring) in ``jobs``
    worker processes; rows {config, sass_sha256} as the gate writes them, to ``out`` or stdout."""
    import concurrent.futures as cf

    names = [n for n in _run_names(root) if pattern is None or pattern in n]
    chunks = [names[i::jobs] for i in range(jobs) if names[i::jobs]]
    digests: dict[str, str] = {}
    with cf.ThreadPoolExecutor(max_workers=len(chunks) or 1) as pool:  # each thread waits on one subprocess
        for part in pool.map(lambda c: _run_dump(root, c), chunks):
            digests.update(part)
    rows = [{"meta": {"tree": str(root), "hashed_by": "scripts/sass_compare.py --hash-tree", "count": len(names)}}]
    rows += [{"config": n, "sass_sha256": digests.get(n)} if not str(digests.get(n, "")).startswith("error: ")
             else {"config": n, "sass_sha256": None, "error": digests[n][7:]} for n in names]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if out:
        out.write_text(text)
    else:
        sys.stdout.write(text)
    missing = [n for n in names if n not in digests or digests[n].startswith("error: ")]
    print(f"sass_compare --hash-tree {root}: {len(names) - len(missing)}/{len(names)} configurations hashed",
          file=sys.stderr)
    return 1 if missing else 0


def _run_names(root: Path) -> list[str]:
    """The configuration names of ``root``'s gate worklist (the tree's own compile_gate, in a subprocess)."""
    code = ("import importlib.util, json, sys; "
            f"spec = importlib.util.spec_from_file_location('g', {str(root / 'scripts' / 'compile_gate.py')!r}); "
            "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); "
            "print(json.dumps([c.name() for c in g._worklist(None)]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if res.returncode:
        raise SystemExit(f"listing the worklist of {root} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- source identity: what can change the SASS at all ------------------------------------------------------------
# A kernel's SASS is a function of its kernel module, the config record it is built from, the route from config to
# kernel class and the fake compile arguments.  Comparing their syntax trees (docstrings dropped: comments never
# reach the tree) between two revisions tells which configurations can differ before anything is compiled.
_COMPILE_PATH = {"jit.py": ("target_arch", "fake_args", "compile_kernel", "kernel_class", "kernel_route")}
_CONFIG_FILES = ("config.py", "config_bwd.py", "config_combine.py", "config_decode.py", "device.py", "arguments.py")


def _tree(src: str):
    import ast

    tree = ast.parse(src)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _top_level(src: str) -> dict:
    import ast

    return {n.name: ast.dump(n) for n in _tree(src).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


def source_identity(base: str) -> int:
    """Print, per kernel module, whether its syntax tree equals ``base``'s, and for the config modules and the
    compile path which top-level classes/functions differ.  Returns the number of kernel modules that differ."""
    import ast

    pkg = "torch-ext/flash_attn_4_sm120"

    def old(rel):
        res = subprocess.run(["git", "show", f"{base}:{pkg}/{rel}"], cwd=ROOT, capture_output=True, text=True)
        return None if res.returncode else res.stdout

    differ = 0
    for path in sorted((ROOT / pkg / "kernels").glob("*.py")):
        rel = f"kernels/{path.name}"
        before = old(rel)
        if before is None:
            print(f"  new          {rel}")
        elif ast.dump(_tree(before)) == ast.dump(_tree(path.read_text())):
            print(f"  same tree    {rel}")
        else:
            differ += 1
            print(f"  DIFFERS      {rel}")
    for rel in _CONFIG_FILES + tuple(_COMPILE_PATH):
        before = old(rel)
        if before is None:
            print(f"  new          {rel}")
            continue
        a, b = _top_level(before), _top_level((ROOT / pkg / rel).read_text())
        names = _COMPILE_PATH.get(rel)
        changed = sorted(k for k in set(a) & set(b) if a[k] != b[k] and (names is None or k in names))
        gone = sorted(k for k in set(a) - set(b) if names is None or k in names)
        print(f"  {rel}: changed {changed or 'none'}; only in {base}: {gone or 'none'}")
    print(f"sass_compare --source-identity: {differ} kernel module(s) differ from {base}")
    return differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs=2, type=Path, default=None, metavar=("A", "B"),
                    help="compare two compile-gate JSON-lines runs by configuration (no compiling)")
    ap.add_argument("--show", type=int, default=20, help="--rows: names listed per kind (default 20)")
    ap.add_argument("--hash-tree", type=Path, default=None, metavar="DIR",
                    help="digest the SASS of every configuration of DIR's own gate worklist (--filter: one "
                         "substring) into gate-like rows")
    ap.add_argument("--jobs", type=int, default=1, help="--hash-tree: worker processes")
    ap.add_argument("--json", type=Path, default=None, help="--hash-tree: write the rows here")
    ap.add_argument("--base", default="HEAD", help="git revision to compare against")
    ap.add_argument("--source-identity", action="store_true",
                    help="compare the syntax trees of the kernel modules, config modules and compile path with "
                         "--base (no compiling): which configurations can have different SASS at all")
    ap.add_argument("--filter", nargs="*", default=None,
                    help="substrings of the configuration names (a configuration matching any is taken)")
    ap.add_argument("--limit", type=int, default=16, help="configurations per filter")
    args = ap.parse_args(argv)
    if args.rows:
        return _rows_main(*args.rows, args.show)
    if args.source_identity:
        return 1 if source_identity(args.base) else 0
    if args.hash_tree:
        if args.filter and len(args.filter) > 1:
            print("sass_compare --hash-tree: one --filter substring at most", file=sys.stderr)
            return 2
        return _hash_tree(args.hash_tree.resolve(), (args.filter or [None])[0], max(1, args.jobs), args.json)
    sys.path.insert(0, str(ROOT))
    import scripts.compile_gate as gate

    every = [c.name() for c in gate._worklist(None)]
    names = []
    for pattern in args.filter or [None]:
        names += [n for n in every if pattern is None or pattern in n][: args.limit]
    names = list(dict.fromkeys(names))
    if not names:
        print("sass_compare: no configuration matches", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fa4sm120_base_") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True)
        try:
            old = _run_dump(base, names)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    new = _run_dump(ROOT, names)
    differ = 0
    for name in names:
        if name not in old:
            print(f"  new        {name}")
        elif old[name] == new[name]:
            print(f"  identical  {name}")
        else:
            differ += 1
            print(f"  DIFFERS    {name}")
    print(f"sass_compare: {len(names) - differ}/{len(names)} identical or new against {args.base}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
