"""Benchmarks of the hybrid (Qwen3.5) path, side by side in one process, interleaved, medians:

  prefill   one Gated DeltaNet layer's delta rule over 1k / 4k tokens: the chunked (WY/UT) form
            against the token-by-token recurrence (lax.scan), and the model's prefill
  verify    a draft tree's DeltaNet pass + commit: the masked block with a rank-n commit along the
            accepted path (specjax) against keeping a recurrent state per node (scan over nodes
            along parents, commit picks the slot: vLLM's one-slot-per-draft-position design),
            at 16 and 64 nodes, with the bytes each keeps per row
  plain     plain greedy decoding of a random Qwen3.5 model: specjax against transformers'
            Qwen3_5ForCausalLM on the same weights (torch fallbacks, CPU)

    python scripts/bench_hybrid.py --out runs/bench_hybrid.json

Dimensions default to Qwen3.5-0.8B's DeltaNet (16 key heads, 16 value heads, 128 x 128); --value-heads 32
gives the 9B's. Single runs on a shared 2-core machine vary by +-25%: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from specjax.bench.ar import interleaved_medians  # noqa: E402
from specjax.decoding.tree import ancestor_mask, parse_tree, spec_arrays  # noqa: E402
from specjax.models import gdn  # noqa: E402


def rule_inputs(b, t, heads, dk, dv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = gdn.l2_normalize(jax.random.normal(ks[0], (b, t, heads, dk))) * dk ** -0.5
    k = gdn.l2_normalize(jax.random.normal(ks[1], (b, t, heads, dk)))
    v = jax.random.normal(ks[2], (b, t, heads, dv))
    g = -0.3 * jnp.abs(jax.random.normal(ks[3], (b, t, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, heads)))
    return q, k, v, g, beta, jnp.zeros((b, heads, dk, dv), jnp.float32)


def recurrent_sequence(q, k, v, g, beta, s0):
    """The recurrence token by token under lax.scan (the form transformers uses for decoding)."""
    def body(state, xs):
        o, state = gdn.recurrent_step(*xs, state)
        return state, o
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, o = lax.scan(body, s0, xs)
    return jnp.moveaxis(o, 0, 1), state


def bench_prefill(args) -> dict:
    out = {}
    for t in (1024, 4096):
        inputs = rule_inputs(1, t, args.value_heads, args.dk, args.dv)
        chunked = jax.jit(gdn.chunked_rule)
        recurrent = jax.jit(recurrent_sequence)
        got = interleaved_medians({"chunked": lambda: chunked(*inputs), "recurrent": lambda: recurrent(*inputs)},
                           args.repeats)
        err = float(jnp.max(jnp.abs(chunked(*inputs)[0] - recurrent(*inputs)[0])))
        out[str(t)] = {**got, "recurrent_over_chunked": got["recurrent"] / got["chunked"], "max_abs_diff": err}
        print(f"prefill {t:5d} tokens, one layer: chunked {got['chunked'] * 1e3:8.1f} ms, recurrent "
              f"{got['recurrent'] * 1e3:8.1f} ms ({got['recurrent'] / got['chunked']:.1f}x), max |diff| {err:.1e}")
    return out


def per_node_states(q, k, v, g, beta, s0, parents_BN):
    """The alternative: each node's state from its parent's (scan over nodes), all N states kept."""
    b, n = parents_BN.shape
    states = jnp.zeros((n, *s0.shape), s0.dtype)

    def body(states, i):
        parent = parents_BN[:, i]  # the template's parents are the same in every row
        prev = jnp.where((parent >= 0)[:, None, None, None], states[jnp.maximum(parent, 0), jnp.arange(b)], s0)
        o, new = gdn.recurrent_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], prev)
        return states.at[i].set(new), o

    states, o = lax.scan(body, states, jnp.arange(n))
    return jnp.moveaxis(o, 0, 1), states


def bench_verify(args) -> dict:
    out = {}
    heads, dk, dv = args.value_heads, args.dk, args.dv
    for nodes, tree in ((16, "chain:15"), (64, "chain:63")):
        spec = parse_tree(tree, None)
        parents = spec_arrays(spec, args.batch)
        mask = ancestor_mask(parents)
        inputs = rule_inputs(args.batch, nodes, heads, dk, dv, seed=1)
        num = jnp.full((args.batch,), nodes // 2, jnp.int32)
        on_path = jnp.arange(nodes)[None, :] < num[:, None]

        @jax.jit
        def masked_then_commit(q, k, v, g, beta, s0):
            o, v_new, cum = gdn.masked_block(q, k, v, g, beta, s0, mask)
            k_bh = k.transpose(0, 2, 1, 3)
            cum_end = jnp.take_along_axis(cum, (num - 1)[:, None, None], axis=2)[..., 0]
            return o, gdn.state_along_path(s0, k_bh, v_new, cum, on_path, cum_end)

        @jax.jit
        def states_then_pick(q, k, v, g, beta, s0):
            o, states = per_node_states(q, k, v, g, beta, s0, parents)
            return o, states[num - 1, jnp.arange(args.batch)]

        got = interleaved_medians({"masked_block": lambda: masked_then_commit(*inputs),
                            "state_per_node": lambda: states_then_pick(*inputs)}, args.repeats)
        a, b = masked_then_commit(*inputs), states_then_pick(*inputs)
        err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))
        kept_ours = nodes * heads * (dk + dv + 1) * 4  # k, v_new, cum per node (+ the conv input, not timed here)
        kept_states = nodes * heads * dk * dv * 4
        out[str(nodes)] = {**got, "state_per_node_over_masked": got["state_per_node"] / got["masked_block"],
                           "bytes_kept_per_row_per_layer": {"masked_block": kept_ours, "state_per_node": kept_states},
                           "max_abs_diff": err}
        print(f"verify {nodes:3d} nodes x batch {args.batch}, one layer: masked block + commit "
              f"{got['masked_block'] * 1e3:7.2f} ms, state per node {got['state_per_node'] * 1e3:7.2f} ms "
              f"({got['state_per_node'] / got['masked_block']:.1f}x); kept per row {kept_ours / 2**20:.2f} MiB vs "
              f"{kept_states / 2**20:.1f} MiB; max |diff| {err:.1e}")
    return out


def bench_plain(args) -> dict:
    import torch
    from hf_tiny import build_qwen35, save_hf_model

    import specjax

    dims = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=32, linear_value_head_dim=32)
    hf = build_qwen35("causal_lm", **dims)
    target = specjax.load(save_hf_model(hf, Path(tempfile.mkdtemp())))
    prompt = np.random.default_rng(0).integers(3, dims["vocab_size"], size=64).tolist()
    new = args.new_tokens
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(prompt):].tolist()
    ours = specjax.generate(target, [prompt], max_new_tokens=new, eos_token_id=[])
    assert ours.tokens[0] == ref, "specjax and transformers disagree on greedy decoding"
    torch.set_num_threads(2)

    def run_hf():
        with torch.no_grad():
            hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=0)

    def run_ours():
        return specjax.generate(target, [prompt], max_new_tokens=new, eos_token_id=[]).tokens

    times = {"specjax": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("specjax", run_ours), ("transformers", run_hf)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    got = {k: float(np.median(v)) for k, v in times.items()}
    print(f"plain greedy, random Qwen3.5 {target.cfg.num_params() / 1e6:.1f}M, 64-token prompt, {new} new: specjax "
          f"{got['specjax'] * 1e3:.0f} ms, transformers {got['transformers'] * 1e3:.0f} ms "
          f"({got['transformers'] / got['specjax']:.1f}x); outputs equal")
    return {**got, "transformers_over_specjax": got["transformers"] / got["specjax"], "params": target.cfg.num_params(),
            "new_tokens": new, "outputs_equal": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--value-heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only", choices=("prefill", "verify", "plain"), nargs="*")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sections = args.only or ["prefill", "verify", "plain"]
    result = {"machine": f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} device(s)",
              "settings": {k: v for k, v in vars(args).items() if k != "out" and v is not None}}
    for name in sections:
        result[name] = {"prefill": bench_prefill, "verify": bench_verify, "plain": bench_plain}[name](args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
