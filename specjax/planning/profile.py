"""The cost side of planning: how long one verify round and one draft take, estimated or measured.

Two sources, one interface (`CostModel`: verify_s(batch, nodes) and draft_s(batch, depth)):

- `Roofline`: verify of T = batch x nodes tokens costs
  max(weight_bytes / bandwidth, 2 x params x T / peak_flops) + KV bytes read / bandwidth,
  the usual decode roofline (attention FLOPs and activations ignored). Below the knee
  T* = peak x weight_bytes / (2 x params x bandwidth) more tokens per pass are free; above
  it each token costs its FLOPs. Known devices in DEVICES; an 8B bf16 model on an H100 has
  its knee at ~295 tokens per pass. A mixture of experts reads its shared weights once and,
  per sparse layer, only the experts the pass's tokens route to: E (1 - (1 - k/E)^T) under
  uniform routing, or a measured curve (`routing_curve`); its FLOPs are the active params'.
  More tokens per pass read more experts, so verification is not free below the knee.
- `Profile`: times measured on this device by `profile()` (one verify round: forward +
  lm_head + acceptance + commit, several rounds per jitted call as the loop runs them,
  median of repeats; and the drafter's propose), interpolated piecewise-linearly in T.
  Saved as JSON keyed by device kind, model and dtype (and the mesh's shape, "tp8",
  for a target on a mesh, where the passes run split as the loops run them), so one
  file can hold several machines' profiles.

Draft time: `relative_draft` (a fixed fraction of one target step per drafted level, the
published model's assumption) or a profile's measured propose times (linear in depth).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, MoeConfig, SamplingConfig
from specjax.decoding.drafter import PrefillContext, Settings
from specjax.decoding.request import bucket, round_cache_length
from specjax.decoding.tree import ancestor_mask, chain, depths, spec_arrays
from specjax.decoding.verify import Draft, verify
from specjax.models.model import merge
from specjax.models.moe import distinct_experts, routed_experts
from specjax.models.sharding import axis_size, constrain_cache, mesh_label, place_batch, use_mesh
from specjax.models.target import format_count
from specjax.multihost import agreed
from specjax.planning.tensor_parallel import TensorParallel, replicated, split_model


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Memory bandwidth (bytes/s) and dense matmul peaks (FLOP/s): 16-bit, and full fp32 (specjax's fp32 dots
    do not use TF32); for tensor parallelism the memory one device holds (bytes), its NVLink bandwidth per
    direction (bytes/s) and the latency of a small NCCL all-reduce by device count ((n, seconds) pairs)."""

    name: str
    bandwidth: float
    peak_flops: float
    source: str
    peak_flops_fp32: float | None = None  # None: same as peak_flops
    memory_bytes: float | None = None
    link_bandwidth: float | None = None  # None: no multi-device link known (tensor parallelism refused)
    allreduce_latency: tuple[tuple[int, float], ...] = ()
    max_tensor_parallel: int = 1  # devices one link domain joins (an HGX board: 8)

    def peak_for(self, dtype: str) -> float:
        return (self.peak_flops_fp32 or self.peak_flops) if dtype == "float32" else self.peak_flops

    def latency(self, n: int) -> float:
        """A small collective's fixed cost over n devices: the measured all-reduce latency, linear in n between
        the measured counts (0 on one device)."""
        if n == 1:
            return 0.0
        return interp(n, [k for k, _ in self.allreduce_latency], [s for _, s in self.allreduce_latency])

    def allreduce_s(self, n: int, nbytes: float) -> float:
        """A ring all-reduce of `nbytes` over n devices: latency + 2 (n - 1) / n x bytes / link bandwidth (each
        device sends and receives 2 (n - 1) / n of the buffer, reduce-scatter then all-gather)."""
        return 0.0 if n == 1 else self.latency(n) + 2 * (n - 1) / n * nbytes / self.link_bandwidth

    def allgather_s(self, n: int, nbytes: float) -> float:
        """A ring all-gather whose result is `nbytes` on every device: latency + (n - 1) / n x bytes / link
        bandwidth (the all-reduce's latency: a measured all-gather's is lower, so this is the safe side)."""
        return 0.0 if n == 1 else self.latency(n) + (n - 1) / n * nbytes / self.link_bandwidth


# NVLink 4 (H100 SXM and H200 alike): 900 GB/s per GPU in both directions together (18 links of 50 GB/s,
# NVIDIA's H100 and H200 datasheets), 450 GB/s each way; a ring all-reduce sends and receives at once, so the
# per-direction figure is the one the ring runs at (ai-dynamo/aiconfigurator systems/h100_sxm.yaml and
# h200_sxm.yaml: intra_node_bw 450e9 "per gpu, single direction").
NVLINK4_PER_DIRECTION = 450e9
# NCCL all-reduce latency on 2, 4 and 8 GPUs of one HGX board: nccl-tests all_reduce_perf (out-of-place time,
# fp16, the smallest message: 512 bytes), NCCL 2.29.2, as NVIDIA's aiconfigurator collected it
# (collector/network/collect_nccl.py) in aic-core/src/aiconfigurator_core/systems/data/{h100_sxm,h200_sxm}/comm/
# nccl/*/nccl_perf.parquet (snapshot 095f58a). The same tables put the ring formula within 10% of the measured
# time at 16 KB and at 512 MB on 8 GPUs (bus bandwidth there 445 GB/s on H100, 459 on H200), and 1.5-2.1x below
# it between 1 and 16 MiB (38.6 us measured at 1 MiB on 8 H100s against 19.6 modelled), where NCCL changes protocol. scripts/gpu_checks.sh times
# jax's all-reduce on the machine it runs on when it has more than one GPU.
H100_ALLREDUCE_LATENCY = ((2, 6.2e-6), (4, 9.5e-6), (8, 15.5e-6))
H200_ALLREDUCE_LATENCY = ((2, 6.0e-6), (4, 9.3e-6), (8, 16.0e-6))
# Memory per device: nvidia-smi's memory.total, 81559 MiB (H100 80GB HBM3) and 143771 MiB (H200), as widely logged.
H100_MEMORY = 81559 * 2**20
H200_MEMORY = 143771 * 2**20

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("NVIDIA H100 SXM", 3.35e12, 989e12, "datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, "
                       "67 TFLOP/s fp32", 67e12, H100_MEMORY, NVLINK4_PER_DIRECTION, H100_ALLREDUCE_LATENCY, 8),
    "h200": DeviceSpec("NVIDIA H200", 4.3e12, 790e12,
                       "measured on one H200: ~4.3 TB/s device copy (4.8 TB/s nominal), ~790 TFLOP/s bf16 matmul; "
                       "fp32 from the H100 datasheet (same chip)", 67e12, H200_MEMORY, NVLINK4_PER_DIRECTION,
                       H200_ALLREDUCE_LATENCY, 8),
    # The 2-core x86-64 machine these sessions run on, fp32, measured with `measure_device()`:
    # a jitted sum over 512 MB read 31 GB/s; a jitted 1024^2 / 2048^2 matmul ran 178-223 GFLOP/s.
    "cpu": DeviceSpec("2-core x86-64 CPU (fp32)", 31e9, 2.0e11, "measured here: jnp.sum read 31 GB/s, matmul 200 GFLOP/s"),
}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Qwen/Qwen3-30B-A3B's config.json (the fields specjax reads): 48 layers, every MLP 128 experts of 768, 8 per token.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 151643, "eos_token_id": 151645,
                 "torch_dtype": "bfloat16"}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {sorted(DEVICES)}, or pass a profile JSON file")
    return DEVICES[name]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """verify_s(batch, nodes): one verify round; draft_s(batch, depth): the rest of a round (drafting, loop
    bookkeeping); plain_s(batch): one plain decoding step when measured (None: verify_s(batch, 1)). Seconds."""

    verify_s: Callable[[int, int], float]
    draft_s: Callable[[int, int], float]
    source: str
    plain_s: Callable[[int], float] | None = None
    collective_s: Callable[[int, int], float] | None = None  # the collectives inside verify_s (tensor parallel)


# ---------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A roofline verify-time estimate for one model on one device, at a given cache length.

    Under tensor parallelism (`tensor_parallel` = n > 1) every figure is one device's share (what it holds, reads
    and computes: tensor_parallel.split_model), and each pass adds its collectives (`collective_s`), which run
    between the matmuls that need them and so add to the pass rather than hide under it."""

    device: DeviceSpec
    params: float  # matmul parameters (2 FLOPs each per token)
    weight_bytes: float  # bytes read once per pass
    kv_bytes_per_position: float = 0.0  # K and V bytes of one cached position of one row, all attention layers
    cache_len: int = 0  # cached positions each row's attention reads
    state_bytes_per_row: float = 0.0  # a hybrid's Gated DeltaNet states, all layers, one row (fp32)
    node_bytes: float = 0.0  # per draft node per row: the DeltaNet results a verify pass keeps for commit
    state_flops_per_token: float = 0.0  # the delta rule's state reads and updates per token (not in params)
    expert_bytes: float = 0.0  # one expert of every sparse layer; weight_bytes then holds only the shared weights
    experts: MoeConfig | None = None  # the routing (E, k) behind experts_read
    routing: tuple[tuple[int, float], ...] = ()  # measured (tokens per pass, distinct experts per sparse layer)
    tensor_parallel: int = 1  # devices the model is split over
    allreduces: int = 0  # all-reduces of the [tokens, hidden] activation per pass
    activation_bytes: float = 0.0  # one token's hidden activation (model dtype)
    logits_bytes: float = 0.0  # per token, what the vocabulary-split lm_head exchanges (0: the vocabulary is whole)
    gather_logits: bool = False  # True: the fp32 logits all-gathered; False: each device's argmax all-reduced
    replicated: tuple[str, ...] = ()  # what stays whole on every device (tensor_parallel.replicated)

    @classmethod
    def for_config(cls, cfg, device: DeviceSpec, cache_len: int = 0, tensor_parallel: int = 1,
                   sampled: bool = False) -> "Roofline":
        """From a ModelConfig: params and bytes at its dtype, KV per position from the attention layers x kv heads
        x head_dim, and for a hybrid its recurrent state (`hybrid_bytes`); with tensor_parallel = n, one device's
        share of each and the pass's collectives (`collectives`; sampled: the logits are gathered)."""
        check_tensor_parallel(device, tensor_parallel)
        tp = split_model(cfg, tensor_parallel)
        shards = tp.shards if tp.n > 1 else None
        width = DTYPE_BYTES[str(cfg.dtype)]
        params = cfg.num_params(active=True, shards=shards)
        kv = 2 * len(cfg.attention_layers) * (cfg.num_kv_heads // tp.kv_heads) * cfg.head_dim * width
        peak = device.peak_for(str(cfg.dtype))
        state, node, flops = hybrid_bytes(cfg, tp)
        one_expert = 0 if cfg.moe is None else \
            len(cfg.moe.sparse_layers) * cfg.moe.expert_params(cfg.hidden_size) / tp.experts
        shared = cfg.num_params(shards=shards) - (0 if cfg.moe is None else one_expert * cfg.moe.num_experts)
        return cls(dataclasses.replace(device, peak_flops=peak), params, shared * width, kv, cache_len, state, node,
                   flops, one_expert * width, cfg.moe, (), tp.n, *collectives(cfg, tp, sampled),
                   replicated=tuple(replicated(cfg, tp)))

    def with_routing(self, routing: Sequence[tuple[int, float]]) -> "Roofline":
        """This roofline with a measured routing curve (tokens per pass -> distinct experts per sparse layer)."""
        return dataclasses.replace(self, routing=tuple((int(t), float(e)) for t, e in sorted(routing)))

    def experts_read(self, tokens: int) -> float:
        """Distinct experts one sparse layer reads in a pass of `tokens`: the measured curve (interpolated; past its
        end, each token missing an expert with the probability the last point implies, E (1 - f^(T / T_last)) with
        f = 1 - D_last / E, which reaches every expert as T grows), else uniform routing's expectation; 0 for a
        dense model."""
        if self.experts is None:
            return 0.0
        if not self.routing:
            return self.experts.expected_experts(tokens)
        xs, ys = [t for t, _ in self.routing], [e for _, e in self.routing]
        if tokens <= xs[-1]:
            return interp(tokens, xs, ys)
        e = float(self.experts.num_experts)
        return e * (1.0 - max(0.0, 1.0 - ys[-1] / e) ** (tokens / xs[-1]))

    def weights_read(self, tokens: int) -> float:
        """Bytes of the weights one pass of `tokens` touches (all of them for a dense model)."""
        return self.weight_bytes + self.expert_bytes * self.experts_read(tokens)

    def weights_s(self, tokens: int) -> float:
        return self.weights_read(tokens) / self.device.bandwidth

    @property
    def knee(self) -> float:
        """Tokens per pass where compute time reaches weight-read time (for an MoE, with the experts T reads).
        One device's: a split that divides every weight evenly divides both sides by n and leaves the knee
        where it was; the collectives are outside it (they grow with the tokens below the knee too)."""
        per_token = 2 * self.params / self.device.peak_flops
        if self.experts is None:
            return self.weights_s(1) / per_token
        lo, hi = 1.0, 1e7  # compute grows linearly, the experts read saturate: one crossing
        for _ in range(100):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if per_token * mid < self.weights_s(int(mid)) else (lo, mid)
        return lo

    def verify_s(self, batch: int, nodes: int) -> float:
        """One verify pass of `nodes` per row and its commit. A hybrid's DeltaNet state is read by the pass and
        read and written by the commit (3 x the state), and each node's results are written and read back."""
        state = batch * (3 * self.state_bytes_per_row + 2 * nodes * self.node_bytes)
        return self._pass_s(batch * nodes, batch * self.cache_len * self.kv_bytes_per_position + state)

    def plain_s(self, batch: int) -> float:
        """One plain decoding step: the recurrence reads and writes each row's state once."""
        return self._pass_s(batch, batch * (self.cache_len * self.kv_bytes_per_position + 2 * self.state_bytes_per_row))

    def describe(self) -> str:
        """What this roofline prices, for a CostModel's source."""
        experts = "" if self.experts is None else \
            f", experts read by {'measured' if self.routing else 'uniform'} routing"
        split = "" if self.tensor_parallel == 1 else (
            f", tensor parallel {self.tensor_parallel} (per device; {self.allreduces} all-reduces of the hidden "
            f"activation, {self.activation_bytes:.0f} bytes a token, per pass + the lm_head's "
            f"{'logits all-gather' if self.gather_logits else 'argmax all-reduce' if self.logits_bytes else 'none'}, "
            f"{self.device.link_bandwidth / 1e9:.0f} GB/s a direction, "
            f"{self.device.latency(self.tensor_parallel) * 1e6:.1f} us each"
            f"{''.join(f'; replicated: {note}' for note in self.replicated)})")
        return (f"roofline {self.device.name}, knee {self.knee:.0f} tokens/pass, cache {self.cache_len}"
                f"{experts}{split}")

    def cost(self, draft_s: Callable[[int, int], float], what: str) -> CostModel:
        """This roofline as a CostModel with `draft_s` (described by `what`)."""
        return CostModel(self.verify_s, draft_s, f"{self.describe()}; {what}", self.plain_s,
                         lambda batch, nodes: self.collective_s(batch * nodes))

    def collective_s(self, tokens: int) -> float:
        """The collectives of one pass of `tokens` over the model's devices (0 on one device): `allreduces`
        all-reduces of the [tokens, hidden] activation, and the vocabulary-split lm_head's exchange: the fp32
        logits all-gathered (gather_logits) or each device's (value, index) argmax all-reduced."""
        n, dev = self.tensor_parallel, self.device
        if n == 1:
            return 0.0
        total = self.allreduces * dev.allreduce_s(n, tokens * self.activation_bytes)
        if self.logits_bytes:
            exchange = dev.allgather_s if self.gather_logits else dev.allreduce_s
            total += exchange(n, tokens * self.logits_bytes)
        return total

    def _pass_s(self, tokens: int, per_row_bytes: float) -> float:
        weights = self.weights_s(tokens)
        compute = (2 * self.params + self.state_flops_per_token) * tokens / self.device.peak_flops
        return max(weights, compute) + per_row_bytes / self.device.bandwidth + self.collective_s(tokens)


def check_tensor_parallel(device: DeviceSpec, n: int) -> None:
    """A ValueError unless `device` has a link to price n devices with (n = 1 always passes)."""
    if n == 1:
        return
    if device.link_bandwidth is None:
        known = sorted(k for k, d in DEVICES.items() if d.link_bandwidth is not None)
        raise ValueError(f"tensor parallelism needs a device link to price: {device.name} has none in DEVICES; "
                         f"use --device {' or '.join(known)} (NVLink)")
    if n > device.max_tensor_parallel:
        raise ValueError(f"--tensor-parallel {n} spans more than one NVLink domain ({device.max_tensor_parallel} "
                         f"GPUs of {device.name}, one HGX board); the roofline prices one domain: use "
                         f"{device.max_tensor_parallel} or fewer")


def collectives(cfg, tp: TensorParallel, sampled: bool = False) -> tuple[int, float, float, bool]:
    """(all-reduces per pass, activation bytes per token, logits bytes per token, gather) for `cfg` split as `tp`.

    All-reduces of the [tokens, hidden] activation: one after each layer's mixer when its output projection is
    split (attention's o_proj by heads, a DeltaNet's out_proj by value heads), one after each MLP when it is split
    (a dense MLP's down_proj; an MoE layer's experts, under expert parallelism too: every device holds every token
    after the attention's all-reduce, computes its own experts' share of each and the shared expert's slice, and
    one all-reduce sums the layer's output, as for a dense MLP), and one after a vocabulary-split embedding (each
    device looks up the rows it holds, zeros elsewhere). The split lm_head leaves each device the logits of its
    slice of the vocabulary: a greedy verify needs only each token's argmax, one all-reduce of (value, index)
    pairs (8 bytes a token); a sampled verify reads whole rows (softmax, top-k, top-p), so the fp32 logits are
    all-gathered (4 x vocab bytes a token). Not counted: the DeltaNet conv channels' regrouping into value heads
    (collective-permutes the sharding work notes, removable by a head-aligned packing)."""
    if tp.n == 1:
        return 0, 0.0, 0.0, False
    mixers = sum(tp.heads > 1 if cfg.layer_type(i) == "full_attention" else tp.v_heads > 1
                 for i in range(cfg.num_layers))
    mlps = sum((tp.experts > 1 or tp.shared > 1) if cfg.is_sparse(i) else tp.mlp > 1 for i in range(cfg.num_layers))
    embed = int(tp.vocab > 1)
    logits = 0.0 if tp.vocab == 1 else (4.0 * cfg.vocab_size if sampled else 8.0)
    return mixers + mlps + embed, float(cfg.hidden_size * DTYPE_BYTES[str(cfg.dtype)]), logits, sampled


def hybrid_bytes(cfg, tp: TensorParallel | None = None) -> tuple[float, float, float]:
    """(state bytes per row, kept bytes per verified node per row, state FLOPs per token) of a hybrid's DeltaNet
    layers, on one device of the split `tp` (the value heads and conv channels it holds); zeros for a dense model.

    State: Hv x dk x dv fp32 per layer. A verified node keeps its conv input (C in the model dtype), its
    key, corrected value (fp32, on the value heads) and cumulative decay (models/cache.py NodeResults).
    FLOPs: reading the state twice (w S, q S) and the rank-1 update, about 6 dk dv per value head per token.
    """
    lin = cfg.linear
    if lin is None:
        return 0.0, 0.0, 0.0
    n = len(cfg.linear_layers)
    tp = tp or TensorParallel(1)
    heads, dk, dv = lin.num_value_heads // tp.v_heads, lin.key_head_dim, lin.value_head_dim
    state = n * heads * dk * dv * 4
    node = n * (lin.conv_dim // tp.conv * DTYPE_BYTES[str(cfg.dtype)] + heads * (dk + dv + 1) * 4)
    return float(state), float(node), float(6 * n * heads * dk * dv)


ROUTING_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def routing_curve(target, prompts: Sequence[Sequence[int]], tokens: Sequence[int] = ROUTING_TOKENS
                  ) -> list[tuple[int, float]]:
    """(tokens per pass, distinct experts one sparse layer reads) measured through an MoE target's own routers on
    `prompts` (each run alone), for the passes the routed tokens can fill: what `Roofline.with_routing` takes."""
    per_prompt = [routed_experts(target.model, np.asarray([p], np.int32)) for p in prompts if len(p)]
    if not per_prompt:
        raise ValueError("routing_curve needs at least one non-empty prompt to route")
    routed = [np.concatenate([r[i].reshape(-1, r[i].shape[-1]) for r in per_prompt]) for i in range(len(per_prompt[0]))]
    available = routed[0].shape[0]
    return [(t, distinct_experts(routed, t)) for t in tokens if t <= available]


def relative_draft(verify_s: Callable[[int, int], float], cost: float) -> Callable[[int, int], float]:
    """Drafting one level costs `cost` x one target step at that batch (verify_s(batch, 1))."""
    if cost < 0:
        raise ValueError(f"draft cost must be >= 0 (a fraction of one target step), got {cost}")
    return lambda batch, depth: cost * depth * verify_s(batch, 1)


def roofline_cost(cfg, device: str | DeviceSpec, cache_len: int = 0, draft_cost: float = 0.0,
                  tensor_parallel: int = 1, sampled: bool = False) -> CostModel:
    dev = device_spec(device) if isinstance(device, str) else device
    roof = Roofline.for_config(cfg, dev, cache_len, tensor_parallel, sampled)
    return roof.cost(relative_draft(roof.verify_s, draft_cost), f"draft {draft_cost:g} x step/level")


def local_device() -> str:
    """This machine's entry in DEVICES by JAX's device kind (an unknown GPU falls back to h100, said in the source)."""
    kind = device_kind().lower()
    if "h200" in kind:
        return "h200"
    if "h100" in kind or "gpu" in kind or "nvidia" in kind:
        return "h100"
    return "cpu"


def cost_model(device: str, target_cfg, drafter, cache_len: int, draft_cost: float | None,
               routing: Sequence[tuple[int, float]] | None = None, tensor_parallel: int = 1,
               sampled: bool = False, mesh=None) -> CostModel:
    """A profile JSON (path), or a roofline on a known device for this target and (when it has a config) draft model;
    an MoE target's roofline reads the experts of `routing` (measured, `routing_curve`) or of uniform routing. With
    tensor_parallel = n the target is priced split over n devices of the roofline's kind (a profile is measured
    on the devices it ran on: n must be 1; `mesh`, the target's, picks its entry); the drafter is priced whole on
    one device (replicated)."""
    if device.endswith(".json") or Path(device).is_file():
        if tensor_parallel != 1:
            raise ValueError(f"--tensor-parallel {tensor_parallel} prices a split target by roofline; a profile JSON "
                             "holds times measured where it ran: drop --tensor-parallel, or pass --device h100|h200")
        return load_profile(device, profile_key_for(target_cfg, device, mesh)).cost(cache_len)
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {sorted(DEVICES)} or a profile JSON file, got {device!r}")
    roof = Roofline.for_config(target_cfg, DEVICES[device], cache_len, tensor_parallel, sampled)
    if routing:
        roof = roof.with_routing(routing)
    if draft_cost is not None:
        draft, what = relative_draft(roof.verify_s, draft_cost), f"{draft_cost:g} x target step per level"
    else:
        draft, what = drafter_roofline(drafter, DEVICES[device], cache_len)
    return roof.cost(draft, what)


def local_roofline(target, drafter, cache_len: int, draft_cost: float | None) -> CostModel:
    """This device's roofline for `target` as it runs: split over its mesh's model axis where the device table
    prices a link (H100, H200; the CPU entry has none, so there it is priced whole, said in the source), each data
    replica taking its share of the batch."""
    mesh = getattr(target, "mesh", None)
    device, data, model = local_device(), axis_size(mesh, "data"), axis_size(mesh, "model")
    priced = model if DEVICES[device].link_bandwidth is not None else 1
    cost = cost_model(device, target.cfg, drafter, cache_len, draft_cost, tensor_parallel=priced)
    if data == 1 and priced == model:
        return cost
    rows = lambda b: -(-b // data)  # noqa: E731 (rows one replica runs)
    note = (f"; {mesh_label(mesh)}: {data} replicas of the batch" if data > 1 else "") + \
        (f"; tp {model} priced whole ({device} has no link in DEVICES)" if priced != model else "")
    return CostModel(lambda b, n: cost.verify_s(rows(b), n), lambda b, d: cost.draft_s(rows(b), d),
                     cost.source + note, None if cost.plain_s is None else lambda b: cost.plain_s(rows(b)),
                     None if cost.collective_s is None else lambda b, n: cost.collective_s(rows(b), n))


def drafter_roofline(drafter, device: DeviceSpec, cache_len: int) -> tuple[Callable[[int, int], float], str]:
    """draft_s(batch, depth) by roofline for any drafter, and what it assumed.

    A draft model: its config's roofline, one pass per level. A learned head (EAGLE-3, MTP, DFlash, DSpark): the
    weights its params hold, read once per pass, embedding tables excepted when an lm_head projects the vocabulary
    (a lookup reads a row per token); one
    pass per level, or one pass over the whole block for block drafters (max_draft_tokens). Its own one-layer KV
    cache is left out. A model-free drafter (n-gram, replay) drafts for free.
    """
    cfg = getattr(drafter, "cfg", None)
    if isinstance(cfg, ModelConfig):
        droof = Roofline.for_config(cfg, device, cache_len)
        what = f"draft model {cfg.num_params() / 1e6:.2f}M by roofline per level"
        return (lambda b, d: d * droof.verify_s(b, 1)), what
    named = [(jax.tree_util.keystr(path), x) for path, x in
             jax.tree_util.tree_leaves_with_path(getattr(drafter, "params", None) or {}) if hasattr(x, "nbytes")]
    tied = not any("lm_head" in path for path, _ in named)  # then the embedding is the vocab projection too
    leaves = [(path, x) for path, x in named if tied or "embed" not in path]
    if not leaves:
        return (lambda b, d: 0.0), "drafting free (model-free drafter)"
    count = sum(int(x.size) for _, x in leaves)
    width = max(x.dtype.itemsize for _, x in leaves)
    droof = Roofline(dataclasses.replace(device, peak_flops=device.peak_for(str(leaves[0][1].dtype))), count,
                     sum(int(x.nbytes) for _, x in leaves), 0.0, cache_len)
    name = getattr(drafter, "name", type(drafter).__name__)
    block = getattr(drafter, "max_draft_tokens", None)
    if block is not None:
        return ((lambda b, d: droof.verify_s(b, block)),
                f"{name} head {count / 1e6:.2f}M ({width}-byte weights) by roofline, one pass per block of {block}")
    return ((lambda b, d: d * droof.verify_s(b, 1)),
            f"{name} head {count / 1e6:.2f}M ({width}-byte weights) by roofline per level")


def profile_key_for(cfg, path: str | Path, mesh=None) -> str | None:
    """This device's key for cfg (on `mesh`, when the target has one) when the file at path holds it, else None
    (load_profile then wants a single entry)."""
    path = Path(path)
    if not path.is_file():
        return None
    key = profile_key(device_kind(), model_name(cfg), str(cfg.dtype), mesh_label(mesh))
    return key if key in (json.loads(path.read_text()).get("profiles") or {}) else None


@dataclasses.dataclass(frozen=True)
class RunTimes:
    """Seconds measured on the user's own prompts: per loop iteration of plain decoding and of a few chains
    ((nodes, depth, seconds) per chain), and the prefill."""

    plain_step_s: float
    spec_rounds: tuple[tuple[int, int, float], ...]
    prefill_s: float = 0.0
    # Per chain in spec_rounds: the relative standard error of its round's median and the plain step's together.
    noise: tuple[float, ...] = ()
    # The timed rounds the medians come from, each (plain step, prefill, a round of each chain): timing again pools
    # with them (calibration.run_times(earlier=...)).
    samples: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        if self.noise and len(self.noise) != len(self.spec_rounds):
            raise ValueError(f"RunTimes has {len(self.noise)} noise figures for {len(self.spec_rounds)} timed chains: "
                             f"give one per chain, or none")

    def noise_at(self, nodes: int) -> float:
        """The timing noise behind a prediction for a shape of `nodes` nodes: that of the timed chain nearest
        in nodes (the larger on a tie; 0 without timings)."""
        if not self.noise:
            return 0.0
        nearest = min(range(len(self.noise)), key=lambda i: (abs(self.spec_rounds[i][0] - nodes),
                                                             -self.spec_rounds[i][0]))
        return self.noise[nearest]


AUTO_PROFILE_NODES = (1, 4, 16, 64)  # verify passes timed for "auto" (interpolated in between)
AUTO_PROFILE_DEPTHS = (1, 4)


def cost_for_run(target, drafter, batch: int, cache_len: int, times: RunTimes | None = None) -> CostModel:
    """The cost model `generate(..., "auto")` plans one batch bucket with: `pass_costs`, corrected to the rounds
    timed inside the loop when `times` are given (`with_loop_times`)."""
    return with_loop_times(pass_costs(target, drafter, batch, cache_len), times, batch)


def pass_costs(target, drafter, batch: int, cache_len: int) -> CostModel:
    """Verify passes and drafting, priced on their own: from $SPECJAX_PROFILE (a profile JSON) when set; this
    device's roofline when it is `roofline`; else measured here and now at this batch (verify passes of
    AUTO_PROFILE_NODES, and the drafter's propose at AUTO_PROFILE_DEPTHS)."""
    setting = os.environ.get("SPECJAX_PROFILE", "")
    if setting == "roofline":
        return local_roofline(target, drafter, cache_len, None)
    if setting:
        return cost_model(setting, target.cfg, drafter, cache_len, None, mesh=getattr(target, "mesh", None))
    longest = getattr(drafter, "max_draft_tokens", max(AUTO_PROFILE_DEPTHS))  # block drafters: one block
    depths = tuple(sorted({min(d, longest) for d in AUTO_PROFILE_DEPTHS}))
    prof = profile(target, drafter, (batch,), AUTO_PROFILE_NODES, (cache_len,), depths, repeats=3)
    return prof.cost(cache_len)


def with_loop_times(base: CostModel, times: RunTimes | None, batch: int) -> CostModel:
    """`base` corrected to the loop timings (`in_loop`: plain steps cost what they measured, every round pays the
    loop's own cost on top of its modelled pass and drafting); unchanged without timings, or when `base` is the
    roofline ($SPECJAX_PROFILE=roofline), which models the device rather than this loop."""
    if times is None or os.environ.get("SPECJAX_PROFILE", "") == "roofline":
        return base
    return in_loop(base, times, batch)


def in_loop(base: CostModel, times: RunTimes, batch: int) -> CostModel:
    """`base` corrected to what rounds cost inside the loop at this batch.

    A pass timed on its own is not a pass inside the loop: the loop adds its bookkeeping (masks,
    statistics, emission, the drafter's update). So inside the range of the timed chains a round of n nodes
    costs what the timed rounds cost, less their drafting, interpolated in nodes; past the range, the
    nearest timed round plus what the modelled pass adds from there (held flat below it). The drafting of
    the shape's own depth is added by the scorer. A round never costs less than a plain step.

    The previous version fitted a least-squares line in nodes to what the timed rounds took beyond their
    modelled passes, which carries the passes' own timing noise into the timed range: at batch 1 (replay
    0.6) its predictions were off by a median 6.8% against 2.8% for this one, from the same timings
    (`python scripts/loop_correction_check.py`; at batch 4 both were 7% off, shifted alike by the machine's
    drift between timing and measuring).
    """
    plain = times.plain_step_s
    n_R = np.array([n for n, _, _ in times.spec_rounds], float)
    own_R = np.array([t - base.draft_s(batch, d) for n, d, t in times.spec_rounds])  # a timed round, undrafted
    order = np.argsort(n_R)
    n_R, own_R = n_R[order], own_R[order]

    def verify_s(b: int, n: int) -> float:
        inside = float(np.clip(n, n_R[0], n_R[-1]))
        beyond = base.verify_s(b, max(n, inside)) - base.verify_s(batch, inside)  # 0 inside, at this batch
        return max(plain, float(np.interp(inside, n_R, own_R)) + beyond)

    timed = ", ".join(f"{n:.0f} nodes {t * 1e3:.2f}" for n, t in zip(n_R, own_R))
    return CostModel(verify_s, base.draft_s, f"{base.source}; measured in the loop: plain step {plain * 1e3:.2f} ms, "
                     f"rounds less drafting ({timed} ms) interpolated in nodes, the modelled pass beyond",
                     lambda b: plain)


# ---------------------------------------------------------------- measured profile


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys), flat below the first point, the last slope (>= 0) above the last."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    order = np.argsort(xs)
    xs, ys = xs[order], ys[order]
    if x <= xs[-1] or xs.size == 1:
        return float(np.interp(x, xs, ys))
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return float(ys[-1] + slope * (x - xs[-1]))


@dataclasses.dataclass
class Profile:
    """Measured verify-round and propose times for one (device, model, dtype) and, for a target on a mesh, the
    mesh's shape (`sharding.mesh_label`: "tp8", "dp2xtp4"; "" on one device).

    verify: {"batch", "nodes", "cache_len", "seconds", "all_seconds"} per shape;
    propose: {"batch", "depth", "seconds", "all_seconds"} per shape (empty without a drafter).
    """

    device: str
    model: str
    dtype: str
    verify: list[dict[str, Any]]
    propose: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: str = ""

    @property
    def key(self) -> str:
        return profile_key(self.device, self.model, self.dtype, self.mesh)

    @property
    def cache_lens(self) -> list[int]:
        return sorted({r["cache_len"] for r in self.verify})

    def verify_s(self, batch: int, nodes: int, cache_len: int | None = None) -> float:
        """Interpolated: piecewise linear in T = batch x nodes per profiled batch (made non-decreasing in T; past the
        largest measured T, proportional to T), then linear in batch and in cache length."""
        lens = self.cache_lens
        cache_len = lens[0] if cache_len is None else cache_len
        at_len = [self._verify_at(batch, nodes, c) for c in lens]
        return interp(cache_len, lens, at_len) if len(lens) > 1 else at_len[0]

    def _verify_at(self, batch: int, nodes: int, cache_len: int) -> float:
        rows = [r for r in self.verify if r["cache_len"] == cache_len]
        batches = sorted({r["batch"] for r in rows})
        per_batch = []
        for b in batches:
            pts = sorted((r["batch"] * r["nodes"], r["seconds"]) for r in rows if r["batch"] == b)
            # More tokens never cost less: a running max irons out timing noise between neighbouring points.
            secs = np.maximum.accumulate([s for _, s in pts])
            tokens, last_t = batch * nodes, pts[-1][0]
            # Past the largest measured pass, cost grows in proportion to tokens (compute-bound, the safe side).
            per_batch.append(secs[-1] * tokens / last_t if tokens > last_t else interp(tokens, [t for t, _ in pts], secs))
        return interp(batch, batches, per_batch) if len(batches) > 1 else per_batch[0]

    def draft_s(self, batch: int, depth: int) -> float:
        """Measured propose time, linear in depth at each profiled batch, interpolated in batch; 0 without data."""
        if not self.propose or depth == 0:
            return 0.0
        batches = sorted({r["batch"] for r in self.propose})
        per_batch = []
        for b in batches:
            pts = sorted((r["depth"], r["seconds"]) for r in self.propose if r["batch"] == b)
            per_batch.append(interp(depth, [d for d, _ in pts], [s for _, s in pts]))
        return interp(batch, batches, per_batch) if len(batches) > 1 else per_batch[0]

    def cost(self, cache_len: int | None = None) -> CostModel:
        return CostModel(lambda b, n: self.verify_s(b, n, cache_len), self.draft_s,
                         f"measured profile {self.key}" + (f" at cache {cache_len}" if cache_len else ""))

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry; "mesh" only when there is one (a one-device entry is written as before it existed)."""
        d = dataclasses.asdict(self)
        if not self.mesh:
            del d["mesh"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        missing = {"device", "model", "dtype", "verify"} - set(d)
        if missing:
            raise ValueError(f"a profile needs fields {sorted(missing)}; was it written by specjax profile?")
        return cls(d["device"], d["model"], d["dtype"], list(d["verify"]), list(d.get("propose") or []),
                   dict(d.get("meta") or {}), str(d.get("mesh") or ""))


def profile_key(device: str, model: str, dtype: str, mesh: str = "") -> str:
    """device|model|dtype, then |mesh for a target on a mesh (times measured split differ from one device's)."""
    return f"{device}|{model}|{dtype}" + (f"|{mesh}" if mesh else "")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Add (or replace) this profile in the JSON file at path, keyed by device|model|dtype[|mesh]."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("profiles", {})[profile.key] = profile.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def load_profile(path: str | Path, key: str | None = None) -> Profile:
    """One profile from a file: the one under `key`, or the only one there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no profile file at {path}; write one with `specjax profile --out {path}`")
    profiles = json.loads(path.read_text()).get("profiles") or {}
    if key is None:
        if len(profiles) != 1:
            raise ValueError(f"{path} holds {len(profiles)} profiles ({sorted(profiles)}); name one with its key")
        key = next(iter(profiles))
    if key not in profiles:
        raise ValueError(f"{path} has no profile {key!r}; it has {sorted(profiles)}")
    return Profile.from_dict(profiles[key])


# ---------------------------------------------------------------- measuring


def model_name(cfg) -> str:
    """'llama-L16-D1024-V32000-246M': what a profile is keyed by (the shapes that set its cost)."""

    return (f"{cfg.family}-L{cfg.num_layers}-D{cfg.hidden_size}-F{cfg.intermediate_size}-V{cfg.vocab_size}"
            f"-{format_count(cfg.num_params())}")


def _median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    import jax

    jax.block_until_ready(fn())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    times = agreed(np.asarray(times)).tolist()  # a multi-host job plans from process 0's timings (multihost.agreed)
    return statistics.median(times), times


def time_verify_round(target, batch: int, nodes: int, cache_len: int, repeats: int = 5,
                      steps: int = 8) -> tuple[float, list[float]]:
    """Median seconds of one verify round (forward + lm_head + greedy acceptance + commit) of a chain of `nodes`.

    Each row's cache holds `cache_len` positions. Rounds are timed as the loop runs them: `steps` rounds in
    one jitted `fori_loop` with the cache carried (and donated between calls), divided by `steps`. Timed
    one call per round instead, a round pays its own dispatch, and on the CPU its commit copies the whole
    cache, which the loop does not pay (scripts/profile_vs_loop.py: 68 ms against 41 ms for a 1-node
    round). Tree shape does not change the cost, only N.
    """
    cfg, params = target.cfg, target.params
    spec = chain(nodes - 1) if nodes > 1 else None
    parents_BN = spec_arrays(spec, batch) if spec else jnp.full((batch, 1), -1, jnp.int32)
    sampling = SamplingConfig()

    def round_fn(i, carry):
        params, cache, tokens_BN, lengths_B = carry
        cache = cache.with_lengths(lengths_B)  # every round verifies at the same cache length
        draft = Draft(tokens_BN, parents_BN, jnp.ones(tokens_BN.shape, jnp.bool_))
        mask_BNN = ancestor_mask(draft.parents)
        positions_BN = lengths_B[:, None] + depths(mask_BNN)
        model = merge(cfg, params)
        h_BND, _, cache = model.forward(tokens_BN, cache, positions_BT=positions_BN, mask_BTT=mask_BNN,
                                        attn_impl=target.attn_impl, provisional=True)
        keys_B = jax.random.split(jax.random.fold_in(jax.random.key(0), i), batch)
        verdict = verify(draft, mask_BNN, model.logits(h_BND), sampling, keys_B)
        return params, cache.commit(verdict.path, verdict.num_accepted), tokens_BN, lengths_B

    def rounds_fn(params, cache, tokens_BN, lengths_B):
        # constrained as allocated: the cache comes back in the shardings it went in with (one compile)
        return constrain_cache(jax.lax.fori_loop(0, steps, round_fn, (params, cache, tokens_BN, lengths_B))[1])

    s = round_cache_length(cache_len + nodes + 1)
    mesh = getattr(target, "mesh", None)
    tokens_BN, lengths_B = place_batch(
        (np.asarray(jax.random.randint(jax.random.key(1), (batch, nodes), 0, cfg.vocab_size, jnp.int32)),
         np.full((batch,), cache_len, np.int32)), mesh)
    run_rounds = jax.jit(rounds_fn, donate_argnums=1)
    with use_mesh(mesh):  # as the loops compile: the cache allocated (and constrained) under the target's mesh
        state = {"cache": jax.jit(lambda p: merge(cfg, p).init_cache(batch, s))(params)}

        def run():
            state["cache"] = run_rounds(params, state["cache"], tokens_BN, lengths_B)
            return state["cache"].lengths

        med, all_s = _median_s(run, repeats)
    return med / steps, [t / steps for t in all_s]


def time_propose(target, drafter, batch: int, depth, cache_len: int, repeats: int = 5) -> tuple[float, list[float]]:
    """Median seconds of the drafter's propose at this batch (state donated and reused) for a chain of `depth`,
    or for the static tree `depth` when it is a TreeSpec (a draft model's tree levels cost more than a chain's).
    On the target's mesh as the loops run it: the inputs split over "data", the state allocated under the mesh."""
    spec = chain(depth) if isinstance(depth, int) else depth
    depth = spec.max_depth
    s = round_cache_length(cache_len + spec.cache_slots + 2)
    configured = drafter.configure(Settings(spec, SamplingConfig(), s, bucket(depth + 1)))
    t = max(1, min(cache_len, s - depth - 2))
    prompt_BT = np.asarray(jax.random.randint(jax.random.key(2), (batch, t), 0, target.cfg.vocab_size, jnp.int32))
    feats = tuple(np.zeros((batch, t, target.cfg.hidden_size), jnp.dtype(target.cfg.dtype))
                  for _ in configured.feature_layers)
    key_data_B = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), batch)))
    mesh = getattr(target, "mesh", None)
    ctx, root_B, key_data_B = place_batch(
        (PrefillContext(prompt_BT, np.full((batch,), t, np.int32), prompt_BT[:, -1], feats), prompt_BT[:, 0],
         key_data_B), mesh)
    step = jax.jit(lambda p, st, r, k: configured.propose(p, st, r, jax.random.wrap_key_data(k)), donate_argnums=1)
    with use_mesh(mesh):
        state = {"s": jax.jit(configured.init)(configured.params, ctx)}

        def run():
            draft, state["s"] = step(configured.params, state["s"], root_B, key_data_B)
            return draft.tokens

        run()  # on a mesh the state may come back in other shardings than init's: its compile happens here
        return _median_s(run, repeats)


def device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def profile(target, drafter=None, batches: Sequence[int] = (1, 4, 16, 64), nodes: Sequence[int] = (1, 2, 4, 8, 16, 32),
            cache_lens: Sequence[int] = (256,), draft_depths: Sequence[int] = (1, 4), repeats: int = 5,
            log: Callable[[str], None] = lambda m: None, max_tokens: int | None = None) -> Profile:
    """Measure verify rounds over batch x nodes x cache length, and the drafter's propose over batch x depth.

    max_tokens: skip verify passes of more than this many tokens (batch x nodes; one node per row is always
    measured): on a CPU a large pass takes minutes, and the profile extrapolates at its last slope.
    """
    if not batches or not nodes or not cache_lens or min(batches) < 1 or min(nodes) < 1 or min(cache_lens) < 0:
        raise ValueError(f"profile needs positive batches and nodes and cache lengths >= 0; got batches {batches}, "
                         f"nodes {nodes}, cache_lens {cache_lens}")
    verify_rows, propose_rows = [], []
    for c in cache_lens:
        for b in batches:
            for n in nodes:
                if max_tokens is not None and n > 1 and b * n > max_tokens:
                    continue
                med, all_s = time_verify_round(target, b, n, c, repeats)
                verify_rows.append({"batch": b, "nodes": n, "cache_len": c, "seconds": med, "all_seconds": all_s})
                log(f"verify batch {b:4d} nodes {n:3d} cache {c:5d}: {med * 1e3:8.2f} ms")
    if drafter is not None:
        for b in batches:
            for d in draft_depths:
                med, all_s = time_propose(target, drafter, b, d, cache_lens[0], repeats)
                propose_rows.append({"batch": b, "depth": d, "seconds": med, "all_seconds": all_s})
                log(f"propose batch {b:4d} depth {d:3d}: {med * 1e3:8.2f} ms")
    meta = {"params": target.cfg.num_params(), "repeats": repeats, "drafter": getattr(drafter, "name", None),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    return Profile(device_kind(), model_name(target.cfg), str(target.cfg.dtype), verify_rows, propose_rows, meta,
                   mesh_label(getattr(target, "mesh", None)))
