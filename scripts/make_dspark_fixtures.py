"""Build the DSpark parity fixtures by running the original PyTorch drafter (deepseek-ai/DeepSpec).

    python scripts/make_dspark_fixtures.py --deepspec-repo /path/to/DeepSpec --out tests/fixtures/dspark

The original is imported from the local checkout given (deepspec/modeling/dspark/ and
deepspec/eval/dspark/draft_ops.py, the code its evaluator runs); nothing is downloaded and no
code of it is copied here. A tiny random Qwen3 target is built from a config at run time
(transformers, fp32): hidden 64, 4 layers, 4 query / 2 KV heads of 16, vocabulary 128. For each
case the original drafter class (`Qwen3DSparkModel`, built by the original's own
`build_draft_config` from the target's config) gets random weights and runs the original's
inference path, greedy, batch 1:

  round 1   the prompt's target features are the context (positions 0 .. T-1), the target's greedy
            first token the anchor; `forward_dspark_draft_block` + `build_dspark_proposal`;
  verify    the target runs [anchor, drafts] after the prompt (its hidden states are the next
            round's context features, as the original evaluator's `_update` takes them);
  round 2   after 0, some and all drafts were accepted (forced, not verified: a random drafter
            is never right): the verified rows up to the last accepted draft are the new context,
            the target's greedy token after it the new anchor.

Each case directory holds
  config.json, model.safetensors   the drafter exactly as DeepSpec's checkpoint manager saves it
                                   (`save_pretrained` of the drafter; weights rounded to bf16 and
                                   stored in bf16 as the released checkpoints are, run in fp32);
  io.npz                           prompt [T], root, prompt_features [T, n*H] (the taps
                                   concatenated, original order), verify_tokens [gamma + 1],
                                   verify_features [gamma + 1, n*H], verify_argmax [gamma + 1], and
                                   for round r in {r1, r2_acc0, r2_acc<a>, r2_acc<gamma>}:
      {r}_anchor, {r}_start         the block's first token and its position
      {r}_U                         backbone logits [gamma, V] (lm_head of the final-normed block)
      {r}_markov                    Markov-adjusted logits [gamma, V] (absent without a Markov head)
      {r}_tokens                    greedy drafts [gamma]
      {r}_conf_logit, {r}_conf      confidence logits and sigmoid [gamma] (absent without a head)
      {r}_k{l}, {r}_v{l}            drafter cache of layer l after the round [Hkv, ctx, D] (K after
                                    k_norm and RoPE, the original's DynamicCache layout), for round 1
                                    and the all-accepted round 2 only: context row p depends only on
                                    the feature and position of p, so every other round's cache is
                                    a prefix of the latter
  meta.json                        versions and the case's settings.

Cases: "dspark" (2 layers, block 5, Markov rank 8 vanilla, confidence head with Markov, taps
[0, 1, 2]) and "rank0" (the `dflash_*_block7` class: 1 layer, block 4, markov_rank 0, no
confidence head, taps [-1, 1, 2], -1 being the embedding output; a target of hidden 32).

This script is for regenerating the committed fixtures; the tests read only its outputs.

Round trip (a DSpark directory, e.g. one `specjax export` wrote, in the original):

    python scripts/make_dspark_fixtures.py --deepspec-repo /path/to/DeepSpec --round-trip DIR --target TARGET_DIR

loads DIR into the original `Qwen3DSparkModel`, drafts one round on a random prompt of TARGET_DIR
(a Hugging Face Qwen3 directory), and checks specjax's drafter read from DIR gives the same
backbone and Markov logits, drafts and confidences (1e-4, fp32). Nothing is written; the exit
status says whether they match. CI never runs it.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

TARGET = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

CASES = {
    "dspark": dict(model=dict(num_draft_layers=2, block_size=5, target_layer_ids=[0, 1, 2], mask_token_id=127,
                              num_anchors=8, markov_rank=8, markov_head_type="vanilla", confidence_head_alpha=1.0,
                              confidence_head_with_markov=True),
                   prompt_len=9, seed=0, accepted=(0, 2, 5)),
    # A narrower target (hidden 32, 2 query / 1 KV heads) keeps the committed fixtures small.
    "rank0": dict(model=dict(num_draft_layers=1, block_size=4, target_layer_ids=[-1, 1, 2], mask_token_id=127,
                             num_anchors=8, markov_rank=0, confidence_head_alpha=0.0),
                  target=dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
                  prompt_len=7, seed=3, accepted=(0, 1, 4)),
}


class ModelArgs(dict):
    """The config object the original's `build_draft_config` reads (`key in args` and `args.key`)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


def build_target(torch, seed: int, overrides: dict):
    """The tiny random Qwen3 target (fp32), weights spread enough for clear greedy margins."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TARGET, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def build_drafter(torch, Qwen3DSparkModel, build_draft_config, target, model_args: dict, seed: int):
    """The original drafter class on the target's config, random weights rounded to bf16 values.

    Embedding and lm_head are copied from the target, as the original's training initialises and
    freezes them (`initialize_embeddings_and_head`).
    """
    cfg = build_draft_config(target.config, ModelArgs(model_args))
    cfg._attn_implementation = "sdpa"  # what the original evaluator loads it with
    torch.manual_seed(1000 + seed)
    model = Qwen3DSparkModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "markov_w" in name:
                p.copy_(torch.randn_like(p) * (2.0 if "w1" in name else 1.0) / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(0.5 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def legacy_cache(DynamicCache):
    """A DynamicCache whose `crop(n)` keeps the first n positions, as transformers 4's did.

    The original evaluator calls `crop(start)` after each block (the absolute length to keep);
    transformers 5 reads a positive argument as an error and takes only a count to remove.
    """

    class LegacyCropCache(DynamicCache):
        def crop(self, max_length: int) -> None:
            if max_length >= 0:
                max_length = max_length - self.get_seq_length()
                if max_length >= 0:
                    return
            super().crop(max_length)

    return LegacyCropCache()


def draft_round(torch, model, *, context_features, anchor: int, start: int, cache, position_ids, keep_cache=True):
    """One round of the original's proposal (greedy): returns the recorded arrays and the cropped cache."""
    from deepspec.eval.dspark import draft_ops

    block = model.block_size
    draft_input_ids = torch.full((1, block), int(model.mask_token_id), dtype=torch.long)
    draft_input_ids[:, 0] = anchor
    with torch.no_grad():
        hidden = draft_ops.forward_dspark_draft_block(
            model, draft_input_ids=draft_input_ids, position_ids=position_ids, past_key_values_draft=cache,
            target_hidden_states=context_features, start=start, block_size=block)
        proposal = draft_ops.build_dspark_proposal(model, draft_input_ids=draft_input_ids, block_hidden=hidden,
                                                   block_size=block, temperature=0.0, confidence_threshold=0.0)
        base = model.compute_logits(hidden[:, :block])
        tokens, markov = model.sample_draft_tokens(base, first_prev_token_ids=draft_input_ids[:, 0],
                                                   temperature=0.0, hidden_states=hidden[:, :block])
    assert torch.equal(tokens[0], proposal.verify_input_ids[0, 1:]), "proposal tokens differ from the sampler's"
    out = dict(anchor=np.int32(anchor), start=np.int32(start), U=base[0].numpy(),
               tokens=tokens[0].numpy().astype(np.int32))
    if model.markov_head is not None:
        out["markov"] = markov[0].numpy()
    if proposal.confidence_logits is not None:
        out["conf_logit"] = proposal.confidence_logits[0].numpy()
        out["conf"] = torch.sigmoid(proposal.confidence_logits[0]).numpy()
    if keep_cache:
        for layer in range(len(model.layers)):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
            out[f"k{layer}"], out[f"v{layer}"] = k[0].numpy(), v[0].numpy()
    return out


def run_case(torch, name: str, case: dict, out_dir: Path, commit: str) -> None:
    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config
    from transformers import DynamicCache

    target = build_target(torch, case["seed"], case.get("target", {}))
    model = build_drafter(torch, Qwen3DSparkModel, build_draft_config, target, case["model"], case["seed"])
    gen = torch.Generator().manual_seed(50 + case["seed"])
    t, block, layer_ids = case["prompt_len"], model.block_size, model.target_layer_ids
    prompt = torch.randint(3, TARGET["vocab_size"] - 1, (1, t), generator=gen)
    position_ids = torch.arange(t + 4 * block).unsqueeze(0)
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True, use_cache=True)
    target_cache = out.past_key_values
    root = int(out.logits[0, -1].argmax())
    prompt_features = extract_context_feature(out.hidden_states, layer_ids)

    arrays = dict(prompt=prompt[0].numpy().astype(np.int32), root=np.int32(root),
                  prompt_features=prompt_features[0].numpy())
    cache = legacy_cache(DynamicCache)
    r1 = draft_round(torch, model, context_features=prompt_features, anchor=root, start=t, cache=cache,
                     position_ids=position_ids)
    arrays |= {f"r1_{k}": v for k, v in r1.items()}

    verify_tokens = torch.tensor([[root, *r1["tokens"].tolist()]])
    with torch.no_grad():
        vout = target(input_ids=verify_tokens, position_ids=position_ids[:, t: t + block + 1],
                      past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    verify_features = extract_context_feature(vout.hidden_states, layer_ids)
    verify_argmax = vout.logits[0].argmax(-1)
    arrays |= dict(verify_tokens=verify_tokens[0].numpy().astype(np.int32), verify_features=verify_features[0].numpy(),
                   verify_argmax=verify_argmax.numpy().astype(np.int32))

    for a in case["accepted"]:
        c2 = copy.deepcopy(cache)
        r2 = draft_round(torch, model, context_features=verify_features[:, : a + 1],
                         anchor=int(verify_argmax[a]), start=t + a + 1, cache=c2, position_ids=position_ids,
                         keep_cache=a == max(case["accepted"]))
        arrays |= {f"r2_acc{a}_{k}": v for k, v in r2.items()}

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case_dir / "io.npz", **arrays)
    model.to(torch.bfloat16).save_pretrained(case_dir)
    meta = dict(deepspec_commit=commit, torch=torch.__version__, transformers=_version("transformers"),
                target={**TARGET, **case.get("target", {})}, model_args=case["model"], prompt_len=t, seed=case["seed"],
                accepted=list(case["accepted"]), weights="bf16 values, run in fp32")
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{name}: round-1 drafts {r1['tokens'].tolist()}, verify argmax {verify_argmax.tolist()}")


def round_trip(torch, head_dir: Path, target_dir: Path, prompt_len: int = 11, tol: float = 1e-4) -> bool:
    """The DSpark directory in the original vs in specjax: one greedy round (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import transformers
    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from transformers import DynamicCache

    import specjax
    from specjax.config import SamplingConfig
    from specjax.decoding.drafter import PrefillContext, Settings
    from specjax.decoding.tree import chain
    from specjax.loading.drafter import dspark_drafter

    hf_target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = Qwen3DSparkModel.from_pretrained(head_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, hf_target.config.vocab_size, (1, prompt_len), generator=gen)
    with torch.no_grad():
        out = hf_target(input_ids=prompt, output_hidden_states=True)
    root = int(out.logits[0, -1].argmax())
    feats = extract_context_feature(out.hidden_states, model.target_layer_ids)
    theirs = draft_round(torch, model, context_features=feats, anchor=root, start=prompt_len,
                         cache=legacy_cache(DynamicCache),
                         position_ids=torch.arange(prompt_len + 2 * model.block_size)[None])

    target = specjax.load(target_dir, dtype="float32", attn_impl="xla")
    drafter = dspark_drafter(head_dir, target, dtype="float32")
    k = model.block_size
    if drafter.cfg.confidence:  # the original's confidence head is uncalibrated: compare before temperature scaling
        drafter = drafter.with_temperatures(np.ones((k,), np.float32))
    drafter = drafter.configure(Settings(chain(k), SamplingConfig(), 128, 16, record_logits=True))
    width = hf_target.config.hidden_size
    split = [jnp.asarray(feats[0, :, i * width:(i + 1) * width].numpy())[None]
             for i in range(len(model.target_layer_ids))]
    ctx = PrefillContext(jnp.asarray(prompt.numpy(), jnp.int32), jnp.asarray([prompt_len], jnp.int32),
                         jnp.asarray([root], jnp.int32), tuple(split))
    state = drafter.init(drafter.params, ctx)
    draft, _ = drafter.propose(drafter.params, state, jnp.asarray([root], jnp.int32),
                               jax.random.split(jax.random.key(0), 1))
    ok = bool(np.array_equal(np.asarray(draft.tokens[0, 1:]), theirs["tokens"]))
    print(f"drafts: specjax {np.asarray(draft.tokens[0, 1:]).tolist()} original {theirs['tokens'].tolist()}")
    diff = float(np.max(np.abs(np.asarray(draft.logits[0, 1:]) - theirs["markov"])))
    print(f"Markov logits: max |specjax - original| = {diff:.2e}")
    ok &= diff <= tol * max(1.0, float(np.max(np.abs(theirs["markov"]))))
    if "conf" in theirs:
        cdiff = float(np.max(np.abs(np.asarray(draft.confidence[0, 1:]) - theirs["conf"])))
        print(f"confidences: max |specjax - original| = {cdiff:.2e}")
        ok &= cdiff <= tol
    print(f"round trip {'OK' if ok else 'MISMATCH'}: {head_dir}")
    return ok


def _version(module: str) -> str:
    import importlib

    return importlib.import_module(module).__version__


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspec-repo", required=True, type=Path, help="local checkout of deepseek-ai/DeepSpec")
    ap.add_argument("--out", type=Path, help="fixture directory, e.g. tests/fixtures/dspark")
    ap.add_argument("--round-trip", type=Path, metavar="DIR",
                    help="instead: load the DSpark directory DIR into the original and compare with specjax")
    ap.add_argument("--target", type=Path, help="with --round-trip: the drafter's target (Hugging Face Qwen3 dir)")
    ap.add_argument("--commit", help="the checkout's commit, for meta.json, when it is not a git work tree")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.round_trip is None):
        ap.error("give exactly one of --out and --round-trip")
    if args.round_trip is not None and args.target is None:
        ap.error("--round-trip needs --target")
    marker = args.deepspec_repo / "deepspec" / "modeling" / "dspark" / "qwen3" / "modeling.py"
    if not marker.is_file():
        raise SystemExit(f"{marker} not found: --deepspec-repo must be a checkout of deepseek-ai/DeepSpec")

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(args.deepspec_repo.resolve()))
    commit = args.commit
    try:
        commit = commit or subprocess.run(["git", "-C", str(args.deepspec_repo), "rev-parse", "HEAD"],
                                          capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "unknown"
    if args.round_trip is not None:
        raise SystemExit(0 if round_trip(torch, args.round_trip, args.target) else 1)
    for name, case in CASES.items():
        run_case(torch, name, case, args.out, commit)


if __name__ == "__main__":
    main()
