"""EAGLE-3.1 heads: fc_norm (an RMSNorm per tap before fc), norm_before_fc (one over the concatenated taps) and
norm_output (the final norm's output fed back), each against its producer's own code.

Fixtures in tests/fixtures/eagle3_layouts/ (scripts/make_eagle3_layout_fixtures.py, commits in each meta.json):
speculators_eagle31 (speculators' Eagle3DraftModel, fc_norm + norm_output, two layers, draft vocabulary 64),
speculators_norm_before_fc (the same code, norm_before_fc, a qwen3 layer) and specforge_fc_norm (SpecForge's
LlamaForCausalLMEagle3 before its PR #879 with the flags of its published qwen3-30B-A3B-eagle3.1.json: fc_norm and
norm_output true, which that SpecForge computes as plain EAGLE-3 with the pre-norm output fed back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle3_layouts import FIXTURES, ATOL, MAX_NEW, copy_case, edit, io_of, row_chains, target_config
from test_eagle3_layouts import plain, prompts, target  # noqa: F401 (module-scope fixtures)

import specjax
from specjax.convert import export as ex
from specjax.convert.eagle3 import load_eagle3, read_head_tensors
from specjax.drafters import eagle3
from specjax.drafters.eagle3 import Eagle3Drafter

# case -> (norm_output= the test loads it with, the flags it must be read with)
CASES = {
    "speculators_eagle31": (None, dict(fc_norm=True, norm_before_fc=False, norm_output=True, layout="speculators")),
    "speculators_norm_before_fc": (None, dict(fc_norm=False, norm_before_fc=True, norm_output=False,
                                              layout="speculators")),
    "specforge_fc_norm": (False, dict(fc_norm=True, norm_before_fc=False, norm_output=False, layout="specforge")),
}


def fixture_params(case: str):
    cfg, host = load_eagle3(FIXTURES / case, target_config(), "float32", norm_output=CASES[case][0])
    params = dict(host)
    params.setdefault("embed", io_of(case).get("target_embed"))
    return cfg, jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("case", CASES)
def test_flags_and_tensors_are_read(case):
    cfg, params = fixture_params(case)
    want = CASES[case][1]
    assert {k: getattr(cfg, k) for k in want} == want
    assert ("fc_norm" in params) == cfg.fc_norm and ("input_norm" in params) == cfg.norm_before_fc
    if cfg.fc_norm:
        assert params["fc_norm"].shape == (3, 32)
    if cfg.norm_before_fc:
        assert params["input_norm"].shape == (96,)


@pytest.mark.parametrize("case", CASES)
def test_every_step_matches_the_producers_code(case):
    """Prefill and two chain steps per row (the hidden each step feeds back, and its logits) at 1e-5 in fp32."""
    cfg, params = fixture_params(case)
    io = io_of(case)
    ours = row_chains(eagle3.head_of(cfg, params), cfg, io)
    assert "step3_logits" in ours
    for name, value in ours.items():
        np.testing.assert_allclose(value, io[name], atol=ATOL, rtol=0, err_msg=f"{case} {name}")


def test_each_flag_changes_the_numbers():
    """Dropping fc_norm / norm_before_fc / norm_output (the plain EAGLE-3 reading of the same weights) moves the
    logits: the parity above checks each flag, not a head they leave unchanged."""
    import dataclasses

    for case, flag in (("speculators_eagle31", "fc_norm"), ("speculators_eagle31", "norm_output"),
                       ("speculators_norm_before_fc", "norm_before_fc")):
        cfg, params = fixture_params(case)
        plain_cfg = dataclasses.replace(cfg, **{flag: False})
        drop = {"fc_norm": "fc_norm", "norm_before_fc": "input_norm"}.get(flag)
        plain_params = {k: v for k, v in params.items() if k != drop}
        moved = row_chains(eagle3.head_of(plain_cfg, plain_params), plain_cfg, io_of(case))
        step = "step1_logits" if flag != "norm_output" else "step2_logits"
        assert np.abs(np.asarray(moved[step]) - io_of(case)[step]).max() > 1e-2, (case, flag)


@pytest.mark.parametrize("case, tree", [("speculators_eagle31", "chain:3"),
                                        ("speculators_eagle31", "dynamic:top_k=2,depth=2,total_tokens=6"),
                                        ("speculators_norm_before_fc", "kary:2,2"),
                                        ("specforge_fc_norm", "chain:3")])
def test_greedy_speculative_equals_plain(target, prompts, plain, case, tree):  # noqa: F811
    drafter = specjax.load_drafter(FIXTURES / case, target, norm_output=CASES[case][0])
    assert isinstance(drafter, Eagle3Drafter) and drafter.cfg.fc_norm == CASES[case][1]["fc_norm"]
    out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=[], drafter=drafter, tree=tree)
    assert out.tokens == plain.tokens and out.stats["rounds"] > 0


def test_specforge_norm_output_is_refused_unless_told(tmp_path):
    """SpecForge changed norm_output's meaning (PR #879): a `midlayer.*` head that sets it is refused without the
    caller's reading, either value; absent, both versions mean plain EAGLE-3."""
    with pytest.raises(ValueError, match=r"sets norm_output=True, whose meaning .* SpecForge version .*#879.*"
                                         r"Pass norm_output=True to load_drafter"):
        load_eagle3(FIXTURES / "specforge_fc_norm", target_config())
    head = copy_case("specforge_fc_norm", tmp_path)
    edit(head, lambda c: c.update(norm_output=False))
    with pytest.raises(ValueError, match=r"sets norm_output=False"):
        load_eagle3(head, target_config())
    edit(head, lambda c: c.pop("norm_output"))
    cfg, _ = load_eagle3(head, target_config())
    assert cfg.fc_norm and not cfg.norm_output
    assert load_eagle3(head, target_config(), norm_output=True)[0].norm_output  # the EAGLE-3.1 reading
    with pytest.raises(ValueError, match=r"norm_output= says how an EAGLE-3.1 head's config is read; .* is a dflash"):
        specjax.load_drafter(specjax.embedded("dflash"), specjax.load(specjax.embedded("target")), norm_output=True)


@pytest.mark.parametrize("case, change, match", [
    ("speculators_eagle31", lambda c: c.update(norm_before_fc=True), r"both fc_norm and norm_before_fc"),
    ("speculators_norm_before_fc", lambda c: c.update(norm_before_fc=False),
     r"has 1 tensor\(s\) an EAGLE-3 head in the speculators layout does not have: 'input_norm.weight'"),
    ("speculators_llama", lambda c: c.update(fc_norm=True), r"lacks tensor 'fc_norm.0.weight'"),
])
def test_flags_and_tensors_must_agree(case, change, match, tmp_path):
    head = copy_case(case, tmp_path)
    edit(head, change)
    with pytest.raises(ValueError, match=match):
        load_eagle3(head, target_config())


@pytest.mark.parametrize("case", ["speculators_eagle31", "speculators_norm_before_fc"])
def test_export_writes_the_flags_and_norms_back(case, tmp_path):
    cfg, host = load_eagle3(FIXTURES / case, target_config())
    dst = ex.export_eagle3(cfg, host, tmp_path / "out", include_embed=True)
    assert set(read_head_tensors(dst)) == set(read_head_tensors(FIXTURES / case))
    cfg2, host2 = load_eagle3(dst, target_config())
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, host, host2)


def test_a_repository_of_compressed_and_full_heads_names_them(target, tmp_path):  # noqa: F811
    """EAGLE-3 heads published as `compressed/` (a reduced draft vocabulary with d2t) beside `full/`: the root is
    refused naming both, each subdirectory loads."""
    import shutil

    shutil.copytree(FIXTURES / "speculators_llama", tmp_path / "compressed")  # draft vocabulary 64 of 128, d2t
    shutil.copytree(FIXTURES / "speculators_qwen3", tmp_path / "full")
    with pytest.raises(ValueError, match=r"holds no config.json but 2 drafter variants in subdirectories: "
                                         r"compressed/ \(a draft vocabulary of 64 tokens \(d2t\)\), full/ \(the "
                                         r"whole vocabulary\); load one of them"):
        specjax.load_drafter(tmp_path, target)
    assert specjax.load_drafter(tmp_path / "compressed", target).cfg.draft_vocab_size == 64
    assert specjax.load_drafter(tmp_path / "full", target).cfg.draft_vocab_size == 128
