"""Build the EAGLE-3 layout fixtures: tiny heads written as SpecForge, speculators, ModelOpt and DeepSpec write them,
and those producers' own code run on them (SafeAILab's layout: scripts/make_eagle3_fixtures.py).

    python scripts/make_eagle3_layout_fixtures.py --specforge-repo DIR --speculators-repo DIR --deepspec-repo DIR \\
        --out tests/fixtures/eagle3_layouts [--cases NAME ...]

Each producer is imported from the local checkout given (nothing is downloaded, no code of theirs is copied
here; CI never runs this script, the tests read only what it writes). What was run, per case:

  specforge          sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py `LlamaForCausalLMEagle3`,
                     imported alone: the `specforge`, `specforge.modeling` and `specforge.modeling.draft` package
                     __init__s are skipped (empty packages over the checkout's directories, so the file's own
                     imports of flex_attention.py, base.py, registry.py, utils.py, distributed.py are the
                     checkout's); torch.compile is disabled (TORCHDYNAMO_DISABLE) so its compiled RMSNorm and RoPE
                     run eagerly. Driven through its training-time-test path (`backbone` with `cache_hidden`, sdpa
                     attention, `compute_logits`), the argmax draft of each row fed back (as a target id, d2t):
                     row p at step s is the chain drafted after the prefix 0..p. Saved as SpecForge's SGLang export
                     saves it (specforge/export/to_sglang.py: the model's state dict without the embedding, through
                     `save_pretrained`; sharded here, with model.safetensors.index.json), in bf16; config.json in the
                     published form (configs/qwen3-8b-eagle3.json's keys): head_dim 16 with hidden / heads 8,
                     rope_theta 1e6.
  speculators_llama  vllm-project/speculators src/speculators `Eagle3DraftModel` (models/eagle3/core.py), imported
  speculators_qwen3  from src/ with two stand-ins: `importlib.metadata.version("speculators")` answers the
                     checkout's commit (it is not pip-installed) and `speculators.train.data` (training data
                     loading: openai, datasets, hs_connectors) is a module holding only its `BatchType` alias;
                     without loguru installed, its `logger` is a standard-library logger.
                     Config built by its own `Eagle3SpeculatorConfig` / `SpeculatorsConfig`, saved by its own
                     `save_pretrained` (config.json and model.safetensors exactly as speculators writes them; the
                     copy of speculators' config.py it adds for `auto_map` is deleted, being their code).
                     Driven through its `forward` (ttt_steps 3, sdpa attention, explicit position ids 0..T-1,
                     teacher-forced tokens: row p at step s is fed ids[p + s - 1]) with forward hooks recording
                     lm_head's logits and the last layer's output each step. llama: 2 layers, norm_before_residual
                     true, top-level eagle_aux_hidden_state_layer_ids [1, 3, 5] (vLLM's numbering), draft vocab 64,
                     fp16. qwen3: 1 layer (q/k norms), norm_before_residual false, no ids (default taps), full
                     vocabulary (no d2t / t2d), rope_theta 1e6, fp32.
  modelopt           NVIDIA ModelOpt's exporter needs its training wrapper around a base model
                     (modelopt/torch/export/plugins/hf_spec_export.py `EagleExporter`), so the checkpoint is written
                     here with exactly its key set and config: `LLAMA_EAGLE_SINGLE_LAYER`'s keys (layers.{i}.*, fc,
                     norm; d2t and lm_head optional, left out: full vocabulary, the target's lm_head; no t2d, no
                     embedding) and `llama_eagle_template_config`'s fields (eagle_config with ModelOpt's flags, ids
                     in ModelOpt's "output of layer" numbering, rope_theta 10000 and the YaRN rope_scaling its
                     exporter writes by default, speculative/config.py `eagle_export_rope_scaling`), in bf16. Its served semantics are vLLM's llama_eagle3.py
                     (layer 0 over the 2H concat, layers 1.. plain Llama layers, norm_before_residual off); the
                     numbers come from speculators' Eagle3DraftModel with the same weights, which runs those
                     semantics (llama layer config with the same YaRN, norm_before_residual false, lm_head = the
                     target's).
                     Two layers.
  deepspec           deepseek-ai/DeepSpec `Qwen3Eagle3Model` (deepspec/modeling/eagle3/qwen3/modeling.py) with the
                     config of its own `build_draft_config` on a tiny transformers Qwen3 target (7 layers,
                     target_layer_ids [0, 1, 2, 4, 5]), driven by its evaluator's `_init_context` and `_propose`
                     (deepspec/eval/eagle3/evaluator.py, bound to a stand-in holding the drafter: greedy, three
                     drafts) on the target's own hidden states; a forward hook records the prefill's hidden
                     states, and `compute_logits` scores them. Saved by `save_pretrained` (embed_tokens and the
                     full-vocabulary lm_head included) in bf16.

  EAGLE-3.1 heads (the same drivers):
  speculators_eagle31   speculators' Eagle3DraftModel with fc_norm and norm_output (models/eagle3/core.py: an
                        RMSNorm per tap before fc; the final norm's output fed back and scored), llama, 2 layers,
                        draft vocab 64, ids [1, 3, 5], bf16. Its step{s}_hidden is what is fed back: the hook sits
                        on the final norm (`model.norm`), not the last layer.
  speculators_norm_before_fc   the older variant: one RMSNorm over the concatenated taps (`input_norm`), qwen3,
                        1 layer, norm_output off, fp32.
  specforge_fc_norm     SpecForge's LlamaForCausalLMEagle3 at the fetched commit with configs/
                        qwen3-30B-A3B-eagle3.1.json's flags (fc_norm true, norm_output true): at that commit
                        (before its PR #879) norm_output true means normed logits with the pre-norm output fed back,
                        plain EAGLE-3 (`compute_logits`, algorithms/eagle3/model.py); saved as `case_specforge`.
  specforge_eagle_config  the same SpecForge code and saving, config with the `eagle_config` SpecForge's own
                        configs carry (configs/deepseek-v3-671b-eagle3.json: custom ids [0, 3, 5] and
                        `use_aux_hidden_state`, a key ModelOpt's configs have too) over `midlayer.*` tensors.

Weights are random (norms 1 + 0.1 N(0,1), matrices and lm_heads N(0,1)/sqrt(fan-in), embeddings N(0,1)), rounded to the stored
dtype and run in fp32. Each case directory holds the checkpoint, io.npz and meta.json:
    features_BTF [B, T, n*Ht]          target features (the taps concatenated in the head's order)
    step1_ids [B, T]                   row p's paired token (the last row's: the root)
    step{s}_hidden [B, T, H], step{s}_logits [B, T, Vd]   s = 1 (prefill) .. S (speculators, SpecForge,
                                       ModelOpt): row p at step s is step s of the chain drafted after prefix 0..p
    step{s}_ids [B, T]                 the token row p is fed at step s >= 2
    chain_tokens [B, K + 1], chain_logits [B, K, Vd]     DeepSpec: its evaluator's proposal (root, drafts) and
                                       the logits each draft came from
    target_embed [V, H]                the embedding the head reads when it has none of its own
    target_lm_head [V, H]              ModelOpt: the target's lm_head that scores it

Round trip (a head specjax exported, in its producer's code):

    python scripts/make_eagle3_layout_fixtures.py --speculators-repo DIR ... --round-trip HEAD --target TARGET

loads HEAD with the producer's own loading (speculators and DeepSpec: `from_pretrained`; SpecForge: the model
class on HEAD's config + `load_state_dict`; ModelOpt: HEAD's tensors into speculators' model under the same
names, the target's lm_head where it has none, as vLLM loads them), runs it on random features (SpecForge,
speculators, ModelOpt: the prefill and two chain steps per row; DeepSpec: the prefill, `extend_draft_cache`), and
checks specjax's head read from HEAD gives the same logits (1e-4 of the largest, fp32). Nothing is written; the
exit status says whether they match. CI never runs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SpecForge decorates its RMSNorm and RoPE with torch.compile

HEAD = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=128,
            rms_norm_eps=1e-6)
TARGET_LAYERS = 7
CASES = ("specforge", "speculators_llama", "speculators_qwen3", "modelopt", "deepspec", "speculators_eagle31",
         "speculators_norm_before_fc", "specforge_fc_norm", "specforge_eagle_config")
PRODUCER = {"specforge": "specforge", "speculators_llama": "speculators", "speculators_qwen3": "speculators",
            "modelopt": "speculators", "deepspec": "deepspec", "speculators_eagle31": "speculators",
            "speculators_norm_before_fc": "speculators", "specforge_fc_norm": "specforge",
            "specforge_eagle_config": "specforge"}


# ---- the producers, imported from their checkouts ------------------------------------------------------------


def commit_of(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def import_specforge(repo: Path):
    """specforge/modeling/draft/llama3_eagle.py without the package __init__s (see the module docstring)."""
    for name, sub in (("specforge", ""), ("specforge.modeling", "modeling"),
                      ("specforge.modeling.draft", "modeling/draft")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(repo / "specforge" / sub)]
        sys.modules[name] = pkg
    return importlib.import_module("specforge.modeling.draft.llama3_eagle")


def import_speculators(repo: Path):
    """speculators from src/ with its version lookup and training-data module stood in (module docstring)."""
    real_version = importlib.metadata.version
    commit = commit_of(repo)
    importlib.metadata.version = lambda name: f"0.0.0+{commit[:7]}" if name == "speculators" else real_version(name)
    data = types.ModuleType("speculators.train.data")
    data.BatchType = dict
    sys.modules["speculators.train.data"] = data
    try:
        import loguru  # noqa: F401 (speculators' loading helpers log through it)
    except ImportError:
        import logging

        sys.modules["loguru"] = types.SimpleNamespace(logger=logging.getLogger("speculators"))
    sys.path.insert(0, str(repo / "src"))
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return types.SimpleNamespace(Config=Eagle3SpeculatorConfig, Model=Eagle3DraftModel,
                                 SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
                                 Greedy=GreedyTokenProposalConfig)


def import_deepspec(repo: Path):
    sys.path.insert(0, str(repo))
    from deepspec.eval.eagle3.evaluator import Qwen3Eagle3Evaluator
    from deepspec.modeling.eagle3 import extract_eagle3_context_feature
    from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model, build_draft_config

    return types.SimpleNamespace(Model=Qwen3Eagle3Model, build_draft_config=build_draft_config,
                                 Evaluator=Qwen3Eagle3Evaluator, features=extract_eagle3_context_feature)


# ---- shared pieces ----------------------------------------------------------------------------------------------


def randomize(torch, model, dtype, seed: int) -> None:
    """Random weights (module docstring), rounded to `dtype` and kept in fp32; NaN placeholders overwritten too."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:  # lm_head too: logits O(1), so 1e-5 absolute is a float32-sized tolerance
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            p.copy_(p.to(dtype).to(torch.float32))


def draft_vocab(torch, vocab: int, draft: int, seed: int):
    """(d2t int64, t2d bool) of a random sorted draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(vocab, generator=gen)[:draft]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft), t2d


def inputs(torch, batch: int, seq: int, width: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(batch, seq, width, generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen)


def write_meta(case_dir: Path, torch, **fields) -> None:
    meta = dict(fields, torch=torch.__version__, transformers=importlib.metadata.version("transformers"))
    (case_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def save_npz(case_dir: Path, arrays: dict) -> None:
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(case_dir / "io.npz", **{k: np.asarray(v) for k, v in arrays.items()})


def to_target(d2t, draft_ids):
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


# ---- SpecForge ----------------------------------------------------------------------------------------------------


SPECFORGE_CONFIG = {  # configs/qwen3-8b-eagle3.json's keys, scaled down
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 2048, "max_window_layers": TARGET_LAYERS, "model_type": "llama",
    "num_hidden_layers": 1, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "draft_vocab_size": 64, **HEAD}


def specforge_model(torch, mod, raw: dict):
    from transformers import LlamaConfig

    config = LlamaConfig(**raw)
    config.draft_vocab_size = raw["draft_vocab_size"]
    for flag in ("fc_norm", "norm_output"):  # EAGLE-3.1 flags llama3_eagle.py reads with getattr
        if flag in raw:
            setattr(config, flag, raw[flag])
    return mod.LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()


def specforge_steps(torch, model, features, ids, d2t, steps: int) -> dict:
    """SpecForge's training-time test (backbone + cache_hidden), each row's argmax draft fed back."""
    b, t = ids.shape
    mask = model.prepare_decoder_attention_mask(torch.ones(b, t, dtype=torch.bool), features, b, t, 0)
    positions = torch.arange(t).unsqueeze(0)
    cache = [[], []]
    hidden, tok, out = model.project_hidden_states(features), ids, {}
    for s in range(1, steps + 1):
        hidden = model.backbone(model.embed_input_ids(tok), hidden, cache, mask, positions, use_cache=False)
        logits = model.compute_logits(hidden)
        out.update({f"step{s}_ids": tok, f"step{s}_hidden": hidden, f"step{s}_logits": logits})
        tok = to_target(d2t, logits.argmax(-1))
    return out


SPECFORGE_FC_NORM_CONFIG = {**SPECFORGE_CONFIG, "fc_norm": True, "norm_output": True}  # qwen3-30B-A3B-eagle3.1.json
SPECFORGE_EAGLE_CONFIG = {**SPECFORGE_CONFIG, "eagle_config": {  # configs/deepseek-v3-671b-eagle3.json's form
    "eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True}}


def case_specforge(torch, repos, out_dir: Path, seed: int = 0, name: str = "specforge",
                   raw: dict = SPECFORGE_CONFIG) -> None:
    mod = import_specforge(repos["specforge"])
    model = specforge_model(torch, mod, raw)
    assert (model.fc_norm is not None) == bool(raw.get("fc_norm"))
    randomize(torch, model, torch.bfloat16, seed)
    d2t, t2d = draft_vocab(torch, HEAD["vocab_size"], raw["draft_vocab_size"], seed)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    features, ids = inputs(torch, 2, 7, 3 * HEAD["hidden_size"], HEAD["vocab_size"], seed)
    with torch.no_grad():
        steps = specforge_steps(torch, model, features, ids, model.d2t, 3)
    case_dir = out_dir / name
    save_npz(case_dir, {"features_BTF": features, "target_embed": model.embed_tokens.weight.detach(),
                        **{k: v.detach() for k, v in steps.items()}})
    model.to(torch.bfloat16)
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}  # to_sglang.py's filter
    model.save_pretrained(case_dir, state_dict=state, max_shard_size="20KB")
    (case_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_meta(case_dir, torch, producer="sgl-project/SpecForge", commit=commit_of(repos["specforge"]), seed=seed)


# ---- speculators (and ModelOpt's layout, whose semantics it runs) ------------------------------------------------


def speculators_config(sp, layer: dict, *, draft_vocab: int, norm_before_residual: bool, ids, **flags):
    from transformers import AutoConfig

    layer_cfg = AutoConfig.for_model(**layer)
    layer_cfg._attn_implementation = "sdpa"  # see speculators_steps
    return sp.Config(
        transformer_layer_config=layer_cfg, draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=ids, **flags,
        speculators_config=sp.SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[sp.Greedy(speculative_tokens=3)], default_proposal_method="greedy",
            verifier=sp.VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))


def speculators_steps(torch, model, features, ids, steps: int) -> dict:
    """speculators' Eagle3DraftModel.forward (its training-time test, teacher-forced) with hooks on lm_head and the
    last layer. sdpa attention: its bool masks extend correctly across steps (the eager path's float masks would be
    extended with 0/1 entries by extend_dense_mask_for_draft_tokens)."""
    logits, hidden = [], []
    fed_back = model.norm if model.config.norm_output else model.layers[-1]  # what the next step reads
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach())),
             fed_back.register_forward_hook(lambda m, i, o: hidden.append(
                 (o[0] if isinstance(o, tuple) else o).detach()))]
    b, t = ids.shape
    assert b == 1, "speculators' forward packs documents into one row"
    model(hidden_states=features, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
          position_ids=torch.arange(t).unsqueeze(0), ttt_steps=steps)
    for h in hooks:
        h.remove()
    out = {}
    for s in range(1, steps + 1):
        tok = torch.cat([ids[:, s - 1:], ids.new_zeros(1, s - 1)], dim=1)  # core.py's teacher forcing
        out.update({f"step{s}_ids": tok, f"step{s}_hidden": hidden[s - 1], f"step{s}_logits": logits[s - 1]})
    return out


SPECULATORS_CASES = {
    "speculators_llama": dict(layer=dict(model_type="llama", num_hidden_layers=2, head_dim=8, rope_theta=10000.0,
                                         max_position_embeddings=2048, tie_word_embeddings=False),
                              draft_vocab=64, norm_before_residual=True, ids=[1, 3, 5], dtype="float16", seed=1),
    "speculators_qwen3": dict(layer=dict(model_type="qwen3", num_hidden_layers=1, head_dim=8, rope_theta=1000000.0,
                                         max_position_embeddings=2048, tie_word_embeddings=False),
                              draft_vocab=HEAD["vocab_size"], norm_before_residual=False, ids=None, dtype="float32",
                              seed=2),
    "speculators_eagle31": dict(layer=dict(model_type="llama", num_hidden_layers=2, head_dim=8, rope_theta=10000.0,
                                           max_position_embeddings=2048, tie_word_embeddings=False),
                                draft_vocab=64, norm_before_residual=True, ids=[1, 3, 5], dtype="bfloat16", seed=5,
                                flags=dict(fc_norm=True, norm_output=True)),
    "speculators_norm_before_fc": dict(layer=dict(model_type="qwen3", num_hidden_layers=1, head_dim=8,
                                                  rope_theta=1000000.0, max_position_embeddings=2048,
                                                  tie_word_embeddings=False),
                                       draft_vocab=HEAD["vocab_size"], norm_before_residual=False, ids=None,
                                       dtype="float32", seed=6, flags=dict(norm_before_fc=True)),
}


def speculators_model(torch, sp, spec: dict):
    layer = {**HEAD, **spec["layer"]}
    config = speculators_config(sp, layer, draft_vocab=spec["draft_vocab"],
                                norm_before_residual=spec["norm_before_residual"], ids=spec["ids"],
                                **spec.get("flags", {}))
    model = sp.Model(config).eval()
    randomize(torch, model, getattr(torch, spec["dtype"]), spec["seed"])
    if model.d2t is not None:
        d2t, t2d = draft_vocab(torch, HEAD["vocab_size"], spec["draft_vocab"], spec["seed"])
        model.load_vocab_mappings(t2d, d2t)
    return model


def case_speculators(torch, repos, out_dir: Path, name: str) -> None:
    sp = import_speculators(repos["speculators"])
    spec = SPECULATORS_CASES[name]
    model = speculators_model(torch, sp, spec)
    features, ids = inputs(torch, 1, 7, 3 * HEAD["hidden_size"], HEAD["vocab_size"], spec["seed"])
    with torch.no_grad():
        steps = speculators_steps(torch, model, features, ids, 3)
    case_dir = out_dir / name
    save_npz(case_dir, {"features_BTF": features, **steps})
    model.to(getattr(torch, spec["dtype"])).save_pretrained(case_dir)
    (case_dir / "config.py").unlink(missing_ok=True)  # save_pretrained's copy of speculators' own config class
    write_meta(case_dir, torch, producer="vllm-project/speculators", commit=commit_of(repos["speculators"]),
               seed=spec["seed"])


MODELOPT_KEYS = {"layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
                 "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
                 "layers.0.mlp.down_proj", "layers.0.hidden_norm", "layers.0.input_layernorm",
                 "layers.0.post_attention_layernorm", "norm", "fc"}  # hf_spec_export.py LLAMA_EAGLE_SINGLE_LAYER


MODELOPT_EXPORT_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}  # config.py
#   EagleConfig.eagle_export_rope_scaling's default, which _export_config writes for a head trained at default RoPE


def modelopt_config(num_layers: int, ids: list[int]) -> dict:
    """llama_eagle_template_config (hf_spec_configs.py) as EagleExporter._export_config fills it."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": HEAD["hidden_size"], "initializer_range": 0.01, "intermediate_size": HEAD["intermediate_size"],
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": HEAD["num_attention_heads"],
            "num_key_value_heads": HEAD["num_key_value_heads"], "num_hidden_layers": num_layers, "pad_token_id": 0,
            "rms_norm_eps": HEAD["rms_norm_eps"], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": importlib.metadata.version("transformers"), "use_cache": True,
            "vocab_size": HEAD["vocab_size"], "draft_vocab_size": HEAD["vocab_size"],
            "rope_scaling": dict(MODELOPT_EXPORT_ROPE), "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 8, "mlp_bias": False, "pretraining_tp": 1, "rope_theta": 10000,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                             "parallel_draft_heads_num_layers": 1}}


def modelopt_tensors(state: dict, num_layers: int) -> dict:
    """The exporter's key set: the head's own tensors, no embedding, no t2d, no lm_head (the target's), no d2t."""
    keep = {}
    for name, value in state.items():
        base = name.rsplit(".", 1)[0]
        generic = ".".join(["layers", "0", *base.split(".")[2:]]) if base.startswith("layers.") else base
        if generic in MODELOPT_KEYS and not (base.startswith("layers.") and int(base.split(".")[1]) > 0
                                             and generic.endswith("hidden_norm")):
            keep[name] = value.contiguous()
    assert all(f"layers.{i}.self_attn.q_proj.weight" in keep for i in range(num_layers))
    return keep


def case_modelopt(torch, repos, out_dir: Path, seed: int = 3) -> None:
    from safetensors.torch import save_file

    sp = import_speculators(repos["speculators"])
    spec = dict(layer=dict(model_type="llama", num_hidden_layers=2, head_dim=8, max_position_embeddings=2048,
                           rope_parameters={**MODELOPT_EXPORT_ROPE, "rope_theta": 10000.0}, tie_word_embeddings=False),
                draft_vocab=HEAD["vocab_size"], norm_before_residual=False, ids=[2, 3, 4], dtype="bfloat16",
                seed=seed)
    model = speculators_model(torch, sp, spec)  # hidden_states 2, 3, 4 = ModelOpt ids 1, 2, 3
    gen = torch.Generator().manual_seed(200 + seed)
    target_lm_head = torch.randn(HEAD["vocab_size"], HEAD["hidden_size"], generator=gen) / HEAD["hidden_size"] ** 0.5
    with torch.no_grad():
        model.lm_head.weight.copy_(target_lm_head)
    features, ids = inputs(torch, 1, 7, 3 * HEAD["hidden_size"], HEAD["vocab_size"], seed)
    with torch.no_grad():
        steps = speculators_steps(torch, model, features, ids, 3)
    case_dir = out_dir / "modelopt"
    save_npz(case_dir, {"features_BTF": features, "target_embed": model.embed_tokens.weight.detach(),
                        "target_lm_head": target_lm_head, **steps})
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_file(modelopt_tensors(state, 2), str(case_dir / "model.safetensors"))  # EagleExporter.export: save_file
    (case_dir / "config.json").write_text(json.dumps(modelopt_config(2, [1, 2, 3]), indent=4))
    write_meta(case_dir, torch, producer="NVIDIA/Model-Optimizer layout; numbers from vllm-project/speculators",
               commit=commit_of(repos["speculators"]), modelopt_commit=commit_of(repos["modelopt"])
               if repos.get("modelopt") else "not given", seed=seed)


# ---- DeepSpec -----------------------------------------------------------------------------------------------------


DEEPSPEC_TARGET = dict(HEAD, num_hidden_layers=TARGET_LAYERS, head_dim=8, max_position_embeddings=512,
                       rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


class ModelArgs(dict):
    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


def case_deepspec(torch, repos, out_dir: Path, seed: int = 4) -> None:
    import transformers

    ds = import_deepspec(repos["deepspec"])
    torch.manual_seed(seed)
    target = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DEEPSPEC_TARGET)).eval()
    randomize(torch, target, torch.float32, seed)
    cfg = ds.build_draft_config(target_config=target.config, model_args=ModelArgs(
        target_model_name_or_path="tiny-qwen3", target_layer_ids=[0, 1, 2, 4, 5], ttt_length=3, step_loss_decay=0.8,
        draft_num_hidden_layers=1))
    cfg._attn_implementation = "sdpa"  # what its evaluator loads it with
    model = ds.Model(cfg).eval()
    randomize(torch, model, torch.bfloat16, seed + 1)
    t = 7
    prompt = torch.randint(3, HEAD["vocab_size"], (1, t), generator=torch.Generator().manual_seed(300 + seed))
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True)
        root = out.logits[:, -1].argmax(-1, keepdim=True)
        output_ids = torch.cat([prompt, root, torch.zeros(1, 8, dtype=torch.long)], dim=1)
        position_ids = torch.arange(output_ids.shape[1]).unsqueeze(0)
        hidden = []
        hook = model.layers[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach()))
        evaluator = types.SimpleNamespace(draft_model=model, max_proposal_tokens=3,
                                          args=types.SimpleNamespace(temperature=0.0))
        context = ds.Evaluator._init_context(evaluator, initial_output=out, output_ids=output_ids,
                                             position_ids=position_ids, num_input_tokens=t)
        hook.remove()
        logits = []
        hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
        proposal = ds.Evaluator._propose(evaluator, context=context, output_ids=output_ids, position_ids=position_ids,
                                         start=t)
        hook.remove()
        step1_hidden = hidden[0]
        step1_logits = model.compute_logits(step1_hidden)
    features = ds.features(out.hidden_states, model.target_layer_ids)
    ids = torch.cat([prompt[:, 1:], root], dim=1)  # _init_context's shifted_prompt_ids
    case_dir = out_dir / "deepspec"
    save_npz(case_dir, {"features_BTF": features, "step1_ids": ids, "step1_hidden": step1_hidden,
                        "step1_logits": step1_logits, "chain_tokens": proposal.verify_input_ids,
                        "chain_logits": torch.cat(logits, dim=1)})
    model.to(torch.bfloat16).save_pretrained(case_dir)
    write_meta(case_dir, torch, producer="deepseek-ai/DeepSpec", commit=commit_of(repos["deepspec"]), seed=seed)


# ---- round trip: a specjax export in its producer's code ---------------------------------------------------------


def specjax_steps(head_dir: Path, target, features, ids, step_ids: list) -> dict:
    """specjax's head read from head_dir over the same inputs: step 1 every row, then each row's chain."""
    import jax
    import jax.numpy as jnp

    from specjax.convert.eagle3 import load_eagle3
    from specjax.drafters.eagle3 import head_of, init_head_cache
    from specjax.models.cache import KVCache

    cfg, host = load_eagle3(head_dir, target.cfg, "float32")
    params = dict(host)
    params.setdefault("embed", np.asarray(target.params["embed"], np.float32))
    if cfg.lm_head == "target":
        params["lm_head"] = np.asarray(target.params["lm_head"], np.float32)
    head = head_of(cfg, jax.tree.map(jnp.asarray, params))
    b, t = ids.shape
    cache = init_head_cache(cfg, b * t, 64)
    h, cache = head.midlayer(jnp.asarray(np.repeat(ids, t, 0)), head.fuse(jnp.asarray(np.repeat(features, t, 0))),
                             cache, attn_impl="xla")
    out = {"step1_logits": np.asarray(head.draft_logits(h))[::t]}
    rows = np.arange(b * t) % t
    h = h[np.arange(b * t), rows][:, None]
    for s, tok in enumerate(step_ids, start=2):
        h, cache = head.midlayer(jnp.asarray(tok.reshape(b * t, 1)), h,
                                 KVCache(cache.k, cache.v, jnp.asarray(rows + 1 + s - 2, jnp.int32)), attn_impl="xla")
        out[f"step{s}_logits"] = np.asarray(head.draft_logits(h)).reshape(b, t, -1)
    return out


def producer_steps(torch, repos: dict, layout: str, head_dir: Path, target, features, ids) -> dict:
    """The producer's own code on head_dir (see the module docstring): logits of step 1 and of each row's chain."""
    from safetensors.torch import load_file

    if layout == "specforge":
        mod = import_specforge(repos["specforge"])
        raw = json.loads((head_dir / "config.json").read_text())
        model = specforge_model(torch, mod, raw)
        state = {}
        for f in sorted(head_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        state.setdefault("embed_tokens.weight", torch.from_numpy(np.asarray(target.params["embed"], np.float32)))
        missing, unexpected = model.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                     for k, v in state.items()}, strict=False)
        assert not unexpected and not [k for k in missing if "inv_freq" not in k], (missing, unexpected)
        return specforge_steps(torch, model.eval(), features, ids, model.d2t, 3)
    if layout in ("speculators", "modelopt"):
        sp = import_speculators(repos["speculators"])
        if layout == "speculators":  # its from_pretrained reads the verifier named in the config: the target
            import shutil
            import tempfile

            copy = Path(tempfile.mkdtemp()) / head_dir.name
            shutil.copytree(head_dir, copy)
            raw = json.loads((copy / "config.json").read_text())
            raw["speculators_config"]["verifier"]["name_or_path"] = str(Path(target.path).absolute())
            (copy / "config.json").write_text(json.dumps(raw))
            model = sp.Model.from_pretrained(str(copy), torch_dtype=torch.float32).eval()
            from torch.nn.attention.flex_attention import create_mask

            # sdpa, as Eagle3DraftModel.__init__ sets it up for that implementation (see speculators_steps)
            model.config.transformer_layer_config._attn_implementation = "sdpa"
            model._attn_impl, model._create_mask_fn = "sdpa", create_mask
        else:  # vLLM's loading of a ModelOpt export: the same names, the target's lm_head when it has none
            raw = json.loads((head_dir / "config.json").read_text())
            layer = {k: raw[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "intermediate_size", "rms_norm_eps", "vocab_size", "num_hidden_layers",
                                         "max_position_embeddings")}
            layer["rope_parameters"] = {**(raw.get("rope_scaling") or {"rope_type": "default"}),
                                        "rope_theta": raw.get("rope_theta", 10000.0)}
            ids_hs = [i + 1 for i in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
            model = speculators_model(torch, sp, dict(layer=dict(layer, model_type="llama"), seed=0,
                                                      draft_vocab=raw["draft_vocab_size"], dtype="float32",
                                                      norm_before_residual=False, ids=ids_hs))
            state = {k: v.float() if v.is_floating_point() else v
                     for k, v in load_file(str(head_dir / "model.safetensors")).items()}
            state.setdefault("lm_head.weight", torch.from_numpy(np.asarray(target.params["lm_head"]).T.copy()))
            state["embed_tokens.weight"] = torch.from_numpy(np.asarray(target.params["embed"], np.float32))
            model.load_state_dict(state, strict=False)
        if model.embed_tokens.weight.isnan().any():
            model.embed_tokens.weight.data.copy_(torch.from_numpy(np.asarray(target.params["embed"], np.float32)))
        return speculators_steps(torch, model, features, ids, 3)
    ds = import_deepspec(repos["deepspec"])
    model = ds.Model.from_pretrained(str(head_dir), torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    hidden = []
    hook = model.layers[0].register_forward_hook(lambda m, i, o: hidden.append(o.detach()))
    model.extend_draft_cache(hidden_states=features, input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                             past_key_values=__import__("transformers").DynamicCache())
    hook.remove()
    return {"step1_logits": model.compute_logits(hidden[0])}


def round_trip(torch, repos: dict, head_dir: Path, target_dir: Path, tol: float = 1e-4) -> bool:
    """A head directory (specjax's export) in its producer's code against specjax's reading of it (module
    docstring): the producer's step-1 and chain logits against specjax's, at tol."""
    import specjax
    from specjax.convert.eagle3_layouts import head_layout

    target = specjax.load(target_dir, dtype="float32", attn_impl="xla")
    layout = head_layout(json.loads((head_dir / "config.json").read_text()))
    if layout == "safeailab":
        raise SystemExit("SafeAILab heads: scripts/make_eagle3_fixtures.py --round-trip")
    from specjax.convert.eagle3 import load_eagle3

    cfg, _ = load_eagle3(head_dir, target.cfg, "float32")
    features, ids = inputs(torch, 1, 7, cfg.num_taps * cfg.target_hidden_size, cfg.vocab_size, 7)
    with torch.no_grad():
        theirs = producer_steps(torch, repos, layout, head_dir, target, features, ids)
    steps = [theirs[f"step{s}_ids"].numpy() for s in range(2, 10) if f"step{s}_ids" in theirs]
    ours = specjax_steps(head_dir, target, features.numpy(), ids.numpy(), steps)
    ok = True
    for name, value in ours.items():
        want = theirs[name].numpy()
        diff = float(np.max(np.abs(value - want)))
        print(f"{layout} {name}: max |specjax - producer| = {diff:.2e} (max |logit| {np.abs(want).max():.2f})")
        ok &= diff <= tol * max(1.0, float(np.abs(want).max()))
    print(f"round trip {'OK' if ok else 'MISMATCH'}: {head_dir} ({layout})")
    return ok


def run_case(torch, name: str, repos: dict, out_dir: Path) -> None:
    if name == "specforge":
        case_specforge(torch, repos, out_dir)
    elif name == "specforge_fc_norm":
        case_specforge(torch, repos, out_dir, seed=8, name=name, raw=SPECFORGE_FC_NORM_CONFIG)
    elif name == "specforge_eagle_config":
        case_specforge(torch, repos, out_dir, seed=9, name=name, raw=SPECFORGE_EAGLE_CONFIG)
    elif name.startswith("speculators"):
        case_speculators(torch, repos, out_dir, name)
    elif name == "modelopt":
        case_modelopt(torch, repos, out_dir)
    else:
        case_deepspec(torch, repos, out_dir)
    print(f"{name}: {sorted(p.name for p in (out_dir / name).iterdir())}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specforge-repo", type=Path)
    ap.add_argument("--speculators-repo", type=Path)
    ap.add_argument("--deepspec-repo", type=Path)
    ap.add_argument("--modelopt-repo", type=Path, help="only recorded in modelopt's meta.json (its code is not run)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    ap.add_argument("--round-trip", type=Path, metavar="DIR", help="instead: DIR in its producer's code vs specjax")
    ap.add_argument("--target", type=Path, help="with --round-trip: the head's target (specjax checkpoint or HF dir)")
    args = ap.parse_args(argv)
    repos = {"specforge": args.specforge_repo, "speculators": args.speculators_repo,
             "deepspec": args.deepspec_repo, "modelopt": args.modelopt_repo}
    import torch

    torch.set_num_threads(1)
    if args.round_trip is not None:
        if args.target is None:
            ap.error("--round-trip needs --target")
        return 0 if round_trip(torch, repos, args.round_trip, args.target) else 1
    if args.out is None:
        ap.error("give --out (or --round-trip)")
    missing = sorted({PRODUCER[c] for c in args.cases if repos[PRODUCER[c]] is None})
    if missing:
        ap.error(f"the cases asked for need --{' --'.join(m + '-repo' for m in missing)}")
    for name in args.cases:
        run_case(torch, name, repos, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
