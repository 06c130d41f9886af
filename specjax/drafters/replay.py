"""A benchmarking tool, not a real drafter: replays the target's own continuation, corrupted at a set rate.

Given the target's greedy continuation of each prompt, it proposes the next K tokens of
that continuation, each replaced by a different random token with probability
`corrupt_prob`. Under greedy verification the expected acceptance is then controlled
exactly, so the cost and benefit of a draft shape can be measured on any chip with any
weights (random ones included) at a chosen acceptance rate. Drafting costs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..verify import Draft, Verdict
from ..request import bucket
from ..sampling import split_rows, uniform_rows
from ..tree import spec_arrays
from .base import PrefillContext, Settings, require_chain


@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    vocab_size: int
    # {"reference": int32 [B, M], "corrupt_prob": float32 []}: arrays, so a sweep over rates compiles once.
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    settings: Settings | None = None
    name: str = "replay"
    feature_layers: tuple[int, ...] = ()

    def __repr__(self) -> str:
        """One line: vocabulary, reference rows x length and corruption rate, not the reference arrays."""
        if self.params is None:
            return f"ReplayDrafter(vocab={self.vocab_size}, no reference)"
        rows, width = self.params["reference"].shape
        try:
            prob = f"{float(self.params['corrupt_prob']):g}"
        except Exception:  # noqa: BLE001 (a traced value under jit has no float)
            prob = "traced"
        return f"ReplayDrafter(vocab={self.vocab_size}, rows={rows}, width={width}, corrupt_prob={prob})"

    def configure(self, settings: Settings) -> "ReplayDrafter":
        require_chain(self.name, settings)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return 0

    def init(self, params, ctx: PrefillContext):
        if params["reference"].shape[0] != ctx.prompt.shape[0]:
            raise ValueError(f"replay reference has {params['reference'].shape[0]} rows; the padded batch has "
                             f"{ctx.prompt.shape[0]}: build it with replay_drafter(continuations) for these prompts")
        return jnp.ones((ctx.prompt.shape[0],), jnp.int32)  # index of the next reference token to draft

    def propose(self, params, state, root_B, keys_B):
        ref_BM = params["reference"]
        b, m = ref_BM.shape
        k = self.settings.tree.num_nodes - 1
        idx_BK = state[:, None] + jnp.arange(k)[None, :]
        drafts_BK = jnp.take_along_axis(ref_BM, jnp.clip(idx_BK, 0, m - 1), axis=1)
        flip_keys_B, tok_keys_B = split_rows(keys_B, 2)
        flip_BK = uniform_rows(flip_keys_B, (b, k)) < params["corrupt_prob"]
        offset_BK = jax.vmap(lambda kk: jax.random.randint(kk, (k,), 1, self.vocab_size))(tok_keys_B)
        other_BK = (drafts_BK + offset_BK) % self.vocab_size
        drafts_BK = jnp.where(flip_BK, other_BK, drafts_BK)
        tokens_BN = jnp.concatenate([root_B[:, None], drafts_BK], axis=1)
        valid_BN = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), idx_BK < m], axis=1)
        return Draft(tokens_BN.astype(jnp.int32), spec_arrays(self.settings.tree, b), valid_BN), state

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        return state + verdict.num_accepted


def replay_drafter(continuations: Sequence[Sequence[int]], vocab_size: int, corrupt_prob: float) -> ReplayDrafter:
    """Build from the target's continuation of each prompt (e.g. `generate(...).tokens` at temperature 0)."""
    if not 0.0 <= corrupt_prob <= 1.0:
        raise ValueError(f"corrupt_prob must be in [0, 1], got {corrupt_prob}")
    rows = bucket(len(continuations), minimum=1)  # the batch bucket generate() pads to
    width = max(1, max(len(c) for c in continuations))
    ref = np.zeros((rows, width), np.int32)
    for i, c in enumerate(continuations):
        ref[i, : len(c)] = c
    return ReplayDrafter(vocab_size, params={"reference": jnp.asarray(ref), "corrupt_prob": jnp.float32(corrupt_prob)})
