"""The compile gate's worklists live in scripts/gate_lists.py, outside the runtime (issue 32): no module of the bundle
imports the gate module, no runtime module defines a gate worklist, and importing the bundle loads none of it."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "torch-ext" / "flash_attn_4_sm120"
# names the worklists had in the runtime modules (config, config_bwd, config_decode, config_combine, modspec)
MOVED = {"all_fwd_tile_configs", "key_row_subset_worklist", "_key_row_heaviest", "_GATE_MODS", "_BWD_HEAVY"}
GATE_NAME = re.compile(r"(^|_)gate(_|s_|$)|worklist")


def _modules():
    mods = sorted(PKG.rglob("*.py"))
    assert len(mods) > 20 and (PKG / "config.py") in mods  # the walk sees the package (kernels/ included)
    return mods


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [f"{'.' * node.level}{node.module or ''}"] + [a.name for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__"):
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def offenders_importing_the_gate(paths) -> list[str]:
    bad = []
    for path in paths:
        for name in _imports(ast.parse(path.read_text())):
            if "gate_lists" in name or "gate_classes" in name or name.split(".")[0] == "scripts":
                bad.append(f"{_rel(path)} imports {name}")
    return bad


def gate_definitions(paths) -> list[str]:
    """Top-level functions and tables of the runtime modules that are gate worklists (by name)."""
    bad = []
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for name in names:
                if GATE_NAME.search(name) or name in MOVED:
                    bad.append(f"{_rel(path)}: {name}")
    return bad


def test_no_runtime_module_imports_the_gate_module():
    assert offenders_importing_the_gate(_modules()) == []


def test_no_runtime_module_defines_a_gate_worklist():
    assert gate_definitions(_modules()) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """Both checks fail on a module that imports the gate module or defines a worklist."""
    mod = tmp_path / "bad.py"
    mod.write_text("from scripts import gate_lists\nimport importlib\nimportlib.import_module('scripts.gate_lists')\n"
                   "def decode_gate_worklist():\n    return []\n\n_GATE_MODS = ()\n")
    assert len(offenders_importing_the_gate([mod])) == 3
    assert len(gate_definitions([mod])) == 2
    assert GATE_NAME.search("combine_gate_configs") and GATE_NAME.search("mods_worklist")


def test_importing_the_bundle_loads_no_gate_module():
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport flash_attn_4_sm120 as fa\n"
            "from flash_attn_4_sm120 import config, config_bwd, config_decode, config_combine, modspec, dispatch\n"
            "print(sorted(m for m in sys.modules if 'gate_' in m or m.split('.')[0] == 'scripts'))\n")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "torch-ext")], capture_output=True, text=True,
                         cwd=str(ROOT / "torch-ext"), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout


def test_the_gate_module_builds_the_lists_from_the_config_layer():
    sys.path.insert(0, str(ROOT))
    from scripts import gate_lists as GL

    work = GL.hand_worklist()
    names = [c.name() for c in work]
    # every kind of list is there: forward, paged, sparse, decode, backward, dropout, fused, combine, preprocess, mods
    for part in ("fwd_", "_paged", "_sparse", "k2", "bwd_", "dq_", "_drop", "dqcvt_", "combine_", "dpsum_", "_mods-"):
        assert any(part in n for n in names), part
    assert len(set(names)) > 600
