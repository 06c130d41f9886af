"""`specjax.generate`: validate input, bucket shapes, compile once per bucket, run, report stats."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import SamplingConfig
from .decode import LoopConfig, ar_generate
from .target import Target


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated ids per prompt, prompt excluded, EOS included when hit
    stats: dict[str, Any]
    texts: list[str] | None = None  # decoded text when the target has a tokenizer
    token_rounds: list[list[int]] | None = None  # speculative only: the round that emitted each token (0 = prefill)


def bucket(n: int, minimum: int = 16) -> int:
    """The next power of two >= max(n, minimum): a shape bucket, so nearby sizes share one compile."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def prompt_ids(target: Target, prompts: Sequence) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists or a list of strings")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    ids = [target.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in row if not 0 <= t < target.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {target.cfg.vocab_size})")
    return ids


def cache_length(target: Target, ids: list[list[int]], max_new_tokens: int, max_len: int | None,
                   extra: int) -> int:
    """The cache length for this call, or a ValueError when the prompts cannot fit."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    longest = max(len(r) for r in ids)
    # A multiple of 128: one length for nearby sizes, and whole KV blocks for the Pallas kernel.
    cache_len = -(-(bucket(longest) + bucket(max_new_tokens) + extra) // 128) * 128
    if max_len is not None:
        if longest + max_new_tokens + extra > max_len:
            raise ValueError(f"the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens}"
                             f"{f' and {extra} draft slots' if extra else ''} it needs a cache of "
                             f"{longest + max_new_tokens + extra}, more than max_len={max_len}")
        cache_len = max_len
    context = target.cfg.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(f"the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} it "
                         f"exceeds the model's context of {context} (max_position_embeddings)")
    window = target.cfg.sliding_window
    if window is not None and longest + max_new_tokens + extra > window:
        raise ValueError(f"this model uses sliding-window attention (window {window}), which specjax does not "
                         f"implement; keep prompt + max_new_tokens within {window} tokens")
    return cache_len


def pad_batch(ids: list[list[int]], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad prompts to a length bucket and the batch to a power of two (padding rows get no budget)."""
    b, t = bucket(len(ids), minimum=1), bucket(max(len(r) for r in ids))
    prompt_BT = np.zeros((b, t), np.int32)
    prompt_len_B = np.ones((b,), np.int32)
    max_new_B = np.zeros((b,), np.int32)
    for i, row in enumerate(ids):
        prompt_BT[i, : len(row)] = row
        prompt_len_B[i] = len(row)
        max_new_B[i] = max_new_tokens
    return prompt_BT, prompt_len_B, max_new_B


def run_compiled(target: Target, key: Any, fn, args: tuple, static: dict) -> tuple[Any, float, float]:
    """Compile `fn` for these shapes once per target (cached), then run it: (result, compile_s, run_s)."""
    compile_s = 0.0
    if key not in target.compiled:
        start = time.perf_counter()
        target.compiled[key] = fn.lower(*args, **static).compile()
        compile_s = time.perf_counter() - start
    start = time.perf_counter()
    result = jax.block_until_ready(target.compiled[key](*args))
    return result, compile_s, time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Request:
    """One validated call, bucketed: padded prompt arrays and the static loop configuration."""

    ids: list[list[int]]
    prompt_BT: np.ndarray
    prompt_len_B: np.ndarray
    max_new_B: np.ndarray
    lc: LoopConfig

    def arrays(self, seed: int) -> tuple:
        """The jitted loops' array arguments after params: prompts, lengths, budgets, key."""
        return (jnp.asarray(self.prompt_BT), jnp.asarray(self.prompt_len_B), jnp.asarray(self.max_new_B),
                jax.random.key(seed))


def prepare(target: Target, prompts: Sequence, max_new_tokens: int, sampling: SamplingConfig,
            eos_token_id, max_len: int | None, extra: int) -> Request:
    """Validate prompts and lengths (`extra` cache slots for a draft tree) and bucket the shapes."""
    ids = prompt_ids(target, prompts)
    cache_len = cache_length(target, ids, max_new_tokens, max_len, extra=extra)
    prompt_BT, prompt_len_B, max_new_B = pad_batch(ids, max_new_tokens)
    lc = LoopConfig(target.cfg, sampling, eos_ids(target, eos_token_id), bucket(max_new_tokens), cache_len,
                    target.attn_impl)
    return Request(ids, prompt_BT, prompt_len_B, max_new_B, lc)


def finish(target: Target, req: Request, out_BO, count_B, steps, compile_s: float, run_s: float,
           extra_stats: dict[str, Any], round_BO=None) -> GenerateOutput:
    """Trim the output buffers to each row's tokens and assemble the statistics every call reports."""
    count_B = np.asarray(count_B)
    tokens = trim(np.asarray(out_BO), count_B, len(req.ids))
    n = sum(len(t) for t in tokens)
    stats = {"tokens_per_s": n / run_s, "compile_s": compile_s, "decode_s": run_s, "rounds": int(steps),
             "generated_tokens": n, **extra_stats, "batch_bucket": req.prompt_BT.shape[0],
             "cache_len": req.lc.cache_len}
    rounds = None if round_BO is None else trim(np.asarray(round_BO), count_B, len(req.ids))
    return GenerateOutput(tokens, stats, decode_texts(target, tokens), rounds)


def generate(target: Target, prompts: Sequence, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, drafter=None, num_draft_tokens: int | None = None,
             tree=None, eos_token_id: int | Sequence[int] | None = None, max_len: int | None = None
             ) -> GenerateOutput:
    """Continue each prompt; greedy when temperature is 0. With a drafter, decode speculatively.

    prompts: list of token-id lists (ragged) or strings (needs the target's tokenizer).
    eos_token_id: overrides the config's EOS ids; [] disables stopping on EOS.
    """
    sampling = SamplingConfig(temperature, top_k, top_p).validate()
    if drafter is not None:
        from .speculative import speculative_generate  # noqa: PLC0415 (speculative.py imports this module)

        return speculative_generate(target, prompts, drafter, max_new_tokens=max_new_tokens, sampling=sampling,
                                    seed=seed, num_draft_tokens=num_draft_tokens, tree=tree,
                                    eos_token_id=eos_token_id, max_len=max_len)
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, extra=0)
    (out_BO, count_B, steps), compile_s, run_s = run_compiled(
        target, ("ar", req.lc, req.prompt_BT.shape), ar_generate, (target.params, *req.arrays(seed)), {"lc": req.lc})
    return finish(target, req, out_BO, count_B, steps, compile_s, run_s,
                  {"acceptance_length": 1.0, "drafter_calls": 0})


def eos_ids(target: Target, override: int | Sequence[int] | None) -> tuple[int, ...]:
    if override is None:
        return target.cfg.eos_token_ids
    return (int(override),) if isinstance(override, (int, np.integer)) else tuple(int(t) for t in override)


def trim(out_BO: np.ndarray, count_B: np.ndarray, n_rows: int) -> list[list[int]]:
    return [out_BO[i, : count_B[i]].tolist() for i in range(n_rows)]


def decode_texts(target: Target, tokens: list[list[int]]) -> list[str] | None:
    return [target.decode(t) for t in tokens] if target.tokenizer is not None else None
