"""A benchmarking tool, not a real drafter: replays the target's own continuation, corrupted at a set rate.

Given the target's greedy continuation of each prompt, it proposes the next K tokens of
that continuation, each replaced by a different random token with probability
`corrupt_prob`. Under greedy verification the expected acceptance is then controlled
exactly, so the cost and benefit of a draft shape can be measured on any chip with any
weights (random ones included) at a chosen acceptance rate. Drafting costs nothing.

`corrupt_prob` may be one rate or one per prompt. With `confidence=True` each draft also
carries the confidence a block drafter such as DSpark reports (Draft.confidence, root 1):
the true P(accept | prefix accepted) = 1 - the row's corrupt_prob, plus optional Gaussian
noise (`confidence_noise`, clipped to [0.01, 0.99]), and 0 past the reference. It lets the
prefix scheduler (specjax/decoding/scheduler.py) be tested and benchmarked without a trained head.

`TreeReplayDrafter` does the same for any static tree: under every node the true next token is
the rank-r child with probability alpha (1 - alpha)^r, so greedy verification accepts exactly as
the planner's positional model says (scripts/load_curve.py, scripts/plan_check.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.drafter import PrefillContext, Settings, require_chain
from specjax.decoding.request import bucket
from specjax.decoding.sampling import split_rows, uniform_rows
from specjax.decoding.tree import child_ranks, spec_arrays
from specjax.decoding.verify import Draft, Verdict


def reference_table(continuations: Sequence[Sequence[int]]) -> np.ndarray:
    """int32 [batch bucket, longest]: each continuation in its row (generate() pads the batch to the bucket)."""
    ref = np.zeros((bucket(len(continuations), minimum=1), max(1, max(len(c) for c in continuations))), np.int32)
    for i, c in enumerate(continuations):
        ref[i, : len(c)] = c
    return ref


def reference_start(params, ctx: PrefillContext):
    """A replay drafter's state after prefill: the reference index of the token after the root, per row.

    With params["prompts"] (`replay_drafter(..., prompts=)`) each row's continuation is found by its prompt, not by
    its place in the batch (the engine puts a request in any slot): the state is then (reference row, index), the
    row the stored prompt that the row's sequence starts with (the longest, if several), the index past what the
    row already decoded (a catch-up hands init the prompt and the output so far)."""
    if "prompts" in params:
        prompts_RP, len_R = params["prompts"], params["prompt_len"]
        b, t = ctx.prompt.shape
        p = prompts_RP.shape[1]
        seq_BP = jnp.pad(ctx.prompt, ((0, 0), (0, max(0, p - t))))[:, :p]
        inside_RP = jnp.arange(p)[None, :] < len_R[:, None]
        match_BR = jnp.all((seq_BP[:, None, :] == prompts_RP[None]) | ~inside_RP[None], axis=-1)
        match_BR &= ctx.prompt_len[:, None] >= len_R[None, :]
        row_B = jnp.argmax(jnp.where(match_BR, len_R[None, :], -1), axis=-1).astype(jnp.int32)
        return row_B, 1 + ctx.prompt_len - len_R[row_B]
    if params["reference"].shape[0] != ctx.prompt.shape[0]:
        raise ValueError(f"replay reference has {params['reference'].shape[0]} rows; the padded batch has "
                         f"{ctx.prompt.shape[0]}: build it from plain decoding of these prompts")
    return jnp.ones((ctx.prompt.shape[0],), jnp.int32)


def reference_rows(params, state) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(each row's reference [B, M], its index [B], its corrupt_prob or alpha value) for either kind of state."""
    rate = params.get("corrupt_prob", params.get("alpha"))
    if isinstance(state, tuple):
        row_B, index_B = state
        return params["reference"][row_B], index_B, rate if jnp.ndim(rate) == 0 else rate[row_B]
    return params["reference"], state, rate


def reference_advance(state, num_accepted_B: jax.Array):
    """The state after a round that accepted num_accepted_B tokens (root included)."""
    if isinstance(state, tuple):
        return state[0], state[1] + num_accepted_B
    return state + num_accepted_B


@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    vocab_size: int
    # {"reference": int32 [B, M], "corrupt_prob": float32 [] or [B, 1]} (+ "confidence_noise": float32 [] with
    # confidences): arrays, so a sweep over rates compiles once.
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    settings: Settings | None = None
    name: str = "replay"
    feature_layers: tuple[int, ...] = ()
    confidence: bool = False  # attach Draft.confidence (static: it changes the Draft's structure)

    def __repr__(self) -> str:
        """One line: vocabulary, reference rows x length and corruption rate, not the reference arrays."""
        if self.params is None:
            return f"ReplayDrafter(vocab={self.vocab_size}, no reference)"
        rows, width = self.params["reference"].shape
        try:
            prob = self.params["corrupt_prob"]
            prob = f"{float(prob):g}" if np.ndim(prob) == 0 else "per-row"
        except Exception:  # noqa: BLE001 (a traced value under jit has no float)
            prob = "traced"
        conf = ", confidence" if self.confidence else ""
        return f"ReplayDrafter(vocab={self.vocab_size}, rows={rows}, width={width}, corrupt_prob={prob}{conf})"

    def configure(self, settings: Settings) -> "ReplayDrafter":
        require_chain(self.name, settings)
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return 0

    def init(self, params, ctx: PrefillContext):
        return reference_start(params, ctx)

    def propose(self, params, state, root_B, keys_B, sampling=None):
        ref_BM, index_B, corrupt = reference_rows(params, state)
        b, m = ref_BM.shape
        k = self.settings.tree.num_nodes - 1
        idx_BK = index_B[:, None] + jnp.arange(k)[None, :]
        drafts_BK = jnp.take_along_axis(ref_BM, jnp.clip(idx_BK, 0, m - 1), axis=1)
        flip_keys_B, tok_keys_B = split_rows(keys_B, 2)
        flip_BK = uniform_rows(flip_keys_B, (b, k)) < corrupt
        offset_BK = jax.vmap(lambda kk: jax.random.randint(kk, (k,), 1, self.vocab_size))(tok_keys_B)
        other_BK = (drafts_BK + offset_BK) % self.vocab_size
        drafts_BK = jnp.where(flip_BK, other_BK, drafts_BK)
        tokens_BN = jnp.concatenate([root_B[:, None], drafts_BK], axis=1)
        valid_BN = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), idx_BK < m], axis=1)
        confidence_BN = self._confidence(params, corrupt, keys_B, valid_BN) if self.confidence else None
        return Draft(tokens_BN.astype(jnp.int32), spec_arrays(self.settings.tree, b), valid_BN,
                     confidence=confidence_BN), state

    def _confidence(self, params, corrupt, keys_B, valid_BN):
        """float32 [B, N]: root 1; draft k: 1 - corrupt_prob (+ noise, clipped to [0.01, 0.99]); 0 when invalid."""
        b, n = valid_BN.shape
        true_BN = jnp.broadcast_to(1.0 - jnp.asarray(corrupt, jnp.float32), (b, n))
        noise_BN = jax.vmap(lambda kk: jax.random.normal(jax.random.fold_in(kk, 1), (n,)))(keys_B)
        noisy_BN = jnp.clip(true_BN + params["confidence_noise"] * noise_BN, 0.01, 0.99)
        conf_BN = jnp.where(params["confidence_noise"] > 0, noisy_BN, true_BN)
        conf_BN = jnp.where(valid_BN, conf_BN, 0.0)
        return conf_BN.at[:, 0].set(1.0)

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        return reference_advance(state, verdict.num_accepted)


def replay_drafter(continuations: Sequence[Sequence[int]], vocab_size: int, corrupt_prob: float | Sequence[float],
                   confidence: bool = False, confidence_noise: float = 0.0,
                   prompts: Sequence[Sequence[int]] | None = None) -> ReplayDrafter:
    """A benchmarking drafter that replays the target's own continuation, corrupted at a set rate.

    Each draft is the next token of the row's continuation, replaced by a different random token with probability
    `corrupt_prob`: under greedy verification the acceptance is then controlled exactly, so a draft shape's cost and
    benefit can be measured on any weights (random ones included) at a chosen acceptance, with no drafting cost.
    Chains only.

    Args:
        continuations: the target's greedy continuation of each prompt (e.g. `generate(...).tokens` at temperature
            0), one list of token ids per prompt, in the order the prompts will be passed.
        vocab_size: the target's vocabulary size (corrupted drafts are drawn from it).
        corrupt_prob: one rate in [0, 1] for every row, or one per continuation.
        confidence: attach synthetic confidences to each draft (1 - the row's rate), for the prefix scheduler.
        confidence_noise: the standard deviation of Gaussian noise added to those confidences (clipped to
            [0.01, 0.99]); 0 keeps them exact.
        prompts: the prompts (token ids) the continuations follow: each row then finds its continuation by its
            prompt rather than by its place in the batch, as `specjax.Engine` needs (a request takes any free slot).

    Returns:
        A `ReplayDrafter` to pass as `drafter=` to `generate`, `stream` or `Engine`.

    Raises:
        ValueError: a rate outside [0, 1], as many rates as continuations not given, a negative confidence_noise,
            or more prompts than continuation rows.

    Example:
        ```python
        target = specjax.load(specjax.embedded("target"))
        prompts = ["def add(a, b):", "class Stack:"]
        plain = specjax.generate(target, prompts, max_new_tokens=64)
        drafter = specjax.replay_drafter(plain.tokens, target.cfg.vocab_size, corrupt_prob=0.2)
        out = specjax.generate(target, prompts, max_new_tokens=64, drafter=drafter, num_draft_tokens=4)
        assert out.tokens == plain.tokens   # greedy: speculation never changes the output
        ```
    """
    per_row = isinstance(corrupt_prob, Sequence) or np.ndim(corrupt_prob) > 0
    probs = np.asarray(corrupt_prob, np.float64).reshape(-1)
    if per_row and probs.size != len(continuations):
        raise ValueError(f"corrupt_prob has {probs.size} rates for {len(continuations)} continuations: pass one "
                         f"rate, or one per continuation")
    if np.any(~(probs >= 0.0)) or np.any(probs > 1.0):
        raise ValueError(f"corrupt_prob must be in [0, 1], got {corrupt_prob}")
    if not confidence_noise >= 0.0:
        raise ValueError(f"confidence_noise is a standard deviation, must be >= 0, got {confidence_noise}")
    ref = reference_table(continuations)
    rows = ref.shape[0]
    if per_row:  # padding rows never emit; give them rate 1 (their drafts are never checked)
        prob = jnp.asarray(np.concatenate([probs, np.ones(rows - probs.size)])[:, None], jnp.float32)
    else:
        prob = jnp.float32(probs[0])
    params = {"reference": jnp.asarray(ref), "corrupt_prob": prob}
    if confidence:
        params["confidence_noise"] = jnp.float32(confidence_noise)
    if prompts is not None:
        params.update(prompt_table(prompts, rows))
    return ReplayDrafter(vocab_size, params=params, confidence=confidence)


def prompt_table(prompts: Sequence[Sequence[int]], rows: int) -> dict:
    """{"prompts": int32 [rows, longest], "prompt_len": int32 [rows]}: the prompts rows are matched by."""
    if len(prompts) > rows:
        raise ValueError(f"{len(prompts)} prompts for {rows} reference rows: pass one prompt per continuation")
    table = np.zeros((rows, max(len(p) for p in prompts)), np.int32)
    lengths = np.full((rows,), table.shape[1] + 1, np.int32)  # padding rows never match
    for i, p in enumerate(prompts):
        table[i, :len(p)], lengths[i] = p, len(p)
    return {"prompts": jnp.asarray(table), "prompt_len": jnp.asarray(lengths)}


@dataclasses.dataclass(frozen=True)
class TreeReplayDrafter:
    """Benchmarking drafter: replays a reference continuation into any static tree at positional acceptance
    alpha (1 - alpha)^r by child rank. params: {"reference": int32 [B, M], "alpha": float32 []}."""

    vocab_size: int
    params: Any = dataclasses.field(default=None, compare=False, repr=False)
    settings: Settings | None = None
    name: str = "tree-replay"
    feature_layers: tuple[int, ...] = ()

    def configure(self, settings: Settings) -> "TreeReplayDrafter":
        return dataclasses.replace(self, settings=settings)

    def calls_per_round(self) -> int:
        return 0

    def init(self, params, ctx: PrefillContext):
        return reference_start(params, ctx)

    def propose(self, params, state, root_B, keys_B, sampling=None):
        spec = self.settings.tree
        ref_BM, index_B, alpha = reference_rows(params, state)
        b, m = ref_BM.shape
        n, depth, ranks = spec.num_nodes, spec.depths, child_ranks(spec)
        idx_BD = index_B[:, None] + jnp.arange(max(spec.max_depth, 1))[None, :]
        true_BD = jnp.take_along_axis(ref_BM, jnp.clip(idx_BD, 0, m - 1), axis=1)
        k_rank_B, k_tok_B = split_rows(keys_B, 2)
        u_BN = uniform_rows(k_rank_B, (b, n))
        # Rank of the true token among each node's children: geometric, P(R = r) = alpha (1 - alpha)^r.
        log_miss = jnp.log1p(-jnp.minimum(alpha, 1.0 - 1e-7))
        true_rank_BN = jnp.where(alpha > 0, jnp.floor(jnp.log(jnp.maximum(u_BN, 1e-30)) / log_miss), 1e6)
        offset_BN = jax.vmap(lambda k: jax.random.randint(k, (n,), 1, self.vocab_size))(k_tok_B)
        cols = [root_B]
        for i in range(1, n):
            truth_B = true_BD[:, depth[i] - 1]
            hit_B = true_rank_BN[:, spec.parents[i]] == ranks[i]
            cols.append(jnp.where(hit_B, truth_B, (truth_B + offset_BN[:, i]) % self.vocab_size))
        tokens_BN = jnp.stack(cols, axis=1).astype(jnp.int32)
        valid_BN = (index_B[:, None] + jnp.asarray(depth)[None, :] - 1 < m) | (jnp.arange(n) == 0)[None, :]
        return Draft(tokens_BN, spec_arrays(spec, b), valid_BN), state

    def update(self, params, state, draft: Draft, verdict: Verdict, features):
        return reference_advance(state, verdict.num_accepted)


def tree_replay(continuations: list[list[int]], vocab: int, alpha: float,
                prompts: Sequence[Sequence[int]] | None = None) -> TreeReplayDrafter:
    """Build from the target's continuation of each prompt: under every node, the true token at rank r w.p.
    alpha (1 - alpha)^r. prompts: as replay_drafter's."""
    ref = reference_table(continuations)
    params = {"reference": jnp.asarray(ref), "alpha": jnp.float32(alpha)}
    if prompts is not None:
        params.update(prompt_table(prompts, ref.shape[0]))
    return TreeReplayDrafter(vocab, params=params)
