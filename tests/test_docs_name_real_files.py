"""Docstrings, comments and the project's documents name only Python files that exist (a renamed file left
``bwd_kernel.py``, ``masking.py``, ``fwd_kernel.py`` and ``bwd_dq_kernel.py`` behind in docstrings)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# names that are not files of this repository: upstream or third-party files that the text names as such
OUTSIDE = {"setup.py", "initialization.py"}


def test_named_python_files_exist():
    present = {p.name for p in ROOT.rglob("*.py")
               if not p.parts[len(ROOT.parts)].startswith(".") and p.parts[len(ROOT.parts)] != "build"}
    sources = [*(ROOT / "torch-ext").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
               *(ROOT / "benchmarks").rglob("*.py"), ROOT / "README.md", ROOT / "CONFLICTS_LOG.md", ROOT / "CARD.md",
               ROOT / "benchmarks" / "experiments" / "README.md"]
    missing = []
    for src in sources:
        for name in sorted(set(re.findall(r"\b([A-Za-z_]\w*\.py)\b", src.read_text()))):
            if name not in present and name not in OUTSIDE:
                missing.append(f"{src.relative_to(ROOT)} names {name}")
    assert not missing, "; ".join(missing)
