"""No module of the package imports another module's private names (``_x``), neither by ``from .m import _x`` nor
as an attribute of an imported module (``m._x``): a private name may change with its module alone.  (A class's
private members are the class's business and not checked here.)  CPU, AST only."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "torch-ext" / "flash_attn_4_sm120"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(root: Path, path: Path, level: int, module: str | None) -> str:
    """The dotted package-relative name an import (``from {'.' * level}{module} import ...``) in ``path`` names."""
    parts = list(path.relative_to(root).with_suffix("").parts)[:-1]  # the importing module's package
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([module] if module else []))


def violations(root: Path = PKG) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        here = ".".join(path.relative_to(root).with_suffix("").parts)
        aliases = {}  # local name -> package module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                target = _module_of(root, path, node.level, node.module)
                for a in node.names:
                    if _private(a.name) and target != here:
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports {a.name} from .{target}")
                    sub = root.joinpath(*filter(None, target.split(".")), a.name)
                    if sub.with_suffix(".py").exists() or sub.is_dir():  # a module (a class's members are its own)
                        aliases[a.asname or a.name] = f"{target}.{a.name}" if target else a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _private(node.attr)):
                found.append(f"{path.relative_to(root)}:{node.lineno} reads {node.value.id}.{node.attr} "
                             f"(.{aliases[node.value.id]})")
    return found


def test_no_module_imports_another_modules_private_names():
    bad = violations()
    assert not bad, "private names used across modules:\n  " + "\n  ".join(bad)


def test_the_check_finds_a_private_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("_x = 1\n")
    (pkg / "b.py").write_text("from .a import _x\nfrom . import a as A\ny = A._x\n")
    bad = violations(pkg)
    assert len(bad) == 2 and "imports _x from .a" in bad[0] and "reads A._x" in bad[1], bad
