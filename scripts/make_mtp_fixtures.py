"""Build the MTP parity fixtures by running vLLM's own MTP modules on tiny random weights.

    python scripts/make_mtp_fixtures.py --vllm-repo /path/to/vllm --out tests/fixtures/mtp

--vllm-repo is a vLLM source tree: a git checkout, or an unpacked wheel (the fixtures committed
here came from the vllm 0.11.0 wheel's sources). Nothing is downloaded and no vLLM code is
copied into specjax; CI never runs this script, the tests read only what it writes.

What is ORIGINAL vLLM code, executed unchanged from the given tree:
  * vllm/model_executor/models/deepseek_mtp.py: `DeepSeekMultiTokenPredictorLayer` (embedding
    masked at position 0, enorm / hnorm, concat [embedding, hidden], eh_proj, block, residual
    add), `DeepSeekMultiTokenPredictor` (layer = spec_step_idx % num_mtp_layers, embed_tokens,
    compute_logits = shared_head.head(shared_head.norm(h))) and `SharedHead`.
  * vllm/model_executor/models/qwen3_next_mtp.py: `Qwen3NextMultiTokenPredictor` (embedding,
    pre_fc_norm_embedding / pre_fc_norm_hidden, concat [embedding, hidden], fc, layer
    spec_step_idx % n, final `norm` with the residual) — its forward returns the post-norm
    hidden, which is what vLLM feeds back to the next step; the logits are the target's
    lm_head applied to it (`Qwen3NextMTP.compute_logits`).
  * vllm/model_executor/layers/layernorm.py: `RMSNorm` and `GemmaRMSNorm` (their
    `forward_native` PyTorch paths). Qwen3-Next's `Qwen3NextRMSNorm` is vLLM's alias of
    GemmaRMSNorm (x * (1 + w)), so the Qwen3-Next layout's own norms come from that code too.

What is STUBBED (small plain-torch modules put in sys.modules before those files are loaded):
  * vLLM's infrastructure: vllm.config, vllm.envs, vllm.logger, vllm.platforms (not ROCm),
    vllm.utils, vllm.sequence, vllm.compilation.decorators (support_torch_compile = identity),
    vllm.distributed (a single pipeline rank), CustomOp (forward = forward_native), the fused-MoE,
    quantization, weight-loader and model-utils helpers (only weight loading uses them; the
    weights are set directly here).
  * The parallel layers, as their single-device meaning: VocabParallelEmbedding (a lookup in a
    [V, H] weight), ParallelLMHead (a [V, H] weight), LogitsProcessor (h @ head.weight^T),
    ColumnParallelLinear (a bias-free nn.Linear).
  * The inner decoder block. specjax's targets are dense decoders, so the MTP block is a dense
    layer of the target's family: `DeepseekV2DecoderLayer` (MLA + MoE in vLLM) and
    `Qwen3NextDecoderLayer` (gated attention + MoE in vLLM) are replaced by transformers'
    `LlamaDecoderLayer` (original transformers code, eager attention) with its own KV cache
    (transformers' DynamicCache), attention visible to cached positions <= the query's. vLLM's
    layers return (hidden, residual) with the residual add deferred to the caller; the stub
    returns (layer output, zeros), whose sum the original callers form.
The inputs (token ids, positions, the previous hidden states) are random; the block's RoPE is
Llama's default (theta from the case's config).

Each case directory holds
  config.json, model.safetensors   a tiny dense target (LlamaForCausalLM, one layer, untied
                                   lm_head) carrying the MTP tensors in the case's layout, as a
                                   checkpoint would: what specjax converts and reads back;
  io.npz                           ids [T] (t_1 .. t_T), positions [T] (0 .. T-1), h_prev [T, H];
                                   for each step s: step{s}_layer (MTP layer used), step{s}_hidden
                                   (the module's return: what vLLM feeds back), step{s}_logits;
                                   step 1 is the prefill over the T rows (one per MTP layer in
                                   the deepseek2 case: step1_l{j}_*), later steps one token at
                                   position T + s - 2 fed the previous step's hidden and argmax;
                                   k{j}, v{j}: layer j's K/V [Hkv, rows, D] after all steps
                                   (RoPE applied, rows in the order written);
  meta.json                        versions, layout, settings.
"""

from __future__ import annotations

import argparse
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
}
DIMS = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            vocab_size=96, rms_norm_eps=1e-6, max_position_embeddings=256)
TARGET_LAYERS = 1
SEQ = 6


# ---------------------------------------------------------------- stubs for vLLM's infrastructure


def _module(name: str, **attrs) -> types.ModuleType:
    """A stub module registered under `name` (parents created as empty packages)."""
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


def install_stubs(vllm_root: Path):
    """Stub vLLM's infrastructure, load its layernorm.py, then stub the layers the MTP files import."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    class CustomOp(nn.Module):
        op_registry_oot: dict = {}

        @classmethod
        def register(cls, name):
            return lambda op_cls: op_cls

        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

    _module("vllm.envs", VLLM_ROCM_USE_AITER_RMSNORM=False, VLLM_ROCM_USE_AITER=False)
    _module("vllm.model_executor.custom_op", CustomOp=CustomOp)
    _module("vllm.platforms", current_platform=SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: False))
    _module("vllm.utils", direct_register_custom_op=lambda *a, **k: None)
    layernorm = _load_original("vllm.model_executor.layers.layernorm",
                               vllm_root / "vllm/model_executor/layers/layernorm.py")

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

    class DenseBlock(nn.Module):
        """In place of vLLM's decoder layer: transformers' LlamaDecoderLayer with its own KV cache."""

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__()
            hf = vllm_config.model_config.hf_config
            self.llama_config = LlamaConfig(**{k: hf.dims[k] for k in DIMS}, rope_theta=hf.rope_theta,
                                            attention_bias=False, mlp_bias=False)
            self.llama_config._attn_implementation = "eager"
            self.layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
            self.rotary = LlamaRotaryEmbedding(self.llama_config)
            self.use_attn_reduce_scatter_for_moe = False
            self.reset()

        def reset(self):
            self.cache = DynamicCache()
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

    class Placeholder:
        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def make_expert_params_mapping(*args, **kwargs):
            return []

    class IntermediateTensors(dict):
        pass

    def maybe_prefix(prefix, name):
        return f"{prefix}.{name}" if prefix else name

    _module("vllm.config", VllmConfig=Placeholder)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.sequence", IntermediateTensors=IntermediateTensors)
    _module("vllm.compilation.decorators", support_torch_compile=lambda cls: cls)
    _module("vllm.distributed.parallel_state",
            get_pp_group=lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True))
    _module("vllm.model_executor.layers.fused_moe", FusedMoE=Placeholder)
    _module("vllm.model_executor.layers.quantization", QuantizationConfig=Placeholder)
    _module("vllm.model_executor.layers.logits_processor", LogitsProcessor=LogitsProcessor)
    _module("vllm.model_executor.layers.linear", ColumnParallelLinear=ColumnParallelLinear)
    _module("vllm.model_executor.layers.vocab_parallel_embedding", VocabParallelEmbedding=VocabParallelEmbedding,
            ParallelLMHead=ParallelLMHead, DEFAULT_VOCAB_PADDING_SIZE=64)
    _module("vllm.model_executor.model_loader.weight_utils", default_weight_loader=lambda *a, **k: None)
    _module("vllm.model_executor.models.interfaces", SupportsPP=object)
    _module("vllm.model_executor.models.utils", maybe_prefix=maybe_prefix, AutoWeightsLoader=Placeholder,
            is_pp_missing_parameter=lambda *a: False,
            make_empty_intermediate_tensors_factory=lambda *a: None)
    _module("vllm.model_executor.models.deepseek_v2", DeepseekV2DecoderLayer=DenseBlock,
            get_spec_layer_idx_from_weight_name=lambda *a: None)
    _module("vllm.model_executor.models.qwen3_next", Qwen3NextDecoderLayer=DenseBlock,
            Qwen3NextRMSNorm=layernorm.GemmaRMSNorm)
    _module("vllm.transformers_utils.configs", Qwen3NextConfig=Placeholder)
    models = vllm_root / "vllm/model_executor/models"
    return (_load_original("vllm.model_executor.models.deepseek_mtp", models / "deepseek_mtp.py"),
            _load_original("vllm.model_executor.models.qwen3_next_mtp", models / "qwen3_next_mtp.py"))


# ---------------------------------------------------------------- one case


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
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


# Qwen3-Next's own (1 + w) norms, by module name; the dense block's norms stay plain.
ZERO_CENTERED = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def hf_tensors(module, layout: str, own_head: bool) -> dict:
    """The MTP module's weights under the names a checkpoint stores them (torch [out, in]).

    DeepSeek: layers.{idx}.* -> model.layers.{idx}.* (the block's weights without `mtp_block.`);
    Qwen3-Next: * -> mtp.* (layers.{i}.* likewise). The predictor's own embed_tokens is the
    target's table here, so it is not stored again (nor shared_head.head unless `own_head`).
    """
    out = {}
    for name, p in module.state_dict().items():
        if name.startswith("embed_tokens") or (not own_head and "shared_head.head" in name):
            continue
        name = name.replace("mtp_block.layer.", "").replace(".layer.", ".")
        out[("model." if layout == "deepseek" else "mtp.") + name] = p.detach().numpy().copy()
    return out


def run_case(name: str, spec: dict, mods, out_dir: Path, vllm_root: Path):
    import torch
    import transformers
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    deepseek_mtp, qwen3_next_mtp = mods
    layout, n = spec["layout"], spec["num_mtp"]
    gen = torch.Generator().manual_seed(spec["seed"])
    hf = SimpleNamespace(**DIMS, dims=DIMS, num_hidden_layers=TARGET_LAYERS, rope_theta=spec["rope_theta"],
                         num_nextn_predict_layers=n)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), quant_config=None, lora_config=None)
    target_cfg = LlamaConfig(**DIMS, num_hidden_layers=TARGET_LAYERS, rope_theta=spec["rope_theta"],
                             tie_word_embeddings=False)
    torch.manual_seed(spec["seed"])
    target = LlamaForCausalLM(target_cfg).eval()
    randomize(target, gen, zero_centered=False)
    if layout == "deepseek":
        model = deepseek_mtp.DeepSeekMultiTokenPredictor(vllm_config=vllm_config, prefix="model")
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
        model = qwen3_next_mtp.Qwen3NextMultiTokenPredictor(vllm_config=vllm_config, prefix="model")
        randomize(model, gen, zero_centered=True)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        blocks = list(model.layers)

        def logits_of(h, step):  # Qwen3NextMTP.compute_logits: the target's lm_head on the returned hidden
            return torch.nn.functional.linear(h, target.lm_head.weight)
    model.eval()

    ids = torch.randint(3, DIMS["vocab_size"], (SEQ,), generator=gen)
    positions = torch.arange(SEQ)
    h_prev = 2.0 * torch.randn(SEQ, DIMS["hidden_size"], generator=gen)
    io = dict(ids=ids.numpy().astype(np.int32), positions=positions.numpy().astype(np.int32), h_prev=h_prev.numpy())
    with torch.no_grad():
        # Step 1, the prefill: every MTP layer over the true pairs (h_p, t_{p+1}), each into its own cache.
        first = {}
        for j in range(n):
            hid = model(ids, positions, h_prev.clone(), spec_step_idx=j)
            first[j] = (hid, logits_of(hid, j))
            io[f"step1_l{j}_hidden"], io[f"step1_l{j}_logits"] = hid.numpy(), first[j][1].numpy()
        hid, logits = first[0][0][-1:], first[0][1][-1:]
        # Later steps: layer s % n at position T - 1 + s, fed the previous step's hidden and argmax.
        for s in range(1, spec["steps"]):
            tok = logits.argmax(-1)
            pos = torch.tensor([SEQ - 1 + s])
            hid = model(tok, pos, hid.clone(), spec_step_idx=s)
            logits = logits_of(hid, s)
            io[f"step{s + 1}_ids"] = tok.numpy().astype(np.int32)
            io[f"step{s + 1}_layer"] = np.int32(s % n)
            io[f"step{s + 1}_hidden"], io[f"step{s + 1}_logits"] = hid.numpy(), logits.numpy()
    for j, block in enumerate(blocks):
        io[f"k{j}"], io[f"v{j}"] = block.kv()

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().numpy().copy() for k, v in target.state_dict().items()}
    tensors |= hf_tensors(model, layout, spec.get("own_head", False))
    if layout == "deepseek" and spec.get("own_head"):  # the published checkpoints repeat the embedding per layer
        for j in range(n):
            tensors[f"model.layers.{TARGET_LAYERS + j}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(case_dir / "model.safetensors"))
    config = target_cfg.to_dict()
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    config.pop("dtype", None)
    config["num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"] = n
    (case_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    np.savez_compressed(case_dir / "io.npz", **io)
    meta = dict(layout=layout, num_mtp_layers=n, steps=spec["steps"], seed=spec["seed"],
                vllm_files=["vllm/model_executor/models/deepseek_mtp.py" if layout == "deepseek"
                            else "vllm/model_executor/models/qwen3_next_mtp.py",
                            "vllm/model_executor/layers/layernorm.py"],
                vllm_version=_vllm_version(vllm_root), torch=torch.__version__,
                transformers=transformers.__version__,
                stubbed=["parallel layers (embedding, lm head, logits processor, column-parallel linear)",
                         "decoder block -> transformers LlamaDecoderLayer", "vLLM infrastructure modules"])
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
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    mods = install_stubs(args.vllm_repo)
    for name in args.cases:
        run_case(name, CASES[name], mods, args.out, args.vllm_repo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
