"""Build the DFlash2 parity fixtures by running z-lab's own DFlash2 code on a tiny random head.

    python scripts/make_dflash2_fixtures.py --dflash-repo /path/to/dflash \
        --dflash2-file /path/to/vllm-fork/vllm/model_executor/models/qwen3_dflash2.py --out tests/fixtures/dflash2

Where z-lab's DFlash2 code lives: z-lab/dflash (fetched; HEAD 44947fb) has no DFlash2 yet; z-lab publishes
`DFlash2DraftModel` in its vLLM fork, z-lab/vllm-fork `vllm/model_executor/models/qwen3_dflash2.py` (commit
162166a) and `vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py` (the walk, a Triton kernel). What runs unchanged
(nothing of either is copied into specjax):
- from qwen3_dflash2.py: `DFlashGroupedConv` (prepare / finish, `_grouped_conv`), `CandidateSelector`
  (`_score_edges`) and `DFlash2Qwen3ForCausalLM.compute_candidates` (top-k of the target lm_head's logits,
  output_multiplier, softcapping), called on a stand-in `self` holding the lm_head, the selector and the settings;
- from z-lab/dflash `dflash/model.py`: `DFlashDraftModel` (fc + hidden_norm on the context, each layer's
  `Qwen3DFlashAttention` over the context's and the block's K/V, the final norm) and `extract_context_feature`.
Import stand-ins (here, never in z-lab's code): vLLM is not installable on this CPU machine, so the `vllm.*` names
qwen3_dflash2.py imports are small stand-ins: ReplicatedLinear a bias-free nn.Linear, `support_torch_compile` the
identity, a TP world of 1, `current_platform.is_cuda()` False (torch.topk), and the DFlash base classes of
`.qwen3_dflash` empty nn.Modules (only the DFlash2 pieces above are used).
Written here after z-lab's code, because it is vLLM-bound: each layer's order, `DFlash2Qwen3DecoderLayer.forward`
(norm, attention_conv.prepare, attention, attention_conv.finish, residual; the same around the MLP) with z-lab/dflash's
modules; the per-layer attention mask (vLLM's `_resolve_layer_attention`: `is_causal` false, so the block is
bidirectional; a `sliding_attention` layer sees the context rows within `sliding_window` of each block row); and the
greedy walk of `_selector_walk_kernel` at temperature 0 (prev = 0; at each step the argmax of scores[step, prev]).

The tiny models: the DFlash fixture's random Qwen3 target (make_dflash_fixtures.TARGET; 6 layers, hidden 32, vocab
128) and a random DFlash2 head (2 layers: sliding (window 6) then full; block_size 5; conv_kernel_size 3,
conv_group_size 8; selector_rank 8, selector_top_k 6; final_logit_softcapping 5, output_multiplier 0.8,
input_embedding_scale 1.5), fp32. The prompt (9 tokens) is longer than the window, so the window matters.

The case directory (`--out`/basic) holds config.json + model.safetensors (the head's tensors under z-lab's names),
meta.json, and io.npz, for B = 2 rows:
    target_embed [V, H], target_lm_head [V, H]; prompt_ids [B, T]; features [B, T, n*H]; anchor [B]
    conv_x [N, H], conv_out0 [N, H], conv_coef1 [N, T, G], conv_out1 [N, H]   layer 0's attention_conv on random rows
    hidden [B, K, H]                 the head's output after its final norm
    ids, unary [B, K-1, C]           compute_candidates on block rows 1..K-1
    scores [B, K-1, C, C]            CandidateSelector
    drafts [B, K-1]                  the greedy walk
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dflash_fixtures import TARGET, randomize  # noqa: E402

HEAD = dict(architectures=["DFlash2DraftModel"], model_type="qwen3", vocab_size=128, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
            attention_bias=False, is_causal=False, layer_types=["sliding_attention", "full_attention"],
            sliding_window=6, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, dtype="float32",
            num_target_layers=6,
            dflash_config={"block_size": 5, "mask_token_id": 127, "target_layer_ids": [0, 2, 4],
                           "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6,
                           "final_logit_softcapping": 5.0, "output_multiplier": 0.8, "input_embedding_scale": 1.5})
BATCH, PROMPT_LEN, SEED = 2, 9, 0


def stub_vllm(torch) -> None:
    """The few `vllm` names qwen3_dflash2.py imports, as CPU stand-ins (module docstring)."""
    nn = torch.nn

    class ReplicatedLinear(nn.Linear):
        def __init__(self, input_size, output_size, bias=False, params_dtype=None, **_):
            super().__init__(input_size, output_size, bias=bias, dtype=params_dtype)

    class UnquantizedLinearMethod:
        def apply(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.weight, bias)

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    module("vllm")
    module("vllm.compilation")
    module("vllm.compilation.decorators", support_torch_compile=lambda cls: cls)
    module("vllm.config", CacheConfig=object, VllmConfig=object)
    module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: 1,
           tensor_model_parallel_all_gather=lambda x, dim=-1: x)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.model_executor")
    module("vllm.model_executor.layers")
    module("vllm.model_executor.layers.linear", ReplicatedLinear=ReplicatedLinear,
           UnquantizedLinearMethod=UnquantizedLinearMethod)
    module("vllm.model_executor.layers.quantization")
    module("vllm.model_executor.layers.quantization.base_config", QuantizationConfig=object)
    module("vllm.model_executor.layers.vocab_parallel_embedding", UnquantizedEmbeddingMethod=type("UEM", (), {}))
    module("vllm.platforms", current_platform=types.SimpleNamespace(is_cuda=lambda: False))
    module("vllm.utils")
    module("vllm.utils.flashinfer", has_flashinfer=lambda: False)
    module("vllm.model_executor.models")
    module("vllm.model_executor.models.qwen3_dflash", DFlashQwen3DecoderLayer=nn.Module,
           DFlashQwen3ForCausalLM=nn.Module, DFlashQwen3Model=nn.Module)
    module("vllm.model_executor.models.utils", maybe_prefix=lambda prefix, name: f"{prefix}.{name}" if prefix else name)


def load_dflash2(path: Path):
    spec = importlib.util.spec_from_file_location("vllm.model_executor.models.qwen3_dflash2", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(torch, transformers, dmodel, d2):
    """(target, head): the tiny random target and the DFlash2 head (z-lab/dflash's model + z-lab's DFlash2 modules)."""
    tcfg = transformers.Qwen3Config(**{k: v for k, v in TARGET.items() if k != "architectures"})
    tcfg._attn_implementation = "eager"
    target = transformers.Qwen3ForCausalLM(tcfg).eval()
    randomize(torch, target, SEED)
    with torch.no_grad():  # favour tokens 3, 4, 5 so drafts through the same lm_head get accepted
        favour = torch.full((TARGET["vocab_size"], 1), 0.01)
        favour[3:6, 0] = torch.tensor([50.0, 100.0, 50.0])
        target.lm_head.weight.mul_(favour)
    dflash = HEAD["dflash_config"]
    dcfg = transformers.Qwen3Config(**{k: v for k, v in HEAD.items() if k != "architectures"})
    dcfg.block_size = dflash["block_size"]
    dcfg._attn_implementation = "eager"
    head = dmodel.DFlashDraftModel(dcfg).eval()
    conv = dict(hidden_size=HEAD["hidden_size"], taps=dflash["conv_kernel_size"], group_size=dflash["conv_group_size"],
                block_size=dflash["block_size"], params_dtype=torch.float32)
    for i, layer in enumerate(head.layers):
        layer.attention_conv = d2.DFlashGroupedConv(**conv, prefix=f"layers.{i}.attention_conv")
        layer.mlp_conv = d2.DFlashGroupedConv(**conv, prefix=f"layers.{i}.mlp_conv")
    head.candidate_selector = d2.CandidateSelector(HEAD["hidden_size"], HEAD["vocab_size"], dflash["selector_rank"],
                                                   dflash["selector_top_k"], torch.float32, "candidate_selector")
    randomize(torch, head, SEED + 1)
    with torch.no_grad():  # tap 0 of each base kernel near 1: the convolutions pass their input on, plus a mix
        for layer in head.layers:
            for c in (layer.attention_conv, layer.mlp_conv):
                c.base_kernel[:, 0] += 1.0
    return target, head


def layer_forward(layer, hidden, context, position_embeddings, mask):
    """One layer in `DFlash2Qwen3DecoderLayer.forward`'s order, with z-lab/dflash's modules ([B, K, H] rows)."""
    b, k, h = hidden.shape
    residual = hidden
    x, coef = layer.attention_conv.prepare(layer.input_layernorm(hidden).reshape(b * k, h))
    attn = layer.self_attn(hidden_states=x.reshape(b, k, h), target_hidden=context,
                           position_embeddings=position_embeddings, attention_mask=mask)[0]
    hidden = residual + layer.attention_conv.finish(attn.reshape(b * k, h), coef).reshape(b, k, h)
    residual = hidden
    x, coef = layer.mlp_conv.prepare(layer.post_attention_layernorm(hidden).reshape(b * k, h))
    return residual + layer.mlp_conv.finish(layer.mlp(x), coef).reshape(b, k, h)


def head_forward(torch, head, target, context_raw, anchor, start: int):
    """Final-normed hidden [B, K, H] of the block [anchor, MASK...] at positions start.. over context rows < start."""
    b, k = anchor.shape[0], HEAD["dflash_config"]["block_size"]
    block = torch.full((b, k), HEAD["dflash_config"]["mask_token_id"], dtype=torch.long)
    block[:, 0] = anchor
    hidden = target.model.embed_tokens(block) * HEAD["dflash_config"]["input_embedding_scale"]
    context = head.hidden_norm(head.fc(context_raw))
    positions = torch.arange(start + k)[None].expand(b, -1)
    position_embeddings = head.rotary_emb(hidden, positions)
    q_pos, kv_pos = torch.arange(start, start + k), torch.arange(start + k)
    for i, layer in enumerate(head.layers):
        visible = torch.ones(k, start + k, dtype=torch.bool)  # is_causal false: the whole block
        if HEAD["layer_types"][i] == "sliding_attention":
            visible[:, :start] = (q_pos[:, None] - kv_pos[None, :start]) < HEAD["sliding_window"]
        mask = torch.zeros(k, start + k).masked_fill(~visible, float("-inf"))[None, None].expand(b, 1, k, start + k)
        hidden = layer_forward(layer, hidden, context, position_embeddings, mask)
    return head.norm(hidden)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dflash-repo", required=True, type=Path, help="local checkout of z-lab/dflash")
    ap.add_argument("--dflash2-file", required=True, type=Path,
                    help="z-lab/vllm-fork's vllm/model_executor/models/qwen3_dflash2.py")
    ap.add_argument("--out", required=True, type=Path, help="fixture directory, e.g. tests/fixtures/dflash2")
    args = ap.parse_args(argv)
    import torch
    import transformers

    torch.set_num_threads(1)
    stub_vllm(torch)
    d2 = load_dflash2(args.dflash2_file)
    sys.path.insert(0, str(args.dflash_repo.resolve()))
    from dflash import model as dmodel  # noqa: PLC0415 (z-lab/dflash, from the checkout given)

    try:
        commit = subprocess.run(["git", "-C", str(args.dflash_repo), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "44947fb (git archive of the fetched mirror, no git metadata)"
    target, head = build(torch, transformers, dmodel, d2)
    dflash = HEAD["dflash_config"]
    k, top_k = dflash["block_size"], dflash["selector_top_k"]
    gen = torch.Generator().manual_seed(100 + SEED)
    prompt = torch.randint(6, TARGET["vocab_size"] - 1, (BATCH, PROMPT_LEN), generator=gen)
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        anchor = out.logits[:, -1].argmax(-1)
        features = dmodel.extract_context_feature(out.hidden_states, head.target_layer_ids)
        hidden = head_forward(torch, head, target, features, anchor, PROMPT_LEN)
        rows = hidden[:, 1:]  # the MASK rows: the speculative steps
        stand_in = types.SimpleNamespace(
            lm_head=types.SimpleNamespace(weight=target.lm_head.weight,
                                          quant_method=sys.modules["vllm.model_executor.layers.linear"]
                                          .UnquantizedLinearMethod(),
                                          shard_indices=types.SimpleNamespace(num_org_vocab_padding=0,
                                                                              org_vocab_start_index=0)),
            model=types.SimpleNamespace(candidate_selector=head.candidate_selector),
            output_multiplier=float(dflash["output_multiplier"]),
            final_logit_softcapping=float(dflash["final_logit_softcapping"]))
        ids, unary = d2.DFlash2Qwen3ForCausalLM.compute_candidates(stand_in, rows.flatten(0, 1))
        ids, unary = ids.view(BATCH, k - 1, top_k), unary.view(BATCH, k - 1, top_k)
        scores = head.candidate_selector(ids, unary, rows, anchor)
        prev = torch.zeros(BATCH, dtype=torch.long)  # _selector_walk_kernel at temperature 0
        drafts = []
        for step in range(k - 1):
            row = scores[torch.arange(BATCH), step, prev]
            row = torch.where(row == row, row, torch.tensor(float("-inf")))
            prev = row.argmax(-1)
            drafts.append(ids[torch.arange(BATCH), step, prev])
        drafts = torch.stack(drafts, 1)
        conv_x = torch.randn(2 * k, HEAD["hidden_size"], generator=gen)
        conv0, coef1 = head.layers[0].attention_conv.prepare(conv_x)
        conv1 = head.layers[0].attention_conv.finish(conv_x.flip(0), coef1)
    arrays = dict(target_embed=target.model.embed_tokens.weight.detach().numpy(),
                  target_lm_head=target.lm_head.weight.detach().numpy(),
                  prompt_ids=prompt.numpy().astype(np.int32), features=features.numpy(),
                  anchor=anchor.numpy().astype(np.int32), hidden=hidden.numpy(), ids=ids.numpy().astype(np.int32),
                  unary=unary.numpy(), scores=scores.numpy(), drafts=drafts.numpy().astype(np.int32),
                  conv_x=conv_x.numpy(), conv_out0=conv0.numpy(), conv_coef1=coef1.numpy(), conv_out1=conv1.numpy())
    case_dir = args.out / "basic"
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case_dir / "io.npz", **arrays)
    from safetensors.torch import save_file

    state = {n: t.contiguous() for n, t in head.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    save_file(state, str(case_dir / "model.safetensors"), metadata={"format": "pt"})
    (case_dir / "config.json").write_text(json.dumps(HEAD, indent=2) + "\n")
    meta = dict(dflash_commit=commit, dflash2_source="z-lab/vllm-fork@162166a191d8 "
                "vllm/model_executor/models/qwen3_dflash2.py", torch=torch.__version__,
                transformers=transformers.__version__, batch=BATCH, prompt_len=PROMPT_LEN, seed=SEED, target=TARGET)
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"basic: drafts {arrays['drafts'].tolist()}, tensors {len(state)}")


if __name__ == "__main__":
    main()
