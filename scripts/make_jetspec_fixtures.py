"""Build the JetSpec parity fixtures by running JetSpec's own code (hao-ai-lab/JetSpec) from a local checkout.

    python scripts/make_jetspec_fixtures.py --jetspec-repo /path/to/JetSpec --out tests/fixtures/jetspec

What runs unchanged from the checkout (commit in meta.json; nothing of it is copied into specjax):
- `jetspec.models.draft_head.DFlashDraftModel`: the causal draft head (`dflash_config.causal_head` true:
  `_build_dflash_causal_attention_mask`, block row i sees the context and block rows 0..i);
- `jetspec.draft_head_adapter.DraftHeadTreeDrafter.propose_logits`: one head pass with its draft KV cache
  (context rows appended once, the block cropped after each pass), the target's embedding and lm_head,
  giving the per-depth draft logits (1, block_size - 1, V);
- `jetspec.tree.get_algorithm("accum_logp").build`: the best-first tree from those logits (top `WIDTH`
  per depth, `BUDGET` nodes, root included);
- `jetspec.tree.tree_accept` (greedy): the accepted path and the correction token, from the target's
  logits at every tree node.
The target's logits (and hidden states, for the next round's context) at a node are computed here by
running the tiny transformers target over prompt + anchor + the node's path: what tree attention gives.
Round 2 feeds JetSpec's drafter the accepted path's tapped hidden states as new context rows (the
engine's protocol) and records its per-depth logits again.

Compatibility shim (here, never in JetSpec): the adapter calls `DynamicCache.crop(ctx_len)` meaning
"keep the first ctx_len positions" (transformers 4.5x); transformers 5.x refuses a positive argument,
so scripts/make_dflash_fixtures.py's `_ensure_crop` restores the 4.5x meaning first.

The tiny models: the DFlash fixture's random Qwen3 target (6 layers, hidden 32, vocab 128) with its lm_head
rows favouring tokens 3, 4, 5 (so drafts get accepted), and a random JetSpec head in the published heads'
config layout (`JetSpec/jetspec-Qwen3.6-35B-A3B`: top-level block_size, dflash_config {causal_head,
mask_token_id, target_layer_ids}, rope_parameters, dtype; 8 layers), block_size 6, fp32.

The case directory (`--out`/causal) holds config.json + model.safetensors (the head as JetSpec saves it),
meta.json, and io.npz with, for B = 2 independent prompts of equal length:
    target_embed [V, H], target_lm_head [V, H]; prompt_ids [B, T]; r1_features [B, T, n*H]; r1_anchor [B]
    r1_logits [B, block_size - 1, V]                 propose_logits (round 1)
    r1_tokens, r1_parents, r1_depths [B, BUDGET]     the accum_logp tree; r1_scores its cum_logprob
    r1_target_logits [B, BUDGET, V]                  the target's logits at each node
    r1_path [B, BUDGET] (0-padded), r1_accepted [B] (drafts accepted), r1_correction [B]   tree_accept
    r2_features [B, a+1, n*H] (a = max accepted over rows; rows padded with the root's), r2_logits [B, bs-1, V]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dflash_fixtures import TARGET, _ensure_crop, randomize  # noqa: E402

HEAD = dict(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"}, block_size=6,
            dflash_config={"causal_head": True, "mask_token_id": 127, "target_layer_ids": [0, 2, 4]},
            dtype="float32", hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_target_layers=6, vocab_size=128, model_type="qwen3",
            rope_parameters={"rope_theta": 10000000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
            max_position_embeddings=512, hidden_act="silu", attention_bias=False, tie_word_embeddings=False)
WIDTH, BUDGET, BATCH, PROMPT_LEN, SEED = 3, 20, 2, 7, 0


def build(torch, transformers, draft_head):
    tcfg = transformers.Qwen3Config(**{k: v for k, v in TARGET.items() if k != "architectures"})
    tcfg._attn_implementation = "eager"
    target = transformers.Qwen3ForCausalLM(tcfg).eval()
    randomize(torch, target, SEED)
    with torch.no_grad():  # favour tokens 3, 4, 5 so the head's guesses (through the same lm_head) get accepted
        favour = torch.full((TARGET["vocab_size"], 1), 0.01)
        favour[3:6, 0] = torch.tensor([50.0, 100.0, 50.0])
        target.lm_head.weight.mul_(favour)
    dcfg = transformers.Qwen3Config(**{k: v for k, v in HEAD.items() if k not in ("architectures", "auto_map")})
    dcfg._attn_implementation = "eager"
    head = draft_head.DFlashDraftModel(dcfg).eval()
    randomize(torch, head, SEED + 1)
    assert head.causal_head and head.resolve_causal_head("auto") and head.mask_token_id == 127
    return target, head


def node_outputs(torch, target, prefix, tree, layer_ids, extract):
    """The target's logits [N, V] and tapped hidden [N, n*H] at every tree node (prefix + the node's path)."""
    tokens, parents = tree.token_ids.tolist(), tree.parent_indices.tolist()
    logits, feats = [], []
    for node in range(len(tokens)):
        path, j = [], node
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        ids = torch.tensor([prefix + path[::-1]])
        out = target(ids, output_hidden_states=True)
        logits.append(out.logits[0, -1])
        feats.append(extract(out.hidden_states, layer_ids)[0, -1])
    return torch.stack(logits), torch.stack(feats)


def run_row(torch, target, head, adapter, draft_head, jtree, prompt, arrays_rows):
    layer_ids = head.target_layer_ids
    extract = draft_head.extract_context_feature
    drafter = adapter.DraftHeadTreeDrafter(head, target, HEAD["block_size"], layer_ids, draft_shift=False)
    out = target(prompt[None], output_hidden_states=True)
    anchor = int(out.logits[0, -1].argmax())
    context = extract(out.hidden_states, layer_ids)  # [1, T, n*H]
    ids = torch.tensor([prompt.tolist() + [anchor]])
    logits1 = drafter.propose_logits(ids, HEAD["block_size"] - 1, target_hidden=context)
    tree = jtree.get_algorithm("accum_logp").build(root_token=anchor, draft_logits=logits1,
                                                   block_size=HEAD["block_size"], tree_width=WIDTH, budget=BUDGET,
                                                   device=torch.device("cpu"))
    assert tree.num_nodes == BUDGET
    node_logits, node_feats = node_outputs(torch, target, prompt.tolist(), tree, layer_ids, extract)
    path, accepted, correction = jtree.tree_accept(tree, node_logits[None], temperature=0.0)
    # Round 2: the accepted path's tapped hidden states are the new context rows; the correction is the anchor.
    context2 = torch.cat([context, node_feats[path][None]], dim=1)
    ids2 = torch.tensor([prompt.tolist() + [tree.token_ids[i].item() for i in path] + [correction]])
    logits2 = drafter.propose_logits(ids2, HEAD["block_size"] - 1, target_hidden=context2)
    arrays_rows.append(dict(
        r1_features=context[0].numpy(), r1_anchor=np.int32(anchor), r1_logits=logits1[0].numpy(),
        r1_tokens=tree.token_ids.numpy().astype(np.int32), r1_parents=tree.parent_indices.numpy().astype(np.int32),
        r1_depths=tree.depth.numpy().astype(np.int32), r1_scores=tree.cum_logprob.numpy(),
        r1_target_logits=node_logits.numpy(), r1_path=np.pad(np.asarray(path, np.int32), (0, BUDGET - len(path))),
        r1_accepted=np.int32(accepted), r1_correction=np.int32(correction), r2_features=node_feats[path].numpy(),
        r2_logits=logits2[0].numpy()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jetspec-repo", required=True, type=Path, help="local checkout of hao-ai-lab/JetSpec")
    ap.add_argument("--out", required=True, type=Path, help="fixture directory, e.g. tests/fixtures/jetspec")
    args = ap.parse_args(argv)
    if not (args.jetspec_repo / "jetspec" / "models" / "draft_head.py").is_file():
        raise SystemExit(f"{args.jetspec_repo} is not a checkout of hao-ai-lab/JetSpec (no jetspec/models/draft_head.py)")
    import torch
    import transformers

    torch.set_num_threads(1)
    _ensure_crop(transformers.DynamicCache)
    sys.path.insert(0, str(args.jetspec_repo.resolve()))
    import jetspec.draft_head_adapter as adapter_mod  # noqa: PLC0415 (JetSpec's own code, from the checkout)
    import jetspec.tree as jtree  # noqa: PLC0415
    from jetspec.models import draft_head  # noqa: PLC0415

    try:
        commit = subprocess.run(["git", "-C", str(args.jetspec_repo), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "2c7b3fa (git archive of the fetched mirror, no git metadata)"
    target, head = build(torch, transformers, draft_head)
    with torch.no_grad():  # the first prompt seed whose rows each accept some drafts (round 2 then has a path)
        for prompt_seed in range(100, 200):
            gen = torch.Generator().manual_seed(prompt_seed)
            prompts = torch.randint(6, TARGET["vocab_size"] - 1, (BATCH, PROMPT_LEN), generator=gen)
            rows: list[dict] = []
            for prompt in prompts:
                run_row(torch, target, head, adapter_mod, draft_head, jtree, prompt, rows)
            if all(r["r1_accepted"] > 0 for r in rows) and len({int(r["r1_accepted"]) for r in rows}) > 1:
                break
        else:
            raise SystemExit("no prompt seed in 100..199 gives accepted drafts in every row")
    longest = max(len(r["r2_features"]) for r in rows)
    for r in rows:  # pad round 2's context rows (a row uses its own r1_accepted + 1 of them)
        f = r["r2_features"]
        r["r2_features"] = np.concatenate([f, np.repeat(f[:1], longest - len(f), axis=0)])
    arrays = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    arrays |= dict(target_embed=target.model.embed_tokens.weight.detach().numpy(),
                   target_lm_head=target.lm_head.weight.detach().numpy(), prompt_ids=prompts.numpy().astype(np.int32))
    case = args.out / "causal"
    case.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case / "io.npz", **arrays)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(case / "model.safetensors"),
              metadata={"format": "pt"})
    (case / "config.json").write_text(json.dumps(HEAD, indent=2) + "\n")
    meta = dict(jetspec_commit=commit, torch=torch.__version__, transformers=transformers.__version__,
                width=WIDTH, budget=BUDGET, batch=BATCH, prompt_len=PROMPT_LEN, seed=SEED, prompt_seed=prompt_seed, target=TARGET,
                favoured_tokens={"3": 50.0, "4": 100.0, "5": 50.0})
    (case / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"causal: accepted {arrays['r1_accepted'].tolist()}, paths {arrays['r1_path'].tolist()}")


if __name__ == "__main__":
    main()
