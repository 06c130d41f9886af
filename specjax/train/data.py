"""Token streams and batches for training: corpus windows and target-generated continuations.

A batch is a dict of arrays; `tokens` is [B, T+1] (inputs are tokens[:, :-1], labels
tokens[:, 1:]) and an optional `mask` [B, T] says which labels count. Batches are pure
functions of (seed, step), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer


def token_stream(tok: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """All texts encoded (each led by the tokenizer's BOS/EOS) and concatenated: int32 [N]."""
    encodings = tok.encode_batch(list(texts))
    return np.concatenate([np.asarray(e.ids, np.int32) for e in encodings])


def random_windows(stream_N: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """Training batch `step`: `batch` windows of seq_len+1 tokens at offsets drawn from (seed, step)."""
    if len(stream_N) <= seq_len + 1:
        raise ValueError(f"the token stream has {len(stream_N)} tokens; windows of {seq_len + 1} need more")
    rng = np.random.default_rng([seed, step])
    starts_B = rng.integers(0, len(stream_N) - seq_len - 1, size=batch)
    return {"tokens": np.stack([stream_N[s: s + seq_len + 1] for s in starts_B])}


def fixed_windows(stream_N: np.ndarray, seq_len: int, count: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of seq_len+1 tokens from the stream's start: [count, T+1].

    Window i is stream[i*T : i*T + T + 1], so every token but the first is predicted exactly once.
    The deterministic evaluation slice: `count` windows, or all that fit when count is None.
    """
    fit = (len(stream_N) - 1) // seq_len
    count = fit if count is None else min(count, fit)
    return np.stack([stream_N[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)])


def batches_of(windows_WT: np.ndarray, batch: int) -> list[dict[str, np.ndarray]]:
    """Split evaluation windows into batches (the last one may be smaller)."""
    return [{"tokens": windows_WT[i: i + batch]} for i in range(0, len(windows_WT), batch)]


def prompt_windows(stream_N: np.ndarray, seed: int, step: int, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` prompts of prompt_len tokens at offsets drawn from (seed, step): inputs for continuations."""
    return [row.tolist() for row in random_windows(stream_N, seed, step, batch, prompt_len - 1)["tokens"]]


def continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, np.ndarray]:
    """The target's own greedy continuations as a training batch (a drafter learns what the target says).

    target: a `specjax.Target`. Returns tokens [B, P+max_new_tokens] (prompt + continuation, padded
    with the last token when a row stops at EOS) and mask [B, P+max_new_tokens-1] selecting the labels
    that are the target's generated tokens. Prompts must all have the same length P.
    """
    from specjax.generate import generate  # noqa: PLC0415 (keeps data loading free of the decode stack)

    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"continuation prompts must share one length; got lengths {sorted(lengths)}")
    p = lengths.pop()
    out = generate(target, [list(r) for r in prompts], max_new_tokens=max_new_tokens, eos_token_id=[])
    tokens_BS = np.zeros((len(prompts), p + max_new_tokens), np.int32)
    mask_BS = np.zeros((len(prompts), p + max_new_tokens - 1), bool)
    for i, (prompt, new) in enumerate(zip(prompts, out.tokens)):
        row = list(prompt) + list(new)
        tokens_BS[i, : len(row)] = row
        tokens_BS[i, len(row):] = row[-1]
        mask_BS[i, p - 1: len(row) - 1] = True
    return {"tokens": tokens_BS, "mask": mask_BS}


def continuation_pool(target, stream_N: np.ndarray, seed: int, rows: int, prompt_len: int, new_tokens: int,
                      gen_batch: int = 64) -> dict[str, np.ndarray]:
    """`rows` greedy target continuations of random corpus prompts, generated gen_batch rows at a time.

    Generating once and sampling batches from the pool (pool_batch) amortises the slow
    autoregressive decode over many training steps.
    """
    parts = [continuations(target, prompt_windows(stream_N, seed, i, gen_batch, prompt_len), new_tokens)
             for i in range(-(-rows // gen_batch))]
    return {k: np.concatenate([p[k] for p in parts])[:rows] for k in parts[0]}


def cached_pool(path, target, make_stream, seed: int, rows: int, prompt_len: int, new_tokens: int,
                log=print) -> dict[str, np.ndarray]:
    """The continuation pool saved at `path` (npz); absent, `continuation_pool` over make_stream()'s tokens, saved.

    A saved pool of another shape is refused: training would silently use other data than asked.
    """
    path = Path(path)
    want = (rows, prompt_len + new_tokens)
    if path.is_file():
        pool = dict(np.load(path))
        if pool["tokens"].shape != want:
            raise ValueError(f"{path} holds {pool['tokens'].shape} tokens; this run wants {want}")
        return pool
    start = time.perf_counter()
    pool = continuation_pool(target, make_stream(), seed, rows, prompt_len, new_tokens)
    np.savez(path, **pool)
    log(f"data: {rows} target continuations ({prompt_len} + {new_tokens} tokens) in "
        f"{time.perf_counter() - start:.0f} s")
    return pool


def pool_batch(pool: dict[str, np.ndarray], seed: int, step: int, batch: int) -> dict[str, np.ndarray]:
    """Training batch `step`: `batch` rows of a pool drawn from (seed, step)."""
    rows_B = np.random.default_rng([seed, step]).integers(0, len(pool["tokens"]), size=batch)
    return {k: v[rows_B] for k, v in pool.items()}
