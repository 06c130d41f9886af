"""Verification with hand-made logits: greedy paths, tree branches, rejection and residual sampling."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SamplingConfig
from specjax.decoding.tree import ancestor_mask, chain, kary, spec_arrays
from specjax.decoding.verify import Draft, verify_greedy, verify_sampled

V = 5


def onehot_logits(choices):
    """Logits [1, N, V] whose argmax at node i is choices[i]."""
    return jnp.asarray(np.eye(V)[choices][None] * 10.0, jnp.float32)


def make_draft(spec, tokens, valid=None, q=None):
    n = spec.num_nodes
    valid = jnp.ones((1, n), bool) if valid is None else jnp.asarray([valid])
    return Draft(jnp.asarray([tokens], jnp.int32), spec_arrays(spec, 1), valid, q)


def greedy(spec, tokens, target_choices, valid=None):
    draft = make_draft(spec, tokens, valid)
    v = verify_greedy(draft, ancestor_mask(draft.parents), onehot_logits(target_choices))
    n = int(v.num_accepted[0])
    return list(np.asarray(v.path[0, :n])), int(v.bonus[0])


def test_greedy_chain_all_accepted():
    # root 0, drafts 1,2,3; target after root says 1, after 1 says 2, after 2 says 3, after 3 says 4.
    assert greedy(chain(3), [0, 1, 2, 3], [1, 2, 3, 4]) == ([0, 1, 2, 3], 4)


def test_greedy_chain_first_rejected():
    assert greedy(chain(3), [0, 4, 2, 3], [1, 2, 3, 4]) == ([0], 1)


def test_greedy_chain_stops_at_first_mismatch_even_if_later_match():
    assert greedy(chain(3), [0, 1, 4, 3], [1, 2, 3, 4]) == ([0, 1], 2)


def test_greedy_invalid_node_is_never_accepted():
    assert greedy(chain(3), [0, 1, 2, 3], [1, 2, 3, 4], valid=[True, True, False, False]) == ([0, 1], 2)


def test_greedy_tree_picks_the_matching_branch():
    # kary(2,1): root -> nodes 1,2; node 1 -> 3; node 2 -> 4.
    spec = kary([2, 1])
    # target: after root 3; after node 2 (token 3) says 1; node 4 has token 1 -> accepted path 0,2,4.
    assert greedy(spec, [0, 4, 3, 0, 1], [3, 0, 1, 0, 2]) == ([0, 2, 4], 2)


def sampled_outcomes(draft, p_logits, n_samples=20000, sampling=SamplingConfig(temperature=1.0)):
    mask = ancestor_mask(draft.parents)
    keys = jax.random.split(jax.random.key(0), n_samples)
    v = jax.vmap(lambda k: verify_sampled(draft, mask, p_logits, sampling, k[None]))(keys)
    return np.asarray(v.num_accepted)[:, 0], np.asarray(v.bonus)[:, 0]


def test_sampled_deterministic_draft_accepts_with_target_probability():
    """One-hot q: accept token 0 with p(0)=0.5; on rejection the residual is p with token 0 zeroed."""
    p_root = np.log(np.array([0.5, 0.3, 0.2, 1e-12, 1e-12]))
    p_after = np.log(np.array([1e-12, 1e-12, 1e-12, 1.0, 1e-12]))
    logits = jnp.asarray(np.stack([p_root, p_after])[None], jnp.float32)
    n_acc, bonus = sampled_outcomes(make_draft(chain(1), [4, 0]), logits)
    accepted = n_acc == 2
    assert abs(accepted.mean() - 0.5) < 0.02
    assert np.all(bonus[accepted] == 3)
    rejected_bonus = bonus[~accepted]
    assert set(rejected_bonus) <= {1, 2}  # token 0 was zeroed
    assert abs((rejected_bonus == 1).mean() - 0.6) < 0.03  # 0.3 / (0.3 + 0.2)


def test_sampled_stochastic_draft_residual():
    """q = (0.8, 0.2, 0...) drew token 0; p = (0.4, 0.6): accept w.p. 0.5; residual (p-q)+ = token 1 only."""
    p = np.log(np.array([0.4, 0.6, 1e-12, 1e-12, 1e-12]))
    logits = jnp.asarray(np.stack([p, p])[None], jnp.float32)
    q = jnp.asarray(np.array([[[0, 0, 0, 0, 0], [0.8, 0.2, 0, 0, 0]]], np.float32))
    n_acc, bonus = sampled_outcomes(make_draft(chain(1), [4, 0], q=q), logits)
    assert abs((n_acc == 2).mean() - 0.5) < 0.02
    assert np.all(bonus[n_acc == 1] == 1)


def test_sampled_tree_tries_siblings_in_order():
    """Root children tokens 0 then 1 (deterministic). p = (0.5, 0.5): first child accepted w.p. 0.5;
    after its rejection the residual is (0, 1), so the second child is always accepted."""
    spec = kary([2])
    p = np.log(np.array([0.5, 0.5, 1e-12, 1e-12, 1e-12]))
    logits = jnp.asarray(np.stack([p, p, p])[None], jnp.float32)
    draft = make_draft(spec, [4, 0, 1])
    mask = ancestor_mask(draft.parents)
    keys = jax.random.split(jax.random.key(1), 20000)
    v = jax.vmap(lambda k: verify_sampled(draft, mask, logits, SamplingConfig(temperature=1.0), k[None]))(keys)
    last = np.asarray(v.path)[:, 0, 1]
    assert np.all(np.asarray(v.num_accepted)[:, 0] == 2)
    assert abs((last == 1).mean() - 0.5) < 0.02 and abs((last == 2).mean() - 0.5) < 0.02


def test_sampled_empty_residual_is_guarded():
    """p == q exactly: rejection has probability 0; nothing may be NaN."""
    p = np.log(np.array([0.25, 0.25, 0.25, 0.25, 1e-12]))
    logits = jnp.asarray(np.stack([p, p])[None], jnp.float32)
    q = jnp.asarray(np.exp(np.stack([p, p]))[None], jnp.float32)
    n_acc, bonus = sampled_outcomes(make_draft(chain(1), [4, 2], q=q), logits, n_samples=2000)
    assert np.all(n_acc == 2) and np.all((bonus >= 0) & (bonus < 4))
