"""Build the MTP parity fixtures by running vLLM's own MTP modules on tiny random weights.

    python scripts/make_mtp_fixtures.py --vllm-repo /path/to/vllm --out tests/fixtures/mtp [--cases NAME ...]

--vllm-repo is a vLLM source tree: a git checkout, or an unpacked wheel. All five fixtures committed
here come from one run over the vllm 0.33.0 wheel's sources (python scripts/make_mtp_fixtures.py
--vllm-repo <unpacked 0.33.0 files> --out tests/fixtures/mtp). Nothing is downloaded and no vLLM code
is copied into specjax; CI never runs this script, the tests read only what it writes. An older tree
still runs (0.11.0: deepseek2, deepseek1, qwen3_next; it has no qwen3_5_mtp.py), with that tree's
semantics: 0.11.0's DeepSeek MTP layer returns h' alone, which is then both scored and fed back (no
step{s}_prenorm), so its deepseek fixtures differ from these and the current tests reject them.

What is ORIGINAL vLLM code, executed unchanged from the given tree:
  * vllm/model_executor/models/deepseek_mtp.py: `DeepSeekMultiTokenPredictorLayer` (embedding
    masked at position 0, enorm / hnorm, concat [embedding, hidden], eh_proj, block, residual
    add giving h'; 0.33.0 returns the pair (h', shared_head(h')), shared_head(h') =
    shared_head.norm(h')), `DeepSeekMultiTokenPredictor` (layer = spec_step_idx %
    num_mtp_layers, embed_tokens, compute_logits = shared_head.head(shared_head.norm(h))) and
    `SharedHead`. The pair is used as vLLM 0.33.0's proposers use it (`model_returns_tuple`:
    `last_hidden_states, hidden_states = model(...)`): compute_logits on the first (h', normed
    once inside), the second (post-norm) recycled into the next draft step.
  * vllm/model_executor/models/qwen3_next_mtp.py: `Qwen3NextMultiTokenPredictor` (embedding,
    pre_fc_norm_embedding / pre_fc_norm_hidden, concat [embedding, hidden], fc, layer
    spec_step_idx % n, final `norm` with the residual) — its forward returns the post-norm
    hidden, which is what vLLM feeds back to the next step; the logits are the target's
    lm_head applied to it (`Qwen3NextMTP.compute_logits`).
  * vllm/model_executor/models/qwen3_5_mtp.py: `Qwen3_5MultiTokenPredictor`, the same recipe as
    Qwen3-Next's (pre_fc_norm_embedding / pre_fc_norm_hidden, concat [embedding, hidden], fc,
    layer spec_step_idx % n, final `norm`); it returns the post-norm hidden (fed back), and the
    logits are the target's lm_head on it (`Qwen3_5MTP.compute_logits`).
  * vllm/model_executor/models/mimo_mtp.py: `MiMoMultiTokenPredictorLayer` (embedding masked at
    position 0, token_layernorm / hidden_layernorm, concat [hidden, embedding] — hidden first,
    unlike DeepSeek — input_proj, block, residual add, final_layernorm) and
    `MiMoMultiTokenPredictor` (layer num_hidden_layers + spec_step_idx, compute_logits =
    logits_processor(lm_head, h)). The returned final_layernorm output is both what vLLM feeds
    back and what it scores; vLLM's `MiMoMTP` asserts spec_step_idx == 0, so every step uses
    layer 0.
  * vllm/model_executor/layers/layernorm.py: `RMSNorm` and `GemmaRMSNorm` (their
    `forward_native` PyTorch paths). `Qwen3NextRMSNorm` and `Qwen3_5RMSNorm` are vLLM's aliases
    of GemmaRMSNorm (x * (1 + w)), so those layouts' own norms come from that code too. Where
    forward_native calls vllm.ir ops (newer trees, e.g. 0.33.0), vllm/ir/ops/layernorm.py
    (`rms_norm`, `fused_add_rms_norm`: the native implementations) is executed unchanged as well
    (unpack it with the other files); only the op registry around it is stubbed.

What is STUBBED (small plain-torch modules put in sys.modules before those files are loaded):
  * vLLM's infrastructure: vllm.config, vllm.envs, vllm.logger, vllm.platforms (not ROCm),
    vllm.utils (+ utils.torch_utils), vllm.sequence, vllm.compilation.decorators
    (support_torch_compile = identity, bare or configured), vllm.distributed (a single pipeline
    rank; all_gather = identity), vllm.kernels, vllm.ir's op registry (register_op -> the
    decorated native function), model_executor.utils.set_weight_attrs, determinism.batch_invariant
    (off), CustomOp (forward = forward_native), the fused-MoE, quantization, weight-loader,
    mtp-validation and model-utils helpers (WeightsMapper, AutoWeightsLoader, ...: only weight
    loading uses them; the weights are set directly here), is_model_fused_shared_expert_compatible
    (-> False), sequence_parallel_chunk (identity; unused without sequence-parallel MoE), the
    interfaces' mixins (empty classes), and the MoE pieces imported for MoE configs only
    (Qwen3NextSparseMoeBlock, QwenNextMixtureOfExperts, DeepseekV2MoE / DeepseekV2MixtureOfExperts:
    empty classes; the configs here are dense).
  * The parallel layers, as their single-device meaning: VocabParallelEmbedding (a lookup in a
    [V, H] weight), ParallelLMHead (a [V, H] weight), LogitsProcessor (h @ head.weight^T),
    ColumnParallelLinear (a bias-free nn.Linear).
  * The inner decoder block, as an ORIGINAL transformers decoder layer (eager attention) with its
    own KV cache (transformers' DynamicCache), attention visible to cached positions <= the
    query's. vLLM's layers return (hidden, residual) with the residual add deferred to the caller;
    the stub returns (layer output, zeros), whose sum the original callers form.
      - deepseek*, qwen3_next: specjax's targets are dense decoders, so `DeepseekV2DecoderLayer`
        (MLA + MoE in vLLM) and `Qwen3NextDecoderLayer` (gated attention + MoE in vLLM) are
        transformers' `LlamaDecoderLayer`, RoPE Llama's default (theta from the case's config).
      - qwen3_5: `Qwen3_5DecoderLayer` (full_attention) is transformers' `Qwen3_5DecoderLayer` of a
        one-layer full_attention copy of the target's text config: gated attention (q_proj rows
        per head [query | gate]), zero-centred q_norm / k_norm and layer norms, partial RoPE from
        `Qwen3_5TextRotaryEmbedding` (text positions: its mrope sections all see the same
        position), dense SiLU MLP.
      - mimo: `Qwen2DecoderLayer` is transformers' `Qwen2DecoderLayer` (q/k/v biases).

The inputs, in every case driven by the target itself: a random prompt t_0 .. t_{T-1} (T = 6) runs
through a tiny transformers target (deepseek*, qwen3_next: LlamaForCausalLM, 1 layer;
Qwen3_5ForCausalLM: 3 linear_attention + 1 full_attention layers; Qwen2ForCausalLM: 2 layers);
root = the target's argmax at the last position; ids = prompt[1:] + [root] (row p pairs h_p with
t_{p+1}); positions 0 .. T-1; h_prev = the hidden state vLLM hands that MTP:
  * deepseek2, deepseek1, qwen3_next, qwen3_5: the target's post-final-norm hidden (transformers'
    last_hidden_state, what lm_head scores): vLLM's DeepseekV2Model and Qwen3NextModel forwards
    (Qwen3_5Model inherits the latter's) return self.norm(hidden, residual), and the proposer
    feeds that output to the MTP.
  * mimo: the pre-final-norm hidden (the input of model.norm: vLLM's MiMoModel returns hidden +
    residual and applies the norm only in compute_logits).
The driving (`drive`): step 1 is the prefill, every MTP layer j over the T rows with spec_step_idx
j (the deepseek2 case thus prefills both layers on the target's hidden); step s > 1 is one token
at position T + s - 2, the previous step's argmax, fed the previous step's fed-back hidden (its
last row), through layer (s - 1) % num_mtp (MiMo: always 0, as MiMoMTP asserts). With one MTP
layer this is the order of vLLM 0.33.0's v1/spec_decode/llm_base_proposer.py (prefill, then one
token per step fed the recycled hidden). The two-layer schedule of deepseek2 is the one specjax
implements, not a vLLM proposer's: llm_base_proposer passes no spec_step_idx (layer 0 every step),
and v1/worker/gpu/spec_decode/multi_module_mtp reruns the whole shifted window through module s fed
module s - 1's output. What each step reads and scores follows vLLM in every case.

Each case directory holds
  config.json, model.safetensors   the target carrying the MTP tensors in the case's layout, as a
                                   checkpoint would: what specjax converts and reads back.
                                   deepseek*, qwen3_next: a tiny LlamaForCausalLM (one layer, untied
                                   lm_head) with model.layers.{L+j}.* / mtp.*; qwen3_5: the
                                   Qwen3_5ForCausalLM target with mtp.* (mtp_num_hidden_layers 1);
                                   mimo: the Qwen2 target as MiMoForCausalLM (model_type mimo,
                                   num_nextn_predict_layers 1) with model.mtp_layers.0.*;
  io.npz                           prompt [T] (t_0 .. t_{T-1}), target_logits [T, V] (the
                                   target's logits on the prompt), ids [T] (t_1 .. t_{T-1}, root),
                                   positions [T] (0 .. T-1), h_prev [T, H];
                                   for each step s: step{s}_hidden = the hidden vLLM feeds the next
                                   step (every layout: the post-final-norm output; DeepSeek: the
                                   pair's shared_head(h'), Qwen3-Next / Qwen3.5 / MiMo: the single
                                   return), step{s}_logits = the module's compute_logits as vLLM
                                   calls it (DeepSeek: on h'; the others: the target's lm_head on
                                   the return); deepseek* also step{s}_prenorm = h' (the pair's
                                   first element). Step 1 is the prefill over the T rows, keyed
                                   step1_l{j}_* per MTP layer j (deepseek2: l0, l1); later steps
                                   add step{s}_ids (the token fed) and step{s}_layer;
                                   k{j}, v{j}: layer j's K/V [Hkv, rows, D] after all steps
                                   (RoPE applied, rows in the order written);
  meta.json                        versions, layout, settings, the vLLM files executed, what was
                                   stubbed, what h_prev and step{s}_hidden are (qwen3_5: the dims
                                   it overrides).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CASES = {
    # DeepSeek-V3 layout, two MTP layers (model.layers.{L}, {L+1}), the target's embedding and
    # lm_head not repeated inside the MTP layers.
    "deepseek2": dict(layout="deepseek", num_mtp=2, seed=0, steps=3, rope_theta=10000.0),
    # DeepSeek-V3 layout, one layer carrying its own shared_head.head and embed_tokens (as the
    # published DeepSeek-V3 checkpoint does), reused for every step.
    "deepseek1": dict(layout="deepseek", num_mtp=1, seed=1, steps=3, rope_theta=500000.0, own_head=True),
    # Qwen3-Next / Qwen3.5 layout, one layer, reused for every step.
    "qwen3_next": dict(layout="qwen3_next", num_mtp=1, seed=2, steps=3, rope_theta=1000000.0),
    # Qwen3.5 (mtp.*), one layer reused for every step, fed a Qwen3_5ForCausalLM target's post-norm hidden;
    # a narrower MLP than DIMS (five dense MLPs: keeps the directory small).
    "qwen3_5": dict(layout="qwen3_5", num_mtp=1, seed=3, steps=3, rope_theta=10000000.0,
                    dims={"intermediate_size": 32}),
    # MiMo (model.mtp_layers.0.*), one layer (vLLM: spec_step_idx is always 0), fed a Qwen2 target's
    # pre-norm hidden.
    "mimo": dict(layout="mimo", num_mtp=1, seed=4, steps=3, rope_theta=10000.0),
}
MTP_FILES = {"deepseek": "deepseek_mtp.py", "qwen3_next": "qwen3_next_mtp.py", "qwen3_5": "qwen3_5_mtp.py",
             "mimo": "mimo_mtp.py"}
DIMS = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            vocab_size=96, rms_norm_eps=1e-6, max_position_embeddings=256)
TARGET_LAYERS = 1  # the Llama targets of the deepseek* / qwen3_next cases
SEQ = 6
# The Qwen3.5 target: layer_types default to 3 linear_attention + 1 full_attention; rotary dim
# head_dim * 0.5 = 4, i.e. 2 frequencies, which the mrope sections must add up to.
QWEN3_5_TARGET = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8)
QWEN3_5_ROPE = dict(rope_type="default", partial_rotary_factor=0.5, mrope_section=[1, 1, 0])
MIMO_TARGET_LAYERS = 2
IR_LAYERNORM = "vllm/ir/ops/layernorm.py"  # newer trees: the native rms_norm / fused_add_rms_norm
# What h_prev is, per layout: the hidden state vLLM 0.33.0's target model hands its MTP.
H_PREV = {"deepseek": ("target post-norm (transformers LlamaForCausalLM last_hidden_state, the lm_head's input; "
                       "vLLM's DeepseekV2Model.forward returns self.norm(hidden, residual))"),
          "qwen3_next": ("target post-norm (transformers LlamaForCausalLM last_hidden_state, the lm_head's input; "
                         "vLLM's Qwen3NextModel.forward returns self.norm(hidden, residual))"),
          "qwen3_5": "target post-norm (transformers Qwen3_5ForCausalLM last_hidden_state)",
          "mimo": "target pre-norm (input of transformers Qwen2 model.norm)"}
# What step{s}_hidden is (the hidden vLLM 0.33.0 feeds the next draft step), and step{s}_prenorm where saved.
STEP_HIDDEN = {
    "deepseek": ("step{s}_hidden = shared_head(h') = shared_head.norm(h'), the second element of "
                 "DeepSeekMultiTokenPredictorLayer.forward's pair, recycled into the next step; step{s}_prenorm = h' "
                 "(the first element, residual + block output); step{s}_logits = compute_logits(h') = "
                 "shared_head.head(shared_head.norm(h'))"),
    "qwen3_next": ("step{s}_hidden = norm(h') (Qwen3NextMultiTokenPredictor.forward's return, fed back); "
                   "step{s}_logits = the target lm_head on it (Qwen3NextMTP.compute_logits)"),
    "qwen3_5": ("step{s}_hidden = norm(h') (Qwen3_5MultiTokenPredictor.forward's return, fed back); "
                "step{s}_logits = the target lm_head on it (Qwen3_5MTP.compute_logits)"),
    "mimo": ("step{s}_hidden = final_layernorm(h') (MiMoMultiTokenPredictorLayer.forward's return, fed back); "
             "step{s}_logits = compute_logits = the target lm_head on it"),
}


# ---------------------------------------------------------------- stubs for vLLM's infrastructure


def _module(name: str, **attrs) -> types.ModuleType:
    """A stub module registered under `name` (parents created as empty packages, each child an attribute)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            pkg = types.ModuleType(parent)
            pkg.__path__ = []
            sys.modules[parent] = pkg
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__path__ = getattr(mod, "__path__", [])
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    if len(parts) > 1:  # `from vllm import envs, ir`
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], mod)
    return mod


def _load_original(name: str, path: Path) -> types.ModuleType:
    """Execute an original vLLM source file as module `name`."""
    if not path.is_file():
        raise SystemExit(f"{path} not found: --vllm-repo must be a vLLM source tree")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _empty_class(name: str) -> type:
    """A distinct empty class (mixins and MoE blocks listed together as bases must differ)."""
    return type(name, (), {})


def install_ir_ops(vllm_root: Path) -> bool:
    """vllm.ir (newer trees): the op registry reduced to the decorated native functions.

    Those functions are vLLM's own: vllm/ir/ops/layernorm.py is executed unchanged when the tree
    has it. Returns whether it did (older trees, e.g. 0.11.0, compute the norms in layernorm.py).
    """

    class IrOp:
        """An IR op: calling it (or its maybe_inplace overload) runs its native implementation."""

        def __init__(self, fn):
            self.fn = fn
            self.impls = {"native": SimpleNamespace(impl_fn=fn)}

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

        def maybe_inplace(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

        def register_input_generator(self, generator):
            return generator

        def override_tolerance(self, *args, **kwargs):
            pass

    def register_op(fn=None, **kwargs):
        return IrOp(fn) if fn is not None else IrOp

    _module("vllm.ir.op", register_op=register_op)
    ops = _module("vllm.ir.ops")
    _module("vllm.ir", ops=ops, register_op=register_op)
    path = vllm_root / IR_LAYERNORM
    if not path.is_file():
        return False
    native = _load_original("vllm.ir.ops.layernorm", path)
    ops.rms_norm, ops.fused_add_rms_norm = native.rms_norm, native.fused_add_rms_norm
    return True


def install_stubs(vllm_root: Path) -> list[str]:
    """Stub vLLM's infrastructure, load its layernorm.py, then stub the layers the MTP files import.

    Returns the vLLM files executed beside the MTP file (for meta.json).
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding

    class CustomOp(nn.Module):
        op_registry_oot: dict = {}

        @classmethod
        def register(cls, name):
            return lambda op_cls: op_cls

        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

    def set_weight_attrs(weight, attrs):
        for k, v in (attrs or {}).items():
            setattr(weight, k, v)

    def unused(*args, **kwargs):
        raise NotImplementedError("stubbed: not on the single-device native path")

    _module("vllm.envs", VLLM_ROCM_USE_AITER_RMSNORM=False, VLLM_ROCM_USE_AITER=False, VLLM_BATCH_INVARIANT=False)
    _module("vllm.model_executor.custom_op", CustomOp=CustomOp)
    _module("vllm.platforms", current_platform=SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: False,
                                                               device_type="cpu"))
    _module("vllm.utils", direct_register_custom_op=lambda *a, **k: None)
    _module("vllm.utils.torch_utils", direct_register_custom_op=lambda *a, **k: None)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.kernels")
    _module("vllm.model_executor.utils", set_weight_attrs=set_weight_attrs)
    _module("vllm.model_executor.determinism.batch_invariant", rms_norm_batch_invariant=unused)
    files = ["vllm/model_executor/layers/layernorm.py"]
    if install_ir_ops(vllm_root):
        files.append(IR_LAYERNORM)
    layernorm_py = vllm_root / "vllm/model_executor/layers/layernorm.py"
    if "ir.ops." in (layernorm_py.read_text() if layernorm_py.is_file() else "") and len(files) == 1:
        raise SystemExit("this layernorm.py computes through vllm.ir: unpack vllm/ir/ops/layernorm.py too")
    layernorm = _load_original("vllm.model_executor.layers.layernorm", layernorm_py)

    class VocabParallelEmbedding(nn.Module):
        def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(num_embeddings, embedding_dim))

        def forward(self, ids):
            return F.embedding(ids, self.weight)

    class ParallelLMHead(VocabParallelEmbedding):
        pass

    class LogitsProcessor(nn.Module):
        def __init__(self, vocab_size, *args, **kwargs):
            super().__init__()

        def forward(self, lm_head, hidden_states, *args):
            return F.linear(hidden_states, lm_head.weight)

    class ColumnParallelLinear(nn.Module):
        def __init__(self, input_size, output_size, bias=True, gather_output=False, return_bias=True, **kwargs):
            super().__init__()
            assert not bias
            self.weight = nn.Parameter(torch.zeros(output_size, input_size))
            self.return_bias = return_bias

        def forward(self, x):
            out = F.linear(x, self.weight)
            return (out, None) if self.return_bias else out

    class CachedBlock(nn.Module):
        """In place of vLLM's decoder layer: an original transformers decoder layer with its own KV cache.

        `config` is a one-layer transformers config; the layer is its layer 0, eager attention, RoPE
        cos/sin from `rotary_cls`. Called as vLLM's layers are, (positions, hidden_states, residual),
        it returns (layer output, zeros): vLLM's callers add the two.
        """

        use_attn_reduce_scatter_for_moe = False  # qwen3_next / qwen3_5 MTP: no sequence-parallel MoE
        use_sequence_parallel_moe = False  # deepseek_mtp (newer trees)

        def __init__(self, config, layer_cls, rotary_cls):
            super().__init__()
            config._attn_implementation = "eager"
            self.hf_layer_config = config
            self.layer = layer_cls(config, layer_idx=0)
            self.rotary = rotary_cls(config)
            self.reset()

        def reset(self):
            self.cache = DynamicCache(config=self.hf_layer_config)
            self.key_positions = torch.zeros(0, dtype=torch.long)

        def forward(self, positions, hidden_states, residual):
            assert residual is None  # an MTP layer always starts a fresh residual stream
            pos = positions.long()
            self.key_positions = torch.cat([self.key_positions, pos])
            visible = self.key_positions[None, :] <= pos[:, None]  # [T, S]
            mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
            cos_sin = self.rotary(hidden_states[None], pos[None])
            out = self.layer(hidden_states[None], attention_mask=mask, position_ids=pos[None], cache=self.cache,
                             use_cache=True, position_embeddings=cos_sin)
            out = out[0] if isinstance(out, tuple) else out
            return out[0], torch.zeros_like(out[0])

        def kv(self):
            layer = self.cache.layers[0]
            return layer.keys[0].numpy(), layer.values[0].numpy()

    class DenseBlock(CachedBlock):
        """deepseek_v2's / qwen3_next's decoder layer -> transformers' LlamaDecoderLayer."""

        def __init__(self, vllm_config, *args, **kwargs):
            hf = vllm_config.model_config.hf_config
            config = LlamaConfig(**{k: hf.dims[k] for k in DIMS}, num_hidden_layers=1, rope_theta=hf.rope_theta,
                                 attention_bias=False, mlp_bias=False)
            super().__init__(config, LlamaDecoderLayer, LlamaRotaryEmbedding)

    def one_layer(config, layer_type="full_attention"):
        """A copy of a transformers config with one layer of `layer_type`."""
        return type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1, "layer_types": [layer_type]})

    class Qwen3_5Block(CachedBlock):
        """qwen3_5's Qwen3_5DecoderLayer (full_attention) -> transformers' Qwen3_5DecoderLayer."""

        def __init__(self, vllm_config, layer_type, prefix=""):
            assert layer_type == "full_attention"
            config = one_layer(vllm_config.model_config.hf_text_config)
            super().__init__(config, Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding)

    class Qwen2Block(CachedBlock):
        """qwen2's Qwen2DecoderLayer (MiMo's mtp_block) -> transformers' Qwen2DecoderLayer."""

        def __init__(self, config, cache_config=None, quant_config=None, prefix=""):
            super().__init__(one_layer(config), Qwen2DecoderLayer, Qwen2RotaryEmbedding)

    class Placeholder:
        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def make_expert_params_mapping(*args, **kwargs):
            return []

    class WeightsMapper(Placeholder):
        def __or__(self, other):
            return self

    class IntermediateTensors(dict):
        pass

    def maybe_prefix(prefix, name):
        return f"{prefix}.{name}" if prefix else name

    def support_torch_compile(cls=None, **kwargs):
        """Identity, bare (`@support_torch_compile`) or configured (`@support_torch_compile(dynamic_arg_dims=...)`)."""
        return cls if cls is not None else (lambda c: c)

    def single_rank():
        return SimpleNamespace(is_first_rank=True, is_last_rank=True)

    _module("vllm.config", VllmConfig=Placeholder, CacheConfig=Placeholder, ModelConfig=Placeholder)
    _module("vllm.sequence", IntermediateTensors=IntermediateTensors)
    _module("vllm.compilation.decorators", support_torch_compile=support_torch_compile)
    _module("vllm.distributed.parallel_state", get_pp_group=single_rank)
    _module("vllm.distributed", get_pp_group=single_rank, tensor_model_parallel_all_gather=lambda x, dim=-1: x)
    _module("vllm.model_executor.layers.fused_moe", FusedMoE=Placeholder,
            fused_moe_make_expert_params_mapping=lambda *a, **k: [])
    _module("vllm.model_executor.layers.fused_moe.utils", is_model_fused_shared_expert_compatible=lambda *a, **k: False)
    _module("vllm.model_executor.layers.quantization", QuantizationConfig=Placeholder)
    _module("vllm.model_executor.layers.logits_processor", LogitsProcessor=LogitsProcessor)
    _module("vllm.model_executor.layers.linear", ColumnParallelLinear=ColumnParallelLinear)
    _module("vllm.model_executor.layers.vocab_parallel_embedding", VocabParallelEmbedding=VocabParallelEmbedding,
            ParallelLMHead=ParallelLMHead, DEFAULT_VOCAB_PADDING_SIZE=64)
    _module("vllm.model_executor.model_loader.weight_utils", default_weight_loader=lambda *a, **k: None,
            maybe_remap_kv_scale_name=lambda name, params: name)
    _module("vllm.model_executor.model_loader.mtp_validation", is_mtp_completeness_check_enabled=lambda *a: False)
    _module("vllm.model_executor.models.interfaces", SupportsPP=_empty_class("SupportsPP"),
            SupportsMultiModal=_empty_class("SupportsMultiModal"), LocalArgmaxMixin=_empty_class("LocalArgmaxMixin"),
            MultiModalEmbeddings=_empty_class("MultiModalEmbeddings"), _require_is_multimodal=unused)
    _module("vllm.model_executor.models.utils", maybe_prefix=maybe_prefix, AutoWeightsLoader=Placeholder,
            WeightsMapper=WeightsMapper, PPMissingLayer=Placeholder, is_pp_missing_parameter=lambda *a: False,
            make_empty_intermediate_tensors_factory=lambda *a: None, sequence_parallel_chunk=lambda x: x,
            maybe_fuse_shared_experts=lambda weights, **k: weights, _merge_multimodal_embeddings=unused,
            get_pp_missing_layer_names=lambda *a, **k: [], get_spec_layer_idx_from_weight_name=lambda *a: None)
    _module("vllm.model_executor.models.deepseek_v2", DeepseekV2DecoderLayer=DenseBlock,
            get_spec_layer_idx_from_weight_name=lambda *a: None, DeepseekV2MoE=_empty_class("DeepseekV2MoE"),
            DeepseekV2MixtureOfExperts=_empty_class("DeepseekV2MixtureOfExperts"), _try_load_fp8_indexer_wk=unused)
    _module("vllm.model_executor.models.qwen3_next", Qwen3NextDecoderLayer=DenseBlock,
            Qwen3NextRMSNorm=layernorm.GemmaRMSNorm,
            Qwen3NextModel=type("Qwen3NextModel", (), {"hf_to_vllm_mapper": WeightsMapper()}),
            Qwen3NextSparseMoeBlock=_empty_class("Qwen3NextSparseMoeBlock"),
            QwenNextMixtureOfExperts=_empty_class("QwenNextMixtureOfExperts"))
    _module("vllm.model_executor.models.qwen3_5", Qwen3_5DecoderLayer=Qwen3_5Block,
            Qwen3_5RMSNorm=layernorm.GemmaRMSNorm,
            Qwen3_5Model=type("Qwen3_5Model", (), {"hf_to_vllm_mapper": WeightsMapper()}))
    _module("vllm.model_executor.models.qwen2", Qwen2DecoderLayer=Qwen2Block)
    _module("vllm.transformers_utils.configs", Qwen3NextConfig=Placeholder)
    return files


def load_mtp(vllm_root: Path, layout: str) -> types.ModuleType:
    """The layout's original MTP file, executed (once) as its vLLM module."""
    name = "vllm.model_executor.models." + MTP_FILES[layout].removesuffix(".py")
    return sys.modules.get(name) or _load_original(name, vllm_root / "vllm/model_executor/models" / MTP_FILES[layout])


# ---------------------------------------------------------------- weights


def randomize(module, gen, zero_centered: bool):
    """Weights with clear margins: norms near 1 (offsets near 0 for (1 + w) norms), 1/sqrt(in) matrices."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                base = 0.0 if zero_centered and name.split(".")[-2] in ZERO_CENTERED else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or name.endswith("head.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


# Qwen3-Next's own (1 + w) norms, by module name; the dense block's norms stay plain.
ZERO_CENTERED = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def randomize_qwen3_5(module, gen):
    """Qwen3.5 weights with clear margins (the target's and the MTP predictor's alike).

    Its RMSNorms are zero-centred (x * (1 + w)): offsets near 0; the gated norm inside linear
    attention is plain (x * w): near 1. A_log, dt_bias and the short convolution 0.5 randn,
    embeddings and lm_head randn, matrices 1/sqrt(in).
    """
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("A_log", "dt_bias")) or "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or name.endswith("head.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def hf_tensors(module, layout: str, own_head: bool, start: int = 0) -> dict:
    """The MTP module's weights under the names a checkpoint stores them (torch [out, in]).

    DeepSeek: layers.{idx}.* -> model.layers.{idx}.* (the block's weights without `mtp_block.`);
    Qwen3-Next / Qwen3.5: * -> mtp.* (layers.{i}.* likewise); MiMo: mtp_layers.{start+i}.* ->
    model.mtp_layers.{i}.* (0-indexed, the block's weights without `mtp_block.`: vLLM's MiMoMTP
    maps them back). The predictor's own embed_tokens is the target's table here, so it is not
    stored again (nor shared_head.head unless `own_head`).
    """
    out = {}
    for name, p in module.state_dict().items():
        if name.startswith("embed_tokens") or (not own_head and "shared_head.head" in name):
            continue
        name = name.replace("mtp_block.layer.", "").replace(".layer.", ".")
        if layout == "mimo":
            name = re.sub(r"^mtp_layers\.(\d+)\.", lambda m: f"mtp_layers.{int(m.group(1)) - start}.", name)
        out[("mtp." if layout in ("qwen3_next", "qwen3_5") else "model.") + name] = p.detach().numpy().copy()
    return out


# ---------------------------------------------------------------- one case per layout


def target_inputs(target, gen, pre_norm: bool) -> dict:
    """Inputs from the target itself, as vLLM drives an MTP after a prefill.

    A random prompt t_0 .. t_{T-1}; the target's logits on it; root = their argmax at the last
    position; ids = prompt[1:] + [root] (row p pairs h_p with t_{p+1}); h_prev = the input of the
    target's final norm (`pre_norm`) or its output (the last_hidden_state that lm_head scores).
    """
    import torch

    prompt = torch.randint(3, DIMS["vocab_size"], (SEQ,), generator=gen)
    seen = []
    hook = target.model.norm.register_forward_hook(lambda mod, args, out: seen.append((args[0][0], out[0])))
    logits = target(prompt[None]).logits[0]
    hook.remove()
    h_prev = seen[0][0] if pre_norm else seen[0][1]
    root = logits[-1].argmax()
    return dict(prompt=prompt, ids=torch.cat([prompt[1:], root[None]]), positions=torch.arange(SEQ),
                h_prev=h_prev.detach().clone(), target_logits=logits.detach().clone())


def build_llama_case(spec: dict, mtp, gen) -> SimpleNamespace:
    """deepseek* / qwen3_next: a one-layer Llama target, the MTP tensors of the layout, fed its post-norm hidden."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layout, n = spec["layout"], spec["num_mtp"]
    hf = SimpleNamespace(**DIMS, dims=DIMS, num_hidden_layers=TARGET_LAYERS, rope_theta=spec["rope_theta"],
                         num_nextn_predict_layers=n)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), quant_config=None, lora_config=None,
                                  speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    target_cfg = LlamaConfig(**DIMS, num_hidden_layers=TARGET_LAYERS, rope_theta=spec["rope_theta"],
                             tie_word_embeddings=False)
    torch.manual_seed(spec["seed"])
    target = LlamaForCausalLM(target_cfg).eval()
    randomize(target, gen, zero_centered=False)
    if layout == "deepseek":
        model = mtp.DeepSeekMultiTokenPredictor(vllm_config=vllm_config, prefix="model")
        randomize(model, gen, zero_centered=False)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            if not spec.get("own_head"):
                for layer in model.layers.values():
                    layer.shared_head.head.weight.copy_(target.lm_head.weight)
        blocks = [model.layers[str(TARGET_LAYERS + j)].mtp_block for j in range(n)]

        def logits_of(h, step):
            return model.compute_logits(h, spec_step_idx=step)
    else:
        model = mtp.Qwen3NextMultiTokenPredictor(vllm_config=vllm_config, prefix="model")
        randomize(model, gen, zero_centered=True)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        blocks = list(model.layers)

        def logits_of(h, step):  # Qwen3NextMTP.compute_logits: the target's lm_head on the returned hidden
            return torch.nn.functional.linear(h, target.lm_head.weight)
    model.eval()

    tensors = hf_tensors(model, layout, spec.get("own_head", False))
    if layout == "deepseek" and spec.get("own_head"):  # the published checkpoints repeat the embedding per layer
        for j in range(n):
            tensors[f"model.layers.{TARGET_LAYERS + j}.embed_tokens.weight"] = (
                target.model.embed_tokens.weight.detach().numpy().copy())
    config = target_cfg.to_dict()
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    config.pop("dtype", None)
    config["num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"] = n
    stubbed = ["parallel layers (embedding, lm head, logits processor, column-parallel linear)",
               "decoder block -> transformers LlamaDecoderLayer", "vLLM infrastructure modules"]
    return SimpleNamespace(target=target, model=model, blocks=blocks, logits_of=logits_of, step_idx=lambda s: s,
                           inputs=target_inputs(target, gen, pre_norm=False), tensors=tensors, config=config,
                           stubbed=stubbed)


def build_qwen3_5_case(spec: dict, mtp, gen) -> SimpleNamespace:
    """qwen3_5: a Qwen3_5ForCausalLM target, vLLM's Qwen3_5MultiTokenPredictor fed its post-norm hidden."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    n = spec["num_mtp"]
    target_cfg = Qwen3_5TextConfig(**{**DIMS, **spec.get("dims", {})}, **QWEN3_5_TARGET, rope_parameters=dict(QWEN3_5_ROPE,
                                   rope_theta=spec["rope_theta"]), tie_word_embeddings=False, mtp_num_hidden_layers=n)
    torch.manual_seed(spec["seed"])
    target = Qwen3_5ForCausalLM(target_cfg).eval()
    randomize_qwen3_5(target, gen)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=target_cfg, hf_text_config=target_cfg),
                                  quant_config=None, lora_config=None)
    model = mtp.Qwen3_5MultiTokenPredictor(vllm_config=vllm_config, prefix="mtp")
    randomize_qwen3_5(model, gen)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    model.eval()

    def logits_of(h, step):  # Qwen3_5MTP.compute_logits: the target's lm_head on the returned hidden
        return torch.nn.functional.linear(h, target.lm_head.weight)

    config = target_cfg.to_dict()
    config.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", torch_dtype="float32",
                  mtp_num_hidden_layers=n)
    config.pop("dtype", None)
    stubbed = ["parallel layers (embedding, lm head, logits processor, column-parallel linear)",
               ("decoder block Qwen3_5DecoderLayer (full_attention) -> transformers Qwen3_5DecoderLayer "
                "(one-layer full_attention copy of the text config, Qwen3_5TextRotaryEmbedding)"),
               "MoE-only imports (Qwen3NextSparseMoeBlock, QwenNextMixtureOfExperts, fused shared experts -> off)",
               "vLLM infrastructure modules"]
    return SimpleNamespace(target=target, model=model, blocks=list(model.layers), logits_of=logits_of,
                           step_idx=lambda s: s, inputs=target_inputs(target, gen, pre_norm=False),
                           tensors=hf_tensors(model, "qwen3_5", own_head=False), config=config, stubbed=stubbed)


def build_mimo_case(spec: dict, mtp, gen) -> SimpleNamespace:
    """mimo: a Qwen2ForCausalLM target, vLLM's MiMoMultiTokenPredictor fed its pre-norm hidden."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    n = spec["num_mtp"]
    target_cfg = Qwen2Config(**DIMS, num_hidden_layers=MIMO_TARGET_LAYERS, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="default", rope_theta=spec["rope_theta"]))
    torch.manual_seed(spec["seed"])
    target = Qwen2ForCausalLM(target_cfg).eval()
    randomize(target, gen, zero_centered=False)
    hf = copy.deepcopy(target_cfg)  # MiMo-7B's config: a Qwen2 one plus num_nextn_predict_layers
    hf.num_nextn_predict_layers = n
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), cache_config=None, quant_config=None)
    model = mtp.MiMoMultiTokenPredictor(vllm_config=vllm_config, prefix="model")
    randomize(model, gen, zero_centered=False)
    lm_head = mtp.ParallelLMHead(DIMS["vocab_size"], DIMS["hidden_size"])  # MiMoMTP's lm_head: the target's
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        lm_head.weight.copy_(target.lm_head.weight)
    model.eval()

    def logits_of(h, step):
        return model.compute_logits(h, lm_head, spec_step_idx=step)

    config = target_cfg.to_dict()
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", torch_dtype="float32",
                  num_nextn_predict_layers=n)
    config.pop("dtype", None)
    stubbed = ["parallel layers (embedding, lm head, logits processor)",
               "decoder block Qwen2DecoderLayer -> transformers Qwen2DecoderLayer", "vLLM infrastructure modules"]
    blocks = [layer.mtp_block for layer in model.mtp_layers.values()]
    return SimpleNamespace(target=target, model=model, blocks=blocks, logits_of=logits_of, step_idx=lambda s: 0,
                           inputs=target_inputs(target, gen, pre_norm=True),
                           tensors=hf_tensors(model, "mimo", own_head=False, start=MIMO_TARGET_LAYERS), config=config,
                           stubbed=stubbed)


BUILDERS = {"deepseek": build_llama_case, "qwen3_next": build_llama_case, "qwen3_5": build_qwen3_5_case,
            "mimo": build_mimo_case}


def _split(out):
    """(hidden to score, hidden fed back) of one MTP forward.

    vllm 0.33.0's DeepSeekMultiTokenPredictorLayer returns the pair (h', shared_head(h')), as its
    proposers unpack it (`model_returns_tuple`: `last_hidden_states, hidden_states = ...`); the
    other layouts (and 0.11.0's deepseek_mtp.py) return one hidden, both scored and fed back.
    """
    return out if isinstance(out, tuple) else (out, out)


def drive(case: SimpleNamespace, spec: dict) -> dict:
    """Run the MTP as vLLM's proposer does; the io.npz arrays.

    Step 1, the prefill: every MTP layer over the true pairs (h_p, t_{p+1}), each into its own
    cache. Later steps s + 1 (s = 1, 2, ...): one token at position T - 1 + s, the previous step's
    argmax, fed the previous step's fed-back hidden (last row), spec_step_idx = case.step_idx(s)
    (layer = that % num_mtp). Logits come from the hidden to score (`_split`).
    """
    import torch

    model, n, inp = case.model, spec["num_mtp"], case.inputs
    io = {k: v.numpy().astype(np.int32) if k in ("prompt", "ids", "positions") else v.numpy() for k, v in inp.items()}

    def run(ids, pos, h, step, key):
        out = model(ids, pos, h.clone(), spec_step_idx=step)
        scored, fed = _split(out)
        logits = case.logits_of(scored, step)
        io[f"{key}_hidden"], io[f"{key}_logits"] = fed.numpy(), logits.numpy()
        if isinstance(out, tuple):
            io[f"{key}_prenorm"] = scored.numpy()
        return fed, logits

    with torch.no_grad():
        first = {j: run(inp["ids"], inp["positions"], inp["h_prev"], j, f"step1_l{j}") for j in range(n)}
        hid, logits = first[0][0][-1:], first[0][1][-1:]
        for s in range(1, spec["steps"]):
            tok = logits.argmax(-1)
            step = case.step_idx(s)
            io[f"step{s + 1}_ids"] = tok.numpy().astype(np.int32)
            io[f"step{s + 1}_layer"] = np.int32(step % n)
            hid, logits = run(tok, torch.tensor([SEQ - 1 + s]), hid, step, f"step{s + 1}")
    for j, block in enumerate(case.blocks):
        io[f"k{j}"], io[f"v{j}"] = block.kv()
    return io


def run_case(name: str, spec: dict, out_dir: Path, vllm_root: Path, vllm_files: list[str]):
    """Build the case's target and MTP module, run them, write its directory."""
    import torch
    import transformers
    from safetensors.numpy import save_file

    layout = spec["layout"]
    gen = torch.Generator().manual_seed(spec["seed"])
    case = BUILDERS[layout](spec, load_mtp(vllm_root, layout), gen)
    io = drive(case, spec)

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().numpy().copy() for k, v in case.target.state_dict().items()} | case.tensors
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(case_dir / "model.safetensors"))
    (case_dir / "config.json").write_text(json.dumps(case.config, indent=2, default=str))
    np.savez_compressed(case_dir / "io.npz", **io)
    meta = dict(layout=layout, num_mtp_layers=spec["num_mtp"], steps=spec["steps"], seed=spec["seed"],
                vllm_files=[f"vllm/model_executor/models/{MTP_FILES[layout]}", *vllm_files],
                vllm_version=_vllm_version(vllm_root), torch=torch.__version__,
                transformers=transformers.__version__, stubbed=case.stubbed)
    if IR_LAYERNORM in vllm_files:  # newer trees: the norms' math through vllm.ir
        meta["stubbed"] = [*case.stubbed, "vllm.ir op registry (register_op -> the decorated native function)"]
    meta.update(h_prev=H_PREV[layout], step_hidden=STEP_HIDDEN[layout])
    if "dims" in spec:
        meta["dims"] = spec["dims"]
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    print(f"{name}: {sorted(io)}")


def _vllm_version(root: Path) -> str:
    """The tree's version from vllm/_version.py (setuptools-scm writes it), else 'unknown'."""
    file = root / "vllm/_version.py"
    found = re.search(r"^__version__ = version = ['\"]([^'\"]+)", file.read_text(), re.M) if file.is_file() else None
    return found.group(1) if found else "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-repo", required=True, type=Path, help="vLLM source tree (checkout or unpacked wheel)")
    ap.add_argument("--out", default=Path("tests/fixtures/mtp"), type=Path)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    vllm_files = install_stubs(args.vllm_repo)
    for name in args.cases:
        run_case(name, CASES[name], args.out, args.vllm_repo, vllm_files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
