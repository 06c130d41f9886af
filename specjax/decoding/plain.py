"""`generate` without a drafter: the plain loop's request path (prepare, compile once per shape, run, finish).

The counterpart of `speculative.speculative_generate`, below the API so that the planner can time
plain decoding on a user's prompts without importing `generate`.
"""

from __future__ import annotations

from typing import Any, Sequence

from specjax.config import SamplingConfig
from specjax.decoding.decode import ar_generate
from specjax.decoding.request import GenerateOutput, finish, prepare, run_compiled
from specjax.models.target import Target


def plain_generate(target: Target, prompts: Sequence, *, max_new_tokens: int, sampling: SamplingConfig, seed,
                   eos_token_id, max_len: int | None, extra: dict[str, Any] | None = None,
                   token_bucket: int = 0) -> GenerateOutput:
    """Plain autoregressive decoding of every prompt; `extra` is merged into out.stats (token_bucket: see prepare)."""
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, seed, token_bucket=token_bucket)
    (out_BO, count_B, steps), compile_s, run_s = run_compiled(
        target, ("ar", req.lc, req.prompt_BT.shape), ar_generate, (target.params, *req.arrays()), {"lc": req.lc})
    return finish(target, req, out_BO, count_B, compile_s, run_s,
                  {"acceptance_length": 1.0, "drafter_calls": 0, "rounds": int(steps), **(extra or {})})
