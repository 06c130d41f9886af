"""Published model configs the planner prices without a checkpoint: the config.json fields specjax reads.

Sources: Meta-Llama-3-8B is the published 8B (the planner's default target, 8.03B parameters); the three
served models are copied from the Hugging Face config.json files that NVIDIA's ai-dynamo/aiconfigurator keeps
under aic-core/src/aiconfigurator_core/model_configs/ (snapshot 095f58a, 2026-08-21):
meta-llama--Llama-3.3-70B-Instruct_config.json, Qwen--Qwen3.5-27B_config.json,
Qwen--Qwen3.5-122B-A10B_config.json. Their shapes agree with independent copies: THUDM/slime
scripts/models/qwen3.5-27B.sh (24 heads, 4 kv groups of 256, 64 layers, hidden 5120, FFN 17408, vocab 248320).
The Qwen3.5 configs' `layer_types` lists are the full_attention_interval rule (every 4th layer full attention),
checked against the lists there, so the interval stands for them here. The vision towers are left out (text only).
"""

from __future__ import annotations

from typing import Any

# Meta-Llama-3-8B shapes (rope scaling as in Llama 3.1), bf16: 8.03B parameters.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_bias": False, "mlp_bias": False, "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}

# meta-llama/Llama-3.3-70B-Instruct: 80 layers of hidden 8192, 64 heads, 8 kv heads of 128, MLP 28672, untied.
LLAMA33_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}

_QWEN35_TEXT: dict[str, Any] = {
    "attention_bias": False, "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-6, "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25}}

# Qwen/Qwen3.5-27B: 64 layers (48 Gated DeltaNet, 16 gated attention), hidden 5120, 24 heads, 4 kv heads of 256,
# MLP 17408, DeltaNet 16 key / 48 value heads of 128, one MTP layer.
QWEN35_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {**_QWEN35_TEXT, "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                    "linear_num_value_heads": 48}}

# Qwen/Qwen3.5-122B-A10B: 48 layers (36 DeltaNet, 12 attention), hidden 3072, 32 heads, 2 kv heads of 256, every
# MLP 256 experts of 1024 (8 per token) plus a shared expert of 1024, DeltaNet 16 key / 64 value heads, one MTP layer.
QWEN35_122B_A10B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {**_QWEN35_TEXT, "model_type": "qwen3_5_moe_text", "hidden_size": 3072, "num_hidden_layers": 48,
                    "num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64,
                    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024,
                    "shared_expert_intermediate_size": 1024, "router_aux_loss_coef": 0.001}}

SERVED: dict[str, dict[str, Any]] = {"Llama-3.3-70B": LLAMA33_70B, "Qwen3.5-27B": QWEN35_27B,
                                     "Qwen3.5-122B-A10B": QWEN35_122B_A10B}
