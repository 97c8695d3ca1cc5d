"""transformers selects and calls the bundle the way the README says (CPU).

The selection path needs no GPU: transformers resolves ``attn_implementation="<org>/flash-attn-4-sm120"`` through
kernels against the local hub, registers the bundle's functions and decides from their signatures which keywords
to pass. The GPU suite's own checks (tests/packaging/test_transformers_gpu.py) are also run here on a few
scenarios with a pure-PyTorch FlashAttention reference in place of the kernel (``--reference-kernel``), which tests
the harness: transformers' call forms, masks, the tolerances and the controls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hub_server import LocalHub
from hubtools import REPO, ROOT, UNTRUSTED_REPO, build_metadata, run_tf_scenario, seed_bundle
from test_transformers_gpu import (check_forward, check_generate, check_generate_batch, check_generate_fp8_cache,
                                   check_train)

TRANSFORMERS_PIN = "5.22.2"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with LocalHub(tmp_path_factory.mktemp("hub")) as hub:
        seed_bundle(hub.store, REPO)
        seed_bundle(hub.store, UNTRUSTED_REPO, trusted=False)
        yield hub


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tf-home")


def select(hub, home, family="llama", repo=REPO, *extra):
    return run_tf_scenario(hub, home, "select", "--repo", repo, "--family", family, *extra, timeout=300)


def test_requirements_pin_transformers_and_kernels():
    dev = (ROOT / "requirements-dev.txt").read_text().split()
    runtime = (ROOT / "requirements.txt").read_text().split()
    assert f"transformers=={TRANSFORMERS_PIN}" in dev
    assert "kernels==0.17.2" in runtime  # transformers 5.23 needs kernels >= 0.18.2


def test_transformers_loads_the_bundle_as_attn_implementation(hub, home):
    r = select(hub, home)
    assert r["transformers"] == TRANSFORMERS_PIN
    assert r["impl"] == [REPO] and r["registered"]
    assert r["loaded_implementation"] == REPO
    assert r["bundle_name"] == build_metadata()["id"]
    assert Path(r["bundle_file"]).is_relative_to(home / "cache" / f"kernels--{REPO.replace('/', '--')}")
    assert r["varlen_is_bundle"] and r["dense_is_bundle"]
    # what transformers will pass, read from our signatures
    supports = r["supports"]
    for key in ("softmax_scale", "window_size", "softcap", "learnable_sink", "deterministic", "dropout_p",
                "max_seqlen_q", "max_seqlen_k", "page_table"):
        assert supports[key] is True, key
    for key in ("s_aux", "block_table", "cache_seqlens"):
        assert supports[key] is False, key
    assert r["transformers_has_kvcache"] == r["bundle_has_kvcache"]


def test_untrusted_org_needs_allow_all_kernels(hub, home):
    with pytest.raises(AssertionError, match=f"Kernel repository '{UNTRUSTED_REPO}' is not from a trusted publisher"):
        select(hub, home, "llama", UNTRUSTED_REPO)
    r = select(hub, home, "llama", UNTRUSTED_REPO, "--allow-all-kernels")
    assert r["impl"] == [UNTRUSTED_REPO]


def test_gpt_oss_replaces_the_bundle_without_the_workaround(hub, home):
    """gpt-oss keeps a list of flash kernels it accepts and swaps any other "flash" implementation for the first
    of them (kernels-community/vllm-flash-attn3, which the local hub does not serve)."""
    with pytest.raises(AssertionError, match="kernels-community/vllm-flash-attn3"):
        select(hub, home, "gpt_oss", REPO, "--no-workaround")


def test_gpt_oss_keeps_the_bundle_with_the_workaround(hub, home):
    r = select(hub, home, "gpt_oss")
    assert r["impl"] == [REPO] and r["varlen_is_bundle"]


def test_gpt_oss_workaround_skips_the_trust_check(hub, home):
    """Listed kernels are trusted by transformers: the README warns about it."""
    r = select(hub, home, "gpt_oss", UNTRUSTED_REPO)
    assert r["impl"] == [UNTRUSTED_REPO]


# -- the GPU suite's checks, with the reference in place of the kernel ------------------------------------------------
def reference(hub, home, name, family, *extra):
    return run_tf_scenario(hub, home, name, "--repo", REPO, "--family", family, "--reference-kernel", *extra)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_harness_forward_on_cpu(hub, home, family):
    check_forward(reference(hub, home, "forward", family), family, home)


def test_harness_train_on_cpu(hub, home):
    check_train(reference(hub, home, "train", "gpt_oss"), "gpt_oss", False, home)


def test_harness_generate_on_cpu(hub, home):
    check_generate(reference(hub, home, "generate", "llama", "--padded"), "llama", True, home)


def test_harness_generate_with_fp8_cache_on_cpu(hub, home):
    check_generate_fp8_cache(reference(hub, home, "generate_fp8_cache", "llama"), home)


def test_harness_generate_batch_on_cpu(hub, home):
    check_generate_batch(reference(hub, home, "generate_batch", "llama"), home, on_cuda=False)
