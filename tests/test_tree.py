"""Tree templates, ancestor masks and depths."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.tree import (
    TreeSpec,
    ancestor_mask,
    chain,
    child_ranks,
    depths,
    from_choices,
    kary,
    parse_tree,
    spec_arrays,
)


def brute_force_mask(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize("spec", [chain(1), chain(7), kary([3, 2, 1]), kary([2, 2, 2, 2]),
                                  from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])])
def test_ancestor_mask_and_depths_match_brute_force(spec):
    mask = np.asarray(ancestor_mask(spec_arrays(spec, 2)))
    expected = brute_force_mask(spec.parents)
    np.testing.assert_array_equal(mask[0], expected)
    np.testing.assert_array_equal(mask[1], expected)
    np.testing.assert_array_equal(np.asarray(depths(jnp.asarray(mask)))[0], spec.depths)


def test_random_dynamic_trees_under_jit():
    rng = np.random.default_rng(0)
    parents = np.array([[-1] + [rng.integers(0, i) for i in range(1, 33)] for _ in range(4)], np.int32)
    mask = np.asarray(ancestor_mask(jnp.asarray(parents)))
    for row, p in zip(mask, parents):
        np.testing.assert_array_equal(row, brute_force_mask(list(p)))


def test_templates():
    assert chain(3).parents == (-1, 0, 1, 2) and chain(3).is_chain
    assert kary([2, 1]).parents == (-1, 0, 0, 1, 2)
    assert kary([2, 1]).max_depth == 2 and not kary([2, 1]).is_chain
    spec = from_choices([[1], [0], [0, 0]])
    assert spec.parents == (-1, 0, 0, 1)
    assert child_ranks(spec) == (0, 0, 1, 0)


@pytest.mark.parametrize("bad, match", [
    ("spiral:3", "unknown tree spec"), ("chain:1,2", "one number"), ("kary:0", "positive"),
    ([[1]], "ranks"), ([[0, 0]], "lacks its parent"), (3.5, "unknown tree spec"),
])
def test_bad_tree_specs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_tree(bad, None)


def test_tree_spec_rejects_non_topological_parents():
    with pytest.raises(ValueError, match="earlier node"):
        TreeSpec((-1, 2, 0))


def test_parse_defaults():
    assert parse_tree(None, None) == chain(4)
    assert parse_tree(None, 6) == chain(6)
    assert parse_tree("kary:2,2", None) == kary([2, 2])
