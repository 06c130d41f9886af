"""`specjax.generate` and `specjax.stream`: check the arguments, then dispatch to the plain or the speculative loop.

Request preparation, bucketing, per-row seeds, the compile cache and output assembly live
below both loops in request.py (chunked runs: stream.py); this module only resolves the call's
settings (the checkpoint's generation_config.json defaults, the draft shape) and decides which
loop runs.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from os import PathLike
from typing import Any, Iterator, Sequence

import numpy as np

from specjax.chat import render_prompts
from specjax.config import PenaltyConfig, SamplingConfig
from specjax.decoding.drafter import check_drafter_argument
from specjax.decoding.params import SamplingParams, merged
from specjax.decoding.plain import plain_generate, plain_run
from specjax.decoding.request import GenerateOutput, Options, bucket, prepare, row_texts
from specjax.decoding.speculative import spec_runner, speculative_generate
from specjax.decoding.stream import StreamChunk
from specjax.decoding.tree import parse_tree
from specjax.models.target import Target
from specjax.planning.auto import auto_shape
from specjax.planning.scheduler_cost import scheduler_cost

__all__ = ["GenerateOutput", "StreamChunk", "bucket", "generate", "stream"]

# transformers' defaults for a generation config that samples without saying how
# (GenerationConfig._get_default_generation_params in transformers/generation/configuration_utils.py).
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def generate(target: Target, prompts: Sequence, max_new_tokens: int = 128, temperature=None, top_k=None, top_p=None,
             seed: int | Sequence[int] | None = 0, drafter=None, num_draft_tokens: int | str | None = None, tree=None,
             eos_token_id: int | Sequence[int] | None = None, max_len: int | None = None, scheduler: str | None = None,
             scheduler_profile=None, *, min_p=None, stop: str | Sequence | None = None,
             stop_token_ids: Sequence[int] | None = None, include_stop_str_in_output: bool = False,
             skip_special_tokens: bool = True, logprobs: bool = False, top_logprobs: int = 0, repetition_penalty=None,
             presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, chat_template_kwargs: dict | None = None,
             sampling_params: SamplingParams | None = None, max_tokens: int | None = None) -> GenerateOutput:
    """Continue each prompt; greedy when temperature is 0. With a drafter, decode speculatively: the output is the
    same as without one (token for token when greedy, the same distribution when sampling).

    Args:
        target: the model, from `specjax.load`.
        prompts: token-id lists (ragged), strings (needs the target's tokenizer), or chats (lists of
            {"role", "content"} messages, rendered with the checkpoint's chat template).
        max_new_tokens: the output budget of every row.
        temperature: one value for all prompts or one per prompt (a batch may mix greedy and sampled rows); values are
            data, so new ones reuse the compiled loop. Unset (with top_k, top_p, min_p): the checkpoint's
            generation_config.json as transformers applies it (do_sample true: its temperature, top_k, top_p, min_p,
            transformers' defaults 1.0 / 50 / 1.0 for those it omits; otherwise greedy).
        top_k: as temperature, per prompt or one value.
        top_p: as temperature, per prompt or one value.
        seed: an int (row b uses it folded with b), one int per prompt (a prompt then draws the same tokens at any row
            of any batch), or None for fresh randomness (reported in out.stats["seed"]; pass it back to repeat).
        drafter: a drafter from `specjax.load_drafter`, `NgramDrafter` or `replay_drafter`; None decodes plainly.
        num_draft_tokens: a chain of K drafts (default 4 with a drafter), "auto" (the planner picks a chain or off for
            this batch from a short calibration run, cached per target, drafter and batch bucket) or "off".
        tree: instead of num_draft_tokens: "chain:K", "kary:3,2,1", a list of choice paths, "dynamic:top_k=..,depth=..,
            total_tokens=.." (EAGLE-2), a `TreeSpec`, "auto" (a tree, a chain or off) or "off". The choice made is in
            out.stats["plan"].
        eos_token_id: overrides the checkpoint's EOS ids; [] disables stopping on EOS.
        max_len: a limit on prompt + output (+ one draft); the cache is this rounded up to a multiple of 128.
        scheduler: "confidence" verifies, each round, only as much of each row's chain as pays off given the drafter's
            confidences (DSpark's) and the device's verify cost, at the best of a few compiled widths; "prefix" uses
            DSpark's Algorithm 1 verbatim. Chains only (num_draft_tokens=K).
        scheduler_profile: the scheduler's cost curve: a Profile, a profile JSON path, "measure" (time this target
            now), "roofline", or None ($SPECJAX_PROFILE if it holds this model, else the roofline).
            out.stats["scheduler"] says which was used.
        min_p: as temperature, per prompt or one value (vLLM's meaning).
        stop: strings matched on the decoded text: the output ends before the first one; one list for all prompts or
            one per prompt.
        stop_token_ids: token ids that stop a row, beyond EOS.
        include_stop_str_in_output: keep the stop string that ended a row in its text.
        skip_special_tokens: leave special tokens out of out.texts.
        logprobs: fill out.logprobs, each token's raw log-probability (log-softmax of the target's logits).
        top_logprobs: fill out.top_logprobs with the n most likely (id, logprob) at each position (n at most
            MAX_TOP_LOGPROBS = 20, vLLM's cap).
        repetition_penalty: vLLM's (over prompt and output); unset: generation_config.json's, else 1.
        presence_penalty: vLLM's (over the output), per prompt or one value.
        frequency_penalty: vLLM's (over the output), per prompt or one value.
        min_tokens: EOS and stop tokens are kept out until a row has this many tokens.
        chat_template_kwargs: template variables for chat prompts, e.g. {"enable_thinking": False}.
        sampling_params: a `specjax.SamplingParams` holding these settings (vLLM's names), beside or instead of the
            keywords; a setting given both ways must agree.
        max_tokens: vLLM's name for max_new_tokens.

    Returns:
        A `GenerateOutput`: tokens and texts per prompt, finish_reasons ("stop" or "length"), stop_reasons, logprobs
        when asked, and stats (acceptance_length, tokens_per_s, compile_s, plan, ...).

    Raises:
        ValueError: a setting out of range, NaN or inf, a draft shape without a drafter, a prompt the target cannot
            take; each names the argument and what would be right. Checked before anything compiles.
        TypeError: a mistyped argument (a float max_new_tokens, a path where a drafter is expected).

    Example:
        ```python
        out = specjax.generate(target, ["def f(x):"], max_new_tokens=64, drafter=drafter, num_draft_tokens=4,
                               temperature=[0.7], stop=["\\n\\n"], logprobs=True)
        print(out.texts[0], out.stats["acceptance_length"])
        ```
    """
    return _resolve(**locals()).generate()


def stream(target: Target, prompts: Sequence, max_new_tokens: int = 128, temperature=None, top_k=None, top_p=None,
           seed: int | Sequence[int] | None = 0, drafter=None, num_draft_tokens: int | str | None = None, tree=None,
           eos_token_id: int | Sequence[int] | None = None, max_len: int | None = None, scheduler: str | None = None,
           scheduler_profile=None, *, min_p=None, stop: str | Sequence | None = None,
           stop_token_ids: Sequence[int] | None = None, include_stop_str_in_output: bool = False,
           skip_special_tokens: bool = True, logprobs: bool = False, top_logprobs: int = 0, repetition_penalty=None,
           presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, chat_template_kwargs: dict | None = None,
           sampling_params: SamplingParams | None = None, max_tokens: int | None = None) -> Iterator[StreamChunk]:
    """`generate`, yielding each prompt's new output as the loop produces it.

    The chunks of a prompt concatenate to what generate returns for it, with or without a drafter. The loop runs in
    chunks of steps that grow until each takes CHUNK_TARGET_S (stream.py), so the first tokens come at once and long
    runs pay little.

    Args:
        target: the model, from `specjax.load`.
        prompts: as `generate`'s.
        max_new_tokens: as `generate`'s; every other argument too.

    Yields:
        A `StreamChunk` per prompt with new output: .index, .token_ids, .text, with logprobs=True .logprobs and
        .top_logprobs of those tokens, and .finish_reason and .stop_reason on its last chunk.

    Raises:
        ValueError: as `generate`; the arguments are checked at the call, before the first chunk is asked for.
        TypeError: as `generate`.
    """
    return _resolve(**locals()).stream()


@dataclasses.dataclass
class _Call:
    """A checked call: which loop runs it, with what."""

    target: Target
    prompts: Sequence
    max_new_tokens: int
    sampling: SamplingConfig
    seed: Any
    eos_token_id: Any
    max_len: int | None
    options: Options
    drafter: Any = None
    spec: Any = None  # None: the plain loop
    scheduler: str | None = None
    scheduler_profile: Any = None
    extra_stats: dict = dataclasses.field(default_factory=dict)

    def _kw(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, sampling=self.sampling, seed=self.seed,
                    eos_token_id=self.eos_token_id, max_len=self.max_len, options=self.options)

    def _cost(self):
        return partial(scheduler_cost, self.target, self.scheduler_profile)

    def generate(self) -> GenerateOutput:
        if self.spec is None:
            return plain_generate(self.target, self.prompts, extra=self.extra_stats, **self._kw())
        out = speculative_generate(self.target, self.prompts, self.drafter, spec=self.spec, scheduler=self.scheduler,
                                   scheduler_cost=self._cost(), **self._kw())
        out.stats.update(self.extra_stats)
        return out

    def stream(self) -> Iterator[StreamChunk]:
        """The chunks of this call; the request is prepared (its prompts checked) now, the loop runs as they are
        asked for."""
        kw = self._kw()
        req = prepare(self.target, self.prompts, kw["max_new_tokens"], kw["sampling"], kw["eos_token_id"],
                      kw["max_len"], kw["seed"], draft_nodes=0 if self.spec is None else self.spec.cache_slots,
                      options=self.options)

        def chunks() -> Iterator[StreamChunk]:
            texts = row_texts(self.target, req)
            if self.spec is None:
                run = plain_run(self.target, req, texts)[3]
            else:
                run = spec_runner(self.target, req, self.drafter, self.spec, self.scheduler, self._cost()).run(texts)[3]
            for some in run:
                yield from some

        return chunks()


def _resolve(target, prompts, drafter, num_draft_tokens, tree, max_len, scheduler, scheduler_profile,
             chat_template_kwargs, sampling_params, **settings) -> _Call:
    """Check every argument and decide the loop (planning "auto" here): the _Call to run."""
    _check_types(target, max_len, drafter, num_draft_tokens)
    params = merged(sampling_params, settings).validate(target.cfg.vocab_size)
    sampling = _sampling(target, params)
    prompts = render_prompts(target, prompts, chat_template_kwargs)
    max_new_tokens, seed, eos_token_id = params.max_new_tokens, params.seed, params.eos_token_id
    call = _Call(target, prompts, max_new_tokens, sampling, seed, eos_token_id, max_len, _options(target, params))
    if scheduler is None and scheduler_profile is not None:
        raise ValueError("scheduler_profile= gives the prefix scheduler its cost curve; pass scheduler='confidence' "
                         "too, or drop scheduler_profile=")
    if drafter is None and scheduler is not None:
        raise ValueError(f"scheduler={scheduler!r} decides how much of a draft to verify, but no drafter was given: "
                         f"pass drafter= (one that reports confidences), or drop scheduler=")
    if drafter is None:
        if num_draft_tokens is not None or tree is not None:
            given = "num_draft_tokens" if num_draft_tokens is not None else "tree"
            raise ValueError(f"{given}= shapes a speculative draft but no drafter was given: pass drafter= "
                             f"(e.g. specjax.load_drafter(path, target)), or drop {given}=")
        return call
    if "off" in (num_draft_tokens, tree):
        _other_unset(num_draft_tokens, tree, "off", "'off' runs the plain loop")
        if scheduler is not None:
            raise ValueError(f"scheduler={scheduler!r} chooses how much of each draft to verify, but 'off' drafts "
                             "nothing (the plain loop): drop scheduler=, or give num_draft_tokens=K")
        call.extra_stats = {"plan": {"shape": "off", "kind": "off", "requested": True}}
        return call
    if "auto" in (num_draft_tokens, tree) and scheduler is not None:
        raise ValueError("scheduler= chooses the verified prefix of a fixed chain each round; with 'auto' the planner "
                         "picks the shape instead: give num_draft_tokens=K with scheduler=, or drop scheduler=")
    call.drafter, call.scheduler, call.scheduler_profile = drafter, scheduler, scheduler_profile
    if "auto" in (num_draft_tokens, tree):
        _other_unset(num_draft_tokens, tree, "auto",
                     "with 'auto' leave the other one unset (num_draft_tokens='auto' plans chains, tree='auto' plans "
                     "trees and chains)")
        call.spec, plan = auto_shape(target, drafter, prompts, trees=tree == "auto", sampling=sampling, seed=seed,
                                     eos_token_id=eos_token_id, max_new_tokens=max_new_tokens)
        call.extra_stats = {"plan": plan}
        return call
    if num_draft_tokens is not None and tree is not None:
        raise ValueError(f"pass either num_draft_tokens={num_draft_tokens} (a chain) or tree={tree!r}, not both; "
                         f"a chain of K is also tree='chain:K'")
    call.spec = parse_tree(tree, num_draft_tokens)
    return call


def _sampling(target: Target, params: SamplingParams) -> SamplingConfig:
    """The call's sampling: what it gives, else the checkpoint's generation_config.json transformers' way (its values
    only when it says do_sample, with transformers' defaults for those it omits; otherwise greedy)."""
    gen = target.generation_config
    sampled = bool(gen.get("do_sample", False))
    off = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    values = {name: getattr(params, name) if getattr(params, name) is not None else
              (gen.get(name) if gen.get(name) is not None else HF_SAMPLING_DEFAULTS[name]) if sampled else off[name]
              for name in off}
    return SamplingConfig(**values).validate()


def _options(target: Target, params: SamplingParams) -> Options:
    """Penalties (repetition_penalty unset: generation_config.json's, as transformers applies it), stops, logprobs
    and text options of a call."""
    repetition = params.repetition_penalty
    if repetition is None:
        repetition = target.generation_config.get("repetition_penalty") or 1.0
    penalties = PenaltyConfig(repetition, params.presence_penalty, params.frequency_penalty, params.min_tokens)
    return Options(penalties=penalties, stop=params.stop, stop_token_ids=params.stop_token_ids or (),
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens,
                   logprobs=params.top_logprobs if (params.logprobs or params.top_logprobs) else -1)


def _check_types(target, max_len, drafter, num_draft_tokens) -> None:
    """Wrong types get an error that says what to pass, before anything is built."""
    if not isinstance(target, Target):
        hint = " (load the target first: target = specjax.load(path))" if isinstance(target, (str, PathLike)) else ""
        raise TypeError(f"generate's first argument must be a specjax Target, got {type(target).__name__}{hint}")
    if max_len is not None:
        if not _is_int(max_len):
            raise TypeError(f"max_len must be an int, got {max_len!r} ({type(max_len).__name__})")
        if max_len <= 0:
            raise ValueError(f"max_len must be a positive int (a limit on prompt + output tokens), got {max_len}")
    if drafter is not None:
        check_drafter_argument(drafter)
    if num_draft_tokens is not None and num_draft_tokens not in ("auto", "off") and not _is_int(num_draft_tokens):
        raise TypeError(f"num_draft_tokens must be an int K (a chain of K), 'auto' or 'off'; got "
                        f"{num_draft_tokens!r}")


def _other_unset(num_draft_tokens, tree, word: str, why: str) -> None:
    """With `word` ("off" / "auto") in one of num_draft_tokens / tree, the other is unset or the same word."""
    other = tree if num_draft_tokens == word else num_draft_tokens
    if other is not None and other != word:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r} with tree={tree!r}: {why}")


def _is_int(x) -> bool:
    """True for Python and NumPy integers, not bools (True is not a token count)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
