"""The planner: Sequoia's DP equals brute force, tau of given trees, the cost model, the per-batch policy,
the published load model reproduced, profiles round-tripping through JSON, acceptance from a calibration run,
and generate(..., "auto")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from specjax.decoding.tree import TreeSpec, chain, child_ranks, kary
from specjax.planning import auto, calibration, planner
from specjax.planning.planner import (
    best_tree,
    best_trees,
    brute_force_best,
    chain_tau,
    expected_tau,
    plan,
    published_model,
    score,
    shape_of,
)
from specjax.planning.profile import DEVICES, CostModel, Profile, Roofline, RunTimes, interp, load_profile, save_profile

P_VECTORS = [
    (0.8, 0.16, 0.032),  # geometric, alpha 0.8
    (0.5, 0.3, 0.1),
    (0.9,),  # one rank: chains only
    (0.3, 0.29, 0.28),  # flat: wide trees win
    (0.6, 0.05, 0.3),  # not monotone: ranks must still be used in order
]


# ---------------------------------------------------------------- 1. the dynamic program


@pytest.mark.parametrize("p", P_VECTORS)
@pytest.mark.parametrize("depth", [None, 1, 2])
def test_dp_equals_brute_force(p, depth):
    table = best_trees(p, 7, depth if depth is not None else 6)
    for n in range(1, 8):
        spec, tau = brute_force_best(p, n, depth)
        assert table.tau(n) == pytest.approx(tau, abs=1e-12), (n, spec)
        built = table.tree(n)
        assert built.num_nodes <= n and (depth is None or built.max_depth <= depth)
        assert expected_tau(built, p) == pytest.approx(tau, abs=1e-12)


def test_dp_chain_is_the_one_rank_special_case():
    for k in range(1, 10):
        spec, tau = best_tree([0.7], k + 1)
        assert spec == chain(k)
        assert tau == pytest.approx(chain_tau(k, 0.7))


def test_dp_table_never_decreases_and_wide_p_gives_wide_trees():
    table = best_trees((0.3, 0.29, 0.28), 20, 4)
    assert np.all(np.diff(table.tau_ND[1:], axis=0) >= -1e-12)
    assert np.all(np.diff(table.tau_ND[1:], axis=1) >= -1e-12)
    assert table.tree(4, 1) == kary([3])


def test_expected_tau_by_hand():
    p = (0.8, 0.1)
    assert expected_tau(chain(2), p) == pytest.approx(1 + 0.8 + 0.64)
    assert expected_tau(kary([2, 1]), p) == pytest.approx(1 + 0.8 + 0.1 + 0.64 + 0.08)
    assert expected_tau(kary([3]), p) == pytest.approx(1.9)  # rank 2 has no entry: never accepted
    per_depth = [[0.9, 0.05], [0.5, 0.0]]  # depth 1 row, then depth >= 2
    assert expected_tau(chain(3), per_depth) == pytest.approx(1 + 0.9 + 0.45 + 0.225)


def test_bad_p_is_a_value_error_naming_the_fix():
    with pytest.raises(ValueError, match="sum to at most 1"):
        best_trees([0.8, 0.5], 4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_trees([1.5], 4)


# ---------------------------------------------------------------- 1d. the cost model


def test_roofline_knee_h100_8b_and_flat_then_linear():
    roof = Roofline(DEVICES["h100"], 8.03e9, 2 * 8.03e9)
    assert roof.knee == pytest.approx(295, abs=1)
    step = roof.verify_s(1, 1)
    assert step == pytest.approx(16.06e9 / 3.35e12)
    assert roof.verify_s(8, 32) == step  # 256 tokens: below the knee, free
    assert roof.verify_s(64, 64) == pytest.approx(2 * 8.03e9 * 4096 / 989e12)
    h200 = Roofline(DEVICES["h200"], 8.03e9, 2 * 8.03e9)
    assert 150 < h200.knee < 210  # measured 4.3 TB/s and 790 TFLOP/s: ~184


def test_roofline_kv_term_grows_with_batch_and_cache():
    roof = Roofline(DEVICES["h100"], 8e9, 16e9, kv_bytes_per_position=131072, cache_len=4096)
    assert roof.verify_s(8, 1) - roof.verify_s(1, 1) == pytest.approx(7 * 4096 * 131072 / 3.35e12)


def test_interp_is_flat_below_linear_between_and_extrapolates_the_last_slope():
    xs, ys = [1, 4, 16], [1.0, 1.0, 4.0]
    assert interp(0.5, xs, ys) == 1.0
    assert interp(10, xs, ys) == pytest.approx(2.5)
    assert interp(32, xs, ys) == pytest.approx(8.0)


def test_profile_interpolates_in_tokens_per_pass_then_batch():
    rows = [{"batch": b, "nodes": n, "cache_len": 128, "seconds": 1e-3 * max(1.0, b * n / 8)}
            for b in (1, 4) for n in (1, 2, 8)]
    prof = Profile("cpu", "m", "float32", rows)
    assert prof.verify_s(1, 4) == pytest.approx(1e-3)
    assert prof.verify_s(4, 4) == pytest.approx(2e-3)  # T = 16 between (4 x 2 = 8) and (4 x 8 = 32)
    assert prof.verify_s(4, 16) == pytest.approx(8e-3)  # past the largest pass: proportional to tokens
    assert prof.draft_s(4, 3) == 0.0  # no propose measurements: free
    # A noisy last point (cheaper than the one before) never makes larger passes cheaper than measured ones.
    noisy = Profile("cpu", "m", "float32", [{"batch": 8, "nodes": n, "cache_len": 128, "seconds": s}
                                            for n, s in ((1, 0.5), (2, 0.74), (3, 0.55))])
    assert noisy.verify_s(8, 3) == pytest.approx(0.74) and noisy.verify_s(8, 6) == pytest.approx(0.74 * 2)


# ---------------------------------------------------------------- 1e. the per-batch policy


def test_plan_prefers_off_when_verify_is_linear_and_drafts_are_poor():
    verify = lambda b, n: 1e-3 * b * n  # noqa: E731 (no idle compute at all)
    choices = plan((0.3,), [1, 8], verify, lambda b, d: 0.0)
    assert all(c.best.shape.kind == "off" for c in choices)
    assert choices[0].runner_up.shape.label == "chain:1"


def test_plan_scores_are_consistent_with_score():
    p, cm = published_model(0.8, 0.05)
    for c in plan(p, [1, 16], cm.verify_s, cm.draft_s, max_nodes=64, max_depth=12):
        again = score(c.best.shape, c.batch, cm.verify_s, cm.draft_s)
        assert again.speedup == pytest.approx(c.best.speedup)
        assert c.best.speedup >= c.runner_up.speedup


# ---------------------------------------------------------------- 2. the published model


def test_published_model_reproduced():
    """alpha 0.8, draft 5% of a step per level, 8B on H100: a large tree at 1 user, a chain of two at 128,
    and a 64-node tree at 128 users almost 4x slower than not speculating."""
    p, cm = published_model(alpha=0.8, cost=0.05)
    assert p[:3] == pytest.approx((0.8, 0.16, 0.032))
    one, many = plan(p, [1, 128], cm.verify_s, cm.draft_s, max_nodes=512, max_depth=32)
    assert one.best.shape.kind == "tree" and one.best.shape.nodes >= 64
    assert many.best.shape.label == "chain:2"
    tree64 = shape_of(best_trees(p, 64).tree(64), p)
    assert tree64.nodes == 64
    slowdown = 1 / score(tree64, 128, cm.verify_s, cm.draft_s).speedup
    assert 3.5 < slowdown < 4.0


def test_plan_cli_model_only(capsys, tmp_path):
    from specjax.cli import main

    out_json = tmp_path / "plan.json"
    assert main(["plan", "--model-only", "--alpha", "0.8", "--cost", "0.05", "--concurrency", "1,128",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "chain:2" in text and "| 1 | tree:" in text
    saved = json.loads(out_json.read_text())
    assert saved["choices"][1]["best"]["label"] == "chain:2"


def test_plan_cli_scores_one_call_with_tokens(capsys, tmp_path):
    """--tokens scores a generate call (prefill once, slowest row) instead of a server: the same shape's
    predicted speedup matches planner.score with that Call, and a batch that waits for its slowest of 128
    rows gains less than refilled rows do."""
    from specjax.cli import main
    from specjax.planning.planner import Call

    server, one_call = tmp_path / "server.json", tmp_path / "call.json"
    base = ["plan", "--model-only", "--concurrency", "1,128", "--max-nodes", "64"]
    assert main([*base, "--json", str(server)]) == 0
    assert main([*base, "--tokens", "64", "--prompt-len", "256", "--json", str(one_call)]) == 0
    assert "one call per concurrency" in capsys.readouterr().out
    refilled, called = (json.loads(f.read_text()) for f in (server, one_call))
    assert called["call"] == {"tokens": 64, "prompt_len": 256}
    p, cm = published_model(0.8, 0.05, "h100")
    best = called["choices"][1]["best"]
    shape = shape_of(chain(best["depth"]) if best["kind"] == "chain" else TreeSpec(tuple(best["parents"])), p)
    expected = score(shape, 128, cm.verify_s, cm.draft_s, call=Call(64, lambda b: cm.verify_s(b, 256))).speedup
    assert best["speedup"] == pytest.approx(expected)
    assert best["speedup"] < refilled["choices"][1]["best"]["speedup"]


# ---------------------------------------------------------------- 3. profiling


def tiny_target(layers: int = 2):
    import jax

    from specjax.bench.ar import PRESETS
    from specjax.config import ModelConfig
    from specjax.models.model import init_params
    from specjax.models.target import Target

    hf = {**PRESETS["tiny20m"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = ModelConfig.from_hf(hf, dtype="float32")
    return Target(init_params(cfg, jax.random.key(0)), cfg, hf_config=hf)


@pytest.fixture(scope="module")
def tiny_profile():
    from specjax.drafters import DraftModelDrafter
    from specjax.planning.profile import profile

    target = tiny_target(2)
    draft = tiny_target(1)
    return profile(target, DraftModelDrafter(draft.cfg, draft.params), batches=(1, 4), nodes=(1, 4),
                   cache_lens=(32,), draft_depths=(1, 2), repeats=2)


def test_profile_measures_every_shape_and_round_trips_through_json(tiny_profile, tmp_path):
    prof = tiny_profile
    assert {(r["batch"], r["nodes"]) for r in prof.verify} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    assert all(r["seconds"] > 0 and len(r["all_seconds"]) == 2 for r in prof.verify)
    assert {(r["batch"], r["depth"]) for r in prof.propose} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    assert prof.dtype == "float32" and "L2" in prof.model and prof.device
    path = save_profile(prof, tmp_path / "p.json")
    save_profile(Profile("other", "m", "bfloat16", prof.verify), path)  # a second entry under its own key
    back = load_profile(path, prof.key)
    assert back == prof
    assert back.verify_s(2, 3) == prof.verify_s(2, 3) > 0
    assert back.draft_s(4, 3) > 0
    with pytest.raises(ValueError, match="holds 2 profiles"):
        load_profile(path)


def test_a_mesh_profile_has_its_own_key_and_a_one_device_entry_reads_as_before(tmp_path):
    from jax.sharding import AbstractMesh

    from specjax.models.sharding import mesh_label
    from specjax.planning.profile import device_kind, model_name, profile_key_for

    assert [mesh_label(m) for m in (None, AbstractMesh((1, 1), ("data", "model")), AbstractMesh((1, 8), ("data",
            "model")), AbstractMesh((2, 1), ("data", "model")), AbstractMesh((2, 4), ("data", "model")))] == \
        ["", "", "tp8", "dp2", "dp2xtp4"]
    rows = [{"batch": 1, "nodes": 1, "cache_len": 0, "seconds": 1e-3, "all_seconds": [1e-3]}]
    one, split = Profile("cpu", "m", "float32", rows), Profile("cpu", "m", "float32", rows, mesh="tp8")
    assert one.key == "cpu|m|float32" and split.key == "cpu|m|float32|tp8"
    assert "mesh" not in one.to_dict() and split.to_dict()["mesh"] == "tp8"
    path = save_profile(split, save_profile(one, tmp_path / "p.json"))
    assert load_profile(path, one.key) == one and load_profile(path, split.key) == split
    # a file written before profiles knew meshes: the same entry, read the same way
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"profiles": {one.key: {"device": "cpu", "model": "m", "dtype": "float32",
                                                      "verify": rows, "propose": [], "meta": {}}}}))
    assert load_profile(old) == one == load_profile(old, one.key)
    cfg = tiny_target(1).cfg  # this device's entries for it, one device and TP 8: each target finds its own
    here = Profile(device_kind(), model_name(cfg), "float32", rows)
    both = save_profile(dataclasses.replace(here, mesh="tp8"), save_profile(here, tmp_path / "both.json"))
    assert profile_key_for(cfg, both) == here.key
    assert profile_key_for(cfg, both, AbstractMesh((1, 8), ("data", "model"))) == here.key + "|tp8"
    assert profile_key_for(cfg, both, AbstractMesh((1, 2), ("data", "model"))) is None


def test_profile_cli_writes_json(tmp_path, capsys):
    from specjax.cli import main

    out = tmp_path / "prof.json"
    assert main(["profile", "--batches", "1", "--nodes", "1,2", "--cache-lens", "16", "--repeats", "1",
                 "--out", str(out)]) == 0
    (key, entry), = json.loads(out.read_text())["profiles"].items()
    assert len(entry["verify"]) == 2 and key.endswith("|float32")


# ---------------------------------------------------------------- 4. acceptance from a calibration run


def test_acceptance_from_stats_by_hand():
    """kary:2,1 over 100 rounds: rank 0 accepted 60 times, rank 1 20 times at depth 1; 40 depth-2 acceptances."""
    stats = {"row_rounds": [100], "acceptance_length": 2.2,
             "verified_child_rank": [[60, 20, 0, 0, 0], [40, 0, 0, 0, 0]]}
    cal = calibration.acceptance_from_stats(stats, kary([2, 1]))
    assert cal.p_rank == pytest.approx((100 / 180, 0.2))  # rank 0: (60 + 40) / (100 + 80 opportunities)
    assert cal.p_depth_rank[0] == pytest.approx((0.6, 0.2))
    assert cal.p_depth_rank[1][0] == pytest.approx(0.5)
    assert cal.predicted_tau_by_depth == pytest.approx(1 + 0.6 + 0.2 + 0.3 + 0.1)
    with pytest.raises(ValueError, match="speculative"):
        calibration.acceptance_from_stats({"acceptance_length": 1.0}, chain(2))


@pytest.fixture(scope="module")
def tiny_pair():
    import specjax
    from specjax.bench.spec import DEFAULT_DRAFT, DEFAULT_TARGET, bench_prompts

    target = specjax.load(DEFAULT_TARGET)
    return target, specjax.load_drafter(DEFAULT_DRAFT, target), bench_prompts(target, 2)


def test_calibration_on_the_embedded_pair_predicts_measured_tau(tiny_pair):
    target, drafter, prompts = tiny_pair
    cal = calibration.calibrate(target, drafter, prompts, kary([3, 2, 1]), max_new_tokens=24)
    assert 0.4 < cal.p_rank[0] < 1 and sum(cal.p_rank) <= 1 + 1e-9
    assert cal.p_rank[0] > cal.p_rank[1]
    # The positional model is an approximation: report it next to the measurement and keep it close.
    assert cal.predicted_tau == pytest.approx(cal.measured_tau, rel=0.25)
    assert cal.predicted_tau_by_depth == pytest.approx(cal.measured_tau, rel=0.15)


# ---------------------------------------------------------------- 5. the advisor for a pair


def test_plan_cli_for_the_embedded_pair_writes_table_and_plot(tmp_path, capsys):
    from specjax.bench.spec import DEFAULT_DRAFT
    from specjax.cli import main

    png = tmp_path / "plan.png"
    assert main(["plan", "--drafter", str(DEFAULT_DRAFT), "--concurrency", "1,8,32,128", "--device", "h100",
                 "--calibrate-prompts", "2", "--calibrate-tokens", "16", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "tau measured" in text and "| 128 |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_refuses_model_only_with_a_target(capsys):
    from specjax.cli import main

    assert main(["plan", "--model-only", "--target", "x"]) == 2
    assert "drop --target" in capsys.readouterr().err


# ---------------------------------------------------------------- 6. generate(..., "auto")


def test_generate_auto_equals_plain_greedy_and_reports_the_plan(tiny_pair):
    import specjax

    target, drafter, prompts = tiny_pair
    plain = specjax.generate(target, prompts, max_new_tokens=20)
    for kwargs in ({"tree": "auto"}, {"num_draft_tokens": "auto"}):
        out = specjax.generate(target, prompts, max_new_tokens=20, drafter=drafter, **kwargs)
        assert out.tokens == plain.tokens
        assert out.stats["plan"]["kind"] in ("off", "chain", "tree")
        assert out.stats["plan"]["plan_s"] > out.stats["compile_s"]  # the measuring's compiles are counted there
        if "num_draft_tokens" in kwargs:
            assert out.stats["plan"]["kind"] != "tree"
    again = specjax.generate(target, prompts, max_new_tokens=20, drafter=drafter, tree="auto")
    assert again.stats["plan"]["cached"] and again.tokens == plain.tokens
    with pytest.raises(ValueError, match="leave the other"):
        specjax.generate(target, prompts, drafter=drafter, num_draft_tokens="auto", tree="kary:2,1")


def test_plan_on_this_device_measures_as_auto_does(tiny_pair, capsys):
    """`specjax plan` with no --device plans from "auto"'s own measurements (after the test above they are cached
    for this pair at batch 2), and its pick is what generate(..., tree="auto") runs for the same call."""
    import specjax
    from specjax.cli import build_parser
    from specjax.planning import advisor

    target, drafter, prompts = tiny_pair
    args = build_parser().parse_args(["plan", "--drafter", "d", "--concurrency", "2", "--tokens", "20"])
    report = {}
    assert advisor.plan_measured(args, target, drafter, [2], report) == 0
    text = capsys.readouterr().out
    assert "measuring on this device" in text and report["model"] == "measured"
    ran = specjax.generate(target, prompts, max_new_tokens=20, drafter=drafter, tree="auto").stats["plan"]
    assert f"| 2 | {ran['shape']} | {ran['predicted_speedup']:.2f}x |" in text
    assert report["choices"][0]["shape"] == ran["shape"]


def test_generate_auto_off_runs_the_plain_loop(tiny_pair, monkeypatch):
    import specjax

    target, drafter, prompts = tiny_pair
    # The pair's measurements at this batch are cached by the tests above; a new token budget plans afresh.
    monkeypatch.setattr(auto, "plan", lambda p, batches, *a, **k: [planner.Choice(
        batches[0], planner.Scored(planner.Shape("off", None, 1.0), 1.0, 1.0), None)])
    out = specjax.generate(target, prompts, max_new_tokens=12, drafter=drafter, num_draft_tokens="auto")
    assert out.stats["plan"]["kind"] == "off" and out.stats["drafter_calls"] == 0
    assert out.tokens == specjax.generate(target, prompts, max_new_tokens=12).tokens


# ---------------------------------------------------------------- 7. scripts/load_curve.py at a tiny size


def load_script():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "load_curve.py"
    spec = importlib.util.spec_from_file_location("load_curve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tree_replay_accepts_as_the_positional_model_says():
    """Many rows, one shape: measured per-rank acceptance matches alpha (1 - alpha)^r."""
    import specjax
    from specjax.drafters.replay import tree_replay

    target = tiny_target(1)
    prompts = np.random.default_rng(0).integers(3, 512, size=(32, 8)).tolist()
    base = specjax.generate(target, prompts, max_new_tokens=40, eos_token_id=[])
    drafter = tree_replay(base.tokens, 512, 0.6)
    out = specjax.generate(target, prompts, max_new_tokens=40, eos_token_id=[], drafter=drafter, tree=kary([3, 1]))
    assert out.tokens == base.tokens
    cal = calibration.acceptance_from_stats(out.stats, kary([3, 1]))
    assert cal.p_rank == pytest.approx((0.6, 0.24, 0.096), abs=0.05)


def test_calibration_pools_seeds_for_a_stochastic_drafter_and_stops_for_a_deterministic_one(tiny_pair):
    """One short row is one draw of the drafter's luck: calibrate() pools seeds until min_tokens were emitted,
    and stops after the second run when it repeats the first (greedy draft model: nothing new to draw)."""
    import specjax
    from specjax.drafters.replay import tree_replay

    target, drafter, prompts = tiny_pair
    one = calibration.calibrate(target, drafter, prompts[:1], chain(3), max_new_tokens=16, min_tokens=200)
    single = calibration.calibrate(target, drafter, prompts[:1], chain(3), max_new_tokens=16)
    assert one.rounds == single.rounds and one.p_rank == pytest.approx(single.p_rank)

    tiny = tiny_target(1)
    row = np.random.default_rng(1).integers(3, 512, size=(1, 8)).tolist()
    base = specjax.generate(tiny, row, max_new_tokens=40, eos_token_id=[])
    replay = tree_replay(base.tokens, 512, 0.6)
    seeds = [calibration.calibrate(tiny, replay, row, chain(3), max_new_tokens=32, seed=s, eos_token_id=[])
             for s in range(6)]
    pooled = calibration.calibrate(tiny, replay, row, chain(3), max_new_tokens=32, eos_token_id=[], min_tokens=160)
    runs = _runs_for(seeds, 160)
    assert runs > 1 and pooled.rounds == sum(c.rounds for c in seeds[:runs])
    assert pooled.measured_tau == pytest.approx(sum(c.measured_tau * c.rounds for c in seeds[:runs]) / pooled.rounds)
    assert len({round(c.p_rank[0], 6) for c in seeds}) > 1  # seeds are different draws
    assert pooled.p_rank[0] == pytest.approx(0.6, abs=0.1)


def _runs_for(calibrations, min_tokens: int) -> int:
    """How many of these single-seed runs calibrate() pools to emit min_tokens."""
    total = 0.0
    for i, c in enumerate(calibrations, 1):
        total += c.measured_tau * c.rounds
        if total >= min_tokens:
            return i
    return len(calibrations)


def test_load_curve_script_tiny(tmp_path):
    lc = load_script()
    out, png = tmp_path / "lc.json", tmp_path / "lc.png"
    assert lc.main(["--preset", "micro", "--batches", "1,2", "--chains", "1,2", "--trees", "6", "--max-depth", "2",
                    "--repeats", "2", "--max-new-tokens", "8", "--profile-repeats", "1", "--out", str(out),
                    "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    shapes = {(r["batch"], r["shape"]) for r in result["rows"]}
    assert {(1, "off"), (1, "chain:1"), (2, "chain:2"), (2, "tree:6n/d2")} <= shapes
    for r in result["rows"]:
        assert len(r["tokens_per_s_all"]) == 2 and r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
        assert "speedup_predicted" in r
    assert set(result["picks"]) == {"1", "2"} and result["profile"]["verify"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # --rows-from: the same measured rows, a new profile and new predictions
    again = tmp_path / "again.json"
    assert lc.main(["--preset", "micro", "--batches", "1,2", "--chains", "1,2", "--trees", "6", "--max-depth", "2",
                    "--profile-repeats", "1", "--rows-from", str(out), "--out", str(again), "--plot", ""]) == 0
    redone = json.loads(again.read_text())
    assert [r["tokens_per_s_all"] for r in redone["rows"]] == [r["tokens_per_s_all"] for r in result["rows"]]
    assert all("speedup_predicted" in r for r in redone["rows"])
    # --profile-from: the earlier profile, nothing measured: the same predictions as that run
    same = tmp_path / "same.json"
    assert lc.main(["--preset", "micro", "--batches", "1,2", "--chains", "1,2", "--trees", "6", "--max-depth", "2",
                    "--rows-from", str(again), "--profile-from", str(again), "--out", str(same), "--plot", ""]) == 0
    assert [r["speedup_predicted"] for r in json.loads(same.read_text())["rows"]] == pytest.approx(
        [r["speedup_predicted"] for r in redone["rows"]])


def test_plan_check_script_tiny(tmp_path, capsys):
    """scripts/plan_check.py at a tiny size: "auto" and every shape measured, each predicted by the planner's own
    model, and the bar's two figures per batch."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "plan_check.py"
    spec = importlib.util.spec_from_file_location("plan_check", path)
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    out = tmp_path / "pc.json"
    assert pc.main(["--drafters", "replay:0.9", "--batches", "1", "--chains", "1,2", "--trees", "6",
                    "--max-depth", "2", "--repeats", "1", "--min-time", "0", "--max-new-tokens", "16",
                    "--out", str(out)]) in (0, 1)
    for name, result in json.loads(out.read_text())["drafters"].items():
        assert {r["shape"] for r in result["rows"]} >= {"off", "chain:1", "chain:2", "auto"}, name
        assert all("speedup_predicted" in r for r in result["rows"]), name
        for k in result["picks"].values():
            assert {"pick_vs_best", "auto_vs_plain", "pass"} <= set(k)
            for low, high in (k["pick_vs_best_interval"], k["auto_vs_plain_interval"]):
                assert 0 < low <= high
    assert pc.main(["--from", str(out)]) in (0, 1)  # the saved run's cells again, measuring nothing
    printed = capsys.readouterr().out
    assert "cells within the bar" in printed and "Predicted within 15%" in printed


def test_pick_vs_best_interval_tells_a_worse_pick_from_noise():
    """The bootstrap interval of pick / best, 20 repeats with 8% noise a run: a pick 15% slower than the best stays
    below the bar; a pick that is the best shape's twin reaches it."""
    from specjax.bench.plan import pick_summary

    rng = np.random.default_rng(1)
    plain = 100 * (1 + 0.1 * rng.standard_normal(20))
    noisy = lambda mean: plain * mean * (1 + 0.08 * rng.standard_normal(20))  # noqa: E731

    def rows(pick_tps, best_tps):
        made = [{"batch": 1, "shape": s, "kind": k, "tokens_per_s_all": list(t)}
                for s, k, t in (("off", "off", plain), ("chain:2", "chain", best_tps), ("auto", "auto", pick_tps))]
        for r in made:
            r["speedup"] = float(np.median(np.asarray(r["tokens_per_s_all"]) / plain))
        return made

    worse = pick_summary(rows(noisy(1.3 * 0.85), noisy(1.3)), {1: "auto"})[1]
    low, high = worse["pick_vs_best_interval"]
    assert low <= worse["pick_vs_best"] <= high < 0.95
    twin = pick_summary(rows(noisy(1.3), noisy(1.3)), {1: "auto"})[1]
    low, high = twin["pick_vs_best_interval"]
    assert low < 1 and high >= 0.95


def test_profile_cli_missing_target_is_one_line(tmp_path, capsys):
    from specjax.cli import main

    assert main(["profile", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specjax profile: error:") and err.count("\n") == 1


def test_generate_auto_runs_plain_when_the_gain_is_within_the_margin(tiny_pair, monkeypatch):
    """A predicted gain below AUTO_MIN_GAIN is a near-tie: "auto" runs plain decoding and says what it passed up."""
    import specjax

    target, drafter, prompts = tiny_pair
    near_tie = planner.Scored(planner.shape_of(chain(2), (0.5,)), 1.0, 1 + auto.AUTO_MIN_GAIN / 2)
    monkeypatch.setattr(auto, "plan", lambda p, batches, *a, **k: [planner.Choice(batches[0], near_tie, None)])
    out = specjax.generate(target, prompts, max_new_tokens=8, drafter=drafter, num_draft_tokens="auto")
    assert out.stats["plan"]["kind"] == "off" and out.stats["plan"]["best_predicted"] == "chain:2"
    assert out.stats["drafter_calls"] == 0


def test_auto_times_again_when_the_gain_is_inside_the_noise(tiny_pair, monkeypatch):
    """An 8% predicted gain for chain:2 under loop timings with a 5% relative standard error at its 3 nodes (margin
    10%; the other timed chains' 40% does not count) is undecided: "auto" times the loops again, RETIME_FACTOR times
    longer, once, and plans from those timings: quieter ones let the gain through, as noisy ones refuse it. A gain
    past the margin is not timed again."""
    import specjax

    target, drafter, prompts = tiny_pair
    first = next(iter(auto._AUTO_PLANS[target].values())).times  # as timed by the tests above

    def with_noise(times, e):
        """The timed chain of 3 nodes (chain:2's) at relative error e, the others at 0.4."""
        return dataclasses.replace(times, noise=tuple(e if n == 3 else 0.4 for n, _, _ in times.spec_rounds))

    def timed_once_with_noise(e):
        """The pair's measurements (cached by the tests above), their loop timings given this noise, for this test."""
        monkeypatch.setitem(auto._AUTO_PLANS, target, {
            k: dataclasses.replace(m, times=with_noise(m.times, e), plans={}, retimed_from=None)
            for k, m in auto._AUTO_PLANS[target].items()})

    gain = planner.Scored(planner.shape_of(chain(2), (0.5,)), 1.0, 1.08)
    monkeypatch.setattr(auto, "plan", lambda p, batches, *a, **k: [planner.Choice(batches[0], gain, None)])
    for after, kind in ((0.05, "off"), (0.01, "chain")):
        timed_once_with_noise(0.05)
        calls = []

        def run_times(target, drafter, prompts, chains, **kw):
            calls.append({"chains": chains, **kw})
            return with_noise(first, after)

        monkeypatch.setattr(auto, "run_times", run_times)
        out = specjax.generate(target, prompts, max_new_tokens=10, drafter=drafter, num_draft_tokens="auto")
        plan = out.stats["plan"]
        assert plan["kind"] == kind and plan["margin_before_retiming"] == pytest.approx(0.1)
        assert plan["margin"] == pytest.approx(max(auto.AUTO_MIN_GAIN, 2 * after))
        assert len(calls) == 1 and calls[0]["repeats"] == auto.RETIME_FACTOR * calibration.RUN_REPEATS
        assert calls[0]["chains"] == [d for _, d, _ in first.spec_rounds]  # the chains timed the first time
        assert calls[0]["min_time_s"] == auto.RETIME_FACTOR * calibration.RUN_MIN_TIME_S
        assert calls[0]["earlier"].noise == with_noise(first, 0.05).noise  # pooled with the first timings
        # Timed again once: another budget plans from the new timings without timing a third time.
        again = specjax.generate(target, prompts, max_new_tokens=12, drafter=drafter, num_draft_tokens="auto")
        assert len(calls) == 1 and again.stats["plan"]["margin_before_retiming"] == pytest.approx(0.1)
    # Past the margin: decided at once.
    timed_once_with_noise(0.01)
    out = specjax.generate(target, prompts, max_new_tokens=10, drafter=drafter, num_draft_tokens="auto")
    assert out.stats["plan"]["kind"] == "chain" and out.stats["plan"]["margin_before_retiming"] is None
    assert len(calls) == 1


def test_timing_again_pools_with_the_first_timings():
    """RunTimes keep their timed rounds: a second timing's medians and noise are over both (more rounds, a smaller
    error), and timings of other chains are refused rather than pooled."""
    rng = np.random.default_rng(0)
    rounds = [(0.010 * (1 + 0.05 * rng.standard_normal()), 0.002, 0.020 * (1 + 0.05 * rng.standard_normal()),
               0.030 * (1 + 0.05 * rng.standard_normal())) for _ in range(40)]
    first, both = calibration.summarise((1, 2), tuple(rounds[:8])), calibration.summarise((1, 2), tuple(rounds))
    assert first.samples == tuple(rounds[:8]) and [d for _, d, _ in both.spec_rounds] == [1, 2]
    assert both.plain_step_s == pytest.approx(np.median([r[0] for r in rounds]))
    assert both.spec_rounds[1][2] == pytest.approx(np.median([r[3] for r in rounds]))
    assert all(b < f for b, f in zip(both.noise, first.noise))
    with pytest.raises(ValueError, match="chains"):
        calibration.run_times(None, None, [[1]], [1, 4], earlier=first)


def test_auto_margin_follows_the_timing_noise():
    """The margin's noise is the timed chain's nearest the shape in nodes; a chain far from it does not count."""
    times = RunTimes(0.01, ((2, 1, 0.02), (3, 2, 0.02), (5, 4, 0.02), (9, 8, 0.02)), 0.0, (0.01, 0.05, 0.3, 0.4))
    assert [times.noise_at(n) for n in (1, 2, 3, 4, 7, 64)] == [0.01, 0.01, 0.05, 0.3, 0.4, 0.4]
    with pytest.raises(ValueError, match="one per chain"):
        RunTimes(0.01, ((2, 1, 0.02), (3, 2, 0.02)), 0.0, (0.01,))
    assert calibration.relative_error([1.0, 1.0, 1.0]) == 0.0
    assert calibration.relative_error([0.9, 1.0, 1.1, 1.0]) == pytest.approx(1.25 * 1.4826 * 0.05 / 2 / 1.0)


def test_rounds_timed_in_the_loop_correct_the_pass_costs(tiny_pair, tmp_path, monkeypatch):
    """cost_for_run with loop timings: plain steps cost what they measured; inside the timed chains' range a
    round costs what they took less their drafting, interpolated in nodes; past it the longest timed round
    plus what the modelled pass adds; no round costs less than a plain step."""
    from specjax.planning.profile import RunTimes, cost_for_run

    target, drafter, _ = tiny_pair
    verify = [{"batch": 2, "nodes": n, "cache_len": 64, "seconds": 0.001 * n, "all_seconds": []} for n in (1, 32)]
    propose = [{"batch": 2, "depth": d, "seconds": 0.0005 * d, "all_seconds": []} for d in (1, 4)]
    path = save_profile(Profile("cpu", "m", "float32", verify, propose), tmp_path / "p.json")
    monkeypatch.setenv("SPECJAX_PROFILE", str(path))
    base = cost_for_run(target, drafter, 2, 64)
    assert base.plain_s is None and base.verify_s(2, 5) == pytest.approx(0.005)
    # Chains of 1, 2 and 4 (2, 3, 5 nodes) took these rounds, drafting (0.5 ms per level) included.
    undrafted = {2: 0.0015, 3: 0.0030, 5: 0.0034}
    rounds = tuple((n, n - 1, undrafted[n] + 0.0005 * (n - 1)) for n in (5, 2, 3))
    cost = cost_for_run(target, drafter, 2, 64, RunTimes(0.0012, rounds))
    assert cost.plain_s(2) == 0.0012 and cost.draft_s(2, 1) == pytest.approx(0.0005)
    assert [cost.verify_s(2, n) for n in (2, 3, 4, 5)] == pytest.approx([0.0015, 0.0030, 0.0032, 0.0034])
    assert cost.verify_s(2, 16) == pytest.approx(0.0034 + 0.016 - 0.005)  # the modelled pass beyond 5 nodes
    assert cost.verify_s(2, 1) == pytest.approx(0.0015)  # held flat below the shortest timed chain
    assert "interpolated in nodes" in cost.source
    # A measurement far below the modelled pass never makes a round cheaper than a plain step.
    fast = cost_for_run(target, drafter, 2, 64, RunTimes(0.0012, ((2, 1, 0.0001), (5, 4, 0.0002))))
    assert fast.verify_s(2, 4) == pytest.approx(0.0012)


def test_a_planned_tree_pays_its_own_drafting(monkeypatch):
    """A draft model's tree levels cost more than the chain of the same depth: the pick is rescored with the
    difference (timed on the tree itself), which can hand the win to the runner-up."""
    times = {"tree": 0.005, "chain": 0.001}
    monkeypatch.setattr(auto, "time_propose", lambda target, drafter, batch, shape, cache_len, repeats=3: (
        times["chain"] if isinstance(shape, int) else times["tree"], []))
    cost = CostModel(lambda b, n: 0.002 * n, lambda b, d: 0.001 * d, "test", lambda b: 0.003)
    shape = planner.shape_of(kary([3, 1]), (0.6, 0.2))  # 7 nodes, depth 2: rounds of 16 ms as modelled
    tree = planner.score(shape, 4, cost.verify_s, cost.draft_s, cost.plain_s)
    rescored = auto.tree_with_its_drafting(tree, None, None, 4, 64, cost)
    assert tree.round_s == pytest.approx(0.016) and rescored.round_s == pytest.approx(0.020)
    assert rescored.speedup == pytest.approx(shape.tau * 0.003 / 0.020)


def test_tokens_per_round_matches_simulation():
    """The distribution of tokens per round (the slowest row's spread) against rounds simulated under the
    positional model: walk down the tree, trying children in rank order, each accepted with p[rank]."""
    p, spec = (0.6, 0.25, 0.1), kary([3, 2, 1])
    rng = np.random.default_rng(0)
    children = {i: [j for j in range(spec.num_nodes) if spec.parents[j] == i] for i in range(spec.num_nodes)}
    ranks = child_ranks(spec)

    def one_round() -> int:
        node, tokens = 0, 1
        while True:
            u, below = rng.random(), 0.0
            nxt = None
            for c in sorted(children[node], key=lambda c: ranks[c]):  # exclusive guesses of one token
                below += p[ranks[c]]
                if u < below:
                    nxt = c
                    break
            if nxt is None:
                return tokens
            node, tokens = nxt, tokens + 1

    x = np.array([one_round() for _ in range(40000)])
    model = planner.tokens_per_round(spec, p)
    assert model.sum() == pytest.approx(1.0) and model @ np.arange(1, 5) == pytest.approx(planner.expected_tau(spec, p))
    assert np.bincount(x, minlength=5)[1:] / x.size == pytest.approx(model, abs=0.01)
    assert planner.tokens_per_round(chain(3), (1.0,)) == pytest.approx([0, 0, 0, 1])


def test_a_batch_waits_for_its_slowest_row():
    """rounds_for_batch against simulated batches: each row draws rounds of a chain until it has its tokens
    (the last round cut by the budget), and the batch takes as many rounds as its slowest row."""
    assert planner.rounds_for_batch(planner.shape_of(chain(3), (1.0,)), 64, 8) == pytest.approx(16)
    rng = np.random.default_rng(1)
    for k, p0, tokens, rows in [(1, 0.885, 64, 64), (3, 0.885, 64, 64), (6, 0.6, 200, 16), (4, 0.9, 64, 1)]:
        shape = planner.shape_of(chain(k), (p0,))
        accepted = np.minimum(rng.geometric(1 - p0, size=(2000, rows, tokens)) - 1, k)  # drafts accepted
        emitted = np.cumsum(accepted + 1, axis=-1)
        rounds = (emitted < tokens).sum(-1) + 1  # rounds until a row has its budget
        simulated = rounds.max(-1).mean()
        assert planner.rounds_for_batch(shape, tokens, rows) == pytest.approx(simulated, rel=0.01), (k, rows)


def test_a_call_is_scored_with_its_prefill_and_its_slowest_row():
    """With a Call, speedup = (prefill + tokens x plain) / (prefill + rounds of the slowest row x round): the
    prefill dilutes it, a big batch's slowest row costs rounds, and a server (no Call) sees neither."""
    verify, draft = (lambda b, n: 0.01), (lambda b, d: 0.0)
    shape = planner.shape_of(chain(4), (0.8,))
    server = planner.score(shape, 64, verify, draft)
    assert server.speedup == pytest.approx(shape.tau)
    alone = planner.score(shape, 1, verify, draft, call=planner.Call(64))
    batch = planner.score(shape, 64, verify, draft, call=planner.Call(64))
    diluted = planner.score(shape, 64, verify, draft, call=planner.Call(64, lambda b: 0.64))
    assert batch.speedup < alone.speedup < server.speedup * 1.001
    rounds = planner.rounds_for_batch(shape, 64, 64)
    assert batch.speedup == pytest.approx(64 / rounds)
    assert diluted.speedup == pytest.approx((0.64 + 0.64) / (0.64 + rounds * 0.01))
    off = planner.score(planner.Shape("off", None, 1.0), 64, verify, draft, call=planner.Call(64, lambda b: 1.0))
    assert off.speedup == 1.0


def test_the_local_roofline_prices_a_target_as_its_mesh_splits_it(monkeypatch):
    """On an H100 a (2, 4) mesh's target is priced at TP 4, each replica running half the batch; on the CPU
    (no link in DEVICES) the split is priced whole and the source says so."""
    import specjax
    from specjax.loading.embedded import embedded
    from specjax.planning import profile

    class Mesh24:
        axis_names, axis_sizes = ("data", "model"), (2, 4)

    target = dataclasses.replace(specjax.load(embedded("target")), mesh=Mesh24())
    monkeypatch.setattr(profile, "local_device", lambda: "h100")
    split = profile.local_roofline(target, None, 64, 0.0)
    tp4 = profile.cost_model("h100", target.cfg, None, 64, 0.0, tensor_parallel=4)
    assert split.verify_s(8, 4) == tp4.verify_s(4, 4) and split.verify_s(7, 4) == tp4.verify_s(4, 4)
    assert split.collective_s(8, 4) == tp4.collective_s(4, 4) > 0
    assert "dp2xtp4: 2 replicas of the batch" in split.source
    monkeypatch.setattr(profile, "local_device", lambda: "cpu")
    whole = profile.local_roofline(target, None, 64, 0.0)
    assert "tp 4 priced whole (cpu has no link in DEVICES)" in whole.source
    assert whole.verify_s(8, 4) == profile.cost_model("cpu", target.cfg, None, 64, 0.0).verify_s(4, 4)
