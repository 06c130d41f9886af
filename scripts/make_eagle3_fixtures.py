"""Build the EAGLE-3 parity fixtures by running the original PyTorch head (SafeAILab/EAGLE).

    python scripts/make_eagle3_fixtures.py --eagle-repo /path/to/EAGLE --out tests/fixtures/eagle3

The original is imported from the local checkout given (eagle/model/cnets.py, commit cb7e084
checked); nothing is downloaded, and no code of it is copied here. For each case this writes
a directory with
  config.json, model.safetensors   a tiny random head in the SafeAILab checkpoint format
                                   (torch [out, in] weights, d2t / t2d buffers), for the reader;
  io.npz                           inputs and the original's outputs:
    target_embed [V, H]            the embedding table the head reads (the target's)
    features_BTF [B, T, 3H]        target features (three taps concatenated), ids_BT [B, T]
    step1_{logits, hidden, k, v}   prefill over T positions (fc on the features); logits over the
                                   draft vocabulary, pre-norm hidden [B, T, H], K/V [B, Hkv, T, D]
                                   (after RoPE, the layout of the original's cache)
    step2_{ids, logits, hidden, k, v}
                                   one more token per row, fed with the head's own last pre-norm
                                   hidden, continuing the cache (K/V now cover T + 1 positions)
    tree_*                         EAGLE-2 dynamic tree (Model.topK_genrate) from batch row 0:
                                   tree_ids [1, T + 1] (t_0 then ids_BT[0]; its last token the root),
                                   draft tokens (root first, target ids), retrieve indices,
                                   tree mask, position ids, parents (-1 for the root) and the
                                   top_k / depth / total_tokens used
  meta.json                        versions and the case's settings.

This script is for regenerating the committed fixtures; the tests read only its outputs.

Round trip (an exported head, e.g. `specjax export` or checkpoints/tiny/eagle3, in the original):

    python scripts/make_eagle3_fixtures.py --eagle-repo /path/to/EAGLE --round-trip checkpoints/tiny/eagle3 \
        --target checkpoints/tiny/target

loads DIR's config.json and model.safetensors into the original `cnets.Model` (the target's
embedding when the head has none), runs a prefill over random features and a second step fed
its own hidden, and checks specjax's head (read from the same DIR) gives the same draft logits
(1e-4, fp32). Nothing is written; the exit status says whether they match. CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

CASES = {
    # rope_theta given (not 10000), GQA 4 query / 2 kv heads, no embedding in the checkpoint.
    "rope_theta": dict(config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256, draft_vocab_size=128,
                                   rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}),
                       batch=2, seq=7, seed=0, embed_in_checkpoint=False,
                       tree=dict(top_k=4, depth=3, total_tokens=12)),
    # rope_theta absent (base 10000), embedding saved in the checkpoint as some exports do.
    "rope_default": dict(config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=256, draft_vocab_size=128,
                                     rms_norm_eps=1e-6, max_position_embeddings=2048),
                         batch=2, seq=9, seed=1, embed_in_checkpoint=True,
                         tree=dict(top_k=3, depth=4, total_tokens=10)),
}

CONFIG_COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                     hidden_act="silu", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False, torch_dtype="float32")


def econfig_from_json(EConfig, raw: dict):
    """EConfig as the original reads it, with rope fields restored from the JSON.

    transformers 5 folds `rope_theta` into `rope_scaling` / `rope_parameters` while building a
    config; the original's RoPE setup reads `rope_scaling["type"]` and `hasattr(config,
    "rope_theta")` as transformers 4 left them, so the fields are put back as the file has them.
    """
    cfg = EConfig(**raw)
    cfg.rope_scaling = raw.get("rope_scaling")
    if "rope_theta" in raw:
        cfg.rope_theta = raw["rope_theta"]
    elif hasattr(cfg, "rope_theta"):
        delattr(cfg, "rope_theta")
    assert hasattr(cfg, "rope_theta") == ("rope_theta" in raw), "could not restore rope_theta"
    return cfg


def random_head(torch, Model, cfg, seed: int):
    """A random head: unit-scale embeddings, matrices ~ 1/sqrt(fan-in), so activations and logits are O(1)
    (an absolute tolerance of 1e-5 then means about 1e-5 relative) and top-k choices have clear margins."""
    torch.manual_seed(seed)
    model = Model(cfg, load_emb=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        used = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
        model.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[used] = True
        model.t2d.copy_(t2d)
    return model


def tree_parents(tree_mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Parent node of each tree node (-1 for the root): its ancestor one level up."""
    n = tree_mask.shape[0]
    parents = np.full(n, -1, np.int64)
    for i in range(1, n):
        (anc,) = np.nonzero(tree_mask[i, :i] & (positions[:i] == positions[i] - 1))
        assert len(anc) == 1, f"node {i} has {len(anc)} parents"
        parents[i] = anc[0]
    return parents


def run_case(torch, cnets, name: str, case: dict, out_dir: Path, eagle_commit: str) -> None:
    raw = {**CONFIG_COMMON, **case["config"]}
    cfg = econfig_from_json(cnets.EConfig, raw)
    tree = case["tree"]
    model = random_head(torch, cnets.Model, cfg, case["seed"])
    model.top_k, model.depth, model.total_tokens = tree["top_k"], tree["depth"], tree["total_tokens"] - 1
    model.init_tree()

    b, t, h, v = case["batch"], case["seq"], cfg.hidden_size, cfg.vocab_size
    gen = torch.Generator().manual_seed(100 + case["seed"])
    features = torch.randn(b, t, 3 * h, generator=gen)
    ids = torch.randint(0, v, (b, t), generator=gen)

    with torch.no_grad():
        hidden1, (kv1,) = model(features, input_ids=ids, use_cache=True)
        logits1 = model.lm_head(model.norm(hidden1))
        draft_next = logits1[:, -1].argmax(-1)
        ids2 = (draft_next + model.d2t[draft_next])[:, None]  # the head's own guess, as a target id
        hidden2, (kv2,) = model(hidden1[:, -1:], input_ids=ids2, past_key_values=(kv1,), use_cache=True)
        logits2 = model.lm_head(model.norm(hidden2))

        # The dynamic tree over row 0. topK_genrate takes the sequence t_0..t_T (its last token the
        # root) and pairs feature p with t_{p+1}: prepend a t_0 to row 0 of ids_BT, so its first
        # draft step is exactly step 1 on row 0 and the root is ids_BT[0, T-1].
        tree_ids = torch.cat([torch.randint(0, v, (1, 1), generator=gen), ids[:1]], dim=1)  # [1, T + 1]
        model.reset_kv()
        draft_tokens, retrieve, tmask, tpos = model.topK_genrate(features[:1], tree_ids, None, None)

    tmask_np = tmask[0, 0].numpy().astype(bool)
    tpos_np = tpos.numpy()
    arrays = dict(
        target_embed=model.embed_tokens.weight.numpy(),
        features_BTF=features.numpy(), ids_BT=ids.numpy().astype(np.int32),
        step1_logits=logits1.numpy(), step1_hidden=hidden1.numpy(),
        step1_k=kv1[0].numpy(), step1_v=kv1[1].numpy(),
        step2_ids=ids2.numpy().astype(np.int32), step2_logits=logits2.numpy(), step2_hidden=hidden2.numpy(),
        step2_k=kv2[0].numpy(), step2_v=kv2[1].numpy(),
        tree_ids=tree_ids.numpy().astype(np.int32), tree_tokens=draft_tokens.numpy().astype(np.int32),
        tree_retrieve=retrieve.numpy().astype(np.int32), tree_mask=tmask_np,
        tree_positions=tpos_np.astype(np.int32), tree_parents=tree_parents(tmask_np, tpos_np).astype(np.int32),
        tree_top_k=np.int32(tree["top_k"]), tree_depth=np.int32(tree["depth"]),
        tree_total_tokens=np.int32(tree["total_tokens"]),
    )

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case_dir / "io.npz", **arrays)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if case["embed_in_checkpoint"] or k != "embed_tokens.weight"}
    from safetensors.torch import save_file

    save_file(state, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
    (case_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    meta = dict(eagle_commit=eagle_commit, torch=torch.__version__, transformers=_version("transformers"),
                batch=b, seq=t, seed=case["seed"], tree=tree, embed_in_checkpoint=case["embed_in_checkpoint"])
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{name}: tree tokens {draft_tokens.tolist()[0]}")


def round_trip(torch, cnets, head_dir: Path, target_dir: Path, batch: int = 2, seq: int = 9, tol: float = 1e-4) -> bool:
    """The exported head in the original vs in specjax: prefill and second-step draft logits (see the docstring)."""
    import jax.numpy as jnp
    from safetensors.torch import load_file

    import specjax
    from specjax.convert.eagle3 import load_eagle3
    from specjax.drafters.eagle3 import head_of, init_head_cache
    from specjax.models.cache import KVCache

    target = specjax.load(target_dir, dtype="float32", attn_impl="xla")
    raw = json.loads((head_dir / "config.json").read_text())
    cfg = econfig_from_json(cnets.EConfig, raw)
    model = cnets.Model(cfg, load_emb=False).eval()
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = torch.from_numpy(np.array(target.params["embed"], np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        print(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        return False

    gen = torch.Generator().manual_seed(0)
    width = raw.get("target_hidden_size") or raw["hidden_size"]
    features = torch.randn(batch, seq, 3 * width, generator=gen)
    ids = torch.randint(0, raw["vocab_size"], (batch, seq), generator=gen)
    with torch.no_grad():
        hidden1, (kv1,) = model(features, input_ids=ids, use_cache=True)
        logits1 = model.lm_head(model.norm(hidden1))
        nxt = logits1[:, -1].argmax(-1)
        ids2 = (nxt + model.d2t[nxt])[:, None]
        hidden2, _ = model(hidden1[:, -1:], input_ids=ids2, past_key_values=(kv1,), use_cache=True)
        logits2 = model.lm_head(model.norm(hidden2))

    hcfg, host = load_eagle3(head_dir, target.cfg, "float32")
    params = {k: v for k, v in host.items()}
    params = {**params, "embed": jnp.asarray(state["embed_tokens.weight"].numpy())}
    head = head_of(hcfg, params)
    cache = init_head_cache(hcfg, batch, 128)
    h1, cache = head.midlayer(jnp.asarray(ids.numpy()), head.fuse(jnp.asarray(features.numpy())), cache,
                              attn_impl="xla")
    cache = KVCache(cache.k, cache.v, cache.lengths + seq)
    h2, _ = head.midlayer(jnp.asarray(ids2.numpy()), h1[:, -1:], cache, attn_impl="xla")
    ok = True
    for name, ours, theirs in (("step1", head.draft_logits(h1), logits1),
                               ("step2", head.draft_logits(h2), logits2)):
        diff = float(np.max(np.abs(np.asarray(ours) - theirs.numpy())))
        scale = float(np.max(np.abs(theirs.numpy())))
        print(f"{name} draft logits: max |specjax - original| = {diff:.2e} (max |logit| {scale:.2f})")
        ok &= diff <= tol * max(1.0, scale)
    print(f"round trip {'OK' if ok else 'MISMATCH'}: {head_dir} (taps {list(hcfg.feature_layers)}, "
          f"draft vocab {hcfg.draft_vocab_size})")
    return ok


def _version(module: str) -> str:
    import importlib

    return importlib.import_module(module).__version__


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle-repo", required=True, type=Path, help="local checkout of SafeAILab/EAGLE")
    ap.add_argument("--out", type=Path, help="fixture directory, e.g. tests/fixtures/eagle3")
    ap.add_argument("--round-trip", type=Path, metavar="DIR",
                    help="instead: load the exported head in DIR into the original and compare with specjax")
    ap.add_argument("--target", type=Path, help="with --round-trip: the head's target (specjax checkpoint or HF dir)")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.round_trip is None):
        ap.error("give exactly one of --out and --round-trip")
    if args.round_trip is not None and args.target is None:
        ap.error("--round-trip needs --target (the head's feature width, layers and embedding come from it)")
    cnets_file = args.eagle_repo / "eagle" / "model" / "cnets.py"
    if not cnets_file.is_file():
        raise SystemExit(f"{cnets_file} not found: --eagle-repo must be a checkout of SafeAILab/EAGLE")

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(args.eagle_repo.resolve()))
    from eagle.model import cnets  # noqa: PLC0415 (the original, from the checkout given)

    try:
        commit = subprocess.run(["git", "-C", str(args.eagle_repo), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "unknown"
    if args.round_trip is not None:
        ok = round_trip(torch, cnets, args.round_trip, args.target)
        raise SystemExit(0 if ok else 1)
    for name, case in CASES.items():
        run_case(torch, cnets, name, case, args.out, commit)


if __name__ == "__main__":
    main()
