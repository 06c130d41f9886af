"""`specjax.generate`: check the arguments, then dispatch to the plain or the speculative loop.

Request preparation, bucketing, per-row seeds, the compile cache and output assembly live
below both loops in request.py; this module only decides which loop runs.
"""

from __future__ import annotations

from functools import partial
from os import PathLike
from typing import Sequence

import numpy as np

from specjax.config import SamplingConfig
from specjax.decoding.drafter import check_drafter_argument
from specjax.decoding.plain import plain_generate
from specjax.decoding.request import GenerateOutput, bucket
from specjax.decoding.speculative import speculative_generate
from specjax.decoding.tree import parse_tree
from specjax.models.target import Target
from specjax.planning.auto import auto_shape
from specjax.planning.scheduler_cost import scheduler_cost

__all__ = ["GenerateOutput", "bucket", "generate"]


def generate(target: Target, prompts: Sequence, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] | None = 0, drafter=None,
             num_draft_tokens: int | None = None, tree=None, eos_token_id: int | Sequence[int] | None = None,
             max_len: int | None = None, scheduler: str | None = None, scheduler_profile=None) -> GenerateOutput:
    """Continue each prompt; greedy when temperature is 0. With a drafter, decode speculatively.

    prompts: list of token-id lists (ragged) or strings (needs the target's tokenizer).
    seed: an int (row b uses it folded with b), one int per prompt (a prompt then draws the
      same tokens at any row of any batch), or None for fresh randomness (reported in
      out.stats["seed"], pass it back to repeat the run).
    num_draft_tokens / tree: the draft shape, one or the other (default: a chain of 4); only with a drafter.
      "auto": the planner picks it for this batch (num_draft_tokens="auto": a chain or off; tree="auto":
      a tree, a chain or off) from a short calibration run, cached per (target, drafter, batch bucket);
      "off" (either) runs the plain loop. The choice is in out.stats["plan"].
    eos_token_id: overrides the checkpoint's EOS ids; [] disables stopping on EOS.
    max_len: a limit on prompt + output (+ one draft); the cache is this rounded up to a multiple of 128.
    scheduler: "confidence" verifies, each round, only as much of each row's chain as pays off given the
      drafter's confidences (Draft.confidence, e.g. DSpark's) and the device's verify cost, at the best of a
      few compiled widths (specjax/decoding/scheduler.py); "prefix" uses DSpark's Algorithm 1 verbatim. Chains only
      (num_draft_tokens=K). scheduler_profile: its cost curve: a Profile, a profile JSON path, "measure"
      (time this target now), "roofline", or None ($SPECJAX_PROFILE if it holds this model, else the
      roofline). out.stats["scheduler"] says which was used.
    """
    _check_types(target, max_new_tokens, max_len, drafter, num_draft_tokens)
    sampling = SamplingConfig(temperature, top_k, top_p).validate()
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
        return _plain(target, prompts, max_new_tokens, sampling, seed, eos_token_id, max_len)
    if "off" in (num_draft_tokens, tree):
        _other_unset(num_draft_tokens, tree, "off", "'off' runs the plain loop")
        if scheduler is not None:
            raise ValueError(f"scheduler={scheduler!r} chooses how much of each draft to verify, but 'off' drafts "
                             "nothing (the plain loop): drop scheduler=, or give num_draft_tokens=K")
        return _plain(target, prompts, max_new_tokens, sampling, seed, eos_token_id, max_len,
                      {"plan": {"shape": "off", "kind": "off", "requested": True}})
    if "auto" in (num_draft_tokens, tree) and scheduler is not None:
        raise ValueError("scheduler= chooses the verified prefix of a fixed chain each round; with 'auto' the planner "
                         "picks the shape instead: give num_draft_tokens=K with scheduler=, or drop scheduler=")
    if "auto" in (num_draft_tokens, tree):
        return _generate_auto(target, prompts, max_new_tokens, sampling, seed, drafter, num_draft_tokens, tree,
                              eos_token_id, max_len)
    if num_draft_tokens is not None and tree is not None:
        raise ValueError(f"pass either num_draft_tokens={num_draft_tokens} (a chain) or tree={tree!r}, not both; "
                         f"a chain of K is also tree='chain:K'")
    spec = parse_tree(tree, num_draft_tokens)
    return speculative_generate(target, prompts, drafter, max_new_tokens=max_new_tokens, sampling=sampling,
                                seed=seed, spec=spec, eos_token_id=eos_token_id, max_len=max_len,
                                scheduler=scheduler, scheduler_cost=partial(scheduler_cost, target, scheduler_profile))


def _check_types(target, max_new_tokens, max_len, drafter, num_draft_tokens) -> None:
    """Wrong types get an error that says what to pass, before anything is built."""
    if not isinstance(target, Target):
        hint = " (load the target first: target = specjax.load(path))" if isinstance(target, (str, PathLike)) else ""
        raise TypeError(f"generate's first argument must be a specjax Target, got {type(target).__name__}{hint}")
    for name, value in (("max_new_tokens", max_new_tokens), ("max_len", max_len)):
        if not _is_int(value) and not (name == "max_len" and value is None):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
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


def _generate_auto(target, prompts, max_new_tokens, sampling, seed, drafter, num_draft_tokens, tree, eos_token_id,
                   max_len) -> GenerateOutput:
    """num_draft_tokens="auto" / tree="auto": ask the planner for the shape, then run that loop."""
    _other_unset(num_draft_tokens, tree, "auto",
                 "with 'auto' leave the other one unset (num_draft_tokens='auto' plans chains, tree='auto' plans trees "
                 "and chains)")
    spec, plan = auto_shape(target, drafter, prompts, trees=tree == "auto", sampling=sampling, seed=seed,
                            eos_token_id=eos_token_id, max_new_tokens=max_new_tokens)
    if spec is None:
        return _plain(target, prompts, max_new_tokens, sampling, seed, eos_token_id, max_len, {"plan": plan})
    out = speculative_generate(target, prompts, drafter, max_new_tokens=max_new_tokens, sampling=sampling,
                               seed=seed, spec=spec, eos_token_id=eos_token_id, max_len=max_len)
    out.stats["plan"] = plan
    return out


def _plain(target, prompts, max_new_tokens, sampling, seed, eos_token_id, max_len, extra=None) -> GenerateOutput:
    """The plain autoregressive loop (no drafter, or the planner said "off")."""
    return plain_generate(target, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                          eos_token_id=eos_token_id, max_len=max_len, extra=extra)
