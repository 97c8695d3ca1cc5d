"""CONFLICTS_LOG.md against the code, on a CPU: every test it cites exists, and each refusal checked here raises
the exception its row names, with wording the row quotes (a changed message or a changed row fails until the other
follows)."""

import re
from pathlib import Path

import pytest
import torch

from flash_attn_4_sm120 import compat, interface

ROOT = Path(__file__).resolve().parents[1]
LOG = (ROOT / "CONFLICTS_LOG.md").read_text()


def _rows():
    """(pair cell, whole row) of every table row of the log."""
    out = []
    for line in LOG.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 2 and not set(cells[0]) <= set("|- "):
            out.append((cells[0][2:], line))
    return out


def test_every_cited_test_exists():
    """Names in the log's [brackets] that look like tests are test functions or test files; ``test_x_*`` is a
    prefix of at least one."""
    tests = ROOT / "tests"
    source = "\n".join(p.read_text() for p in tests.rglob("*.py"))
    defined = set(re.findall(r"^def (test_\w+)", source, re.M))
    files = {p.stem for p in tests.rglob("test_*.py")}
    cited = set()
    for bracket in re.findall(r"\[([^\]]*)\]", LOG):
        cited |= set(re.findall(r"\btest_\w+\*?", bracket))
    missing = []
    for name in sorted(cited):
        if name.endswith("*"):
            ok = any(d.startswith(name[:-1]) for d in defined | files)
        else:
            ok = name in defined or name.removesuffix("_py") in files
        if not ok:
            missing.append(name)
    assert not missing, f"CONFLICTS_LOG cites tests that do not exist: {missing}"


def _kvcache(**kw):
    q = torch.zeros(2, 1, 4, 64)
    cache = torch.zeros(2, 32, 2, 64)
    return lambda: interface.flash_attn_with_kvcache(q, cache, cache, **kw)


def _table():
    return torch.zeros(2, 4, dtype=torch.int32)


def _varlen_append():
    q = torch.zeros(3, 4, 64)
    cache, new = torch.zeros(2, 32, 2, 64), torch.zeros(2, 1, 2, 64)
    return interface.flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=1, max_seqlen_q=2,
                                             cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))


def _qkv(rank=4):
    shape = (2, 5, 4, 64) if rank == 4 else (5, 4, 64)
    return torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)


def _grad():
    q = torch.zeros(2, 1, 4, 64, requires_grad=True)
    cache = torch.zeros(2, 32, 2, 64)
    return interface.flash_attn_with_kvcache(q, cache, cache)


# (call, exception, words of the row's pair cell, a phrase both the message and the row contain)
REFUSALS = [
    (_kvcache(attention_chunk=128), NotImplementedError, ["`attention_chunk`"], "leave it at 0"),
    (_kvcache(sm_margin=4), NotImplementedError, ["`sm_margin`"], "leave it at 0"),
    (_kvcache(cu_seqlens_k_new=torch.zeros(3, dtype=torch.int32)), NotImplementedError, ["`cu_seqlens_k_new`"],
     "at None"),
    (_kvcache(scheduler_metadata=torch.zeros(1)), NotImplementedError, ["`scheduler_metadata`"], "at None"),
    (_kvcache(alibi_slopes=torch.zeros(4)), NotImplementedError, ["`alibi_slopes`"], "at None"),
    (_kvcache(cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError, ["`cache_leftpad`"], "at None"),
    (_kvcache(qv=torch.zeros(2, 1, 4, 64)), NotImplementedError, ["`qv`"], "at None"),
    (_kvcache(rotary_cos=torch.zeros(1)), NotImplementedError, ["rotary"], "to q and k before the call"),
    (_varlen_append, NotImplementedError, ["append with varlen q"], "append with a dense q, or write the cache first"),
    (_grad, ValueError, ["`flash_attn_with_kvcache` × autograd"], "inference-only"),
    (_kvcache(page_table=_table(), block_table=_table()), ValueError, ["`block_table`"], "give the page table once"),
    (lambda: interface.flash_attn_func(*_qkv(), gather_kv_indices=torch.zeros(1)), NotImplementedError,
     ["`gather_kv_indices`"], "leave it at None"),
    (lambda: interface.flash_attn_varlen_func(*_qkv(3), seqlen_k_per_split=torch.zeros(1)), NotImplementedError,
     ["`seqlen_k_per_split`"], "leave it at None"),
    (lambda: interface.flash_attn_combine(torch.zeros(2, 1, 4, 2, 64), torch.zeros(2, 1, 4, 2),
                                          varlen_batch_idx=torch.zeros(1, dtype=torch.int32)),
     NotImplementedError, ["`flash_attn_combine`", "`varlen_batch_idx`"], "leave it at None"),
    (lambda: interface.flash_attn_func(*_qkv(), dropout_p=0.5, num_splits=2), ValueError,
     ["`dropout_p` × split-KV"], "num_splits != 1"),
    (lambda: interface.flash_attn_func(*_qkv(), dropout_p=0.5, block_sparse_tensors=object()), ValueError,
     ["`dropout_p` × block sparsity"], "the compile gate has no such configuration"),
]


@pytest.mark.parametrize("call,exc,pair_words,phrase", REFUSALS, ids=[" ".join(r[2]) for r in REFUSALS])
def test_refusal_matches_its_row(monkeypatch, call, exc, pair_words, phrase):
    # the tensor checks need CUDA tensors; every refusal here is decided by the arguments alone
    monkeypatch.setattr(interface.V, "check_tensor", lambda *args, **kwargs: None)
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    rows = [row for pair, row in _rows() if all(w in pair for w in pair_words)]
    assert rows, f"CONFLICTS_LOG has no row whose pair names {pair_words}"
    row = " ".join(rows)
    assert exc.__name__ in row, f"the row of {pair_words} does not name {exc.__name__}"
    message = str(info.value)
    if phrase == "num_splits != 1":  # the row restates the condition the message shows with values
        assert "num_splits=2" in message and phrase in row
    else:
        assert phrase.lower() in message.lower(), f"message lacks {phrase!r}: {message}"
        assert phrase.lower() in row.lower(), f"the row of {pair_words} lacks {phrase!r}"


def test_the_refusals_section_is_generated_from_the_table():
    """CONFLICTS_LOG.md's refusals are compat.CONFLICTS rendered by scripts/conflicts_log.py (CI runs --check)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conflicts_log", ROOT / "scripts" / "conflicts_log.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0, "run python scripts/conflicts_log.py"
    for c in compat.CONFLICTS.values():
        assert any(c.pair == pair for pair, _ in _rows()), c.pair


def test_each_refusal_is_raised_in_one_place():
    """Every row of the table is raised by exactly one ``refuse(name)`` call, in compat.py (a row with a ``limit`` by
    that function instead), and no other module of the package spells a row's message."""
    import ast

    pkg = ROOT / "torch-ext" / "flash_attn_4_sm120"
    src = (pkg / "compat.py").read_text()
    names = [node.args[0].value for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "refuse" and node.args and isinstance(node.args[0], ast.Constant)]
    for name, c in compat.CONFLICTS.items():
        assert names.count(name) == (0 if c.limit else 1), (name, names.count(name))
    others = {p.name: p.read_text() for p in pkg.rglob("*.py") if p.name != "compat.py"}
    for name, c in compat.CONFLICTS.items():
        # the message up to its first placeholder, as a source line would spell it
        words = c.message.split("{")[0][:40]
        if c.limit or len(words) < 20:
            continue
        spelled = [f for f, text in others.items() if words in text]
        assert not spelled, f"{name}'s message is also spelled in {spelled}"
