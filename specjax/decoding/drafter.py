"""The one interface every drafter family implements, and the context the loop hands it.

A drafter is a frozen dataclass: its fields are static configuration (hashable, part of
the compiled loop's key) except `params`, which is excluded from hashing and passed to
the jitted loop as an ordinary argument. `configure` fixes the per-call settings (tree
shape, sampling, cache length) before compilation.

Inside the jitted loop, each round calls
    draft, state = propose(params, state, root_B, keys_B, sampling)   # one PRNG key and setting per row
    ... target verifies ...
    state = update(params, state, draft, verdict, features)
where `features` are the target hidden states the drafter asked for (`feature_layers`,
Hugging Face numbering, see models/decoder.py) at every draft node, [B, N, D] each.
"""

from __future__ import annotations

import dataclasses
from os import PathLike
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig
from specjax.decoding.tree import DynamicTreeSpec, TreeSpec
from specjax.decoding.verify import Draft, Verdict
from specjax.models.target import Target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillContext:
    """What the target's prefill gives a drafter's `init`."""

    prompt: jax.Array  # int32 [B, T] right-padded prompts
    prompt_len: jax.Array  # int32 [B]
    root: jax.Array  # int32 [B]: the target's first generated token
    features: tuple[jax.Array, ...]  # [B, T, D] per feature layer, over the prompt


@dataclasses.dataclass(frozen=True)
class Settings:
    """Per-call static settings every drafter needs."""

    tree: TreeSpec | DynamicTreeSpec
    # Greedy (temperature 0) drafts by argmax, anything else by drawing. In the loops it is only the mode
    # (decode.GREEDY or decode.SAMPLED): each row's values reach `propose` as data. A drafter used alone
    # (tests) draws with these values when propose gets none.
    sampling: SamplingConfig
    cache_len: int
    max_new_tokens: int  # output bucket: an upper bound on tokens one row can emit
    record_logits: bool = False  # attach Draft.logits (inspect_draft); never in the decode loop


class Drafter(Protocol):
    name: str
    params: Any
    settings: Settings | None
    feature_layers: tuple[int, ...]

    def configure(self, settings: Settings) -> "Drafter": ...

    def calls_per_round(self) -> int:
        """Drafter forward passes per round (for the drafter_calls statistic)."""
        ...

    def init(self, params, ctx: PrefillContext) -> Any: ...

    def propose(self, params, state, root_B: jax.Array, keys_B: jax.Array, sampling=None) -> tuple[Draft, Any]:
        """A draft rooted at root_B, and the state after drafting (a draft model's cache holds its guesses).

        sampling: each row's values (RowSampling) when Settings.sampling is not greedy; None: Settings.sampling's."""
        ...

    def update(self, params, state, draft: Draft, verdict: Verdict, features: tuple[jax.Array, ...]) -> Any: ...


def check_drafter_argument(drafter) -> None:
    """A drafter= argument that is not a drafter (a path, a Target, anything else) gets an error saying what to pass."""
    if isinstance(drafter, (str, PathLike)):
        raise TypeError(f"drafter= takes a loaded drafter, got the path {str(drafter)!r}: pass "
                        f"specjax.load_drafter(path, target)")
    if isinstance(drafter, Target):
        raise TypeError("drafter= takes a drafter, got a Target: pass specjax.load_drafter(path, target) (a draft "
                        "model, an EAGLE-3/MTP/DFlash/DSpark head) or specjax.NgramDrafter()")
    if not all(callable(getattr(drafter, a, None)) for a in ("configure", "init", "propose", "update")):
        raise TypeError(f"drafter= must implement specjax's Drafter protocol (configure, init, propose, update), got "
                        f"{type(drafter).__name__}: load one with specjax.load_drafter(path, target)")


def drafting_values(settings: Settings, sampling):
    """What a sampling drafter draws with: the rows' values passed to propose, else Settings.sampling's."""
    return settings.sampling if sampling is None else sampling


def require_chain(name: str, settings: Settings) -> None:
    """For drafters that only propose chains: refuse a tree spec with an error that says what to pass."""
    if not settings.tree.is_chain:
        raise ValueError(f"the {name} drafter proposes chains only; pass num_draft_tokens=K, not a tree")


def chain_nodes(first_BX: jax.Array | None, rest_KBX) -> jax.Array | None:
    """Per-node values of a chain, [B, N, ...]: zeros for the root, then draft 1, then drafts 2..K.

    For q and recorded logits: a chain drafter produces draft 1's before its loop and the rest inside
    it, as a scan's stacked [K-1, B, ...] output or a list of [B, ...]. None in, None out.
    """
    if first_BX is None:
        return None
    return jnp.stack([jnp.zeros_like(first_BX), first_BX, *rest_KBX], axis=1)


def accepted_tokens(draft: Draft, verdict: Verdict) -> jax.Array:
    """int32 [B, N]: the tokens this round adds to the sequence, in order: accepted drafts then the bonus.

    Valid for i < num_accepted (entries past it are 0). Node 0 (the root) is not repeated:
    it was emitted by the previous round.
    """
    n = draft.tokens.shape[1]
    path_tokens_BN = jnp.take_along_axis(draft.tokens, verdict.path, axis=1)
    after_root_BN = jnp.concatenate([path_tokens_BN[:, 1:], jnp.zeros_like(path_tokens_BN[:, :1])], axis=1)
    i = jnp.arange(n)[None, :]
    last = (verdict.num_accepted - 1)[:, None]
    return jnp.where(i < last, after_root_BN, jnp.where(i == last, verdict.bonus[:, None], 0)).astype(jnp.int32)
