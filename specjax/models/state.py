"""Modules <-> plain param dicts: how every network (target, draft model, heads) crosses a jit boundary.

A module's weights travel as a nested dict of arrays (`to_params`: nnx's pure dict, the tree the
checkpoints store) and its structure as an `nnx.GraphDef` (static, hashable: part of a compiled
loop's key). Inside a traced function, `nnx.merge(graphdef, params)` rebuilds the module over the
traced arrays; nothing is copied and nothing mutates it. A plain dict flattens in C++; an
nnx.State or a Module is flattened in Python on every call (on this CPU about 10x and 20x slower
for a 32-layer model), which batch-1 decoding would pay per generate call.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx


def to_params(module: nnx.Module) -> dict:
    """The module's variables as a plain nested dict of arrays (nnx.List entries keyed 0, 1, ...)."""
    return nnx.to_pure_dict(nnx.state(module))


def abstract_module(make: Callable[[], nnx.Module]) -> nnx.Module:
    """`make()` with shapes for weights (nnx.eval_shape). Outside any mesh, even when traced under one (a loop for a
    target on a mesh): under a mesh, eval_shape would read the weights' logical axis names as mesh axes."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(make)


def graph_of(make: Callable[[], nnx.Module]) -> nnx.GraphDef:
    """The graph of the module `make()` builds, without making its weights (shapes only)."""
    return nnx.split(abstract_module(make))[0]


def shapes_of(make: Callable[[], nnx.Module]) -> dict:
    """The shape of every variable `make()` would create, as a nested dict of tuples."""
    return jax.tree.map(lambda x: tuple(x.shape), to_params(abstract_module(make)))


@functools.lru_cache(maxsize=256)
def module_graph(cls: type[nnx.Module], cfg, **options) -> nnx.GraphDef:
    """The graph of `cls(cfg, rngs=..., **options)` (cached per hashable config and options; no weights made)."""
    return graph_of(lambda: cls(cfg, rngs=nnx.Rngs(0), **options))


def merged(cls: type[nnx.Module], cfg, params: dict, **options) -> nnx.Module:
    """The `cls` module holding `params` (the same arrays, nothing copied): how traced code runs a params dict."""
    return nnx.merge(module_graph(cls, cfg, **options), params)
