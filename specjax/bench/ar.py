"""Autoregressive decode benchmark: the baseline every speculative speedup is measured against.

CPU presets (`tiny20m`, `300m`) build ONE random Llama-style checkpoint with `transformers`
and run greedy decoding of the same prompts through specjax (`specjax.generate`) and
through `transformers` `generate` (torch CPU, use_cache, default torch threads), EOS
disabled so every row decodes exactly `max_new_tokens`. Each side gets one warm-up call
(for specjax that call compiles; its compile time is reported separately), then the
median wall time of `repeats` calls is reported as tokens/s.

The GPU preset (`8b`, Llama-3-8B shapes) never touches transformers: random bf16 params
are created directly on the device with `specjax.models.decoder.init_params`. It reports
batch-1 decode tokens/s and the weight-read bandwidth that decode achieves
(param bytes x decode steps / decode time, decode time = time(max_new) - time(1 token))
next to a measured device bandwidth (a large array read + written once by a jitted op).

Used by `scripts/bench.py ar`; importable (`run_ar`, `format_table`) for notebooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.convert.hf import hf_to_params
from specjax.generate import generate
from specjax.models.model import init_params
from specjax.models.target import Target
from specjax.planning.presets import LLAMA3_8B
from specjax.planning.profile import DEVICES, QWEN3_30B_A3B, Roofline

_LLAMA_BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                   attention_bias=False, mlp_bias=False, torch_dtype="float32")

# Hugging Face config.json dicts. tiny20m ties its embeddings (as Llama 3.2 1B does) so the
# 32k x 384 table is counted once: 21.7M params; 300m is untied: 246M params.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny20m": {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 384, "intermediate_size": 1024,
                "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
                "tie_word_embeddings": True},
    "300m": {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
             "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
             "tie_word_embeddings": False},
    # Meta-Llama-3-8B shapes (rope scaling as in Llama 3.1), bf16.
    "8b": LLAMA3_8B,
    # Qwen/Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig defaults): 24 Gated DeltaNet + 8 gated
    # attention layers, bf16, random weights.
    "qwen35_9b": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
                  "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                      "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
                  "eos_token_id": 248044, "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1},
    # Qwen/Qwen3-30B-A3B's config (128 experts of 768, 8 per token, 3.3B of 30.5B active), bf16, random weights.
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    # A CPU pair for the expert-read curve (scripts/bench_moe.py): the same 23.5M active parameters, fp32, memory-bound
    # at small passes. moe_cpu: 4 sparse layers of 32 experts of 512, 4 per token (112M in all, 447 MB);
    # moe_cpu_dense: the dense model whose MLP is those 4 experts' width (2048).
    "moe_cpu": {**QWEN3_30B_A3B, "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 2048,
                "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "torch_dtype": "float32"},
    "moe_cpu_dense": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 8192,
                      "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                      "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "float32"},
}
GPU_PRESETS = ("8b", "qwen35_9b", "qwen3_30b_a3b")
# Two layers, 64 wide: for tests of the benchmark scripts (seconds, not a model anyone measures).
MICRO_PRESET = {**PRESETS["tiny20m"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@dataclasses.dataclass(frozen=True)
class ArBenchConfig:
    """What to run. batches: batch sizes; repeats: timed calls per measurement (median reported)."""

    preset: str = "tiny20m"
    batches: tuple[int, ...] = (1, 8)
    prompt_len: int = 64
    max_new_tokens: int = 128
    repeats: int = 3
    compare_hf: bool = True
    seed: int = 0
    attn_impl: str = "auto"

    def validate(self) -> "ArBenchConfig":
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batch sizes must be positive, got {self.batches}")
        if self.prompt_len < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError("prompt_len, max_new_tokens and repeats must all be >= 1")
        if self.preset in GPU_PRESETS and self.max_new_tokens < 2:
            raise ValueError("the 8b preset needs max_new_tokens >= 2 (decode time = time(N) - time(1))")
        return self


def model_config(preset: str) -> ModelConfig:
    hf = PRESETS[preset]
    return ModelConfig.from_hf(hf, dtype="bfloat16" if preset in GPU_PRESETS else "float32")


def machine_info() -> dict[str, Any]:
    """Where the numbers come from (goes into the JSON next to them)."""
    dev = jax.devices()[0]
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "jax_backend": jax.default_backend(), "device": dev.device_kind}
    try:
        import torch  # noqa: PLC0415 (optional: only the CPU comparison needs it)

        info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    except ImportError:
        pass
    return info


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    """(median seconds, all times, last result) over `repeats` calls of fn."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each zero-argument function, calls interleaved (each compiled and run once first), so a
    slow spell of a shared machine lands on every entry alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """[batch, length] token ids, avoiding the low special ids."""
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length), dtype=np.int64)


# ---------------------------------------------------------------- CPU: specjax vs transformers


def build_hf_llama(hf_config: dict[str, Any], seed: int):
    """A random transformers LlamaForCausalLM with spread-out weights (clear greedy margins)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = transformers.LlamaConfig(**kwargs)
    config.architectures = list(hf_config["architectures"])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.generation_config.eos_token_id = None  # decode exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def target_from_hf_model(model, hf_config: dict[str, Any]) -> Target:
    """The same weights as a specjax Target, through the converter's name/shape mapping."""

    cfg = ModelConfig.from_hf(hf_config, dtype="float32")
    tensors = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    params = jax.tree.map(jnp.asarray, hf_to_params(tensors, cfg))
    return Target(params, cfg, hf_config=dict(hf_config))


def _bench_hf(model, prompt_BT: np.ndarray, max_new: int, repeats: int) -> tuple[float, list[float], np.ndarray]:
    import torch  # noqa: PLC0415

    ids = torch.as_tensor(prompt_BT)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, use_cache=True)
        return out[:, prompt_BT.shape[1]:].numpy()

    run()  # warm-up
    median, times, tokens = _median_time(run, repeats)
    if tokens.shape != (prompt_BT.shape[0], max_new):
        raise RuntimeError(f"transformers generated {tokens.shape[1]} tokens per row, expected {max_new}")
    return median, times, tokens


def _bench_specjax(target: Target, prompt_BT: np.ndarray, max_new: int, repeats: int):
    prompts = prompt_BT.tolist()

    def run():
        return generate(target, prompts, max_new_tokens=max_new, eos_token_id=[])

    warm = run()  # compiles this bucket
    median, times, out = _median_time(run, repeats)
    if any(len(t) != max_new for t in out.tokens):
        raise RuntimeError(f"specjax generated {[len(t) for t in out.tokens]} tokens, expected {max_new} each")
    return median, times, np.asarray(out.tokens), warm.stats["compile_s"]


def run_cpu_comparison(bc: ArBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    hf_config = PRESETS[bc.preset]
    log(f"building a random {bc.preset} checkpoint with transformers ...")
    model = build_hf_llama(hf_config, bc.seed) if bc.compare_hf else None
    if model is not None:
        target = target_from_hf_model(model, hf_config)
    else:
        cfg = model_config(bc.preset)
        target = Target(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(bc.seed)), cfg,
                        hf_config=dict(hf_config))
    rows = []
    for batch in bc.batches:
        prompt_BT = random_prompts(batch, bc.prompt_len, target.cfg.vocab_size, bc.seed + batch)
        n_tokens = batch * bc.max_new_tokens
        log(f"batch {batch}: specjax ...")
        sj_s, sj_times, sj_tokens, compile_s = _bench_specjax(target, prompt_BT, bc.max_new_tokens, bc.repeats)
        row = {"batch": batch, "specjax_s": sj_s, "specjax_times_s": sj_times, "specjax_compile_s": compile_s,
               "specjax_tokens_per_s": n_tokens / sj_s}
        if model is not None:
            log(f"batch {batch}: transformers ...")
            hf_s, hf_times, hf_tokens = _bench_hf(model, prompt_BT, bc.max_new_tokens, bc.repeats)
            row |= {"hf_s": hf_s, "hf_times_s": hf_times, "hf_tokens_per_s": n_tokens / hf_s,
                    "speedup_vs_hf": hf_s / sj_s,
                    # Sanity, not a gate: identical greedy rows show both ran the same model.
                    "greedy_rows_identical": int(np.sum(np.all(hf_tokens == sj_tokens, axis=1)))}
        rows.append(row)
    return {"rows": rows, "param_count": target.cfg.num_params(), "dtype": target.cfg.dtype}


# ---------------------------------------------------------------- GPU: 8B bandwidth check


COPY_BYTES = 4 << 30


def device_copy_bandwidth(nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes/s of a jitted elementwise op over a large bf16 array (each byte read once and written once)."""
    nbytes = COPY_BYTES if nbytes is None else nbytes
    x = jnp.ones((max(1, nbytes // 2 // 4096), 4096), jnp.bfloat16)  # 2-D: no single dim past 2**31
    nbytes = x.nbytes
    bump = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))  # a real read + write; a bare copy may be forwarded
    jax.block_until_ready(bump(x))
    median, _, _ = _median_time(lambda: jax.block_until_ready(bump(x)), repeats)
    return 2 * nbytes / median


def run_gpu_bandwidth(bc: ArBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    if jax.default_backend() != "gpu":
        raise ValueError(f"the {bc.preset} preset needs a GPU, but JAX's backend is {jax.default_backend()!r}; "
                         f"on CPU use --preset tiny20m or --preset 300m")
    cfg = model_config(bc.preset)
    log(f"initializing random {cfg.dtype} {bc.preset} params on {jax.devices()[0].device_kind} ...")
    start = time.perf_counter()
    params = jax.block_until_ready(jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(bc.seed)))
    init_s = time.perf_counter() - start
    target = Target(params, cfg, hf_config=dict(PRESETS[bc.preset]), attn_impl=bc.attn_impl)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    embed_bytes = params["embed"].nbytes
    roof = Roofline.for_config(cfg, DEVICES["h100"])  # bytes only: the device does not enter weights_read
    log("measuring device bandwidth ...")
    copy_bw = device_copy_bandwidth()
    rows = []
    for batch in bc.batches:
        prompt_BT = random_prompts(batch, bc.prompt_len, cfg.vocab_size, bc.seed + batch)
        log(f"batch {batch}: specjax ...")
        full_s, full_times, _, compile_full = _bench_specjax(target, prompt_BT, bc.max_new_tokens, bc.repeats)
        first_s, first_times, _, compile_first = _bench_specjax(target, prompt_BT, 1, bc.repeats)
        steps = bc.max_new_tokens - 1  # decode steps after the prefill's token
        step_s = max(full_s - first_s, 1e-12) / steps
        # What one step reads: every weight of a dense model; an MoE's shared weights and the experts a batch of
        # this size routes to under uniform routing (roofline experts_read).
        read_bytes = roof.weights_read(batch)
        rows.append({
            "batch": batch, "specjax_s": full_s, "specjax_times_s": full_times,
            "specjax_tokens_per_s": batch * bc.max_new_tokens / full_s, "prefill_plus_one_s": first_s,
            "prefill_times_s": first_times, "specjax_compile_s": compile_full + compile_first,
            "decode_step_ms": 1e3 * step_s, "decode_tokens_per_s": batch / step_s,
            "step_read_bytes": read_bytes, "weight_read_GBps": read_bytes / step_s / 1e9,
            # The embedding table is gathered (B rows), not read, when it is not tied to the head.
            "weight_read_GBps_excl_embed": (read_bytes - (0 if cfg.tie_word_embeddings else embed_bytes))
            / step_s / 1e9,
            "fraction_of_copy_bw": read_bytes / step_s / copy_bw,
        })
    return {"rows": rows, "param_count": cfg.num_params(), "param_bytes": param_bytes, "embed_bytes": embed_bytes,
            "dtype": cfg.dtype, "init_s": init_s, "copy_bandwidth_GBps": copy_bw / 1e9, "copy_bytes": COPY_BYTES}


# ---------------------------------------------------------------- entry points


def run_ar(bc: ArBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-able dict (settings, machine, rows)."""
    bc.validate()
    body = run_gpu_bandwidth(bc, log) if bc.preset in GPU_PRESETS else run_cpu_comparison(bc, log)
    return {"benchmark": "ar", "settings": dataclasses.asdict(bc), "machine": machine_info(), **body}


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of one `run_ar` result."""
    s = result["settings"]
    head = (f"AR decode, preset {s['preset']} ({result['param_count'] / 1e6:.1f}M params, {result['dtype']}), "
            f"prompt {s['prompt_len']}, {s['max_new_tokens']} new tokens, median of {s['repeats']}, "
            f"jax on {result['machine']['device']}")
    lines = [head]
    if "copy_bandwidth_GBps" in result:
        lines.append(f"device bandwidth (read+write of a {result['copy_bytes'] / 2**30:.2f} GiB array): "
                     f"{result['copy_bandwidth_GBps']:.0f} GB/s; "
                     f"param bytes {result['param_bytes'] / 1e9:.2f} GB")
        lines.append(f"{'batch':>5} {'tok/s (e2e)':>12} {'decode tok/s':>13} {'step ms':>8} "
                     f"{'weight GB/s':>12} {'of copy bw':>10} {'compile s':>10}")
        for r in result["rows"]:
            lines.append(f"{r['batch']:>5} {r['specjax_tokens_per_s']:>12.1f} {r['decode_tokens_per_s']:>13.1f} "
                         f"{r['decode_step_ms']:>8.2f} {r['weight_read_GBps']:>12.0f} "
                         f"{r['fraction_of_copy_bw']:>10.1%} {r['specjax_compile_s']:>10.1f}")
        return "\n".join(lines)
    lines.append(f"{'batch':>5} {'specjax tok/s':>14} {'transformers tok/s':>19} {'ratio':>7} "
                 f"{'specjax compile s':>18} {'same greedy rows':>17}")
    for r in result["rows"]:
        hf = f"{r['hf_tokens_per_s']:>19.1f}" if "hf_tokens_per_s" in r else f"{'-':>19}"
        ratio = f"{r['speedup_vs_hf']:>6.2f}x" if "speedup_vs_hf" in r else f"{'-':>7}"
        same = f"{r['greedy_rows_identical']}/{r['batch']}" if "greedy_rows_identical" in r else "-"
        lines.append(f"{r['batch']:>5} {r['specjax_tokens_per_s']:>14.1f} {hf} {ratio} "
                     f"{r['specjax_compile_s']:>18.2f} {same:>17}")
    return "\n".join(lines)


def describe_plan(bc: ArBenchConfig) -> str:
    """What a run would do, without building anything (for --dry-run)."""
    cfg = model_config(bc.preset)
    bytes_per = 2 if cfg.dtype == "bfloat16" else 4
    where = "GPU only: specjax decode + weight-read bandwidth" if bc.preset in GPU_PRESETS else (
        "CPU: specjax vs transformers generate" if bc.compare_hf else "CPU: specjax only")
    return (f"preset {bc.preset}: {cfg.num_params() / 1e6:.1f}M params ({cfg.dtype}, "
            f"{cfg.num_params() * bytes_per / 1e9:.2f} GB), {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab {cfg.vocab_size}\n"
            f"{where}; batches {list(bc.batches)}, prompt {bc.prompt_len}, {bc.max_new_tokens} new tokens, "
            f"1 warm-up + median of {bc.repeats}; jax backend {jax.default_backend()}")


# Below this many new tokens the ratio to transformers is mostly per-call overhead (a few tokens once read 10x where
# 128 tokens gave 1.9x): main says so.
SHORT_RUN_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ar` subcommand's options (scripts/bench.py registers them)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny20m")
    parser.add_argument("--batch", type=int, nargs="+", default=None,
                        help="batch sizes (default: 1 8 on CPU presets, 1 for 8b)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up; median reported")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="print what would run and exit")


def config_from_args(args: argparse.Namespace) -> ArBenchConfig:
    batches = tuple(args.batch) if args.batch else ((1,) if args.preset in GPU_PRESETS else (1, 8))
    return ArBenchConfig(preset=args.preset, batches=batches, prompt_len=args.prompt_len,
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats, compare_hf=not args.no_hf,
                         seed=args.seed, attn_impl=args.attn_impl).validate()


def main(args: argparse.Namespace) -> int:
    """Run `ar` from parsed arguments: print the table, write JSON when --out is given."""
    bc = config_from_args(args)
    if bc.compare_hf and bc.preset not in GPU_PRESETS and not (find_spec("torch") and find_spec("transformers")):
        raise ValueError("the CPU presets compare against transformers, which needs torch and transformers "
                         "(pip install torch==2.13.0 transformers); or pass --no-hf to time specjax alone")
    if bc.compare_hf and bc.max_new_tokens < SHORT_RUN_TOKENS:
        print(f"note: --max-new-tokens {bc.max_new_tokens} is a short run: each call's fixed costs (transformers' "
              f"generate set-up, the prefill) weigh more than the decode, which exaggerates the ratio to "
              f"transformers; decode {SHORT_RUN_TOKENS} tokens or more for a figure to quote", file=sys.stderr)
    if args.dry_run:
        print(describe_plan(bc))
        return 0
    result = run_ar(bc, log=lambda msg: print(msg, flush=True))
    print(format_table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0
