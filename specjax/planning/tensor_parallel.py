"""Tensor parallelism for planning: which of a model's weights one device of n holds, by the sharding rules.

A weight dimension named by a logical axis (models/layers.py `param`) splits over the n devices of the mesh's
"model" axis when n divides it, counted in whole heads for the head axes, and is otherwise replicated: every
device holds all of it (the rule of the sharded-target work, models/sharding.py `partition_spec`):

    heads     q, the output gate, o's rows            num_heads % n == 0
    kv_heads  k, v, and with them the KV cache        num_kv_heads % n == 0; fewer kv heads than n, or a count n
                                                      does not divide: all of them on every device (never split
                                                      inside a head, never a kv_heads / min(n, kv_heads) share)
    mlp       the dense SwiGLU width                  intermediate % n == 0
              (the shared expert's width likewise: shared_expert_intermediate_size % n == 0)
    vocab     embedding rows, lm_head columns         vocab_size % n == 0
    v_heads   Gated DeltaNet value heads (w_z, w_b, w_a, dt_bias, A_log, w_out's rows); the recurrent state follows
    conv      Gated DeltaNet conv channels C = 2 Hk dk + Hv dv (w_qkv, conv_w); the conv window follows
    experts   expert parallelism: E % n == 0, each device holds E / n whole experts; else each expert split
              inside by its width (expert_size % n == 0); else replicated
    (norms, the router, q/k norms: replicated)

The routed experts are priced as a grouped GEMM reads them, each distinct expert a pass reaches once. Under that,
the two layouts (load's default, each expert split inside by its width; its EXPERT_PARALLEL rules, whole experts per
device) hold E x expert / n weights per device and read the same bytes in expectation: under uniform routing a
device's E / n experts are each hit with the same probability as any expert, so a pass reads D(T) / n whole experts
there (D(T) = E (1 - (1 - k/E)^T)), where an inside split reads D(T) experts of 1/n width. The busiest device sets
the pace; routing imbalance between devices is not modelled. specjax's own accelerator path gathers every block's
matrices instead, which favours the inside split (docs/architecture_devices.md: scripts/bench_expert_split.py).
"""

from __future__ import annotations

import dataclasses

from specjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one model splits over n devices: per logical axis, the number of devices it splits over (n or 1)."""

    n: int
    heads: int = 1
    kv_heads: int = 1
    mlp: int = 1
    vocab: int = 1
    v_heads: int = 1
    conv: int = 1
    experts: int = 1
    shared: int = 1  # the shared expert's width
    expert_layout: str = ""  # "expert parallel", "split inside each expert", "replicated"; "" for a dense model

    @property
    def shards(self) -> dict[str, int]:
        """What ModelConfig.num_params(shards=) takes."""
        return {"heads": self.heads, "kv_heads": self.kv_heads, "mlp": self.mlp, "vocab": self.vocab,
                "v_heads": self.v_heads, "conv": self.conv, "experts": self.experts, "shared": self.shared}


def split_model(cfg: ModelConfig, n: int) -> TensorParallel:
    """The split of `cfg` over n devices by the sharding rules (module docstring); a ValueError when n is not a
    positive integer or does not divide the attention heads (the whole attention would then be replicated)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor parallelism is a positive number of devices, got {n!r}")
    if n == 1:
        return TensorParallel(1, expert_layout="" if cfg.moe is None else "one device")
    if cfg.num_heads % n:
        divisors = [k for k in range(1, cfg.num_heads + 1) if cfg.num_heads % k == 0]
        raise ValueError(f"--tensor-parallel {n} does not divide the {cfg.num_heads} attention heads: the sharding "
                         f"rules would replicate q, k, v and o (the whole attention) on every device, so each device "
                         f"would compute all of it; use a degree that divides {cfg.num_heads}: "
                         f"{', '.join(map(str, divisors))}")

    def split(units: int) -> int:
        return n if units % n == 0 else 1

    lin, moe = cfg.linear, cfg.moe
    experts, layout = 1, ""
    if moe is not None:
        experts = n if moe.num_experts % n == 0 or moe.expert_size % n == 0 else 1
        layout = ("expert parallel" if moe.num_experts % n == 0 else
                  "split inside each expert" if experts > 1 else "replicated")
    return TensorParallel(n, heads=n, kv_heads=split(cfg.num_kv_heads), mlp=split(cfg.intermediate_size),
                          vocab=split(cfg.vocab_size), v_heads=split(lin.num_value_heads) if lin else 1,
                          conv=split(lin.conv_dim) if lin else 1, experts=experts,
                          shared=split(moe.shared_size) if moe is not None else 1, expert_layout=layout)


def replicated(cfg: ModelConfig, tp: TensorParallel) -> list[str]:
    """What stays whole on every device at this split, each said with why (empty when everything splits)."""
    if tp.n == 1:
        return []
    notes = []
    if tp.kv_heads == 1:
        notes.append(f"kv heads ({cfg.num_kv_heads}, not divisible by {tp.n}): k, v and the KV cache whole on every "
                     "device")
    if cfg.intermediate_size and tp.mlp == 1 and (cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers):
        notes.append(f"MLP width {cfg.intermediate_size} (not divisible by {tp.n}): the dense MLPs whole")
    if tp.vocab == 1:
        notes.append(f"vocabulary {cfg.vocab_size} (not divisible by {tp.n}): embedding and lm_head whole")
    if cfg.linear is not None and tp.v_heads == 1:
        notes.append(f"DeltaNet value heads ({cfg.linear.num_value_heads}, not divisible by {tp.n}): their "
                     "projections and the recurrent state whole")
    if cfg.linear is not None and tp.conv == 1:
        notes.append(f"DeltaNet conv channels ({cfg.linear.conv_dim}, not divisible by {tp.n}): w_qkv and the conv "
                     "window whole")
    if cfg.moe is not None and tp.experts == 1:
        notes.append(f"experts ({cfg.moe.num_experts} of width {cfg.moe.expert_size}, neither divisible by "
                     f"{tp.n}): every expert whole")
    if cfg.moe is not None and cfg.moe.shared_size and tp.shared == 1:
        notes.append(f"shared expert width {cfg.moe.shared_size} (not divisible by {tp.n}): whole")
    return notes
