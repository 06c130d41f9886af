"""Which network a config describes (the dense `Decoder` or Qwen3.5's `HybridDecoder`) and the loops' entry
points over params dicts: merge a dict into its module, shapes, random init, forward, lm_head."""

from __future__ import annotations

import jax
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.cache import KVCache
from specjax.models.decoder import Decoder, has_layer_list, unstack_layers
from specjax.models.hybrid import HybridDecoder
from specjax.models.state import merged, shapes_of, to_params


def merge(cfg: ModelConfig, params: dict) -> Decoder:
    """The Decoder holding `params` (the same arrays: nothing is copied), in the layout they are in.

    Inside a traced function this is the `nnx.merge` of the split the loops did outside.
    """
    per_layer = has_layer_list(params)
    if per_layer and isinstance(params["layers"], (list, tuple)):
        params = unstack_layers(params)
    return merged(model_class(cfg), cfg, params, per_layer=per_layer)


def model_class(cfg: ModelConfig) -> type[Decoder]:
    """Decoder, or HybridDecoder for a config with Gated DeltaNet layers (Qwen3.5)."""
    return HybridDecoder if cfg.is_hybrid else Decoder


def param_shapes(cfg: ModelConfig) -> dict:
    """The expected shape of every parameter (stacked layout; per-layer when the layers differ, `mixed_layers`):
    the contract conversion checks against."""
    return shapes_of(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0), per_layer=cfg.mixed_layers))


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02, per_layer: bool = False) -> dict:
    """Random params (normal(0, scale) matrices, identity norms, zero biases): for tests, benchmarks, training."""
    per_layer = per_layer or cfg.mixed_layers
    return to_params(model_class(cfg)(cfg, rngs=nnx.Rngs(params=key), per_layer=per_layer, scale=scale))


def forward(params: dict, cfg: ModelConfig, tokens_BT: jax.Array, cache: KVCache, **kwargs):
    """`Decoder.forward` of the model holding `params`: see there."""
    return merge(cfg, params).forward(tokens_BT, cache, **kwargs)


def sequence_forward(params: dict, cfg: ModelConfig, tokens_BS: jax.Array, capture: tuple[int, ...] = ()):
    """The serving forward over whole sequences from a fresh cache (positions 0..S-1, causal: what prefill
    computes), any target kind: (final-normed hidden [B, S, D], the captured states, fp32 logits [B, S, V]).
    How training reads the target it trains a head for."""
    model = merge(cfg, params)
    h_BSD, captured, _ = model.forward(tokens_BS, model.init_cache(*tokens_BS.shape), capture=tuple(capture),
                                       attn_impl="xla")
    return h_BSD, captured, model.logits(h_BSD)


def lm_head(params: dict, cfg: ModelConfig, h_BTD: jax.Array) -> jax.Array:
    """`Decoder.logits` of the model holding `params`."""
    return merge(cfg, params).logits(h_BTD)
