"""Build the speculators-format DSpark fixture: a tiny DSparkDraftModel run and saved by speculators' own code.

    python scripts/make_dspark_speculators_fixtures.py --speculators-repo DIR --out tests/fixtures/dspark_speculators

DIR is a checkout of vllm-project/speculators, imported from src/ as scripts/make_eagle3_layout_fixtures.py does
(`import_speculators`: its version lookup and training-data module stood in; nothing downloaded, none of its code
copied; CI never runs this script). What runs, unchanged: src/speculators/models/dspark/core.py `DSparkDraftModel`
(its `forward`: DFlash's `_backbone_forward` from models/dflash/core.py, then the Markov logit bias and the
confidence head), built from its own `DSparkSpeculatorConfig` and saved by its own `save_pretrained`. Only the loss
is cut off: `compute_metrics` in dspark/core.py's namespace is replaced by a recorder of what it is given (the
Markov-biased draft-vocabulary logits and the confidence logits), so the forward before it is theirs; a hook on the
final norm records the backbone's hidden states. sdpa attention (`create_mask`, as the EAGLE-3 fixtures use).

The head: a Qwen3 layer config (hidden 32, 4 heads of 8, 2 kv heads, 1 layer, rope_theta 1e6), taps [1, 3, 5]
(vLLM's hidden_states numbering, as speculators' configs count them) on a 7-layer target, block 4,
sample_from_anchor true (DSpark's default), a pruned draft vocabulary of 64 of 128 tokens (d2t / t2d), Markov rank
8 (vanilla), a confidence head with the Markov embedding, fp32. Random weights (norms 1 + 0.1 N(0,1), matrices
N(0,1)/sqrt(fan-in), embeddings N(0,1)).

io.npz: features_BTF [1, T, 3H], input_ids [1, T], anchors [A] (every valid position: the anchor draws all of them),
hidden [A, block, H] (final-normed), logits [A, block, Vd] (teacher-forced: slot k's bias from input_ids[p + k]),
confidence_logits [A, block].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_eagle3_layout_fixtures import commit_of, draft_vocab, import_speculators, randomize, write_meta  # noqa: E402

HEAD = dict(model_type="qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, vocab_size=128, num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=1000000.0,
            max_position_embeddings=2048, tie_word_embeddings=False, layer_types=["full_attention"])
BLOCK, DRAFT_VOCAB, RANK, MASK, IDS, T, SEED = 4, 64, 8, 127, [1, 3, 5], 12, 11


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculators-repo", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch
    from torch.nn.attention.flex_attention import create_mask
    from transformers import AutoConfig

    torch.set_num_threads(1)
    sp = import_speculators(args.speculators_repo)
    import speculators.models.dspark.core as dspark_core
    from speculators.models.dspark import DSparkSpeculatorConfig

    layer = AutoConfig.for_model(**HEAD)
    layer._attn_implementation = "sdpa"
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, block_size=BLOCK, aux_hidden_state_layer_ids=IDS,
        mask_token_id=MASK, markov_rank=RANK, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=sp.SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[sp.Greedy(speculative_tokens=BLOCK)],
            default_proposal_method="greedy",
            verifier=sp.VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    model = dspark_core.DSparkDraftModel(config).eval()
    model._attn_impl, model._create_mask_fn = "sdpa", create_mask
    randomize(torch, model, torch.float32, SEED)
    d2t, t2d = draft_vocab(torch, HEAD["vocab_size"], DRAFT_VOCAB, SEED)
    model.load_vocab_mappings(t2d, d2t)

    recorded, hidden = {}, []

    def record(logits, targets, confidence_logits, *a, **k):
        recorded.update(logits=logits.detach(), confidence_logits=confidence_logits.detach())
        return torch.zeros(()), {}

    dspark_core.compute_metrics = record
    hook = model.norm.register_forward_hook(lambda m, i, o: hidden.append(o.detach()))
    gen = torch.Generator().manual_seed(100 + SEED)
    features = torch.randn(1, T, len(IDS) * HEAD["hidden_size"], generator=gen)
    input_ids = torch.randint(0, HEAD["vocab_size"], (1, T), generator=gen)
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[0, 0] = 0  # no anchor without context
    anchors = [p for p in range(1, T - BLOCK)]  # select_anchors' valid positions; max_anchors = all of them
    torch.manual_seed(SEED)
    with torch.no_grad():
        model(hidden_states=features, input_ids=input_ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.randn(1, T, HEAD["hidden_size"], generator=gen),
              document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T)[None],
              max_anchors=len(anchors))
    hook.remove()
    a = len(anchors)
    case_dir = args.out
    case_dir.mkdir(parents=True, exist_ok=True)
    import numpy as np

    np.savez_compressed(case_dir / "io.npz", features_BTF=features.numpy(), input_ids=input_ids.numpy(),
                        anchors=np.asarray(anchors), hidden=hidden[0].reshape(a, BLOCK, -1).numpy(),
                        logits=recorded["logits"].reshape(a, BLOCK, -1).numpy(),
                        confidence_logits=recorded["confidence_logits"].reshape(a, BLOCK).numpy())
    model.save_pretrained(case_dir)
    (case_dir / "config.py").unlink(missing_ok=True)  # save_pretrained's copy of speculators' own config class
    write_meta(case_dir, torch, producer="vllm-project/speculators", commit=commit_of(args.speculators_repo),
               seed=SEED)
    print(sorted(p.name for p in case_dir.iterdir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
