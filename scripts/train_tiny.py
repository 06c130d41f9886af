"""Train the embedded default models (checkpoints/tiny/) on the Python standard library's source.

Stages, each resumable (rerun the same command after an interruption):
  tokenizer  byte-level BPE (4096) on the train split
  target     a ~4M-parameter Llama on next-token cross-entropy
  draft      a ~0.9M-parameter Llama distilled from the target (KL to its logits)
  export     evaluation, checkpoints/tiny/{target,draft}, manifest.json, eval_slice.json
Training state lives in --run-dir (git-ignored); only the final models go to --out.

    python scripts/train_tiny.py                      # everything: ~23 min on 2 shared CPU cores
    python scripts/train_tiny.py --stop-after target  # one stage at a time
    python scripts/train_tiny.py --stop-after draft --draft-data generated
        # the alternative draft (KL on the target's greedy continuations); export records its tau too
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

from specjax.bench.quality import distinct_ngram_ratio
from specjax.convert import checkpoint
from specjax.models.model import init_params
from specjax.train import corpus, data, losses, tiny, trainer
from specjax.train.model import train_logits
from specjax.train.runlog import RunLog
from specjax.train.tokenizer import eot_id, train_tokenizer

STAGES = ("tokenizer", "target", "draft", "export")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/tiny"), help="training state (git-ignored)")
    ap.add_argument("--out", type=Path, default=Path("checkpoints/tiny"), help="where the final models go")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--draft-data", choices=("corpus", "generated"), default="corpus",
                    help="distil on corpus windows, or on a pool of the target's greedy continuations")
    ap.add_argument("--pool-rows", type=int, default=512, help="continuations in the generated pool")
    ap.add_argument("--draft-ce-weight", type=float, default=0.0, help="label cross-entropy added to the KL")
    ap.add_argument("--num-prompts", type=int, default=8, help="held-out prompts from the test split")
    ap.add_argument("--new-tokens", type=int, default=64, help="continuation length for acceptance estimates")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="K for acceptance estimates")
    ap.add_argument("--stop-after", choices=STAGES, default="export")
    return ap.parse_args(argv)


def stage_tokenizer(args, splits: dict[str, dict[str, str]]) -> Tokenizer:
    path = args.run_dir / "tokenizer.json"
    if not path.is_file():
        tok = train_tokenizer(splits["train"].values(), vocab_size=args.vocab_size)
        if eot_id(tok) != tiny.EOT_ID:
            raise RuntimeError(f"<|endoftext|> got id {eot_id(tok)}, expected {tiny.EOT_ID}")
        tok.save(str(path))
    return Tokenizer.from_file(str(path))


def eval_batches(stream_N: np.ndarray, args, count: int | None) -> list[dict]:
    return data.batches_of(data.fixed_windows(stream_N, args.seq_len, count), args.batch)


def stage_target(args, streams, log) -> dict:
    cfg = tiny.model_config(tiny.TARGET_HF)
    tc = trainer.TrainConfig(steps=args.target_steps, peak_lr=args.target_lr, warmup_steps=50, eval_every=100,
                             ckpt_every=50)
    start = time.perf_counter()
    state = trainer.train(
        args.run_dir / "target", tc, init_params(cfg, jax.random.key(args.seed)), losses.lm_loss(cfg),
        lambda step: data.random_windows(streams["train"], args.seed, step, args.batch, args.seq_len),
        eval_batches=eval_batches(streams["validation"], args, 32), desc="target")
    log(f"target: {tc.steps} steps, this run {time.perf_counter() - start:.0f} s")
    return trainer.host(state["params"])


def stage_draft(args, streams, target_params, log) -> dict:
    cfg = tiny.model_config(tiny.DRAFT_HF)
    target_cfg = tiny.model_config(tiny.TARGET_HF)
    tc = trainer.TrainConfig(steps=args.draft_steps, peak_lr=args.draft_lr, warmup_steps=50, eval_every=100,
                             ckpt_every=50)
    start = time.perf_counter()
    if args.draft_data == "corpus":
        def batch_fn(step):
            return data.random_windows(streams["train"], args.seed + 1, step, args.batch, args.seq_len)
    else:
        pool = generated_pool(args, streams, target_params, log)

        def batch_fn(step):  # KL at every position: prompt (corpus) and continuation (on-policy) alike
            return {"tokens": data.pool_batch(pool, args.seed + 1, step, args.batch)["tokens"]}
    state = trainer.train(
        draft_run_dir(args), tc, init_params(cfg, jax.random.key(args.seed + 1)),
        losses.distill_loss(cfg, target_cfg, ce_weight=args.draft_ce_weight), batch_fn,
        eval_batches=eval_batches(streams["validation"], args, 32), frozen=jax.tree.map(np.asarray, target_params),
        desc="draft")
    log(f"draft: {tc.steps} steps, this run {time.perf_counter() - start:.0f} s")
    return trainer.host(state["params"])


def restore_params(run_dir: Path) -> dict:
    """Final params of a finished training run (its latest orbax checkpoint)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with trainer.checkpoint_manager(run_dir, trainer.TrainConfig(steps=0)) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint; run its training stage first")
        return trainer.host(mgr.restore(step, args=ocp.args.StandardRestore())["params"])


def draft_run_dir(args) -> Path:
    return args.run_dir / ("draft" if args.draft_data == "corpus" else "draft-generated")


def generated_pool(args, streams, target_params, log) -> dict[str, np.ndarray]:
    """The target's greedy continuations of random train-split prompts (64 + seq_len-64 tokens), cached."""
    from specjax.models.target import Target  # noqa: PLC0415

    path = args.run_dir / "generated_pool.npz"
    if path.is_file():
        return dict(np.load(path))
    start = time.perf_counter()
    target_cfg = tiny.model_config(tiny.TARGET_HF)
    target = Target(jax.tree.map(jax.numpy.asarray, target_params), target_cfg, tiny.TARGET_HF, attn_impl="xla")
    pool = data.continuation_pool(target, streams["train"], args.seed + 2, args.pool_rows, 64, args.seq_len - 64)
    np.savez(path, **pool)
    log(f"generated pool: {args.pool_rows} x {args.seq_len} tokens in {time.perf_counter() - start:.0f} s")
    return pool


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def continuation_agreement(target_params, draft_params, prompts_ids: list[list[int]], new_tokens: int
                           ) -> tuple[list[np.ndarray], list[list[int]]]:
    """The target's greedy continuation of each prompt, and the draft's teacher-forced top-1 agreement on it."""
    from specjax.models.target import Target  # noqa: PLC0415

    target_cfg, draft_cfg = tiny.model_config(tiny.TARGET_HF), tiny.model_config(tiny.DRAFT_HF)
    target = Target(jax.tree.map(jax.numpy.asarray, target_params), target_cfg, tiny.TARGET_HF, attn_impl="xla")
    agree, outs = [], []
    for ids in prompts_ids:  # one at a time: prompts differ in length and EOS may stop a row early
        batch = data.continuations(target, [ids], new_tokens)
        new = batch["tokens"][0, len(ids):].tolist()
        tokens_1S = np.asarray([ids + new], np.int32)
        t_logits = np.asarray(train_logits(target_params, target_cfg, tokens_1S[:, :-1]))
        d_logits = np.asarray(train_logits(draft_params, draft_cfg, tokens_1S[:, :-1]))
        sl = slice(len(ids) - 1, None)  # the positions that predict generated tokens
        agree.append(d_logits[0, sl].argmax(-1) == tokens_1S[0, len(ids):])
        if not np.array_equal(t_logits[0, sl].argmax(-1), tokens_1S[0, len(ids):]):
            print("note: train forward and decode disagree on a greedy token (float ties)", file=sys.stderr)
        outs.append(new)
    return agree, outs


def measure_tau(out: Path, prompts: list[str], args) -> dict | None:
    """Greedy acceptance length of the real speculative loop, when specjax has one (else None)."""
    import specjax  # noqa: PLC0415

    if not hasattr(specjax, "load_drafter"):
        return None
    target = specjax.load(out / "target")
    drafter = specjax.load_drafter(out / "draft", target)
    res = specjax.generate(target, prompts, max_new_tokens=args.new_tokens, drafter=drafter,
                           num_draft_tokens=args.num_draft_tokens)
    return {"measured_greedy_tau": float(res.stats["acceptance_length"]),
            "measured_with": "specjax.generate(target, held_out_prompts, max_new_tokens, drafter=load_drafter("
                             "draft), num_draft_tokens)"}


def stage_export(args, splits, streams, tok, target_params, draft_params, log, wall_s: dict) -> None:
    target_cfg, draft_cfg = tiny.model_config(tiny.TARGET_HF), tiny.model_config(tiny.DRAFT_HF)
    lm_t, lm_d = losses.lm_loss(target_cfg), losses.lm_loss(draft_cfg)
    distill = losses.distill_loss(draft_cfg, target_cfg)
    val_all = eval_batches(streams["validation"], args, None)
    full = {
        "target": trainer.evaluate(lm_t, target_params, val_all),
        "draft": trainer.evaluate(lm_d, draft_params, val_all),
        "draft_vs_target": trainer.evaluate(distill, draft_params, val_all, target_params),
    }
    log("full validation: " + json.dumps(full))
    slice_WT = data.fixed_windows(streams["validation"], 128, 8)
    slice_loss = {"target": trainer.evaluate(lm_t, target_params, [{"tokens": slice_WT}])["ce"],
                  "draft": trainer.evaluate(lm_d, draft_params, [{"tokens": slice_WT}])["ce"]}
    unigram = np.bincount(streams["train"], minlength=args.vocab_size) + 1.0
    unigram = unigram / unigram.sum()
    counts = np.bincount(streams["validation"], minlength=args.vocab_size)
    unigram_ce = float(-(counts * np.log(unigram)).sum() / counts.sum())

    prompts = tiny.held_out_prompts(splits["test"], args.num_prompts)
    prompt_ids = [tok.encode(p["text"]).ids for p in prompts]
    agree, outs = continuation_agreement(target_params, draft_params, prompt_ids, args.new_tokens)
    taus = [tiny.greedy_tau(a, args.num_draft_tokens) for a in agree]
    sim_tau = sum(t * r for t, r in taus) / sum(r for _, r in taus)
    cont_agree = float(np.concatenate(agree).mean())
    log(f"held-out continuations: teacher-forced agreement {cont_agree:.3f}, implied greedy tau (K="
        f"{args.num_draft_tokens}) {sim_tau:.3f}")

    alternatives = {}  # the other draft-data choice, when its run exists, for the record
    for run in ("draft", "draft-generated"):
        if run != draft_run_dir(args).name and (args.run_dir / run / "checkpoints").is_dir():
            alt_agree, _ = continuation_agreement(target_params, restore_params(args.run_dir / run), prompt_ids,
                                                  args.new_tokens)
            alt_taus = [tiny.greedy_tau(a, args.num_draft_tokens) for a in alt_agree]
            alternatives[run] = {
                "teacher_forced_top1_agreement_continuations": float(np.concatenate(alt_agree).mean()),
                "implied_greedy_tau": sum(t * r for t, r in alt_taus) / sum(r for _, r in alt_taus)}
            log(f"alternative {run}: " + json.dumps(alternatives[run]))

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok_path = args.run_dir / "tokenizer.json"
    for name, params, hf in (("target", target_params, tiny.TARGET_HF), ("draft", draft_params, tiny.DRAFT_HF)):
        checkpoint.save(out / name, params, hf, dtype="float32", extra_files={"tokenizer.json": tok_path},
                        meta={"source": "scripts/train_tiny.py"}, overwrite=True)
    for stray in out.glob(".*.tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    (out / "eval_slice.json").write_text(json.dumps({
        "rule": "validation stream (files of the validation split in path order, each led by <|endoftext|>), "
                "windows i*128 .. i*128+128 for i < 8; loss = mean next-token cross-entropy over 8 x 128 labels",
        "tokens": slice_WT.tolist()}))
    manifest = {
        "command": "python " + " ".join(sys.argv),
        "python_version": corpus.python_version(),
        "jax_version": jax.__version__,
        "seed": args.seed,
        "corpus": {
            "source": "Python standard library *.py (sysconfig.get_paths()['stdlib'])",
            "excluded_parts": sorted(corpus.EXCLUDED_PARTS), "excluded_prefixes": list(corpus.EXCLUDED_PREFIXES),
            "split_rule": corpus.SPLIT_RULE,
            "files": {s: len(splits[s]) for s in corpus.SPLITS},
            "bytes": {s: sum(len(t.encode()) for t in splits[s].values()) for s in corpus.SPLITS},
            "tokens": {s: int(len(streams[s])) for s in corpus.SPLITS},
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "bos_eos": "<|endoftext|>", "bos_eos_id": tiny.EOT_ID, "prepends_bos": True},
        "training": {"batch": args.batch, "seq_len": args.seq_len, "target_steps": args.target_steps,
                     "target_peak_lr": args.target_lr, "draft_steps": args.draft_steps,
                     "draft_peak_lr": args.draft_lr, "draft_data": args.draft_data,
                     "draft_objective": "KL(target || draft) at every position of "
                     + ("train-split windows" if args.draft_data == "corpus" else
                        f"{args.pool_rows} target greedy continuations of 64-token train-split prompts")
                     + (f" + {args.draft_ce_weight} x CE" if args.draft_ce_weight else ""),
                     "optimizer": "clip 1.0 + AdamW (b2 0.95, wd 0.1), warm-up 50 + cosine to 10%",
                     "wall_s": wall_s},
        "models": {
            "target": {"params": target_cfg.num_params(), "bytes": dir_bytes(out / "target"),
                       "validation_loss": full["target"]["ce"], "validation_accuracy": full["target"]["accuracy"]},
            "draft": {"params": draft_cfg.num_params(), "bytes": dir_bytes(out / "draft"),
                      "validation_loss": full["draft"]["ce"], "validation_accuracy": full["draft"]["accuracy"],
                      "validation_kl_to_target": full["draft_vs_target"]["kl"]},
        },
        "validation_tokens": int(full["target"]["tokens"]),
        "unigram_cross_entropy": unigram_ce,
        "eval_slice_loss": slice_loss,
        "acceptance": {
            "teacher_forced_top1_agreement_validation": full["draft_vs_target"]["agreement"],
            "teacher_forced_top1_agreement_continuations": cont_agree,
            "implied_greedy_tau": sim_tau,
            "num_draft_tokens": args.num_draft_tokens,
            "max_new_tokens": args.new_tokens,
            "alternative_draft_runs": alternatives,
            "note": "implied_greedy_tau replays greedy chain verification on the target's own greedy "
                    "continuations of the held-out prompts using the draft's teacher-forced argmax",
        },
        "held_out_prompts": prompts,
        "target_greedy_continuations": [tok.decode(o) for o in outs],
        "target_continuation_distinct_4gram_ratio": float(np.mean([distinct_ngram_ratio(o) for o in outs])),
    }
    log(f"distinct-4-gram ratio of the target's continuations: "
        f"{manifest['target_continuation_distinct_4gram_ratio']:.3f}")
    measured = measure_tau(out, [p["text"] for p in prompts], args)
    if measured is not None:
        manifest["acceptance"].update(measured)
        log(f"measured greedy tau (K={args.num_draft_tokens}): {measured['measured_greedy_tau']:.3f}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out}: {dir_bytes(out) / 1e6:.1f} MB")


def main(argv=None) -> None:
    args = parse_args(argv)
    run = RunLog(args.run_dir, "train_tiny")
    log, timed, wall_s = run.log, run.timed, run.wall_s

    log(f"python {corpus.python_version()}, stdlib {corpus.stdlib_root()}")
    splits = {s: corpus.load_split(s) for s in corpus.SPLITS}
    tok = timed("tokenizer", stage_tokenizer, args, splits)
    streams = {s: data.token_stream(tok, list(splits[s].values())) for s in corpus.SPLITS}
    log("tokens: " + ", ".join(f"{s} {len(v)}" for s, v in streams.items()))
    if args.stop_after == "tokenizer":
        return
    target_params = timed("target", stage_target, args, streams, log)
    if args.stop_after == "target":
        return
    draft_params = timed(draft_run_dir(args).name, stage_draft, args, streams, target_params, log)
    if args.stop_after == "draft":
        return
    timed("export", stage_export, args, splits, streams, tok, target_params, draft_params, log, wall_s)


if __name__ == "__main__":
    main()
