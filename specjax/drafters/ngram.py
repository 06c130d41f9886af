"""Model-free n-gram drafting (prompt lookup) over the prompt and the output so far.

The last n tokens (ending with the root) are looked up in the row's history; the
most recent earlier occurrence's continuation becomes a chain of drafts. The longest
n in [min_n, max_n] with a match wins. Rows with no match propose no valid drafts.
History is a fixed-shape buffer, so all of it runs under jit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.decoding.drafter import PrefillContext, Settings, require_chain
from specjax.decoding.tree import spec_arrays
from specjax.decoding.verify import Draft, Verdict


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the row's last n tokens (ending with the root) are looked up in its prompt + output, and the
    most recent earlier occurrence's continuation is the draft; the longest n in [min_n, max_n] with a match wins,
    and a row with no match drafts nothing. No network and next to no drafting cost; chains only.

    Args:
        min_n: the shortest suffix it matches (>= 1).
        max_n: the longest suffix it matches (>= min_n).

    Raises:
        ValueError: when not 1 <= min_n <= max_n.

    Example:
        ```python
        target = specjax.load(specjax.embedded("target"))
        out = specjax.generate(target, ["def f(x):\\n    return x + 1\\n\\ndef g(x):"], max_new_tokens=32,
                               drafter=specjax.NgramDrafter(max_n=4), num_draft_tokens=4)
        ```

    The methods below are the Drafter protocol's (specjax/decoding/drafter.py): the loops call them, under jit.
    """
    min_n: int = 1
    max_n: int = 3
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    settings: Settings | None = None
    name: str = "ngram"
    feature_layers: tuple[int, ...] = ()
    vocab_size: None = None

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def __repr__(self) -> str:
        """One line: the n-gram lengths it matches."""
        return f"NgramDrafter(min_n={self.min_n}, max_n={self.max_n})"

    def configure(self, settings: Settings) -> "NgramDrafter":
        """Fix the draft shape and buffer sizes before compilation.

        Args:
            settings: the loop's static settings (tree, sampling mode, cache length, output bucket).

        Returns:
            A copy carrying `settings`.

        Raises:
            ValueError: the settings' tree is not a chain (prompt lookup proposes chains only).
        """
        require_chain(self.name, settings)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        """Network passes per round: none (for the planner's drafting cost)."""
        return 0

    def init(self, params, ctx: PrefillContext):
        """The state after prefill: each row's history (its prompt) and its length.

        Args:
            params: unused (None).
            ctx: the prefill's prompts and their lengths.

        Returns:
            (history int32 [B, cache_len + nodes], lengths int32 [B]).
        """
        b, t = ctx.prompt.shape
        # The history holds at most the cached sequence, the root and a draft: sized by the cache, not the prompt
        # bucket, so every prefill of a loop (the engine's, at any prompt bucket) gives one state shape.
        hist_BH = jnp.zeros((b, self.settings.cache_len + self.settings.tree.num_nodes), jnp.int32)
        hist_BH = hist_BH.at[:, :t].set(ctx.prompt)
        return hist_BH, ctx.prompt_len

    def propose(self, params, state, root_B, keys_B, sampling=None):
        """Draft a chain: the continuation after the latest earlier match of each row's last n tokens.

        Args:
            params: unused (None).
            state: (history, lengths) from `init` / `update`.
            root_B: int32 [B], each row's root (its last token, not yet in the history).
            keys_B: per-row PRNG keys (unused: the drafts are deterministic).
            sampling: unused.

        Returns:
            (Draft, state): the chain with q None (deterministic), drafts past a row's match invalid; the state
            unchanged.
        """
        hist_BH, len_B = state
        b, h = hist_BH.shape
        k = self.settings.tree.num_nodes - 1
        rows = jnp.arange(b)
        seq_BH = hist_BH.at[rows, len_B].set(root_B, mode="drop")
        seq_len_B = len_B + 1
        pos_H = jnp.arange(h)
        best_end_B = jnp.full((b,), -1, jnp.int32)
        for n in range(self.min_n, self.max_n + 1):  # longer n overrides shorter
            match_BH = (pos_H[None, :] >= n - 1) & (pos_H[None, :] < (seq_len_B - 1)[:, None])
            for o in range(n):
                suffix_tok_B = seq_BH[rows, seq_len_B - 1 - o]
                match_BH &= jnp.roll(seq_BH, o, axis=1) == suffix_tok_B[:, None]
            found_B = jnp.any(match_BH, axis=-1) & (seq_len_B > n)
            end_B = jnp.max(jnp.where(match_BH, pos_H[None, :], -1), axis=-1).astype(jnp.int32)
            best_end_B = jnp.where(found_B, end_B, best_end_B)
        follow_BK = best_end_B[:, None] + 1 + jnp.arange(k)[None, :]
        valid_BK = (best_end_B[:, None] >= 0) & (follow_BK < seq_len_B[:, None])
        drafts_BK = jnp.take_along_axis(seq_BH, jnp.clip(follow_BK, 0, h - 1), axis=1)
        tokens_BN = jnp.concatenate([root_B[:, None], jnp.where(valid_BK, drafts_BK, 0)], axis=1)
        valid_BN = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), valid_BK], axis=1)
        return Draft(tokens_BN, spec_arrays(self.settings.tree, b), valid_BN), state

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        """Append the committed tokens (root + accepted drafts) to the history.

        Args:
            params: unused (None).
            state: (history, lengths).
            draft: this round's Draft.
            verdict: what verification accepted.
            features: unused (prompt lookup reads no hidden states).

        Returns:
            The new (history, lengths).
        """
        hist_BH, len_B = state
        b, n = verdict.path.shape
        kept_BN = jnp.take_along_axis(draft.tokens, verdict.path, axis=1)
        i_N = jnp.arange(n)
        dst_BN = jnp.where(i_N[None, :] < verdict.num_accepted[:, None], len_B[:, None] + i_N[None, :], hist_BH.shape[1])
        hist_BH = hist_BH.at[jnp.arange(b)[:, None], dst_BN].set(kept_BN, mode="drop")
        return hist_BH, len_B + verdict.num_accepted
