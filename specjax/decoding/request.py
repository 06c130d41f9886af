"""One generate call made concrete: validated prompts, shape buckets, per-row seeds, compile cache, output.

Both loops (plain in decode.py, speculative in speculative.py) share this module; the
public `generate` (generate.py) sits above both and only dispatches, so the flow is one-way:
generate -> {decode, speculative} -> request.
"""

from __future__ import annotations

import dataclasses
import html
import numbers
import secrets
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.chat import render_prompts
from specjax.config import PenaltyConfig, SamplingConfig, per_row
from specjax.decoding.decode import LoopConfig, RowSettings
from specjax.decoding.penalties import RowPenalties
from specjax.decoding.sampling import RowSampling
from specjax.decoding.stream import ChunkedRun, RowText, finish_reason
from specjax.models.sharding import axis_size, place_batch, use_mesh
from specjax.models.target import Target
from specjax.multihost import agreed, check_same_everywhere, moved_to

CACHE_MULTIPLE = 128  # every KV cache length is a multiple of this: whole kernel blocks, fewer distinct shapes
MAX_SEED = 2**32 - 1


@dataclasses.dataclass
class GenerateOutput:
    """What `specjax.generate` returns: per prompt, the new tokens and text, why each row stopped, and statistics.

    `print(out)` is one line (rows, tokens, tau, tokens/s, compile time, plan); a notebook shows a table of the rows.

    Attributes:
        tokens: generated ids per prompt, prompt excluded, EOS included when a row hit one.
        stats: acceptance_length (tau), per_position_acceptance, tokens_per_s, compile_s, decode_s, seed, plan, ...
        texts: decoded text per prompt (without the EOS) when the target has a tokenizer; else None.
        token_rounds: speculative only: the round that emitted each token (0 = prefill).
        spec_stats: speculative only: the loop's SpecStats pytree (numpy), per row and per depth.
        finish_reasons: per row, "stop" (EOS, a stop token or a stop string) or "length".
        stop_reasons: per row, the stop string or token id that ended it; None for "length".
        logprobs: with logprobs=True, each token's raw log-probability (log-softmax of the target's logits).
        top_logprobs: with top_logprobs=n, the n most likely (token id, logprob) at each position.
    """
    tokens: list[list[int]]  # generated ids per prompt, prompt excluded, EOS included when hit
    stats: dict[str, Any]
    texts: list[str] | None = None  # decoded text when the target has a tokenizer
    token_rounds: list[list[int]] | None = None  # speculative only: the round that emitted each token (0 = prefill)
    spec_stats: Any = None  # speculative only: the loop's SpecStats pytree (numpy), per row and per depth
    finish_reasons: list[str] | None = None  # per row: "stop" (EOS, a stop token or a stop string) or "length"
    stop_reasons: list[Any] | None = None  # per row: the stop string or token id that ended it; None for "length"
    logprobs: list[list[float]] | None = None  # with logprobs=True: each token's raw log-probability
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # with top_logprobs=n: n (id, logprob) per token

    def summary(self) -> dict[str, Any]:
        """The few facts a notebook wants first: rows, tokens, acceptance length, speed, compile time, plan.

        Returns:
            A dict: rows, tokens (generated), tau (acceptance length, None for plain decoding), tokens_per_s,
            compile_s, and plan (the shape "auto" chose) when a plan was made.
        """
        s = self.stats
        facts = {"rows": len(self.tokens), "tokens": s.get("generated_tokens"), "tau": s.get("acceptance_length"),
                 "tokens_per_s": s.get("tokens_per_s"), "compile_s": s.get("compile_s")}
        if isinstance(s.get("plan"), dict):
            facts["plan"] = s["plan"].get("shape")
        return {k: v for k, v in facts.items() if v is not None}

    def __repr__(self) -> str:
        def fmt(v):
            return f"{v:.3g}" if isinstance(v, float) else str(v)

        return f"GenerateOutput({', '.join(f'{k}={fmt(v)}' for k, v in self.summary().items())})"

    def _repr_html_(self) -> str:
        """A notebook cell: the summary, then one line per row (its first 80 characters or token ids)."""
        head = html.escape(repr(self))
        rows = []
        for i, toks in enumerate(self.tokens[:16]):
            text = self.texts[i] if self.texts is not None else " ".join(map(str, toks))
            cut = text[:80] + ("…" if len(text) > 80 else "")
            rows.append(f"<tr><td>{i}</td><td>{len(toks)}</td><td><code>{html.escape(cut)}</code></td></tr>")
        more = f"<tr><td colspan=3>… {len(self.tokens) - 16} more rows</td></tr>" if len(self.tokens) > 16 else ""
        return (f"<div><code>{head}</code><table><tr><th>row</th><th>tokens</th><th>output</th></tr>"
                f"{''.join(rows)}{more}</table></div>")


def bucket(n: int, minimum: int = 16) -> int:
    """The next power of two >= max(n, minimum): a shape bucket, so nearby sizes share one compile."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def round_cache_length(n: int) -> int:
    """The one rounding rule for KV cache lengths: up to a multiple of CACHE_MULTIPLE."""
    return -(-n // CACHE_MULTIPLE) * CACHE_MULTIPLE


def prompt_ids(target: Target, prompts: Sequence, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Each prompt's ids: a string encoded, a conversation (a list of {"role", "content"} messages) rendered by the
    checkpoint's chat template with chat_template_kwargs (specjax/chat.py), token ids (a list or an integer array,
    NumPy or JAX; a 2-d array is one prompt a row) as they are."""
    prompts = _arrays_as_lists(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists or a list of strings")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    prompts = [_arrays_as_lists(p) for p in prompts]
    odd = [p for p in prompts if not isinstance(p, str) and (isinstance(p, bytes) or not isinstance(p, Sequence))]
    if odd:
        raise ValueError(f"prompts must be a list of prompts, each a string, a list of token ids or a conversation; got "
                         f"an element of type {type(odd[0]).__name__}: wrap one prompt of token ids as [ids], one "
                         f"conversation as [messages]")
    prompts = render_prompts(target, prompts, chat_template_kwargs)
    for i, p in enumerate(prompts):
        bad = [] if isinstance(p, str) else [t for t in p if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise TypeError(f"prompt {i} has token ids that are not integers: {bad[:5]}; pass int token ids (or an "
                            f"integer array)")
    ids = [target.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in row if not 0 <= t < target.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {target.cfg.vocab_size})")
    refuse_media_tokens(target, ids)
    return ids


def _arrays_as_lists(value: Any) -> Any:
    """An array (NumPy, JAX) of token ids as nested lists of Python ints (floats, bools kept, to be refused by name);
    anything else as it is."""
    if hasattr(value, "__array__") and not isinstance(value, (str, bytes, Sequence)):
        return np.asarray(value).tolist()
    return value


MEDIA_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id")


def refuse_media_tokens(target: Target, ids: list[list[int]]) -> None:
    """A multimodal checkpoint (Qwen3.5's ConditionalGeneration) runs as text only: image or video placeholders in
    a prompt would be read as plain tokens, so they are refused."""
    media = {int(target.hf_config[k]): k for k in MEDIA_TOKEN_KEYS if isinstance(target.hf_config.get(k), int)}
    for i, row in enumerate(ids):
        found = sorted({media[t] for t in row if t in media})
        if found:
            raise ValueError(f"prompt {i} holds {', '.join(found)} placeholders: specjax runs this model's text part "
                             "only (its vision tower is not loaded); pass text without images or video")


def cache_length(target: Target, ids: list[list[int]], max_new_tokens: int, max_len: int | None,
                 draft_nodes: int) -> int:
    """The KV cache length for this call, or a ValueError when the prompts cannot fit.

    Active rows write at most `longest + max_new_tokens - 2 + draft_nodes` positions (a
    round's N nodes go after the prefix; the last emitted token is never cached), and
    prefill writes the whole padded prompt bucket. The cache holds both, rounded up by
    `round_cache_length`; an explicit max_len is a limit that is checked, then rounded the
    same way. Positions past the cache are dropped on write and never read (see kernels/).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    longest = max(len(r) for r in ids)
    needed = longest + max_new_tokens + draft_nodes
    context = target.cfg.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(f"the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} it "
                         f"exceeds the model's context of {context} (max_position_embeddings)")
    window = target.cfg.sliding_window
    if window is not None and needed > window:
        raise ValueError(f"this model uses sliding-window attention (window {window}), which specjax does not "
                         f"implement; keep prompt + max_new_tokens{' + draft nodes' if draft_nodes else ''} within "
                         f"{window} tokens")
    if max_len is not None:
        if needed > max_len:
            raise ValueError(f"the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens}"
                             f"{f' and a draft of {draft_nodes} nodes' if draft_nodes else ''} it needs a cache of "
                             f"{needed} positions, more than max_len={max_len}")
        return round_cache_length(max(max_len, bucket(longest)))
    return round_cache_length(max(bucket(longest) + bucket(max_new_tokens), needed))


def timing_context(ids: list[list[int]], max_new_tokens: int) -> int:
    """Cached positions of the longest row halfway through decoding: the cache length that cost models for a
    call (the planner's "auto", the prefix scheduler) time their passes at."""
    return max(len(r) for r in ids) + max_new_tokens // 2


def batch_bucket(n: int, multiple: int = 1) -> int:
    """Rows a batch of n prompts is padded to: a power of two, rounded up to a multiple of `multiple` (the mesh's
    data-parallel size, which splits the batch evenly)."""
    return -(-bucket(n, minimum=1) // multiple) * multiple


def pad_batch(ids: list[list[int]], max_new_tokens: int,
              multiple: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad prompts to a length bucket and the batch to `batch_bucket` (padding rows get no budget)."""
    b, t = batch_bucket(len(ids), multiple), bucket(max(len(r) for r in ids))
    prompt_BT = np.zeros((b, t), np.int32)
    prompt_len_B = np.ones((b,), np.int32)
    max_new_B = np.zeros((b,), np.int32)
    for i, row in enumerate(ids):
        prompt_BT[i, : len(row)] = row
        prompt_len_B[i] = len(row)
        max_new_B[i] = max_new_tokens
    return prompt_BT, prompt_len_B, max_new_B


def row_seeds(seed: int | Sequence[int] | None, n_rows: int, batch: int,
              agree: bool = True) -> tuple[np.ndarray, np.ndarray, list]:
    """Per-row (seed, fold) pairs: row b's key is fold_in(key(seed_b), fold_b).

    seed=int: every row uses that seed, folded with its row index (rows differ; row 0
    alone equals row 0 in a batch). seed=[s0, s1, ...]: one seed per prompt, fold 0, so a
    prompt draws the same tokens at any row of any batch. seed=None: fresh seeds per
    prompt, returned so the run can be repeated with seed=<them>. agree=False: this process's draw alone (the
    engine, which sends process 0's requests to the others itself).
    """
    def check(s) -> int:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= int(s) <= MAX_SEED:
            raise ValueError(f"a seed must be an integer in [0, {MAX_SEED}], got {s!r}")
        return int(s)

    seeds_B, fold_B = np.zeros((batch,), np.uint32), np.zeros((batch,), np.uint32)
    if seed is None:
        # drawn on each process; a multi-host job takes process 0's
        used = np.asarray([secrets.randbelow(MAX_SEED + 1) for _ in range(n_rows)], np.int64)
        used = (agreed(used) if agree else used).tolist()
        seeds_B[:n_rows] = used
    elif isinstance(seed, (int, np.integer)):
        seeds_B[:] = check(seed)
        fold_B[:] = np.arange(batch)
        used = check(seed)
    elif isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        used = [check(s) for s in seed]
        if len(used) != n_rows:
            raise ValueError(f"seed has {len(used)} entries for {n_rows} prompts: pass one seed per prompt, "
                             "a single int, or None")
        seeds_B[:n_rows] = used
    else:
        raise ValueError(f"seed must be an int, a list of one int per prompt, or None; got {seed!r}")
    return seeds_B, fold_B, used


@dataclasses.dataclass(frozen=True)
class Options:
    """What a call asks beyond sampling: penalties, stops, logprobs and how text is made (all per call)."""

    penalties: PenaltyConfig = PenaltyConfig()
    stop: tuple = ()  # stop strings matched on the decoded text: one tuple for all prompts, or one per prompt
    stop_token_ids: tuple[int, ...] = ()  # stop tokens beyond EOS
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int = -1  # -1: none; 0: each token's; n > 0: also the n most likely

    def validate(self, vocab: int, has_tokenizer: bool) -> "Options":
        if isinstance(self.stop, str):
            return dataclasses.replace(self, stop=(self.stop,)).validate(vocab, has_tokenizer)
        stops = [s for row in (self.stop if self.per_prompt_stops else (self.stop,)) for s in row]
        bad = [s for s in stops if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop must be a list of non-empty strings (or one such list per prompt), got "
                             f"{list(self.stop)!r}")
        if stops and not has_tokenizer:
            raise ValueError("stop strings are matched on decoded text, but this target has no tokenizer: pass "
                             "stop_token_ids= instead")
        ids = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
               or not 0 <= t < vocab]
        if ids:
            raise ValueError(f"stop_token_ids {ids} are not token ids of this vocabulary [0, {vocab})")
        return dataclasses.replace(self, penalties=self.penalties.validate(), stop=tuple(self.stop),
                                   stop_token_ids=tuple(int(t) for t in self.stop_token_ids))

    @property
    def per_prompt_stops(self) -> bool:
        return bool(self.stop) and not isinstance(self.stop[0], str)

    def row_stops(self, n_rows: int) -> tuple[tuple[str, ...], ...]:
        """Each prompt's stop strings: `stop` is one list for all prompts, or one list per prompt."""
        if self.per_prompt_stops:
            return tuple(tuple(s) for s in per_row(tuple(self.stop), n_rows, "stop"))
        return (tuple(self.stop),) * n_rows


class LoopArrays(NamedTuple):
    """The loops' array arguments after params, in their order: prompts, lengths, budgets, per-row seeds and folds,
    and the per-row settings."""

    prompt_BT: jax.Array
    prompt_len_B: jax.Array
    max_new_B: jax.Array
    seeds_B: jax.Array
    fold_B: jax.Array
    rows: RowSettings


@dataclasses.dataclass(frozen=True)
class Request:
    """One validated call, bucketed: padded prompt arrays, per-row seeds and settings, the static loop config."""

    ids: list[list[int]]
    prompt_BT: np.ndarray
    prompt_len_B: np.ndarray
    max_new_B: np.ndarray
    seeds_B: np.ndarray
    fold_B: np.ndarray
    seeds_used: int | list[int]
    rows: RowSettings  # numpy
    lc: LoopConfig
    options: Options
    stop_ids: tuple[int, ...]  # EOS and stop_token_ids
    mesh: Any = None  # the target's mesh: the arrays are split over its "data" axis

    def arrays(self) -> "LoopArrays":
        """The jitted loops' array arguments after params, on the device (the batch split over "data" on a mesh)."""
        return place_batch(LoopArrays(self.prompt_BT, self.prompt_len_B, self.max_new_B, self.seeds_B, self.fold_B,
                                      self.rows), self.mesh)

    @property
    def chunked(self) -> bool:
        """Stop strings are checked on the host between chunks of the loop."""
        return bool(self.options.stop)


def prepare(target: Target, prompts: Sequence, max_new_tokens: int, sampling: SamplingConfig, eos_token_id,
            max_len: int | None, seed, draft_nodes: int = 0, token_bucket: int = 0,
            options: Options | None = None, agree: bool = True) -> Request:
    """Validate prompts, lengths, seeds and settings (`draft_nodes` cache slots for one draft) and bucket shapes.

    token_bucket: shape the loop for this many new tokens when it is more than max_new_tokens (rows still stop at
    max_new_tokens): a short run then shares a longer one's executable (calibration.run_times times both).
    agree=False: no check that every process of a multi-host job passed the same, and fresh seeds are this
    process's (the engine validates requests on process 0 alone and sends them to the others itself)."""
    ids = prompt_ids(target, prompts)
    options = (options or Options()).validate(target.cfg.vocab_size, target.tokenizer is not None)
    options.row_stops(len(ids))  # one stop list per prompt, when per prompt
    sampling = sampling.validate()
    shaped_for = max(max_new_tokens, token_bucket) if token_bucket else max_new_tokens
    cache_len = cache_length(target, ids, shaped_for, max_len, draft_nodes)
    mesh = getattr(target, "mesh", None)
    prompt_BT, prompt_len_B, max_new_B = pad_batch(ids, max_new_tokens, axis_size(mesh, "data"))
    batch = prompt_BT.shape[0]
    seeds_B, fold_B, used = row_seeds(seed, len(ids), batch, agree)
    stop_ids = tuple(dict.fromkeys(eos_ids(target, eos_token_id) + options.stop_token_ids))
    if agree:
        check_same_everywhere("prompts and settings", (ids, max_new_tokens, max_len, sampling, seeds_B.tolist(),
                                                       stop_ids, options))
    stop_ids_BS = np.full((batch, bucket(len(stop_ids), minimum=1)), -1, np.int32)
    stop_ids_BS[:, :len(stop_ids)] = stop_ids
    rows = RowSettings(RowSampling.of(sampling, len(ids), batch), RowPenalties.of(options.penalties, len(ids), batch),
                       stop_ids_BS)
    lc = LoopConfig(target.cfg, not sampling.greedy, bucket(shaped_for), cache_len, target.attn_impl,
                    penalties=options.penalties.active, logprobs=options.logprobs)
    return Request(ids, prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, used, rows, lc, options, stop_ids, mesh)


def eos_ids(target: Target, override: int | Sequence[int] | None) -> tuple[int, ...]:
    if override is None:
        return target.cfg.eos_token_ids
    return (int(override),) if isinstance(override, (int, np.integer)) else tuple(int(t) for t in override)


def params_signature(tree) -> tuple:
    """What a compiled executable is specialised to: tree structure, and each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
                          for x in leaves)


def compiled_for(target: Target, key: tuple, fn, args: tuple, static: dict) -> tuple[Any, float]:
    """`fn` compiled once per (key, argument signature) on this target (cached): (executable, compile_s).

    The signature of every array argument (params included) is part of the cache key, so two drafters
    whose params differ in structure, shape, dtype or sharding get their own executables instead of a
    type error. A target on a mesh compiles under it (models/sharding.py `use_mesh`: the caches allocated
    inside the loop take their shardings from it).
    """
    full_key = (*key, params_signature(args))
    compile_s = 0.0
    if full_key not in target.compiled:
        start = time.perf_counter()
        with use_mesh(getattr(target, "mesh", None)):
            target.compiled[full_key] = fn.lower(*args, **static).compile()
        compile_s = time.perf_counter() - start
    return target.compiled[full_key], compile_s


def run_compiled(target: Target, key: tuple, fn, args: tuple, static: dict) -> tuple[Any, float, float]:
    """Compile `fn` (see compiled_for), then run it: (result, compile_s, run_s)."""
    executable, compile_s = compiled_for(target, key, fn, args, static)
    start = time.perf_counter()
    result = jax.block_until_ready(executable(*args))
    return result, compile_s, time.perf_counter() - start


def row_texts(target: Target, req: Request) -> list[RowText]:
    """Each prompt's incremental text and stop-string state (stream.RowText), with the call's options."""
    o = req.options
    min_tokens = per_row(o.penalties.min_tokens, len(req.ids), "min_tokens")
    return [RowText(target, stop, o.include_stop_str_in_output, o.skip_special_tokens, m)
            for stop, m in zip(o.row_stops(len(req.ids)), min_tokens)]


def run_loop(target: Target, req: Request, key: tuple, whole, start, advance, args: tuple, advance_args,
             static: dict, first_step: int, texts: list[RowText] | None = None) -> tuple[Any, float, float, Any]:
    """Run a loop whole (`whole`, one executable) or, with stop strings or a stream, chunk by chunk.

    whole(*args) -> outputs; start(*args) -> state; advance(*advance_args(state, until)) -> state. Returns
    (outputs or final state, compile_s, run_s, the ChunkedRun or None). Without `texts` a chunked run (stop strings)
    is run to its end here; with them (streaming) the caller iterates the ChunkedRun, and the state and run_s are
    the ChunkedRun's once it has."""
    if texts is None and not req.chunked:
        result, compile_s, run_s = run_compiled(target, (*key, "whole"), whole, args, static)
        return result, compile_s, run_s, None
    full_key = (*key, "chunks", params_signature(args))
    compile_s = 0.0
    if full_key not in target.compiled:  # the state's shapes (for advance) come from tracing start: once per key
        start_x, c1 = compiled_for(target, (*key, "start"), start, args, static)
        with use_mesh(getattr(target, "mesh", None)):
            shapes = jax.eval_shape(lambda *a: start(*a, **static), *args)
        # advance is compiled for the state as start_x hands it back, shardings included (on a mesh XLA chose them);
        # a state advance hands back in other shardings (XLA may choose others for small leaves) is moved to them
        # first (a leaf already in place is kept)
        state_shardings = start_x.output_shardings
        probe = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes,
                             state_shardings)
        advance_x, c2 = compiled_for(target, (*key, "advance"), advance, advance_args(probe, jnp.int32(0)), static)
        target.compiled[full_key], compile_s = (start_x, advance_x, state_shardings), c1 + c2
    start_x, advance_x, state_shardings = target.compiled[full_key]

    def advance_from(state, until):
        return advance_x(*advance_args(moved_to(state, state_shardings), until))

    run = ChunkedRun(lambda: start_x(*args), advance_from, first_step, req.lc.out_len,
                     texts or row_texts(target, req), req.stop_ids)
    if texts is None:
        for _ in run:
            pass
    return run.state, compile_s, run.run_s, run


@dataclasses.dataclass
class LoopResult:
    """A loop's outputs on the host (numpy): tokens [B, O], counts [B], and what the loop kept besides."""

    out_BO: np.ndarray
    count_B: np.ndarray
    logprobs: Any = None  # decode.Logprobs or None
    round_BO: np.ndarray | None = None  # speculative: the round that emitted each token
    spec_stats: Any = None  # speculative: SpecStats


def finish(target: Target, req: Request, result: LoopResult, compile_s: float, run_s: float,
           extra_stats: dict[str, Any], texts: list[RowText] | None = None) -> GenerateOutput:
    """Trim the output buffers to each row's tokens and assemble the statistics every call reports.

    texts: the rows' RowTexts of a chunked run (their text already cut at a stop string; their token count is
    what each row keeps); None: every emitted token is kept and decoded here."""
    n_rows = len(req.ids)
    kept_B = result.count_B if texts is None else np.asarray([len(t.tokens) for t in texts])
    tokens = trim(result.out_BO, kept_B, n_rows)
    n = sum(len(t) for t in tokens)
    stats = {"tokens_per_s": n / run_s, "compile_s": compile_s, "decode_s": run_s, "generated_tokens": n,
             **extra_stats, "batch_bucket": req.prompt_BT.shape[0], "cache_len": req.lc.cache_len,
             "seed": req.seeds_used}
    rounds = None if result.round_BO is None else trim(result.round_BO, kept_B, n_rows)
    if texts is not None:
        out_texts = [t.text for t in texts] if target.tokenizer is not None else None
        reasons = [finish_reason(t.tokens, t.stop_reason, req.stop_ids) for t in texts]
    else:
        out_texts = decode_texts(target, tokens, req.options.skip_special_tokens)
        reasons = [finish_reason(t, None, req.stop_ids) for t in tokens]
    out = GenerateOutput(tokens, stats, out_texts, rounds, result.spec_stats,
                         finish_reasons=[r for r, _ in reasons], stop_reasons=[s for _, s in reasons])
    if result.logprobs is not None:
        lp = result.logprobs
        out.logprobs = [lp.token_BO[i, :len(t)].tolist() for i, t in enumerate(tokens)]
        if req.lc.logprobs > 0:
            out.top_logprobs = [[list(zip(lp.top_ids_BOK[i, j].tolist(), lp.top_BOK[i, j].tolist()))
                                 for j in range(len(t))] for i, t in enumerate(tokens)]
    return out


def trim(out_BO: np.ndarray, count_B: np.ndarray, n_rows: int) -> list[list[int]]:
    return [np.asarray(out_BO)[i, : count_B[i]].tolist() for i in range(n_rows)]


def decode_texts(target: Target, tokens: list[list[int]], skip_special_tokens: bool = True) -> list[str] | None:
    if target.tokenizer is None:
        return None
    return [target.decode(t, skip_special_tokens=skip_special_tokens) for t in tokens]
