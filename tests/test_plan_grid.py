"""The kernel configurations the host layer selects, over a grid of public calls (dtypes, head dims 64 to 256,
causal / window / softcap / sink / GQA / decode / varlen / seqused / paged / split / dropout / block sparsity /
mods, forward and backward, on a TMA and a non-TMA device), equal those main selected before the plan module
(tests/data/plan_grid_main.json, recorded by ``python tests/plan_grid.py --record`` at aa0de83 and again on main just
before the plan module merged, with that main's package: the 27 calls that differ between the two recordings are
the deliberate changes in between, the sm_80 spill reroutes, packed dropout rows on the 128-key tile and the fused
backward at d96; re-recorded for issue 31's sm_80 reroutes, which changed 13 calls, all on the non-TMA device: dQ
64x32 with dropout at d192, the forward's 64x16 two-stage tile for mods with dropout at d192, the 32x128 P/dS dK/dV
tile for aux-reading mods at d128; re-recorded for issue 30's causal d128 backward tile, which changed 9 calls, all on the TMA device: d128 windowed backward walks without mods or dropout on the fused 32x128 tile; re-recorded for issue 30's
deterministic relay, which added the field ``dq_relay`` to every backward configuration's repr and changed 6 calls,
all ``grad_deterministic`` on the TMA device: the fused kernel's relay form and its convert instead of the pair;
re-recorded for issue 30's relay at d128, which changed 3 calls, the d128 ``grad_deterministic`` ones on the TMA
device: the relay form instead of the pair),
refusals included (exception and message).  Equal configurations are equal compile keys: the same kernels, the same SASS.
CPU only: the device, the compiler and the launches are stubbed (tests/plan_grid.py)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_grid  # noqa: E402


@pytest.fixture(scope="module")
def grids():
    return plan_grid.expand(json.loads(plan_grid.DATA.read_text())), plan_grid.run_grid()


def test_the_grid_covers_what_it_claims(grids):
    main, _ = grids
    assert len(main) > 900
    names = {k.split("/")[1] for k in main}
    for want in ("dropout_gqa", "paged64_causal", "paged_split", "kvcache_decode", "sparse_grad", "grad_mods",
                 "mods_dropout", "varlen_seqused", "split_auto", "gqa_decode4", "grad_sink", "sparse_paged"):
        assert want in names
    launched = [v for v in main.values() if isinstance(v, list) and v]
    refused = [v for v in main.values() if isinstance(v, dict)]
    assert len(launched) > 600 and len(refused) > 100


def test_selected_configs_equal_mains(grids):
    main, now = grids
    assert set(now) == set(main)
    diff = [k for k in sorted(main) if now[k] != main[k]]
    assert not diff, f"{len(diff)} calls select differently from main, e.g. {diff[0]}:\n  main {main[diff[0]]}\n  " \
                     f"now  {now[diff[0]]}"
