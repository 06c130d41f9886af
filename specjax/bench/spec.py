"""Speculative decoding benchmark: plain decoding vs each drafter, and a replay sweep.

Part 1, drafters: for each batch size, plain greedy decoding and each drafter on the same
prompts; tau, per-position acceptance, tokens/s, speedup over plain decoding and agreement
with plain decoding, all measured side by side in one run (median of repeats, compile
excluded and reported separately). Two sources of models:

- a checkpoint pair (default: the embedded tiny target and draft): draft model chain and
  tree, n-gram;
- `--preset` (tiny20m, 300m, 8b from bench_ar): a random target and a random smaller draft
  model with the same vocabulary (8b drafts with Llama-3.2-1B shapes), random prompt ids,
  EOS disabled: draft model chain (random weights accept little, so these rows measure
  cost and agreement) and the replay drafter at a set acceptance (these rows measure the
  speedup that acceptance buys). bf16 on GPU; the 8b preset refuses to run on CPU.

Agreement: in fp32 a speculative output that differs from plain greedy decoding raises
(a bug); in bf16/fp16 a near-tie may flip between the verify pass and plain decoding, so
the match rate and first divergence are reported (see specjax/bench/agreement.py).

Part 2, replay sweep: the `replay` benchmarking drafter proposes the target's own
continuation corrupted at a chosen rate, so acceptance is controlled; sweeping
acceptance rate x draft length x batch size shows where speculation stops paying on
the machine it runs on (drafting is free there, so this is the verify side's cost).

Used by `scripts/bench.py spec`; prints tables and writes JSON (--out), rewritten after
every row so a run cut short by a timeout still leaves its finished rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

from specjax.bench.agreement import check_agreement
from specjax.bench.ar import GPU_PRESETS, PRESETS, machine_info, random_prompts
from specjax.bench.stand_in_tokenizer import stand_in_tokenizer
from specjax.config import ModelConfig
from specjax.drafters import DraftModelDrafter, MtpDrafter, NgramDrafter, mtp, replay_drafter
from specjax.generate import generate
from specjax.loading.drafter import load_drafter
from specjax.loading.embedded import EMBEDDED_DIR
from specjax.loading.prompts import bench_prompts
from specjax.loading.target import load
from specjax.models.model import init_params
from specjax.models.state import to_params
from specjax.models.target import Target

DEFAULT_TARGET = EMBEDDED_DIR / "target"
DEFAULT_DRAFT = DEFAULT_TARGET.parent / "draft"

# Draft models for the random presets: same vocabulary as the target, far fewer parameters.
_LLAMA32_1B = {**PRESETS["8b"], "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True}
_TINY_DRAFT = {**PRESETS["tiny20m"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1}
# Qwen3-0.6B's shapes on Qwen3.5's vocabulary: a dense draft model for the hybrid target.
_QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 248320, "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
DRAFT_PRESETS: dict[str, dict[str, Any]] = {"8b": _LLAMA32_1B, "300m": PRESETS["tiny20m"], "tiny20m": _TINY_DRAFT,
                                            "qwen35_9b": _QWEN3_06B}

# A method: given plain decoding's result at this batch, the drafter and generate() kwargs to run.
Method = Callable[[dict], tuple[Any, dict]]


@dataclasses.dataclass
class BenchRun:
    """What every measurement shares: the target, how prompts are made, lengths, extra generate() kwargs."""

    target: Target
    prompts_for: Callable[[int, int], list]  # (batch, seed) -> prompts
    max_new: int
    repeats: int
    log: Callable[[str], None] = print
    gen_kwargs: dict = dataclasses.field(default_factory=dict)
    on_row: Callable[[], None] = lambda: None  # called after each finished row (saves partial JSON)

    def generate(self, prompts: list, **kwargs) -> dict[str, Any]:
        """Warm-up + median of `repeats` calls of generate() on these prompts."""
        return timed(lambda: generate(self.target, prompts, max_new_tokens=self.max_new, **self.gen_kwargs,
                                      **kwargs), self.repeats)


def timed(run: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """One warm-up call (compiles), then the median of `repeats` calls."""
    first = run()
    outs = [run() for _ in range(repeats)]
    tps = [o.stats["tokens_per_s"] for o in outs]
    stats = dict(outs[-1].stats)
    stats.update(tokens_per_s=statistics.median(tps), tokens_per_s_all=tps, compile_s=first.stats["compile_s"])
    return {"tokens": outs[-1].tokens, "stats": stats}


def run_drafters(run: BenchRun, methods: dict[str, Method], batches: list[int], rows: list) -> list[dict[str, Any]]:
    """Plain decoding, then each method, per batch size; rows are appended to `rows` as they finish."""
    for b in batches:
        prompts = run.prompts_for(b, 0)
        base = run.generate(prompts)
        _add_row(run, rows, dict(batch=b, method="plain", **_summary(base, base), match_rate=1.0,
                                 first_divergence=None), _row_text)
        for name, make in methods.items():
            drafter, kwargs = make(base)
            res = run.generate(prompts, drafter=drafter, **kwargs)
            agreement = check_agreement(base["tokens"], res["tokens"], run.target.cfg.dtype, f"{name} at batch {b}")
            _add_row(run, rows, dict(batch=b, method=name, **_summary(res, base), **agreement.as_dict()), _row_text)
    return rows


def run_replay_sweep(run: BenchRun, batches: list[int], ks: list[int], accepts: list[float],
                     rows: list) -> list[dict[str, Any]]:
    """Replay drafter over draft length x acceptance rate, per batch size; speedup over plain decoding."""
    for b in batches:
        prompts = run.prompts_for(b, 1)
        base = run.generate(prompts)
        for k in ks:
            for a in accepts:
                res = run.generate(prompts, drafter=replay(run.target, base, a), num_draft_tokens=k)
                agreement = check_agreement(base["tokens"], res["tokens"], run.target.cfg.dtype,
                                            f"replay K={k} accept {a} at batch {b}")
                _add_row(run, rows, dict(batch=b, k=k, accept_rate=a, **_summary(res, base), **agreement.as_dict()),
                         _sweep_text)
    return rows


def replay(target: Target, base: dict, accept: float):
    """A replay drafter proposing plain decoding's own tokens, each right with probability `accept`."""
    return replay_drafter(base["tokens"], target.cfg.vocab_size, corrupt_prob=1.0 - accept)


def _add_row(run: BenchRun, rows: list, row: dict, text: Callable[[dict], str]) -> None:
    rows.append(row)
    run.log(text(row))
    run.on_row()


def _summary(res: dict, base: dict) -> dict[str, Any]:
    s = res["stats"]
    return dict(tau=s["acceptance_length"], per_position=[round(x, 3) for x in s.get("per_position_acceptance", [])],
                tokens_per_s=s["tokens_per_s"], speedup=s["tokens_per_s"] / base["stats"]["tokens_per_s"],
                compile_s=s["compile_s"], rounds=s["rounds"], drafter_calls=s["drafter_calls"])


def _row_text(r: dict) -> str:
    pos = " ".join(f"{x:.2f}" for x in r["per_position"])
    return (f"| {r['batch']:5d} | {r['method']:<20} | {r['tau']:5.2f} | {r['tokens_per_s']:9.1f} | "
            f"{r['speedup']:6.2f}x | {r['compile_s']:6.1f} | {_match_text(r)} | {pos}")


def _sweep_text(r: dict) -> str:
    return (f"replay batch {r['batch']:3d} K {r['k']:2d} accept {r['accept_rate']:.2f}: tau {r['tau']:.2f} "
            f"speedup {r['speedup']:.2f}x match {_match_text(r)}")


def _match_text(r: dict) -> str:
    """'100.0%', or '97.5% (row 1 pos 12)' naming the first divergence."""
    div = r.get("first_divergence")
    where = "" if div is None else f" (row {div['row']} pos {div['position']})"
    return f"{r['match_rate']:.1%}{where}"


def format_tables(result: dict[str, Any]) -> str:
    """Plain-text tables of one run: drafters vs plain, then the replay sweep when there is one."""
    lines = [f"{result['dtype']}, {result['max_new_tokens']} new tokens, median of {result['repeats']}, "
             f"jax on {result['machine']['device']}",
             "| batch | method               |   tau |     tok/s | speedup | compile s | match "
             "| per-position acceptance",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_row_text(r) for r in result["drafters"]]
    sweep = result.get("replay_sweep") or []
    if sweep:
        accepts = sorted({r["accept_rate"] for r in sweep})
        lines += ["", "replay sweep: speedup over plain decoding (tau in brackets)",
                  "| batch | K | " + " | ".join(f"accept {a:.2f}" for a in accepts) + " |",
                  "|---|---|" + "---|" * len(accepts)]
        for b in sorted({r["batch"] for r in sweep}):
            for k in sorted({r["k"] for r in sweep}):
                cells = [next(r for r in sweep if (r["batch"], r["k"], r["accept_rate"]) == (b, k, a))
                         for a in accepts]
                lines.append(f"| {b} | {k} | " + " | ".join(f"{c['speedup']:.2f}x ({c['tau']:.2f})" for c in cells)
                             + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- model sources


def preset_pair(preset: str, dtype: str | None, seed: int, attn_impl: str) -> tuple[Target, DraftModelDrafter]:
    """A random target of `preset` and a random draft model of DRAFT_PRESETS[preset], built on the device."""
    if preset not in DRAFT_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(DRAFT_PRESETS)}")
    if preset in GPU_PRESETS and jax.default_backend() != "gpu":
        raise ValueError(f"the {preset} preset needs a GPU, but JAX's backend is {jax.default_backend()!r}; "
                         f"on CPU use --preset tiny20m or --preset 300m")
    dtype = dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    target = random_model(PRESETS[preset], dtype, seed, attn_impl)
    draft = random_model(DRAFT_PRESETS[preset], dtype, seed + 1, attn_impl)
    return target, DraftModelDrafter(draft.cfg, draft.params, attn_impl=draft.attn_impl)


def random_model(hf_config: dict[str, Any], dtype: str, seed: int, attn_impl: str) -> Target:
    """Random params for a Hugging Face config dict, as a Target (the layout load() would give), with a stand-in
    tokenizer over its vocabulary (bench/stand_in_tokenizer.py) so it can be served and streamed as text."""
    cfg = ModelConfig.from_hf(hf_config, dtype=dtype)
    params = jax.block_until_ready(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed)))
    # BOS and EOS are special; a shrunk preset (moe_cpu) keeps its family's ids past its vocabulary: left out.
    special = {i for i in (cfg.bos_token_id, *cfg.eos_token_ids) if i is not None and 0 <= i < cfg.vocab_size}
    return Target(params, cfg, hf_config=dict(hf_config), tokenizer=stand_in_tokenizer(cfg.vocab_size, special),
                  attn_impl=attn_impl)


def preset_methods(target: Target, draft: DraftModelDrafter, k: int, tree: str | None,
                   accept: float) -> dict[str, Method]:
    """Draft model chain of k (and a tree when asked), and the replay drafter at `accept` with chains of k."""
    methods: dict[str, Method] = {f"draft chain:{k}": lambda base: (draft, {"num_draft_tokens": k})}
    if tree:
        methods[f"draft {tree}"] = lambda base: (draft, {"tree": tree})
    methods[f"replay chain:{k} @{accept:.2f}"] = lambda base: (replay(target, base, accept), {"num_draft_tokens": k})
    if target.cfg.is_hybrid:  # the MTP layer the hybrid checkpoints ship, random here: its cost per round
        head = random_mtp(target)
        methods[f"mtp chain:{k}"] = lambda base: (head, {"num_draft_tokens": k})
    return methods


def random_mtp(target: Target, seed: int = 2) -> MtpDrafter:
    """One random Qwen3.5-layout MTP layer on `target`, sharing its embedding and lm_head."""
    cfg = mtp.MtpConfig("qwen3_next", 1, target.cfg)
    params = to_params(mtp.MtpHead(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))))
    params["embed"] = target.params["embed"]
    if "lm_head" in target.params:
        params["lm_head"] = target.params["lm_head"]
    return MtpDrafter(cfg, params, attn_impl=target.attn_impl)


def checkpoint_methods(target: Target, draft_dir: str, k: int, tree: str) -> dict[str, Method]:
    """Draft model chain and tree (when a draft checkpoint is given), and n-gram lookup."""
    methods: dict[str, Method] = {}
    if draft_dir:
        draft = load_drafter(draft_dir, target)
        methods[f"draft chain:{k}"] = lambda base: (draft, {"num_draft_tokens": k})
        if tree:
            methods[f"draft {tree}"] = lambda base: (draft, {"tree": tree})
    methods[f"ngram chain:{k}"] = lambda base: (NgramDrafter(), {"num_draft_tokens": k})
    return methods


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `spec` subcommand's options (scripts/bench.py registers them)."""
    parser.add_argument("--preset", choices=sorted(DRAFT_PRESETS), default=None,
                        help="random target + random draft model of bench_ar's preset shapes (8b: GPU only) "
                             "instead of checkpoints")
    parser.add_argument("--target", default=None, help="target checkpoint (default: embedded tiny)")
    parser.add_argument("--draft", default=None, help="draft-model checkpoint (default: embedded tiny; '' to skip)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: the checkpoint's; presets: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--batches", default=None, help="default: 1,4,16 (checkpoints), 1,8,64 (presets)")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--tree", default=None,
                        help="tree for a draft-model tree row (default: kary:2,2,1 with checkpoints, none with "
                             "presets; '' to skip)")
    parser.add_argument("--replay-accept", type=float, default=0.8, help="presets: the replay rows' acceptance")
    parser.add_argument("--prompt-len", type=int, default=64, help="presets: random prompt length")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="also run the replay sweep")
    parser.add_argument("--sweep-k", default="1,2,4,8")
    parser.add_argument("--sweep-accept", default="0.3,0.6,0.9")
    parser.add_argument("--sweep-batches", default="1,4,16")
    parser.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    parser.add_argument("--out", default=None, help="write the JSON result here")


def _ints(s: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 1,8,64, got {s!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers like 1,8,64, got {s!r}")
    return values


def validate(args: argparse.Namespace) -> None:
    """Refuse contradictory or out-of-range options before building anything."""
    if args.preset and (args.target is not None or args.draft is not None):
        raise ValueError("--preset builds a random target and draft model; drop --target/--draft, or drop --preset "
                         "to benchmark checkpoints")
    if not 0.0 <= args.replay_accept <= 1.0:
        raise ValueError(f"--replay-accept is a probability in [0, 1], got {args.replay_accept}")
    if args.num_draft_tokens < 1 or args.max_new_tokens < 1 or args.repeats < 1 or args.prompt_len < 1:
        raise ValueError("--num-draft-tokens, --max-new-tokens, --repeats and --prompt-len must all be >= 1")


def build(args: argparse.Namespace) -> tuple[Target, dict[str, Method], dict[str, Any], Callable]:
    """(target, methods, result header, prompts_for) for the preset or checkpoint mode."""
    k = args.num_draft_tokens
    if args.preset:
        target, draft = preset_pair(args.preset, args.dtype, args.seed, args.attn_impl)
        vocab, plen = target.cfg.vocab_size, args.prompt_len
        prompts_for = lambda b, s: random_prompts(b, plen, vocab, args.seed + 1000 * s + b).tolist()  # noqa: E731
        head = {"preset": args.preset, "draft_preset": DRAFT_PRESETS[args.preset],
                "draft_params": draft.cfg.num_params(), "prompt_len": plen, "replay_accept": args.replay_accept}
        return target, preset_methods(target, draft, k, args.tree, args.replay_accept), head, prompts_for
    target_dir = args.target or str(DEFAULT_TARGET)
    draft_dir = str(DEFAULT_DRAFT) if args.draft is None else args.draft
    target = load(target_dir, dtype=args.dtype, attn_impl=args.attn_impl)
    tree = "kary:2,2,1" if args.tree is None else args.tree
    prompts_for = lambda b, s: bench_prompts(target, b, seed=s)  # noqa: E731
    return target, checkpoint_methods(target, draft_dir, k, tree), {"target": target_dir, "draft": draft_dir}, \
        prompts_for


def main(args: argparse.Namespace) -> int:
    """Run `spec` from parsed arguments: print the tables, write JSON when --out is given."""
    validate(args)
    batches = _ints(args.batches or ("1,8,64" if args.preset else "1,4,16"), "--batches")
    target, methods, head, prompts_for = build(args)
    result: dict[str, Any] = {"benchmark": "spec", "machine": machine_info(), **head, "dtype": str(target.cfg.dtype),
                              "target_params": target.cfg.num_params(), "max_new_tokens": args.max_new_tokens,
                              "repeats": args.repeats, "drafters": []}
    save = (lambda: write_json(result, Path(args.out))) if args.out else (lambda: None)
    run = BenchRun(target, prompts_for, args.max_new_tokens, args.repeats, log=lambda m: print(m, flush=True),
                   gen_kwargs={"eos_token_id": []} if args.preset else {}, on_row=save)
    print(f"target {head.get('preset') or head.get('target')}: {target.cfg.num_params() / 1e6:.2f}M params, "
          f"{target.cfg.dtype}, on {result['machine']}", flush=True)
    run_drafters(run, methods, batches, result["drafters"])
    if args.sweep:
        result["replay_sweep"] = []
        run_replay_sweep(run, _ints(args.sweep_batches, "--sweep-batches"), _ints(args.sweep_k, "--sweep-k"),
                         [float(a) for a in args.sweep_accept.split(",")], result["replay_sweep"])
    print(format_tables(result))
    if args.out:
        save()
        print(f"wrote {args.out}")
    return 0


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the result (so far) as JSON, creating the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
