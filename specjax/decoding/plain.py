"""`generate` without a drafter: the plain loop's request path (prepare, compile once per shape, run, finish).

The counterpart of `speculative.speculative_generate`, below the API so that the planner can time
plain decoding on a user's prompts without importing `generate`.
"""

from __future__ import annotations

from typing import Any, Sequence

from specjax.config import SamplingConfig
from specjax.decoding.decode import ar_advance, ar_generate, ar_start
from specjax.decoding.request import GenerateOutput, LoopResult, Options, Request, finish, prepare, run_loop
from specjax.decoding.stream import ChunkedRun
from specjax.models.target import Target
from specjax.multihost import to_host


def plain_run(target: Target, req: Request, texts=None) -> tuple[Any, float, float, ChunkedRun | None]:
    """Run the plain loop for `req`: whole, or as a ChunkedRun to iterate (stop strings, streaming)."""
    arrays = req.arrays()
    return run_loop(target, req, ("ar", req.lc, req.prompt_BT.shape), ar_generate, ar_start, ar_advance,
                    (target.params, *arrays),
                    lambda state, until: (target.params, arrays.max_new_B, arrays.rows, state, until), {"lc": req.lc},
                    first_step=1, texts=texts)


def plain_result(req: Request, outputs) -> tuple[LoopResult, int]:
    """(LoopResult, steps) from ar_generate's outputs or a final PlainState."""
    if not isinstance(outputs, tuple):
        outputs = (outputs.out_BO, outputs.count_B, outputs.step, outputs.logprobs)
    out_BO, count_B, steps, logprobs = to_host(outputs)
    return LoopResult(out_BO, count_B, logprobs), int(steps)


def plain_generate(target: Target, prompts: Sequence, *, max_new_tokens: int, sampling: SamplingConfig, seed,
                   eos_token_id, max_len: int | None, extra: dict[str, Any] | None = None,
                   token_bucket: int = 0, options: Options | None = None) -> GenerateOutput:
    """Plain autoregressive decoding of every prompt; `extra` is merged into out.stats (token_bucket: see prepare)."""
    req = prepare(target, prompts, max_new_tokens, sampling, eos_token_id, max_len, seed, token_bucket=token_bucket,
                  options=options)
    outputs, compile_s, run_s, run = plain_run(target, req)
    result, steps = plain_result(req, outputs)
    return finish(target, req, result, compile_s, run_s,
                  {"acceptance_length": 1.0, "drafter_calls": 0, "rounds": steps, **(extra or {})},
                  None if run is None else run.rows)
