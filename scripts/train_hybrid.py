"""Train the embedded hybrid (checkpoints/tiny/hybrid): a small Qwen3.5-style target and the MTP layer it ships.

Stages, each resumable (rerun the same command after an interruption; state lives in --run-dir):
  target   a ~4M-parameter Qwen3.5-style hybrid (three Gated DeltaNet layers and one gated
           full-attention layer, zero-centred norms, partial rotary) on next-token cross-entropy over
           the Python standard library's source, with the embedded dense target's tokenizer
           (checkpoints/tiny/target), trained through the serving forward (chunked delta rule)
  data     the target's own greedy continuations of random train-split prompts (the MTP layer's data)
  mtp      one MTP layer in the layout Qwen3.5 ships (`mtp.*`: fc over [embedding, hidden], zero-centred
           fuse norms, one gated attention layer, the target's tied head), reading the target's
           final-normed hidden as vLLM feeds it; soft cross-entropy against the target, also as a
           chain of 2 reusing the layer (specjax.train.mtp)
  export   --out as a specjax checkpoint carrying its MTP layer (params["mtp"]), stored in bf16, and
           record.json: validation loss fp32 vs bf16, the greedy continuations' distinct 4-grams, and
           the MTP layer's greedy tau at chains 1-3 in the real speculative loop (fp32 compute over the
           bf16 weights; every output checked
           equal to plain greedy decoding) on the manifest's held-out prompts

    python scripts/train_hybrid.py        # ~35 min on 2 shared CPU cores

Load it: specjax.embedded("hybrid"); its MTP drafter: specjax.load_drafter(path, target).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from tokenizers import Tokenizer

from specjax.bench.quality import distinct_ngram_ratio
from specjax.config import ModelConfig
from specjax.convert import checkpoint
from specjax.generate import generate
from specjax.loading.drafter import mtp_drafter
from specjax.loading.target import load
from specjax.models.model import init_params
from specjax.models.target import Target
from specjax.train import corpus, data, losses, tiny, trainer
from specjax.train import mtp as tm
from specjax.train.runlog import RunLog

STAGES = ("target", "data", "mtp", "export")
TOKENIZER = Path("checkpoints/tiny/target/tokenizer.json")
HYBRID_HF = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 4096, "hidden_size": 256,
    "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [4, 2, 2]},
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "attention_bias": False, "bos_token_id": tiny.EOT_ID, "eos_token_id": tiny.EOT_ID, "torch_dtype": "float32",
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/hybrid"), help="training state (git-ignored)")
    ap.add_argument("--out", type=Path, default=Path("checkpoints/tiny/hybrid"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--rows", type=int, default=4096, help="target continuations for the MTP layer")
    ap.add_argument("--val-rows", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mtp-steps", type=int, default=1000)
    ap.add_argument("--mtp-lr", type=float, default=3e-3)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8, help="held-out prompts (checkpoints/tiny/manifest.json)")
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--stop-after", choices=STAGES, default="export")
    return ap.parse_args(argv)


def stage_target(args, cfg: ModelConfig, streams, log) -> dict:
    tc = trainer.TrainConfig(steps=args.target_steps, peak_lr=args.target_lr, warmup_steps=50, eval_every=100,
                             ckpt_every=50)
    val = data.batches_of(data.fixed_windows(streams["validation"], args.seq_len, 32), args.batch)
    state = trainer.train(
        args.run_dir / "target", tc, init_params(cfg, jax.random.key(args.seed)), losses.lm_loss(cfg),
        lambda step: data.random_windows(streams["train"], args.seed, step, args.batch, args.seq_len),
        eval_batches=val, desc="hybrid target")
    return trainer.host(state["params"])


def stage_mtp(args, target: Target, pool, log) -> dict:
    cfg = tm.head_config(target.cfg, "qwen3_next")
    n_train = len(pool["tokens"]) - args.val_rows
    train_pool = {"tokens": pool["tokens"][:n_train], "mask": pool["mask"][:n_train]}
    val = tm.sequence_batch(pool["tokens"][n_train:], pool["mask"][n_train:])
    val_batches = [{k: v[i: i + args.batch] for k, v in val.items()} for i in range(0, args.val_rows, args.batch)]
    frozen = tm.frozen_params(target.params, target.cfg)
    tc = trainer.TrainConfig(steps=args.mtp_steps, peak_lr=args.mtp_lr, warmup_steps=50, clip_norm=1.0, b2=0.95,
                             log_every=25, eval_every=500, ckpt_every=100)
    eval_fn = tm.mtp_loss(cfg, steps=max(args.unroll, 2), objective="soft")

    def batch_fn(step):
        b = data.pool_batch(train_pool, args.seed + 7, step, args.batch)
        return tm.sequence_batch(b["tokens"], b["mask"])

    state = trainer.train(args.run_dir / "mtp", tc, tm.init_layer(target.cfg, jax.random.key(args.seed + 8),
                                                                   layout="qwen3_next"),
                          tm.mtp_loss(cfg, steps=args.unroll), batch_fn, eval_batches=val_batches, frozen=frozen,
                          desc="mtp", eval_loss_fn=eval_fn)
    return {"params": trainer.host(state["params"]),
            "validation": trainer.evaluate(eval_fn, state["params"], val_batches, frozen)}


def stage_export(args, cfg, target_params, mtp_layer, streams, log) -> dict:
    # Weights stored in bf16 (half the bytes), run in fp32 by default: `load` casts them to the checkpoint's
    # dtype, so greedy speculative output equals plain decoding exactly (in bf16 compute a near-tie may flip
    # between the verify pass and plain decoding; `load(path, dtype="bfloat16")` runs it that way).
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), {**target_params, "mtp": tm.stored(mtp_layer, "qwen3_next")})
    if args.out.exists():
        shutil.rmtree(args.out)
    bf16 = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), host)
    checkpoint.save(args.out, bf16, dict(HYBRID_HF), dtype="float32", extra_files={"tokenizer.json": TOKENIZER},
                    meta={"source": "scripts/train_hybrid.py", "stored_dtype": "bfloat16"})
    target = load(args.out)
    manifest = json.loads(Path("checkpoints/tiny/manifest.json").read_text())
    prompts = [p["text"] for p in manifest["held_out_prompts"][: args.num_prompts]]
    val = data.batches_of(data.fixed_windows(streams["validation"], args.seq_len, None), args.batch)
    loss32 = trainer.evaluate(losses.lm_loss(cfg), target_params, val)
    loss16 = trainer.evaluate(losses.lm_loss(target.cfg), target.params, val)
    plain = generate(target, prompts, max_new_tokens=args.eval_new_tokens)
    drafter = mtp_drafter(target)
    chains = {}
    for k in (1, 2, 3):
        out = generate(target, prompts, max_new_tokens=args.eval_new_tokens, drafter=drafter, num_draft_tokens=k)
        if out.tokens != plain.tokens:
            raise RuntimeError(f"the MTP chain of {k} changed the greedy output")
        chains[f"chain_{k}"] = {"measured_greedy_tau": float(out.stats["acceptance_length"]),
                                "per_position_acceptance": [float(x) for x in out.stats["per_position_acceptance"]],
                                "outputs_equal_plain_greedy": True}
        log(f"MTP chain of {k}: tau {chains[f'chain_{k}']['measured_greedy_tau']:.3f}")
    record = {
        "command": "python scripts/train_hybrid.py", "config": HYBRID_HF, "stored_dtype": "bfloat16",
        "run_dtype": "float32", "params": cfg.num_params(),
        "bytes": sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()),
        "validation": {"trained_float32_weights": loss32, "stored_bf16_weights": loss16},
        "greedy_distinct_4gram_ratio": float(np.mean([distinct_ngram_ratio(t, 4) for t in plain.tokens])),
        "mtp": {"layout": "qwen3_next (Qwen3.5's mtp.* layer)", "acceptance": chains},
        "held_out_prompts": args.num_prompts, "new_tokens": args.eval_new_tokens,
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=2, default=float))
    log("record: " + json.dumps({k: v for k, v in record.items() if k != "config"}, default=float))
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    run = RunLog(args.run_dir, "train_hybrid")
    log, timed = run.log, run.timed
    cfg = ModelConfig.from_hf(HYBRID_HF)
    tok = Tokenizer.from_file(str(TOKENIZER))
    splits = {s: corpus.load_split(s) for s in corpus.SPLITS}
    streams = {s: data.token_stream(tok, list(splits[s].values())) for s in corpus.SPLITS}
    log(f"hybrid target {cfg.num_params() / 1e6:.2f}M params; tokens: "
        + ", ".join(f"{s} {len(v)}" for s, v in streams.items()))
    start = time.perf_counter()
    target_params = timed("target", stage_target, args, cfg, streams, log)
    if args.stop_after == "target":
        return 0
    target = Target(jax.tree.map(jax.numpy.asarray, target_params), cfg, dict(HYBRID_HF), tok, attn_impl="xla")
    pool = timed("data", data.cached_pool, args.run_dir / "pool.npz", target, lambda: streams["train"],
                 args.seed + 6, args.rows, args.prompt_len, args.new_tokens, log)
    if args.stop_after == "data":
        return 0
    trained = timed("mtp", stage_mtp, args, target, pool, log)
    log("MTP validation: " + ", ".join(f"{k} {v:.4f}" for k, v in trained["validation"].items()))
    if args.stop_after == "mtp":
        return 0
    timed("export", stage_export, args, cfg, target_params, trained["params"], streams, log)
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
