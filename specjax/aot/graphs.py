"""The production graphs, as shapes only: the tree-attention kernel over its block plans, the block-FP8 matmul kernel
at decode shapes, and the plain and speculative loops of a preset at a batch, each a `Graph` (a jitted function,
abstract arguments, static keywords) to compile.

No weights exist anywhere here: parameters are `jax.ShapeDtypeStruct`s of the stacked (accelerator) layout, so an
8B loop lowers in seconds on a laptop. The drafters are the families' real modules at realistic widths for an 8B
target: a Llama-3.2-1B-shaped draft model (chains, static and dynamic trees, sampling with penalties and
log-probs), a DFlash block drafter (5 layers, block 16) and DSpark with its confidence head under the prefix
scheduler (Algorithm 1 over the compiled verify widths).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.bench.ar import PRESETS
from specjax.config import ModelConfig, RopeConfig
from specjax.decoding.decode import LoopConfig, RowSettings, ar_generate
from specjax.decoding.drafter import Settings
from specjax.decoding.penalties import RowPenalties
from specjax.decoding.sampling import RowSampling
from specjax.decoding.scheduler import verify_widths
from specjax.decoding.speculative import Scheduler, spec_generate
from specjax.decoding.tree import DynamicTreeSpec, chain, kary
from specjax.drafters import DraftModelDrafter, dflash, dspark
from specjax.kernels import block_fp8_matmul, tree_attention
from specjax.loading.target import target_shardings
from specjax.models.model import param_shapes
from specjax.planning.presets import QWEN35_27B
from specjax.quant.qarray import QuantizedWeight

# Presets compiled: the bench presets on a GPU, and Qwen3.5-27B (64 hybrid layers, unrolled) for the compile time
# of the deepest per-layer graph.
LOOP_PRESETS = {"8b": PRESETS["8b"], "qwen35_9b": PRESETS["qwen35_9b"], "qwen3_30b_a3b": PRESETS["qwen3_30b_a3b"],
                "qwen35_27b": QWEN35_27B}
DRAFTS = ("plain", "chain", "tree", "dynamic", "sampled", "dflash", "dspark_prefix")
PROMPT_LEN, OUT_LEN, CACHE_LEN = 128, 256, 2048


@dataclasses.dataclass(frozen=True)
class Graph:
    """One compile: `fn.trace(*args, **static)`; args are ShapeDtypeStructs without shardings, placed on the mesh
    by `place` (replicated, or by `shardings` where given: the target's and drafter's weights under TP)."""

    name: str
    fn: Callable
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)
    shardings: Callable[[Any], tuple] | None = None  # mesh -> one sharding pytree (or None) per arg
    info: dict = dataclasses.field(default_factory=dict)  # facts for the record (batch, nodes, cache_len, ...)
    model: ModelConfig | None = None  # a loop's target (for the memory plan)
    draft_model: ModelConfig | None = None  # a loop's draft model, when its drafter is one

    def place(self, mesh) -> tuple:
        """The args with a NamedSharding on `mesh` each (so the compile targets the mesh's devices)."""
        given = self.shardings(mesh) if self.shardings else (None,) * len(self.args)
        placed = []
        for arg, sh in zip(self.args, given):
            if sh is None:
                sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), arg)
            placed.append(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arg, sh))
        return tuple(placed)


def shapes(tree_of_shapes: dict, dtype) -> dict:
    """A nested dict of shape tuples -> ShapeDtypeStructs of `dtype`."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), tree_of_shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def abstract_request(batch: int, prompt_len: int = PROMPT_LEN) -> tuple:
    """The loops' array arguments after the weights: prompts, lengths, budgets, seeds, folds, RowSettings."""
    i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32
    row = lambda dtype: jax.ShapeDtypeStruct((batch,), dtype)  # noqa: E731
    rows = RowSettings(RowSampling(row(f32), row(i32), row(f32), row(f32)),
                       RowPenalties(row(f32), row(f32), row(f32), row(i32)), jax.ShapeDtypeStruct((batch, 2), i32))
    return (jax.ShapeDtypeStruct((batch, prompt_len), i32), row(i32), row(i32), row(u32), row(u32), rows)


# ---------------------------------------------------------------- the kernel

# (nodes N, GQA group G) pairs covering every block plan: packed rows N x G of 1 (block_m 16), 8 x 4 = 32, 64 (a
# full block), 256 (4 M blocks) and 256 x 8 = 2048 (32 M blocks); S = 2048 at batch 64 (enough programs: one split,
# the kernel normalises its own output) and 32768 at batch 1 (the widest split-K, partials merged by XLA).
KERNEL_NG = ((1, 1), (8, 4), (16, 4), (64, 4), (256, 8))
KERNEL_SB = ((2048, 64), (32768, 1))
KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_DTYPES = ("bfloat16", "float32")


def kernel_graph(*, head_dim: int, group: int, nodes: int, max_len: int, batch: int, dtype: str,
                 kv_heads: int = 8, layers: int = 4) -> Graph:
    """The Pallas kernel alone on a stacked cache [L, B, S, Hkv, D] indexed by a traced layer, as the loops call it."""
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, nodes, kv_heads * group, head_dim), dt)
    kv = jax.ShapeDtypeStruct((layers, batch, max_len, kv_heads, head_dim), dt)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, nodes, nodes), jnp.bool_)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    fn = jax.jit(lambda q, k, v, n, m, i: tree_attention(q, k, v, n, m, layer=i))
    name = f"kernel/d{head_dim}/g{group}/n{nodes}/s{max_len}/b{batch}/{'bf16' if dtype == 'bfloat16' else 'fp32'}"
    return Graph(name, fn, (q, kv, kv, lengths, mask, layer),
                 info=dict(head_dim=head_dim, group=group, nodes=nodes, max_len=max_len, batch=batch, dtype=dtype))


def kernel_sweep(head_dims=KERNEL_HEAD_DIMS, dtypes=KERNEL_DTYPES, ng=KERNEL_NG, sb=KERNEL_SB) -> list[Graph]:
    return [kernel_graph(head_dim=d, group=g, nodes=n, max_len=s, batch=b, dtype=dt)
            for d, dt, (n, g), (s, b) in itertools.product(head_dims, dtypes, ng, sb)]


# the block-FP8 matmul at an 8B's decode rows: the MLP's [4096, 14336] (one K split) at M 1, 8, 64, and wo's
# [4096, 4096] at M 1 (split-K: its 64 column tiles alone leave SMs idle)
FP8_MATMULS = ((1, 4096, 14336), (8, 4096, 14336), (64, 4096, 14336), (1, 4096, 4096))


def fp8_matmul_graph(*, m: int, k: int, n: int, dtype: str = "bfloat16") -> Graph:
    """The block-FP8 Pallas kernel alone: x [m, k] @ FP8 values [k, n] with f32 scales per 128 x 128 block."""
    x = jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype))
    q = jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((-(-k // FP8_BLOCK[0]), -(-n // FP8_BLOCK[1])), jnp.float32)
    fn = jax.jit(lambda x, q, s: block_fp8_matmul(x, q, s, block=FP8_BLOCK))
    name = f"fp8_matmul/m{m}/k{k}/n{n}/{'bf16' if dtype == 'bfloat16' else 'fp32'}"
    return Graph(name, fn, (x, q, scale), info=dict(m=m, k=k, n=n, dtype=dtype))


def fp8_matmul_sweep(shapes=FP8_MATMULS) -> list[Graph]:
    return [fp8_matmul_graph(m=m, k=k, n=n) for m, k, n in shapes]


# ---------------------------------------------------------------- the loops


def preset_config(preset: str) -> ModelConfig:
    if preset not in LOOP_PRESETS:
        raise ValueError(f"preset must be one of {sorted(LOOP_PRESETS)}, got {preset!r}")
    return ModelConfig.from_hf(LOOP_PRESETS[preset], dtype="bfloat16")


def draft_model_config(target: ModelConfig) -> ModelConfig:
    """A Llama-3.2-1B-shaped draft model (16 layers of 2048, 32/8 heads of 64, MLP 8192) on the target's vocabulary."""
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=2048, intermediate_size=8192, num_layers=16,
                       num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
                       eos_token_ids=target.eos_token_ids, dtype=target.dtype)


def block_config(target: ModelConfig, block_size: int = 16) -> dflash.BlockConfig:
    """A DFlash backbone for the target: 5 Qwen3-style layers at the target's width, 5 taps spread over its depth."""
    n = target.num_layers
    layers = dataclasses.replace(draft_model_config(target), hidden_size=target.hidden_size,
                                 intermediate_size=4 * target.hidden_size, num_layers=5, head_dim=128,
                                 qk_norm=True, family="qwen3")
    taps = tuple(sorted({1, n // 4, n // 2, 3 * n // 4, n - 2}))
    return dflash.BlockConfig(layers=layers, target_layer_ids=taps, block_size=block_size,
                              mask_token_id=target.vocab_size - 1)


def loop_graph(preset: str, draft: str, batch: int, *, cache_len: int = CACHE_LEN, out_len: int = OUT_LEN,
               prompt_len: int = PROMPT_LEN, tensor_parallel: bool = False, cfg: ModelConfig | None = None,
               quantized: str | None = None) -> Graph:
    """One loop of `preset` (or of `cfg`, named `preset`) at `batch`: draft "plain" (ar_generate) or a speculative
    loop (module docstring). The cache holds cache_len tokens a row (a multiple of 16, as the kernel needs).
    quantized="fp8": the target's linears as a block-FP8 checkpoint loads them (`fp8_linears`)."""
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    if cache_len % 16 or prompt_len + out_len > cache_len:
        raise ValueError(f"cache_len must be a multiple of 16 holding prompt_len + out_len ({prompt_len} + "
                         f"{out_len}), got {cache_len}")
    cfg = cfg or preset_config(preset)
    params = shapes(param_shapes(cfg), cfg.dtype)
    if quantized not in (None, "fp8"):
        raise ValueError(f"quantized must be None or 'fp8', got {quantized!r}")
    if quantized:
        params = fp8_linears(params, cfg.dtype)
    request = abstract_request(batch, prompt_len)
    sampled = draft == "sampled"
    lc = LoopConfig(cfg, sampled, out_len=out_len, cache_len=cache_len, attn_impl="auto", penalties=sampled,
                    logprobs=5 if sampled else -1)
    info = dict(preset=preset, draft=draft, batch=batch, cache_len=cache_len, out_len=out_len, prompt_len=prompt_len,
                quantized=quantized)
    tp = ("/tp" if tensor_parallel else "") + (f"/{quantized}" if quantized else "")

    def shardings(args):
        if not tensor_parallel:
            return None
        return lambda mesh: (target_shardings(args[0], cfg, mesh),) + (None,) * (len(args) - 1)

    if draft == "plain":
        args = (params, *request)
        return Graph(f"plain/{preset}/b{batch}{tp}", ar_generate, args, dict(lc=lc), shardings(args), info, cfg)
    settings = lambda tree: Settings(tree, lc.drafting, cache_len, out_len)  # noqa: E731
    static: dict[str, Any] = {}
    extra: tuple = ()
    dcfg = None
    if draft in ("chain", "tree", "dynamic", "sampled"):
        tree = {"chain": chain(4), "tree": kary([3, 2, 1]), "sampled": chain(4),
                "dynamic": DynamicTreeSpec(top_k=8, depth=4, total_tokens=32)}[draft]
        dcfg = draft_model_config(cfg)
        draft_params = shapes(param_shapes(dcfg), cfg.dtype)
        drafter = DraftModelDrafter(dcfg, None, attn_impl="auto").configure(settings(tree))
        info["tree"] = {"chain": "chain:4", "tree": "kary:3,2,1", "sampled": "chain:4+sampled+penalties+logprobs:5",
                        "dynamic": "dynamic:top_k=8,depth=4,total_tokens=32"}[draft]
    else:
        bcfg = block_config(cfg)
        block = shapes(dflash.param_shapes(bcfg), cfg.dtype)
        k = bcfg.block_size - 1
        if draft == "dflash":
            draft_params = dflash.drafter_params(block, params, cfg.tie_word_embeddings, per_layer=False)
            drafter = dflash.DFlashDrafter(bcfg, None, attn_impl="auto").configure(settings(chain(k)))
        else:
            scfg = dspark.DSparkConfig(block=bcfg, markov_rank=256, confidence=True)
            draft_params = dspark.drafter_params(block, shapes(dspark.param_shapes(scfg), cfg.dtype), per_layer=False)
            drafter = dspark.DSparkDrafter(scfg, None, attn_impl="auto").configure(settings(chain(k)))
            static["sched"] = Scheduler("prefix", verify_widths(k + 1))
            extra = (jax.ShapeDtypeStruct((batch * (k + 1) + 1,), jnp.float32),)  # the verify cost curve
        info["tree"] = f"{draft.split('_')[0]}:{k}" + ("+prefix" if draft == "dspark_prefix" else "")
    args = (params, draft_params, *request, *extra)
    return Graph(f"spec/{preset}/{info['tree']}/b{batch}{tp}", spec_generate, args,
                 dict(lc=lc, drafter=drafter, **static), shardings(args), info, cfg, dcfg)


# the linears a block-FP8 checkpoint's loader keeps quantized (convert/hf.py `_KEPT_QUANTIZED`), by param key
FP8_KEYS = frozenset({"wq", "wk", "wv", "wo", "wg", "w_gate", "w_up", "w_down", "w_qkv", "w_z", "w_out",
                      "shared_gate", "shared_up", "shared_down"})
FP8_BLOCK = (128, 128)


def fp8_linears(params: dict, dtype) -> dict:
    """`params` (ShapeDtypeStructs) with every linear the loader keeps quantized as a block-FP8 QuantizedWeight:
    float8_e4m3fn values [..., I, O] and float32 scales per 128 x 128 block (DeepSeek-V3's layout, ragged last blocks),
    what `specjax.load` holds for a `quant_method: fp8` checkpoint; norms, routers, embedding and lm_head as they are."""
    bi, bo = FP8_BLOCK

    def convert(path, x):
        if path[-1].key not in FP8_KEYS or len(x.shape) < 2:
            return x
        *lead, i, o = x.shape
        return QuantizedWeight(jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                               jax.ShapeDtypeStruct((*lead, -(-i // bi), -(-o // bo)), jnp.float32),
                               block=FP8_BLOCK, fmt=f"fp8 block {list(FP8_BLOCK)}", compute_dtype=str(jnp.dtype(dtype)))

    return jax.tree_util.tree_map_with_path(convert, params)


def loop_graphs(preset: str, batches=(1, 8, 64), drafts=DRAFTS, **kw) -> list[Graph]:
    return [loop_graph(preset, d, b, **kw) for b in batches for d in drafts]
