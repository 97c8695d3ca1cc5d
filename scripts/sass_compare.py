"""Does a refactor change any kernel?  Compile the compile gate's configurations (a name filter picks them) for
sm_120a from the working tree and from a git revision, and compare their SASS (addresses stripped).  No GPU needed.

    python scripts/sass_compare.py --base HEAD --filter 64x64w4s2        # exit 0: every kernel identical
    python scripts/sass_compare.py --base HEAD~3 --filter bwd_bf16_d128 dq_bf16_d128 --limit 6

A configuration the base revision cannot build (a new one) is reported, not compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
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

    spec = importlib.util.spec_from_file_location("fa4_gate_of_tree", root / "scripts" / "compile_gate.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)  # its ROOT is ``root``: the worklist and the package of that tree
    work = {c.name(): c for c in gate._worklist(None)}
    from flash_attn_4_sm120 import jit
    from scripts.sass_check import disassemble

    out = {}
    for name in names:
        if name not in work:
            continue
        cubin = jit.compile_kernel(work[name]).__cubin__
        if isinstance(cubin, str):
            cubin = Path(cubin).read_bytes()
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln) for ln in disassemble(cubin).splitlines()
                 if not ln.strip().startswith(".")]
        out[name] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return out


def _run_dump(root: Path, names: list[str]) -> dict[str, str]:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from scripts.sass_compare import _dump; "
            f"print(json.dumps(_dump(__import__('pathlib').Path({str(root)!r}), {names!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if res.returncode:
        raise SystemExit(f"compiling in {root} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare against")
    ap.add_argument("--filter", nargs="*", default=None,
                    help="substrings of the configuration names (a configuration matching any is taken)")
    ap.add_argument("--limit", type=int, default=16, help="configurations per filter")
    args = ap.parse_args(argv)
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
