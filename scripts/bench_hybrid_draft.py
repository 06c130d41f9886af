"""A hybrid draft model's chain round, side by side in one process, interleaved, medians:

  specjax     DraftModelDrafter's propose + update: [prev, root] and K-1 one-token passes, each provisional and
              committed at once; per node the DeltaNet results kept; update commits [prev, accepted path] from
              the round's first state (drafters/draft_model.py)
  per-step    the other design: K+1 one-token sequential passes (prev, root, drafts 1..K-1), keeping every
              step's recurrent state and conv window, then each row's at its accepted length
  plain       the per-step design's K+1 one-token passes keeping nothing, as if no draft were ever undone

with the bytes each keeps per row between propose and update. Rows accept 0..K drafts (row b accepts b mod K+1).
specjax runs K passes (its [prev, root] is one two-token pass), the other two K+1: a sequential two-token pass
runs the chunked delta rule padded to a 64-token chunk, and the per-step design needs the state after prev alone.

    python scripts/bench_hybrid_draft.py --out docs/records/bench_hybrid_draft_cpu.json

The model: Qwen3.5-0.8B's layer shapes (hidden 1024, DeltaNet 16 key / 16 value heads of 128 x 128, conv 4,
8 query / 2 kv heads of 256, MLP 3584) with --layers layers (three DeltaNet in four) and a --vocab vocabulary
(the 0.8B's is 248k; its lm_head would dominate a CPU run), random weights, fp32.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from specjax.bench.ar import interleaved_medians
from specjax.config import LinearAttnConfig, ModelConfig, SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.tree import chain
from specjax.decoding.verify import Verdict
from specjax.drafters import DraftModelDrafter
from specjax.models.cache import HybridCache
from specjax.models.model import init_params, merge


def qwen35_08b_like(layers: int, vocab: int) -> ModelConfig:
    types = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))
    return ModelConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=3584, num_layers=layers, num_heads=8,
                       num_kv_heads=2, head_dim=256, qk_norm=True, family="qwen3_5", layer_types=types,
                       linear=LinearAttnConfig(16, 16, 128, 128, conv_kernel=4), partial_rotary_factor=0.25,
                       attn_output_gate=True, norm_offset=True)


def per_step_round(model, cache: HybridCache, prev_B, root_B, k: int, num_accepted_B):
    """K+1 sequential passes keeping every step's state; then each row's after its accepted prefix less one."""
    def step(carry, _):
        c, tok_B = carry
        h_B1D, _, c = model.forward(tok_B[:, None], c)
        c = c.with_lengths(c.lengths + 1)
        nxt_B = jnp.argmax(model.logits(h_B1D)[:, 0], axis=-1).astype(jnp.int32)
        return (c, nxt_B), (c.conv, c.state, tok_B)

    (c, _), (convs, states, _) = lax.scan(step, (cache, prev_B), None, length=k + 1)
    pick_B = jnp.maximum(num_accepted_B - 1, 0)  # the step after the new prev's predecessor: prev + a - 1 nodes
    rows = jnp.arange(prev_B.shape[0])

    def select(stacked_SB):  # [K+1, B, ...] -> [B, ...]
        return stacked_SB[pick_B, rows]

    kept = HybridCache(c.kv.with_lengths(cache.lengths + num_accepted_B), tuple(map(select, convs)),
                       tuple(map(select, states)))
    return kept, (convs, states)


def plain_round(model, cache: HybridCache, prev_B, k: int):
    """The per-step design's K+1 one-token passes, keeping nothing."""
    def step(carry, _):
        c, tok_B = carry
        h_B1D, _, c = model.forward(tok_B[:, None], c)
        return (c.with_lengths(c.lengths + 1), jnp.argmax(model.logits(h_B1D)[:, 0], -1).astype(jnp.int32)), None

    (c, _), _ = lax.scan(step, (cache, prev_B), None, length=k + 1)
    return c


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    cfg = qwen35_08b_like(args.layers, args.vocab)
    params = init_params(cfg, jax.random.key(0))
    k = args.k
    drafter = DraftModelDrafter(cfg, params, attn_impl="xla").configure(
        Settings(chain(k), SamplingConfig(), cache_len=args.context + 2 * k + 2, max_new_tokens=2 * k))
    rows = []
    for b in args.batch:
        prompt_BT = jax.random.randint(jax.random.key(1), (b, args.context), 3, args.vocab, jnp.int32)
        ctx = PrefillContext(prompt_BT, jnp.full((b,), args.context, jnp.int32), prompt_BT[:, 0], ())
        state = jax.jit(drafter.init)(params, ctx)
        root_B, keys_B = prompt_BT[:, 1], jax.random.split(jax.random.key(2), b)
        num_accepted_B = jnp.arange(b, dtype=jnp.int32) % (k + 1) + 1
        path_BN = jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
        path_BN = jnp.where(path_BN < num_accepted_B[:, None], path_BN, 0)

        @jax.jit
        def specjax_round(params, state):
            draft, after = drafter.propose(params, state, root_B, keys_B)
            return drafter.update(params, after, draft, Verdict(path_BN, num_accepted_B, root_B), ()), after

        @jax.jit
        def per_step(params, state):
            return per_step_round(merge(cfg, params), state[0], state[1], root_B, k, num_accepted_B)

        @jax.jit
        def plain(params, state):
            return plain_round(merge(cfg, params), state[0], state[1], k)

        medians = interleaved_medians({"specjax": lambda: specjax_round(params, state)[0],
                                       "per_step": lambda: per_step(params, state)[0],
                                       "plain": lambda: plain(params, state)}, args.repeats)
        _, after = jax.eval_shape(specjax_round, params, state)
        _, (convs, states) = jax.eval_shape(per_step, params, state)
        kept = {"specjax": nbytes(after[0].nodes) / b, "per_step": nbytes((convs, states)) / b}
        row = {"batch": b, "ms": {n: round(s * 1e3, 2) for n, s in medians.items()},
               "kept_bytes_per_row": kept}
        print(json.dumps(row))
        rows.append(row)
    record = {"machine": f"{platform.machine()} {platform.processor() or ''} (this project's 2-core VM, no GPU)",
              "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "vocab": args.vocab,
              "k": k, "context": args.context, "repeats": args.repeats, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
