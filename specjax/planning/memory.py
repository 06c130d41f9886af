"""The memory plan: what one device of a tensor-parallel target holds, and what is left for a batch.

Per device, by the split of tensor_parallel.split_model: the target's weights (a quantized checkpoint's at their
quantized size: `weight_bytes`); its KV cache per cached token of one
row (K and V of every full-attention layer, its kv heads: split when n divides them, else all of them); a hybrid's
recurrent state per row (each Gated DeltaNet layer's fp32 state [Hv, dk, dv] and its conv window [K - 1, C] in
the model dtype, over the value heads and channels the device holds); and the draft's share: a drafter given
(its checkpoint's tensors, whole on every device), else the model's typical one. Free memory is the device's
capacity less all of it for `batch` rows of `context` cached tokens.

Typical drafts. A Qwen3.5 target: its own MTP layers (`mtp_num_hidden_layers`; each fc [2H, H], three norms and
one full-attention layer of the target, its MoE MLP on an MoE target; the embedding and lm_head are the target's).
They split as the target's layers do (the sharding rules apply to the MTP block); fc stays whole. Otherwise an
EAGLE-3 head of SafeAILab's layout at the target's widths (fc [3H, H], one decoder layer over 2H with an MLP of
the target's width, an lm_head over a 32000-token draft vocabulary: its Llama-3.1-8B head's shapes,
/work/shared/REFERENCE.md), replicated as the sharding work replicates EAGLE-3, DFlash and DSpark heads.
Each draft layer keeps its own KV cache over the context.

Not counted: activations and workspace of a pass, XLA's and NCCL's buffers (NVIDIA's aiconfigurator reserves
0.4 GB for NCCL on 8 GPUs: systems/h100_sxm.yaml `nccl_mem`), the per-node results a hybrid's verify pass keeps
(profile.hybrid_bytes), and JAX's allocator: it preallocates 75% of the device by default
(XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's GPU memory allocation docs), so set that fraction near 0.95 to use the
free memory this reports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import jax

from specjax.config import ModelConfig, text_config
from specjax.convert.hf_files import read_hf_config, safetensors_files
from specjax.convert.quantized import QuantScheme, bytes_per_weight
from specjax.drafters.eagle3 import Eagle3Config, param_shapes
from specjax.planning.profile import DEVICES, DTYPE_BYTES, DeviceSpec, check_tensor_parallel
from specjax.planning.tensor_parallel import TensorParallel, replicated, split_model

# The six cases of docs/planning.md's memory table: (model, tensor parallelism), each on an H100 80GB and an H200 141GB.
SERVED_CASES = (("Llama-3.3-70B", 8), ("Qwen3.5-27B", 2), ("Qwen3.5-122B-A10B", 8))
EAGLE3_DRAFT_VOCAB = 32000  # SafeAILab's EAGLE-3 heads' draft vocabulary (REFERENCE.md: lm_head [32000, H])
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclasses.dataclass(frozen=True)
class Draft:
    """One device's share of the draft: its weights, its KV cache per cached token of one row, and a hybrid draft
    model's recurrent state and conv windows per row (bytes)."""

    what: str
    weight_bytes: float
    kv_bytes_per_token: float
    state_bytes_per_row: float = 0.0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One device's memory (bytes) for a target split over `tensor_parallel` devices, at batch x context."""

    model: str
    device: str
    tensor_parallel: int
    capacity: float
    weight_bytes: float
    kv_bytes_per_token: float  # per row, per cached token
    state_bytes_per_row: float  # a hybrid's recurrent state and conv windows (0 for a transformer)
    draft: Draft
    batch: int
    context: int
    replicated: tuple[str, ...] = ()
    quantization: str = ""  # the checkpoint's quant_method ("" for bf16 / fp32 weights)

    @property
    def cache_bytes(self) -> float:
        """The target's KV cache and recurrent state for batch rows of context tokens."""
        return self.batch * (self.context * self.kv_bytes_per_token + self.state_bytes_per_row)

    @property
    def draft_bytes(self) -> float:
        return self.draft.weight_bytes + self.batch * (self.context * self.draft.kv_bytes_per_token +
                                                       self.draft.state_bytes_per_row)

    @property
    def free_bytes(self) -> float:
        return self.capacity - self.weight_bytes - self.cache_bytes - self.draft_bytes

    @property
    def max_batch(self) -> int:
        """Rows of `context` tokens that fit beside the weights (target's and draft's): 0 when none does."""
        per_row = self.context * (self.kv_bytes_per_token + self.draft.kv_bytes_per_token) + \
            self.state_bytes_per_row + self.draft.state_bytes_per_row
        room = self.capacity - self.weight_bytes - self.draft.weight_bytes
        return max(0, math.floor(room / per_row)) if per_row else 0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "cache_bytes": self.cache_bytes, "draft_bytes": self.draft_bytes,
                "free_bytes": self.free_bytes, "max_batch": self.max_batch}


def recurrent_bytes(cfg: ModelConfig, tp: TensorParallel) -> float:
    """One row's Gated DeltaNet memory on one device: per layer the fp32 state over the value heads it holds and
    the conv window (the last K - 1 inputs of the channels it holds, model dtype); 0 for a transformer."""
    lin = cfg.linear
    if lin is None:
        return 0.0
    state = lin.num_value_heads // tp.v_heads * lin.key_head_dim * lin.value_head_dim * 4
    conv = (lin.conv_kernel - 1) * (lin.conv_dim // tp.conv) * DTYPE_BYTES[str(cfg.dtype)]
    return float(len(cfg.linear_layers) * (state + conv))


def kv_bytes_per_token(cfg: ModelConfig, tp: TensorParallel, layers: int | None = None) -> float:
    """K and V of one cached token of one row on one device: `layers` full-attention layers (default: the
    target's) x the kv heads it holds x head_dim, in the model dtype."""
    layers = len(cfg.attention_layers) if layers is None else layers
    return float(2 * layers * (cfg.num_kv_heads // tp.kv_heads) * cfg.head_dim * DTYPE_BYTES[str(cfg.dtype)])


def mtp_draft(cfg: ModelConfig, tp: TensorParallel, layers: int) -> Draft:
    """`layers` MTP layers of a Qwen3.5 target (module docstring) on one device: fc [2H, H] and its three norms
    whole, the block (a full-attention layer of the target) split as the target's layers."""
    block = dataclasses.replace(cfg, num_layers=1, layer_types=(), linear=None)
    d = cfg.hidden_size
    per_layer = 2 * d * d + 3 * d + block.layer_params(0, shards=tp.shards)
    width = DTYPE_BYTES[str(cfg.dtype)]
    return Draft(f"{layers} MTP layer{'s' if layers > 1 else ''} (the model's own)", layers * per_layer * width,
                 kv_bytes_per_token(cfg, tp, layers))


def eagle3_draft(cfg: ModelConfig) -> Draft:
    """A typical EAGLE-3 head for `cfg` (module docstring), whole on every device: its params by the head's own
    shapes (drafters/eagle3.param_shapes), its one layer's KV cache."""
    head = Eagle3Config(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                        draft_vocab_size=EAGLE3_DRAFT_VOCAB, target_hidden_size=cfg.hidden_size,
                        feature_layers=(2, cfg.num_layers // 2, cfg.num_layers - 3), dtype=str(cfg.dtype),
                        config_head_dim=cfg.head_dim)
    shapes = param_shapes(head)
    d2t = math.prod(shapes.pop("d2t"))  # the draft -> target id map, int32
    count = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    return Draft("EAGLE-3 head (typical)",
                 count * DTYPE_BYTES[str(cfg.dtype)] + 4 * d2t, kv_bytes_per_token(cfg, TensorParallel(1), 1))


def typical_draft(cfg: ModelConfig, mtp_layers: int, tp: TensorParallel) -> Draft:
    """The model's own MTP layers when it has them, else a typical EAGLE-3 head."""
    return mtp_draft(cfg, tp, mtp_layers) if mtp_layers else eagle3_draft(cfg)


def checkpoint_draft(path: str | Path) -> Draft:
    """A drafter directory's share, whole on every device: its safetensors tensors as stored (their headers'
    dtypes and shapes; nothing is read beyond them) and a KV cache of its config's layers x kv heads x head_dim
    (in its dtype) per cached token; a hybrid draft model (Qwen3.5) caches K/V in its full-attention layers only
    and keeps a recurrent state and conv window per DeltaNet layer and row."""
    path = Path(path)
    files = safetensors_files(path)
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    hf = text_config(read_hf_config(path))
    if "linear_attention" in (hf.get("layer_types") or ()):
        cfg = ModelConfig.from_hf(hf)
        whole = split_model(cfg, 1)
        return Draft(f"drafter {path.name} (its checkpoint, replicated)", float(total),
                     kv_bytes_per_token(cfg, whole), recurrent_bytes(cfg, whole))
    layers, heads = int(hf.get("num_hidden_layers", 1)), int(hf["num_attention_heads"])
    kv_heads, head_dim = int(hf.get("num_key_value_heads") or heads), hf.get("head_dim") or hf["hidden_size"] // heads
    width = DTYPE_BYTES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", ""), 2)
    return Draft(f"drafter {path.name} (its checkpoint, replicated)", float(total),
                 float(2 * layers * kv_heads * head_dim * width))


def weight_bytes(cfg: ModelConfig, shards, scheme: QuantScheme | None = None) -> float:
    """One device's target weights in bytes: every parameter in the model dtype, except, for a quantized
    checkpoint, the linears specjax keeps quantized (convert/hf.py: attention (Qwen3.5's gated q_proj too), dense
    MLPs, a hybrid's linear_attn projections, routed experts (one module each or fused) and the shared expert; those
    the config's ignore list names stay plain) at `bytes_per_weight`; the embedding and lm_head count at the
    model dtype."""
    width = DTYPE_BYTES[str(cfg.dtype)]
    total = cfg.num_params(shards=shards) * width
    if scheme is None:
        return total
    quantized = sum(n for i in range(cfg.num_layers) for name, n in quantized_linears(cfg, i, shards).items()
                    if not scheme.ignored(f"model.layers.{i}.{name}"))
    return total - quantized * width + quantized * bytes_per_weight(scheme)


def quantized_linears(cfg: ModelConfig, i: int, shards) -> dict[str, float]:
    """Layer i's linears that stay quantized when stored so (module name inside the layer -> one device's count)."""
    share = (lambda count, axis: count / shards.get(axis, 1)) if shards else (lambda count, axis: count)
    d, hd = cfg.hidden_size, cfg.head_dim
    if cfg.layer_type(i) == "full_attention":
        qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
        out = {"self_attn.q_proj": share(d * qd * (2 if cfg.attn_output_gate else 1), "heads"),
               "self_attn.o_proj": share(d * qd, "heads"), "self_attn.k_proj": share(d * kvd, "kv_heads"),
               "self_attn.v_proj": share(d * kvd, "kv_heads")}
    else:
        lin = cfg.linear
        out = {"linear_attn.in_proj_qkv": share(d * lin.conv_dim, "conv"),
               "linear_attn.in_proj_z": share(d * lin.value_dim, "v_heads"),
               "linear_attn.in_proj_b": share(d * lin.num_value_heads, "v_heads"),
               "linear_attn.in_proj_a": share(d * lin.num_value_heads, "v_heads"),
               "linear_attn.out_proj": share(lin.value_dim * d, "v_heads")}
    if not cfg.is_sparse(i):
        return out | {f"mlp.{p}_proj": share(d * cfg.intermediate_size, "mlp") for p in ("gate", "up", "down")}
    moe = cfg.moe
    out |= {f"mlp.experts.{p}_proj": share(moe.num_experts * d * moe.expert_size, "experts")
            for p in ("gate", "up", "down")}
    if moe.shared_size:
        out |= {f"mlp.shared_expert.{p}_proj": share(d * moe.shared_size, "shared") for p in ("gate", "up", "down")}
    return out


def memory_plan(cfg: ModelConfig, model: str, device: DeviceSpec, n: int, batch: int, context: int,
                draft: Draft | None = None, mtp_layers: int = 0, scheme: QuantScheme | None = None) -> MemoryPlan:
    """One device's memory plan for `cfg` split over n devices of `device` (module docstring); `scheme`: the
    checkpoint's quantization (convert/quantized.read_scheme), whose quantized weights count at their size."""
    if batch < 1 or context < 0:
        raise ValueError(f"the memory plan needs --batch >= 1 and --context >= 0, got {batch} and {context}")
    if device.memory_bytes is None:
        known = sorted(k for k, d in DEVICES.items() if d.memory_bytes is not None)
        raise ValueError(f"{device.name} has no memory size in DEVICES: plan memory with --device {' or '.join(known)}")
    check_tensor_parallel(device, n)
    tp = split_model(cfg, n)
    return MemoryPlan(model, device.name, n, device.memory_bytes, weight_bytes(cfg, tp.shards, scheme),
                      kv_bytes_per_token(cfg, tp), recurrent_bytes(cfg, tp), draft or typical_draft(cfg, mtp_layers, tp),
                      batch, context, tuple(replicated(cfg, tp)), quantization=scheme.method if scheme else "")


def format_memory(plans: list[MemoryPlan]) -> str:
    """The plans as a Markdown table, per device, in GiB / MiB / KiB (powers of 2, as nvidia-smi counts)."""
    gib, mib, kib = 2.0**30, 2.0**20, 2.0**10
    lines = ["| model | device (memory) | TP | weights GiB | KV per token KiB | KV per 1k tokens MiB | recurrent state "
             "per row MiB | draft: weights GiB + KV per token KiB | batch x context | KV + state GiB | free GiB | "
             "max batch |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        model = f"{p.model} ({p.quantization})" if p.quantization else p.model
        lines.append(f"| {model} | {p.device} ({p.capacity / gib:.1f} GiB) | {p.tensor_parallel} | "
                     f"{p.weight_bytes / gib:.2f} | {p.kv_bytes_per_token / kib:.0f} | "
                     f"{p.kv_bytes_per_token * 1000 / mib:.1f} | {p.state_bytes_per_row / mib:.1f} | "
                     f"{p.draft.what}: {p.draft.weight_bytes / gib:.2f} + {p.draft.kv_bytes_per_token / kib:.0f} | "
                     f"{p.batch} x {p.context} | {p.cache_bytes / gib:.2f} | {p.free_bytes / gib:.2f} | "
                     f"{p.max_batch} |")
    notes = sorted({f"{p.model} at TP {p.tensor_parallel}: {note}" for p in plans for note in p.replicated})
    return "\n".join(lines + [f"replicated: {note}" for note in notes])
