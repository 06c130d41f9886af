"""The engine's shape policy (specjax/engine/policy.py) on its own, with scripted costs and acceptance: it picks
the shape with the most predicted tokens per second, holds it against noise and one request joining and leaving,
follows a real change of load within `dwell` chunks, and drops a shape that measures worse than "off"."""

from __future__ import annotations

import itertools

import numpy as np

from specjax.decoding.tree import chain
from specjax.engine.policy import DROP_CHUNKS, DWELL, EXPLORE_CHUNKS, EXPLORE_MIN, MIN_SAMPLES, OFF, LoadPolicy

LABELS = [OFF, "chain:1", "chain:2", "chain:4"]
DEPTHS = {OFF: 0, "chain:1": 1, "chain:2": 2, "chain:4": 4}
SPECS = {label: chain(k) for label, k in DEPTHS.items() if k}
# seconds per round at each occupancy bucket: drafting pays at 1-4 rows, not at 8 (verification is no longer free)
ROUND_MS = {1: {OFF: 6, "chain:1": 7, "chain:2": 8, "chain:4": 9},
            4: {OFF: 8, "chain:1": 10, "chain:2": 11, "chain:4": 15},
            8: {OFF: 10, "chain:1": 22, "chain:2": 30, "chain:4": 45}}


def policy(acceptance=0.9) -> LoadPolicy:
    p = LoadPolicy(LABELS, SPECS)
    for nb, costs in ROUND_MS.items():
        for label, ms in costs.items():
            p.round_s[(nb, label)].add(ms / 1e3)
    rounds = 100_000  # of chain:4: depth d's draft verified (accepted by the target) in acceptance^d of them
    p.learn("chain:4", (rounds * acceptance ** np.arange(1, 5))[:, None], rounds)
    return p


def best_by_hand(nb: int, acceptance: float) -> str:
    tau = {label: 1 + sum(acceptance ** d for d in range(1, k + 1)) for label, k in DEPTHS.items()}
    return max(LABELS, key=lambda label: tau[label] / ROUND_MS[nb][label])


def test_picks_the_most_tokens_per_second_at_each_bucket():
    for acceptance in (0.3, 0.6, 0.9):
        p = policy(acceptance)
        for nb in ROUND_MS:
            assert p.choose(nb, nb, None) == best_by_hand(nb, acceptance), (acceptance, nb)
    assert policy(0.9).choose(1, 1, None) == "chain:4" and policy(0.9).choose(8, 8, None) == OFF


def test_noisy_chunk_times_do_not_make_it_thrash():
    """chain:2 and chain:4 predicted 4% apart at bucket 1, every chunk's time +-25% (this VM's spread): the shape
    changes a few times in 300 chunks (13 times without the dwell), and is mostly one of the two."""
    p, rng = policy(0.6), np.random.default_rng(0)
    shape, switches, held = p.choose(1, 1, None), 0, []
    for _ in range(300):
        for label in LABELS:
            seconds = 8 * ROUND_MS[1][label] / 1e3 * rng.uniform(0.75, 1.25)
            p.record(1, 1, label, 8, 8 * p.tau(label), seconds)  # 8 rounds, tau tokens a round
        new = p.choose(1, 1, shape)
        switches += new != shape
        shape = new
        held.append(shape)
    assert switches <= 5, switches
    assert held.count("chain:2") + held.count("chain:4") == len(held)


def test_one_request_joining_and_leaving_does_not_flip_it():
    """Occupancy 4, 5, 4, 5 ... crosses the bucket boundary (4 | 8) every chunk; the shape holds."""
    p = policy(0.9)
    shape = p.choose(4, 4, None)
    assert shape == "chain:4"
    for i in range(50):
        live = 4 + i % 2
        shape = p.choose(4 if live == 4 else 8, live, shape)
        assert shape == "chain:4"


def test_a_lasting_change_of_load_is_followed_within_dwell_chunks():
    p = policy(0.9)
    shape = p.choose(1, 1, None)
    chosen = []
    for _ in range(DWELL + 1):
        shape = p.choose(8, 8, shape)
        chosen.append(shape)
    assert chosen[:DWELL - 1] == ["chain:4"] * (DWELL - 1) and chosen[DWELL - 1] == OFF
    assert p.choose(1, 1, OFF) == OFF  # and back, again after DWELL choices
    for _ in range(DWELL - 1):
        shape = p.choose(1, 1, OFF)
    assert shape == "chain:4"


def test_a_shape_that_measures_worse_than_off_is_dropped_and_left_at_once():
    """Predicted best (acceptance 0.9), but its chunks realize 30% fewer tokens per row than off's."""
    p = policy(0.9)
    for _ in range(MIN_SAMPLES):
        p.record(1, 1, OFF, 10, 10, 0.06)
        p.record(1, 1, "chain:4", 10, 10, 0.0857)  # 117 tokens/s a row against off's 167
    assert (1, "chain:4") in p.dropped
    assert p.choose(1, 1, "chain:4") != "chain:4"  # no dwell: a dropped shape is left at once
    for _ in range(MIN_SAMPLES):
        p.record(1, 1, "chain:2", 10, 20, 0.09)  # 222 a row: kept
    assert (1, "chain:2") not in p.dropped
    lasted = p.chunks_at[1] - p.dropped[(1, "chain:4")]  # the drop lasts DROP_CHUNKS chunks at that bucket
    while (1, "chain:4") in p.dropped:
        p.record(1, 1, OFF, 10, 10, 0.06)
        lasted += 1
    assert lasted == DROP_CHUNKS and (1, "chain:4") not in p.realized  # then fresh evidence decides again


def test_an_untimed_bucket_runs_each_shape_once_before_choosing():
    p = LoadPolicy(LABELS, SPECS)
    seen = set()
    for _ in range(len(LABELS)):
        label = p.choose(2, 2, None)
        seen.add(label)
        p.record(2, 2, label, 4, 8, 0.04)
    assert seen == set(LABELS)


def test_learns_each_ranks_acceptance_from_a_tree_and_prices_trees_with_it():
    """Chunks of kary:3,2,1 whose drafts the target accepts with p = [0.6, 0.2, 0.1] by sibling rank at every depth:
    the policy measures p back, and its tau for that tree, a chain and a one-pass dynamic tree is the planner's
    expected tau under p (the dynamic tree's: of the tree the best-first rule grows on p)."""
    from specjax.decoding.tree import DynamicTreeSpec, parse_tree
    from specjax.planning.block_trees import expected_template
    from specjax.planning.planner import expected_tau

    tree, dynamic = parse_tree("kary:3,2,1", None), DynamicTreeSpec(3, 3, 10)
    specs = {"chain:3": chain(3), "tree:kary:3,2,1": tree, "dynamic": dynamic}
    p = LoadPolicy([OFF, *specs], specs)
    p_R, rounds = np.array([0.6, 0.2, 0.1]), 100_000
    verified_DR = np.zeros((3, 3))
    verified_DR[0] = rounds * p_R  # the root has 3 children
    verified_DR[1, :2] = verified_DR[0].sum() * p_R[:2]  # each depth-1 node 2
    verified_DR[2, :1] = verified_DR[1].sum() * p_R[:1]  # each depth-2 node 1
    p.learn("tree:kary:3,2,1", verified_DR, rounds)
    np.testing.assert_allclose(p.acceptance(), np.tile(p_R, (len(p.acceptance()), 1)), rtol=1e-9)
    for label, spec in specs.items():
        want = expected_tau(expected_template(spec, p_R[None]) if label == "dynamic" else spec, p_R[None])
        assert abs(p.tau(label) - want) < 1e-9, label
    assert p.tau("tree:kary:3,2,1") > p.tau("chain:3")


def test_a_tree_at_light_load_and_off_under_load():
    """Drafts right 60% of the time (the rank-1 guess 20%): the tree's extra nodes cost little at one row and much
    at eight, so the policy takes the tree at 1, off at 8, and a chain in between."""
    from specjax.decoding.tree import parse_tree

    specs = {"chain:3": chain(3), "tree": parse_tree("kary:3,2,1", None)}
    costs_ms = {1: {OFF: 6, "chain:3": 8, "tree": 8.5}, 4: {OFF: 8, "chain:3": 11, "tree": 20},
                8: {OFF: 10, "chain:3": 25, "tree": 60}}
    p = LoadPolicy([OFF, *specs], specs)
    for nb, costs in costs_ms.items():
        for label, ms in costs.items():
            p.round_s[(nb, label)].add(ms / 1e3)
    rounds = 100_000
    p.learn("chain:3", (rounds * 0.6 ** np.arange(1, 4))[:, None], rounds)
    verified_DR = np.zeros((3, 3))
    verified_DR[0] = rounds * np.array([0.6, 0.2, 0.1])
    p.learn("tree", verified_DR, rounds)  # depth 1's ranks (deeper depths: as depth 1)
    assert [p.choose(nb, nb, None) for nb in (1, 4, 8)] == ["tree", "chain:3", OFF]


def test_a_chunk_after_a_prefill_updates_the_realized_rate_but_not_the_round_time():
    p = policy(0.9)
    before = p.round_s[(1, "chain:4")].value
    p.record(1, 1, "chain:4", 8, 30, 8 * 3 * before, clean=False)  # a prefill ran inside: 3x the round time
    assert p.round_s[(1, "chain:4")].value == before and p.realized[(1, "chain:4")].runs == 1
    p.record(1, 1, "chain:4", 8, 30, 8 * 3 * before)
    assert p.round_s[(1, "chain:4")].value > before


def test_a_shape_worse_than_off_is_dropped_even_where_off_never_ran():
    """auto ran chain:4 at bucket 1 only (off never ran there, so off has no realized rate), its chunks after
    prefills realizing 20% of its model: its prediction, carrying that, against off's still drops it."""
    p = policy(0.9)
    assert p.choose(1, 1, None) == "chain:4"
    modelled = p.modelled(1, 1, "chain:4")
    for _ in range(MIN_SAMPLES):
        p.record(1, 1, "chain:4", 10, 0.2 * modelled * 0.1, 0.1, clean=False)
    assert p.predicted(1, 1, "chain:4") < 0.95 * p.predicted(1, 1, OFF)
    assert (1, "chain:4") in p.dropped and p.realized[(1, OFF)].runs == 0


def test_a_shape_is_judged_by_its_tokens_over_its_time_not_by_its_mean_chunk_rate():
    """chain:4 emits 1.3x off's tokens per row-second at bucket 1, but every other chunk of it is a short one after
    a prefill (a tenth of the rate, a tenth of the time): a mean of per-chunk rates would put it at 0.8x off and drop
    it; its tokens over its time keep it."""
    p = policy(0.9)
    for _ in range(MIN_SAMPLES):
        p.record(1, 1, OFF, 10, 10, 0.06)  # 167 a row per second
        p.record(1, 1, "chain:4", 10, 12, 0.05, clean=False)  # 240 a row per second
        p.record(1, 1, "chain:4", 1, 0.12, 0.005, clean=False)  # 24
    assert p.realized[(1, "chain:4")].rate() > 1.25 * p.realized[(1, OFF)].rate()
    assert (1, "chain:4") not in p.dropped


def test_a_shape_realizing_less_than_its_model_yields_and_is_tried_again_later():
    """At 8 rows chain:4 is modelled 37% ahead of off, but every chain's chunks realize about half their model
    (prefills and chunks cut short by finishing rows: work the model leaves out); off realizes its model. Once the
    shape in use is measured, the policy explores off, keeps it, tries the chains predicted within reach once each
    (each cut short after EXPLORE_MIN chunks, as it trails off), and tries them again only as their evidence ages:
    off runs >= 97% of the time."""
    p = policy(0.9)
    p.round_s[(8, "chain:4")] = type(p.round_s[(8, OFF)])(0.030, 1)  # 8 x 4.1 / 30 ms against off's 8 / 10 ms
    shape = p.choose(8, 8, None)
    assert shape == "chain:4" and p.predicted(8, 8, "chain:4") > 1.3 * p.predicted(8, 8, OFF)
    held = []
    for _ in range(3000):
        if shape == OFF:
            p.record(8, 8, OFF, 4, 32, 4 * 0.010)
        else:  # a chain: about half its modelled tokens per second, not clean (the round cost stays the model's)
            p.record(8, 8, shape, 4, int(8 * 4 * p.tau(shape)), 2 * 4 * 0.030, clean=False)
        shape = p.choose(8, 8, shape)
        held.append(shape)
    first_off = held.index(OFF)
    assert first_off <= EXPLORE_CHUNKS, first_off
    assert held[first_off:].count(OFF) >= 0.97 * len(held[first_off:])
    retried = {label for label in held[1000:] if label != OFF}
    assert retried, "a shape's aged evidence must let it be tried again"
    trials = [len(list(run)) for label, run in itertools.groupby(held[first_off:]) if label != OFF]
    assert len(trials) <= 12 and max(trials) == EXPLORE_MIN, trials  # each cut short as it trails: not thrash
    assert abs(p.realized[(8, OFF)].factor() - 1) < 0.01 and p.realized[(8, "chain:4")].factor() < 0.8


def test_a_shape_the_model_underrates_is_explored_and_kept():
    """The warmup priced off dear at 8 rows: modelled at 85% of chain:4, it never runs unless tried. Once chain:4 is
    measured, the shapes predicted within reach are explored, best first; off realizes 1.25x its model against
    chain:4's 0.9x (the others 0.5x), and is kept."""
    p = policy(0.9)
    off_s = 8 / (0.85 * p.modelled(8, 8, "chain:4"))
    p.round_s[(8, OFF)] = type(p.round_s[(8, OFF)])(off_s, 1)
    shape, held = p.choose(8, 8, None), []
    assert shape == "chain:4"
    for _ in range(60):
        truth = {OFF: 1.25, "chain:4": 0.9}.get(shape, 0.5)  # realized over modelled
        rate = p.modelled(8, 8, shape)
        p.record(8, 8, shape, 4, rate * 0.05 * truth, 0.05, clean=False)
        shape = p.choose(8, 8, shape)
        held.append(shape)
    assert OFF in held[:4 * EXPLORE_CHUNKS] and held[-20:] == [OFF] * 20, held  # the likelier shapes first


def test_a_trial_that_trails_is_cut_short_and_the_incumbent_returns_at_once():
    """chain:4 in use at bucket 1, realizing its model; the shapes predicted within reach are tried, but each realizes
    half of chain:4's rate: every trial ends after EXPLORE_MIN chunks, straight back to chain:4 (no dwell). Acceptance
    0.6: chain:2 and chain:1 are predicted at 96% and 89% of chain:4."""
    p = policy(0.6)
    shape, held = p.choose(1, 1, None), []
    assert shape == "chain:4"
    for _ in range(40):
        truth = 1.0 if shape == "chain:4" else 0.5
        rate = p.modelled(1, 1, "chain:4")
        p.record(1, 1, shape, 4, rate * 0.05 * truth, 0.05, clean=False)
        shape = p.choose(1, 1, shape)
        held.append(shape)
    trials = [(label, len(list(run))) for label, run in itertools.groupby(held) if label != "chain:4"]
    assert trials and all(n == EXPLORE_MIN for _, n in trials), trials
    assert len({label for label, _ in trials}) == len(trials) and held[-20:] == ["chain:4"] * 20, held


def test_a_shape_not_running_is_priced_at_its_warmup_cost_scaled_as_the_running_ones_ran():
    """Warmup timed device time alone; running chunks also hold the host's gap (here every shape's 30% more). chain:4
    is the best shape at bucket 1 by its warmup costs (acceptance 0.6, chain:2 4% behind). Priced by raw warmup
    timings, chain:2 would look 20% ahead once chain:4's own chunks showed the gap, and the policy would leave
    chain:4 for it; scaled by the running shapes' runtime over warmup ratio, chain:4 is kept (chain:2 runs only
    as a trial)."""
    p = LoadPolicy(LABELS, SPECS)
    for label, ms in ROUND_MS[1].items():
        p.warm_s[(1, label)] = ms / 1e3
    p.learn("chain:4", (100_000 * 0.6 ** np.arange(1, 5))[:, None], 100_000)
    shape, held = p.choose(1, 1, None), []
    assert shape == "chain:4"
    for _ in range(10):  # clean chunks: the running shape's cost moves to its runtime
        p.record(1, 1, shape, 8, 8 * p.tau(shape), 8 * 1.3 * ROUND_MS[1][shape] / 1e3)
    assert abs(p.cost(1, "chain:2") / (1.3 * ROUND_MS[1]["chain:2"] / 1e3) - 1) < 1e-3
    raw = p.tau("chain:2") / (ROUND_MS[1]["chain:2"] / 1e3)
    assert raw > 1.15 * p.predicted(1, 1, "chain:4") > 1.15 * p.predicted(1, 1, "chain:2")
    for _ in range(60):
        p.record(1, 1, shape, 8, 8 * p.tau(shape), 8 * 1.3 * ROUND_MS[1][shape] / 1e3)
        shape = p.choose(1, 1, shape)
        held.append(shape)
    assert held.count("chain:4") >= len(held) - len(LABELS) * EXPLORE_CHUNKS and held[-20:] == ["chain:4"] * 20, held


def test_chunk_rounds_are_the_fewest_powers_of_two_that_take_the_target_time():
    from specjax.engine.engine import CHUNK_TARGET_S, MAX_ROUNDS, chunk_rounds

    assert chunk_rounds(None) == 1 and chunk_rounds(1e-4) == MAX_ROUNDS  # no cost known yet; a cheap round
    for round_s in (0.004, 0.007, 0.01, 0.03, 0.049, 0.051, 0.2):
        rounds = chunk_rounds(round_s)
        assert rounds * round_s >= CHUNK_TARGET_S and (rounds == 1 or rounds / 2 * round_s < CHUNK_TARGET_S), round_s
        assert rounds & (rounds - 1) == 0
