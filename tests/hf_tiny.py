"""Tiny random Hugging Face checkpoints of each supported family, built at test time.

Weights are drawn with a spread wide enough that greedy argmax has clear margins, so
token-for-token comparisons are not decided by float noise between implementations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)

FAMILIES = {
    # Llama 3.x: llama3 rope scaling (small original context so the scaling bites), tied embeddings.
    "llama": dict(cls="LlamaForCausalLM", tie_word_embeddings=True, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "qwen2": dict(cls="Qwen2ForCausalLM", tie_word_embeddings=False, rope_theta=1000000.0),
    # Qwen3: head_dim independent of hidden_size / heads.
    "qwen3": dict(cls="Qwen3ForCausalLM", tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0),
    "mistral": dict(cls="MistralForCausalLM", tie_word_embeddings=False, sliding_window=None),
}


def build_hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    spec = {**BASE, **FAMILIES[family], **overrides}
    cls = getattr(transformers, spec.pop("cls"))
    config = cls.config_class(**spec)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model, path: Path, dtype=torch.float32, shard_size: str | None = None) -> Path:
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


# Qwen3.5 (hybrid): three Gated DeltaNet layers and one gated full-attention layer, partial rotary, GQA on both.
QWEN35_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                        mrope_section=[2, 1, 1]))
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def build_qwen35(layout: str = "causal_lm", seed: int = 0, **overrides):
    """A tiny random Qwen3.5: layout "causal_lm" (Qwen3_5ForCausalLM, flat config) or "conditional"
    (Qwen3_5ForConditionalGeneration: text config nested, weights under model.language_model, a vision tower).

    Zero-centred norms get small offsets around 0 (the DeltaNet output norm around 1), decays moderate.
    """
    import transformers

    text = {**QWEN35_TEXT, **overrides}
    if layout == "causal_lm":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    else:
        config = transformers.Qwen3_5Config(text_config=text, vision_config=QWEN35_VISION,
                                            tie_word_embeddings=text["tie_word_embeddings"])
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# Mixture-of-experts: 8 experts, 2 per token, narrow experts. The router is drawn wider than the other matrices
# so the top-2 choice has clear margins (a near-tie decided by float noise would route a token differently).
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN3_MOE = dict(**BASE, **MOE, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False, decoder_sparse_step=1,
                 mlp_only_layers=[1], norm_topk_prob=False)
QWEN35_MOE_TEXT = {**{k: v for k, v in QWEN35_TEXT.items() if k != "intermediate_size"}, **MOE,
                   "shared_expert_intermediate_size": 48}
QWEN3_NEXT = {**QWEN35_TEXT, **MOE, "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1,
              "mlp_only_layers": [2], "norm_topk_prob": True}
QWEN3_NEXT["rope_parameters"] = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)


def build_moe(arch: str, layout: str = "causal_lm", seed: int = 0, forced_expert: bool = False, **overrides):
    """A tiny random MoE target: arch "qwen3_moe" (Qwen3MoeForCausalLM, layer 1 dense), "qwen3_5_moe"
    (Qwen3_5MoeForCausalLM, or layout "conditional": Qwen3_5MoeForConditionalGeneration with a vision tower) or
    "qwen3_next" (Qwen3NextForCausalLM, layer 2 dense).

    forced_expert: every token of every prompt routes to expert 0 and none to the last expert (the embedding
    carries a large constant on dim 0 and each router scores expert 0 by +dim 0, the last by -dim 0).
    """
    import transformers

    if arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **overrides}))
    elif arch == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**QWEN3_NEXT, **overrides}))
    elif layout == "causal_lm":
        text = transformers.Qwen3_5MoeTextConfig(**{**QWEN35_MOE_TEXT, **overrides})
        model = transformers.Qwen3_5MoeForCausalLM(text)
    else:
        text = {**QWEN35_MOE_TEXT, **overrides}
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=QWEN35_VISION,
                                               tie_word_embeddings=text["tie_word_embeddings"])
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    zero_centred = arch != "qwen3_moe"
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name or ("norm" in name and not zero_centred):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif "A_log" in name or "dt_bias" in name or "conv1d" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(3.0 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.5 * torch.randn_like(p) / p.shape[-1] ** 0.5)
        if forced_expert:
            for name, p in model.named_parameters():
                if name.endswith("embed_tokens.weight"):
                    p[:, 0] = 20.0
                elif name.endswith("mlp.gate.weight"):
                    p[0, 0], p[-1, 0] = 3.0, -3.0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def fuse_expert_tensors(tensors: dict) -> dict:
    """Per-expert tensors (what transformers 5 saves) -> the fused form Qwen3.5-MoE publishes: per layer
    mlp.experts.gate_up_proj [E, 2I, D] (gate rows, then up) and mlp.experts.down_proj [E, D, I]."""
    import re

    out = {k: v for k, v in tensors.items() if not re.search(r"(^|\.)mlp\.experts\.\d+\.", k)}
    prefixes = sorted({m.group(1) for k in tensors if (m := re.match(r"(.*?mlp\.experts\.)\d+\.", k))})
    for p in prefixes:
        n = len({k for k in tensors if k.startswith(p) and k.endswith("down_proj.weight")})
        gate = np.stack([tensors[f"{p}{j}.gate_proj.weight"] for j in range(n)])
        up = np.stack([tensors[f"{p}{j}.up_proj.weight"] for j in range(n)])
        out[f"{p}gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[f"{p}down_proj"] = np.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(n)])
    return out


def save_fused_experts(path: Path) -> Path:
    """Rewrite a saved MoE checkpoint's model.safetensors with fused expert tensors."""
    from safetensors.numpy import load_file, save_file

    save_file(fuse_expert_tensors(load_file(path / "model.safetensors")), str(path / "model.safetensors"))
    return path


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no EOS)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_matches_transformers(hf_model, target, lengths=(3, 37, 70), new_tokens: int = 64, seed: int = 1):
    """specjax's greedy generation of a ragged batch (random prompts of `lengths` tokens, right-padded together)
    equal, row by row, to transformers' generate of each prompt alone; and not degenerate (many distinct tokens)."""
    import specjax

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, target.cfg.vocab_size, size=n).tolist() for n in lengths]
    out = specjax.generate(target, prompts, max_new_tokens=new_tokens, eos_token_id=[])
    for prompt, tokens in zip(prompts, out.tokens):
        assert tokens == hf_greedy(hf_model, prompt, new_tokens)
    assert all(len(set(t)) > new_tokens // 4 for t in out.tokens)


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    """transformers' fp32 logits for a batch of token ids."""
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.float().numpy()


def assert_convert_export_round_trip(hf_model, target, tmp_path: Path, architecture: str, atol: float) -> None:
    """HF dir -> orbax checkpoint -> load gives transformers' logits; export writes a text-only `architecture`
    directory (no text_config) that transformers loads and runs to the same logits."""
    import json

    import transformers

    import specjax
    from specjax.convert.export import export

    tokens = np.random.default_rng(3).integers(3, target.cfg.vocab_size, size=(1, 20))
    want = hf_logits(hf_model, tokens)
    converted = specjax.load(specjax.convert(target.path, tmp_path / "ckpt"))
    np.testing.assert_allclose(np.asarray(converted.model(tokens, attn_impl="xla")), want, atol=atol, rtol=0)
    exported = export(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [architecture] and "text_config" not in config
    back = getattr(transformers, architecture).from_pretrained(exported).eval()
    np.testing.assert_allclose(hf_logits(back, tokens), want, atol=atol, rtol=0)
