"""Regenerate (or --check) the refusals section of CONFLICTS_LOG.md from the one table of refused feature
combinations, ``CONFLICTS`` in torch-ext/flash_attn_4_sm120/compat.py (pair, exception, message, why, tests):

  <!-- refusals:begin --> ... <!-- refusals:end -->

    python scripts/conflicts_log.py          # rewrite CONFLICTS_LOG.md
    python scripts/conflicts_log.py --check  # exit 1 when CONFLICTS_LOG.md drifted from the table (CI)

The rest of the log is prose (supported pairs and how they interact); a refusal is edited in compat.py only.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "CONFLICTS_LOG.md"
BEGIN, END = "<!-- refusals:begin -->", "<!-- refusals:end -->"


def _compat_module():
    """compat.py loaded on its own (host only, imports nothing of the package at import time)."""
    path = ROOT / "torch-ext" / "flash_attn_4_sm120" / "compat.py"
    spec = importlib.util.spec_from_file_location("_fa4_sm120_compat", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _message(c) -> str:
    if c.limit and not c.message:
        return f"raised by `{c.limit}` (the limit lives with its tile table; the message names the tiles)"
    if c.limit:  # the table's message, raised where the limit is known (once per call, while planning)
        return "\u201c" + c.message.replace("|", "\\|") + f"\u201d, raised by `{c.limit}` where the limit is known"
    return "\u201c" + c.message.replace("|", "\\|") + "\u201d"


def section() -> str:
    compat = _compat_module()
    rows = [BEGIN,
            "## Refused combinations (generated from `compat.CONFLICTS` by scripts/conflicts_log.py: edit them there)",
            "",
            "Each is checked once per call, before any planning or launch (`compat.check_call` in "
            "`interface._attention`; `compat.check_kvcache` for `flash_attn_with_kvcache`'s own arguments), "
            "except a row that names the function raising it: that one is checked once per call where the limit "
            "it depends on is known (a tile, the device's record, the batch), before any launch.",
            "",
            "| pair | resolution |", "|---|---|"]
    for c in compat.CONFLICTS.values():
        tests = f" [{', '.join(c.tests)}]" if c.tests else ""
        rows.append(f"| {c.pair} | refused: `{c.error.__name__}` {_message(c)}. Why: {c.why}{tests} |")
    rows.append(END)
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{LOG.name} lacks the {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section() + tail.lstrip("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    current = LOG.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print(f"{LOG.name} is out of date with compat.CONFLICTS: run python scripts/conflicts_log.py",
                  file=sys.stderr)
            return 1
        return 0
    LOG.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
