"""specjax.Engine: continuous batching is lossless whatever shares the batch, whenever requests arrive or leave.

Requests arrive at random (seeded) times and some are aborted at random moments; every other request's greedy
output must equal plain decoding of its prompt, for every drafter family, while the shape policy switches
between "off" and a chain at random (so the drafter state's catch-up after "off" runs), on the dense, hybrid and
MoE targets. Sampled output keeps the target's distribution under mixed load (chi-square). Stops, logprobs and
penalties per request are those of `specjax.generate` of the prompt alone. Nothing compiles after warmup.
"""

from __future__ import annotations

import asyncio
import random
import time

import jax
import numpy as np
import pytest
from hf_tiny import build_hf_model, build_moe, build_qwen35, save_hf_model
from test_lossless_sampling import NEW, PROMPT, chi_square_passes, exact_distribution, tiny

import specjax
from specjax.config import SamplingConfig
from specjax.drafters import DraftModelDrafter
from specjax.engine import engine as engine_module
from specjax.engine.policy import OFF

PROMPTS = ["def quicksort(xs):", "import os\n", "class Foo:\n    def __init__(self", "for i in range(10):",
           "x = [", "def main():\n    print(", "with open(path) as f:", "try:\n    import"]
BUDGETS = [12, 20, 7, 16, 24, 9, 14, 18]


@pytest.fixture(scope="module")
def target():
    return specjax.load(specjax.embedded("target"))


@pytest.fixture(scope="module")
def plain(target):
    return [specjax.generate(target, [p], max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, BUDGETS)]


def random_switches(engine, seed: int) -> None:
    """Make the engine's policy switch shape every chunk, "off" and a chain in turn, sometimes twice in a row (a
    lossless engine must not care; every return from "off" runs the drafter's catch-up)."""
    rng = random.Random(seed)
    turn = iter(range(10 ** 9))
    engine.policy.choose = lambda nb, live, current: engine.labels[(next(turn) + (rng.random() < 0.2)) %
                                                                   len(engine.labels)]


def run_with_arrivals(engine, prompts, budgets, seed: int, aborts: int = 2):
    """Submit at random times, abort `aborts` requests at random moments; return {index: output}."""
    rng = random.Random(seed)
    handles = []
    for p, n in zip(prompts, budgets):
        handles.append(engine.submit(p, max_new_tokens=n, temperature=0.0))
        time.sleep(rng.random() * 0.05)
    aborted = set(rng.sample(range(len(handles)), aborts))
    for i in sorted(aborted):
        time.sleep(rng.random() * 0.02)
        engine.abort(handles[i])
    outs = {i: h.result(timeout=600) for i, h in enumerate(handles)}
    for i in aborted:
        assert outs[i].finish_reason in ("abort", "length", "stop")  # it may have finished before the abort
    return {i: o for i, o in outs.items() if o.finish_reason != "abort"}, aborted


def assert_no_leaks(engine) -> None:
    deadline = time.time() + 30
    while engine.stats()["occupancy"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats()["occupancy"] == 0 and engine.stats()["queue_length"] == 0


@pytest.mark.parametrize("family", ["draft", "ngram", "eagle3", "mtp", "dflash", "dspark"])
def test_greedy_equals_plain_under_arrivals_aborts_and_switches(target, plain, family, monkeypatch):
    # Chunks of at most 2 rounds: a row (every budget >= 7) outlives an "off" chunk, so the next chain chunk runs
    # its catch-up whatever the machine's speed (with 32-round chunks a fast machine finishes rows inside one).
    monkeypatch.setattr(engine_module, "MAX_ROUNDS", 2)
    drafter = specjax.NgramDrafter() if family == "ngram" else specjax.load_drafter(specjax.embedded(family), target)
    with specjax.Engine(target, drafter, max_slots=4, max_len=64, auto_chains=(2,), sampling=False,
                        max_prefill_batch=2) as engine:
        assert engine.labels == [OFF, "chain:2"]
        random_switches(engine, seed=sum(map(ord, family)))  # str hash() varies per process
        outs, aborted = run_with_arrivals(engine, PROMPTS, BUDGETS, seed=1)
        for i, out in outs.items():
            assert out.tokens == plain[i], f"{family}: request {i} differs from plain decoding"
            assert out.finish_reason == ("length" if len(out.tokens) == BUDGETS[i] else "stop")
        stats = engine.stats()
        assert {label for _, _, label in stats["shapes_over_time"]} == {OFF, "chain:2"}
        assert stats["catch_up_rows"] > 0
        assert_no_leaks(engine)
        # Admitted while "off": prefilled without the drafter (its state stale), caught up when the chain resumes.
        labels = iter([OFF] * 4)
        engine.policy.choose = lambda nb, live, current: next(labels, "chain:2")
        before = engine.stats()
        runner = engine.submit(PROMPTS[4], max_new_tokens=BUDGETS[4], temperature=0.0)  # a chunk runs "off" first
        while engine.stats()["chunks"] == before["chunks"]:
            time.sleep(0.005)
        late = engine.submit(PROMPTS[1], max_new_tokens=BUDGETS[1], temperature=0.0)
        assert late.result(timeout=300).tokens == plain[1] and runner.result(timeout=300).tokens == plain[4]
        after = engine.stats()
        assert after["draftless_prefill_rows"] > before["draftless_prefill_rows"]
        assert after["catch_up_rows"] > before["catch_up_rows"]


def test_a_slot_whose_budget_runs_out_is_not_idle_through_a_chunk(target, plain):
    """Slot turnaround: an "off" chunk ends where its first row's budget does, and a chunk in which a budget may run
    out is read before the next gap, so no request that ended by its budget still holds a row of a later chunk (with
    the next chunk dispatched behind the one reading it, each such slot stayed idle for a whole chunk)."""
    with specjax.Engine(target, None, max_slots=2, max_len=64, sampling=False) as engine:
        ended_before, read = [], engine._read  # per chunk read: the requests in its rows that had already ended

        def recording_read(chunk):
            ended_before.append([a.handle.request_id for a in chunk.owners if a is not None and a.finished])
            return read(chunk)

        engine._read = recording_read
        handles = [engine.submit(p, max_new_tokens=n, temperature=0.0) for p, n in zip(PROMPTS, BUDGETS)]
        outs = {h.request_id: h.result(timeout=300) for h in handles}
    assert [o.tokens for o in outs.values()] == plain
    idle = [rid for ended in ended_before for rid in ended if outs[rid].finish_reason == "length"]
    assert len(ended_before) > len(PROMPTS) and idle == [], f"requests ended by budget held later chunks' rows: {idle}"


@pytest.mark.parametrize("kind", ["hybrid", "moe"])
def test_greedy_equals_plain_on_hybrid_and_moe_targets(tmp_path, kind):
    """The hybrid target drafts with a hybrid draft model (its DeltaNet state moved, held and caught up per slot as
    every drafter state is); test_chunked_prefill_equals_plain runs a dense draft model on it."""
    model = build_qwen35("causal_lm") if kind == "hybrid" else build_moe("qwen3_moe")
    t = specjax.load(save_hf_model(model, tmp_path / kind))
    small = build_qwen35("causal_lm", seed=1, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]) \
        if kind == "hybrid" else build_hf_model("qwen3", seed=1, num_hidden_layers=1)
    other = specjax.load(save_hf_model(small, tmp_path / "draft"))
    draft = DraftModelDrafter(other.cfg, params=other.params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 23, 1, 9, 14)]
    budgets = [10, 6, 12, 8, 11]
    ref = [specjax.generate(t, [p], max_new_tokens=n, eos_token_id=[]).tokens[0] for p, n in zip(prompts, budgets)]
    with specjax.Engine(t, draft, max_slots=2, max_len=64, auto_chains=(3,), sampling=False) as engine:
        random_switches(engine, seed=3)
        handles = [engine.submit(p, max_new_tokens=n, eos_token_id=[], temperature=0.0)
                   for p, n in zip(prompts, budgets)]
        for h, r in zip(handles, ref):
            assert h.result(timeout=600).tokens == r
        assert_no_leaks(engine)


def test_no_compiles_after_warmup(target):
    draft = specjax.load_drafter(specjax.embedded("draft"), target)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/compilation_cache/compile_time_saved_sec"
        or event.endswith("backend_compile_duration") else None)
    with specjax.Engine(target, draft, max_slots=2, max_len=48, auto_chains=(2,), max_prefill_batch=2,
                        logprobs=1, prefill_chunk=16) as engine:
        seconds = engine.warmup()
        assert seconds > 0 and engine.stats()["warmed_up"]
        before, events = engine.stats()["compiles"], len(compiles)
        rng = random.Random(0)
        handles = []
        for i in range(10):
            prompt = [rng.randrange(3, 200) for _ in range(rng.choice([1, 5, 17, 30]))]  # 17, 30: in pieces
            settings = {"max_new_tokens": rng.randrange(1, 48 - len(prompt))}
            if i % 2:
                settings.update(temperature=0.8, seed=i)
            if i % 3 == 0:
                settings.update(logprobs=True, top_logprobs=1)
            handles.append(engine.submit(prompt, **settings))
            time.sleep(rng.random() * 0.03)
        if handles:
            engine.abort(handles[3])
        for h in handles:
            h.result(timeout=300)
        assert engine.stats()["compiles"] == before, f"the engine compiled after warmup: {engine._compiled[before:]}"
        assert len(compiles) == events, f"JAX compiled after warmup: {compiles[events:]}"
        assert_no_leaks(engine)


def test_stops_logprobs_penalties_per_request_match_generate(target):
    cases = [dict(max_new_tokens=20, stop=["\n"]),
             dict(max_new_tokens=16, logprobs=True, top_logprobs=2),
             dict(max_new_tokens=16, repetition_penalty=1.3, presence_penalty=0.5),
             dict(max_new_tokens=12, min_tokens=6, frequency_penalty=0.4, logprobs=True),
             dict(max_new_tokens=18)]
    with specjax.Engine(target, None, max_slots=4, max_len=64, logprobs=2, penalties=True, sampling=False) as engine:
        handles = [engine.submit(PROMPTS[i], **kw) for i, kw in enumerate(cases)]
        for i, (h, kw) in enumerate(zip(handles, cases)):
            ref = specjax.generate(target, [PROMPTS[i]], **kw)
            out = h.result(timeout=300)
            assert out.tokens == ref.tokens[0] and out.text == ref.texts[0], kw
            assert (out.finish_reason, out.stop_reason) == (ref.finish_reasons[0], ref.stop_reasons[0])
            if kw.get("logprobs"):
                np.testing.assert_allclose(out.logprobs, ref.logprobs[0], atol=1e-4)
            if kw.get("top_logprobs"):
                assert [[t for t, _ in row] for row in out.top_logprobs] == \
                    [[t for t, _ in row] for row in ref.top_logprobs[0]]
            streamed = list(h)
            assert sum((c.token_ids for c in streamed), []) == out.tokens
            assert "".join(c.text for c in streamed) == out.text and streamed[-1].finish_reason == out.finish_reason


def test_bad_requests_are_refused_alone_and_async_works(target):
    with specjax.Engine(target, None, max_slots=2, max_len=32, sampling=False) as engine:
        bad = [(([5] * 30,), {"max_new_tokens": 40}, "max_len=32"),
               (([1, 2, 3],), {"max_new_tokens": 4, "temperature": 0.5}, "sampling=False"),
               (([1, 2, 3],), {"max_new_tokens": 4, "logprobs": True}, "no logprobs"),
               (([1, 2, 3],), {"max_new_tokens": 4, "presence_penalty": 0.5}, "without penalties"),
               (([1, 2, 3],), {"max_new_tokens": 0}, "max_new_tokens"),
               (([10 ** 9],), {"max_new_tokens": 4}, "outside the vocabulary")]
        for args, kw, words in bad:
            with pytest.raises(ValueError, match=words):
                engine.submit(args[0], **kw)
        with pytest.raises(TypeError, match="unexpected keyword"):
            engine.submit([1, 2], best_of=3)
        with pytest.raises(ValueError, match="temperature"):
            engine.submit([1, 2], max_new_tokens=2, temperature=float("nan"))
        h = engine.submit("def f(x):", sampling_params=specjax.SamplingParams(max_tokens=8))
        out = asyncio.run(_await(h))
        assert out.tokens == specjax.generate(target, ["def f(x):"], max_new_tokens=8).tokens[0]
        with pytest.raises(RuntimeError, match="idle"):
            engine.submit("x", max_new_tokens=30)
            engine.warmup()


async def _await(handle):
    chunks = [c async for c in handle]
    out = await handle
    assert sum((c.token_ids for c in chunks), []) == out.tokens
    return out


def test_an_error_in_the_loop_fails_requests_and_closes_the_engine(target):
    engine = specjax.Engine(target, None, max_slots=2, max_len=32, sampling=False)

    def broken(*a, **kw):
        raise FloatingPointError("injected")

    engine._chunk = broken
    h = engine.submit("def f(x):", max_new_tokens=8)
    with pytest.raises(RuntimeError, match="injected"):
        h.result(timeout=120)
    with pytest.raises(RuntimeError, match="stopped after an error"):
        engine.submit("x", max_new_tokens=2)
    engine.close()


def test_sampled_output_keeps_the_target_distribution_under_mixed_load():
    target, draft_target = tiny(2, layers=2), tiny(7, layers=1)
    draft = DraftModelDrafter(draft_target.cfg, params=draft_target.params)
    sampling = SamplingConfig(1.0)
    n = 2000
    with specjax.Engine(target, draft, max_slots=8, max_len=16, auto_chains=(2,), max_prefill_batch=8) as engine:
        random_switches(engine, seed=5)
        handles = []
        for i in range(n):
            handles.append(engine.submit(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=i, stop_token_ids=[]))
            if i % 7 == 0:  # greedy and longer requests share the batch
                engine.submit([1, 2, 3, 4, 5], max_new_tokens=8, temperature=0.0)
        samples = np.array([h.result(timeout=600).tokens for h in handles])
    ok, stat, threshold = chi_square_passes(samples, exact_distribution(target, sampling))
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}: the engine's sampled output is not the target's"


def test_engine_on_a_mesh_equals_one_device(tmp_path):
    """TP 2 and DP 2 x TP 4 on 8 fake CPU devices (a subprocess: tests/sharded_check.py part "engine")."""
    from sharded_check import failed, run_part

    checks, _ = run_part("engine", tmp_path)
    count, bad = failed(checks, "engine/")
    assert count == 4 and bad == {}  # equal to one device and nothing compiled after warmup, at each mesh


def test_dspark_budgets_across_live_slots_stay_lossless(target, plain):
    """DSpark's confidences decide, every round and across all live slots, which drafts are verified (the prefix
    scheduler, Algorithm 1's rule); output still equals plain decoding, and fewer nodes are verified."""
    drafter = specjax.load_drafter(specjax.embedded("dspark"), target)
    with specjax.Engine(target, drafter, max_slots=4, max_len=64, num_draft_tokens=4, sampling=False,
                        scheduler="confidence", scheduler_profile="roofline", max_prefill_batch=2) as engine:
        outs, _ = run_with_arrivals(engine, PROMPTS, BUDGETS, seed=2, aborts=1)
        for i, out in outs.items():
            assert out.tokens == plain[i], f"request {i} differs from plain decoding under the scheduler"
        assert_no_leaks(engine)
    with pytest.raises(ValueError, match="prefixes of one chain"):
        specjax.Engine(target, drafter, max_slots=2, max_len=32, scheduler="confidence")


@pytest.mark.parametrize("kind", ["dense-eagle3", "hybrid-draft"])
def test_chunked_prefill_equals_plain(target, tmp_path, kind):
    """Prompts longer than prefill_chunk enter their slots piece by piece while others decode; outputs (and the
    drafter's features over the whole prompt) are as a whole prefill gives them."""
    if kind == "dense-eagle3":
        t, drafter = target, specjax.load_drafter(specjax.embedded("eagle3"), target)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 4000, size=n).tolist() for n in (70, 9, 33, 100, 17)]
    else:
        t = specjax.load(save_hf_model(build_qwen35("causal_lm"), tmp_path / "hybrid"))
        other = specjax.load(save_hf_model(build_hf_model("qwen3", seed=1, num_hidden_layers=1), tmp_path / "d"))
        drafter = DraftModelDrafter(other.cfg, params=other.params)
        rng = np.random.default_rng(2)
        prompts = [rng.integers(3, 200, size=n).tolist() for n in (70, 9, 33, 100, 17)]
    budgets = [9, 12, 6, 10, 8]
    ref = [specjax.generate(t, [p], max_new_tokens=n, eos_token_id=[]).tokens[0] for p, n in zip(prompts, budgets)]
    with specjax.Engine(t, drafter, max_slots=2, max_len=128, auto_chains=(2,), sampling=False, prefill_chunk=16,
                        prefill_tokens_per_gap=32) as engine:
        random_switches(engine, seed=4)
        handles = [engine.submit(p, max_new_tokens=n, eos_token_id=[]) for p, n in zip(prompts, budgets)]
        assert [h.result(timeout=600).tokens for h in handles] == ref
        assert engine.stats()["chunked_prefills"] == 4  # the prompts over 16 tokens
        assert_no_leaks(engine)


@pytest.mark.parametrize("family, tree", [("draft", "kary:2,1"), ("eagle3", "dynamic:top_k=2,depth=2,total_tokens=6")])
def test_trees_among_autos_shapes(target, plain, monkeypatch, family, tree):
    """auto_trees: a static tree (draft model) or EAGLE-3's dynamic tree among "auto"'s shapes, the shape switching
    between off, a chain and the tree every chunk: greedy output equals plain decoding, and the tree's chunks teach
    the policy its side branches' acceptance (rank 1 at depth 1 offered), which chains alone never offer."""
    monkeypatch.setattr(engine_module, "MAX_ROUNDS", 2)
    drafter = specjax.load_drafter(specjax.embedded(family), target)
    with specjax.Engine(target, drafter, max_slots=4, max_len=64, auto_chains=(2,), auto_trees=[tree],
                        sampling=False, max_prefill_batch=2) as engine:
        label = engine.labels[-1]
        assert engine.labels[:2] == [OFF, "chain:2"] and label.endswith(tree)
        random_switches(engine, seed=5)
        outs, _ = run_with_arrivals(engine, PROMPTS, BUDGETS, seed=3, aborts=1)
        for i, out in outs.items():
            assert out.tokens == plain[i], f"request {i} differs from plain decoding with {tree} among the shapes"
        stats = engine.stats()
        assert {lb for _, _, lb in stats["shapes_over_time"]} == set(engine.labels)
        assert engine.policy.offered_DR[0, 1] > 0 and stats["tau"][label] > 1
        assert_no_leaks(engine)
