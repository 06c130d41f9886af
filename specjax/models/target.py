"""A loaded target model: params on the device (or split over a mesh), its config, tokenizer, and compiled loops
(loading/ builds it)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
from tokenizers import Tokenizer

from specjax.config import ModelConfig
from specjax.models.decoder import Decoder, with_layout
from specjax.models.model import merge
from specjax.quant.qarray import quantized_formats


@dataclasses.dataclass(eq=False)
class Target:
    """A loaded target model: its parameters, config and tokenizer, and the executables compiled for it.

    Made by `specjax.load`; `print(target)` gives one line (family, parameters, dtype, vocabulary, layers, layout).
    `target.model` is the target as a Flax NNX module over the same arrays; `target.encode` / `target.decode` are
    the checkpoint's tokenizer.

    Attributes:
        params: the weights as a plain dict of arrays (what crosses the jit boundary).
        cfg: the decoder's ModelConfig, read from config.json.
        hf_config: config.json as published.
        tokenizer: the checkpoint's tokenizer (tokenizer.json), or None.
        path: the directory it was loaded from.
        attn_impl: "auto" (the Pallas kernel on a GPU, XLA elsewhere), "pallas" or "xla".
        layout: "auto", "stacked" (layers under lax.scan) or "per_layer".
        mtp: the checkpoint's MTP layers, for `specjax.load_drafter(target_dir, target)`; never run by the target.
        generation_config: generation_config.json (sampling defaults, EOS ids).
        mesh: the ("data", "model") mesh the params are split over; None on one device.
        rules: the sharding rules that split them; drafters follow them.
    """
    params: dict
    cfg: ModelConfig
    hf_config: dict
    tokenizer: Tokenizer | None = None
    path: Path | None = None
    attn_impl: str = "auto"
    compiled: dict[Any, Any] = dataclasses.field(default_factory=dict)  # loop key -> compiled executable
    layout: str = "auto"  # "auto" | "stacked" | "per_layer": see serving_layout
    mtp: dict | None = None  # the checkpoint's MTP layers (convert/mtp.py) for drafters.mtp_drafter; never run here
    generation_config: dict = dataclasses.field(default_factory=dict)  # generation_config.json: sampling defaults
    mesh: Any = None  # the ("data", "model") jax Mesh the params are split over (models/sharding.py); None: one device
    rules: dict | None = None  # the sharding rules that split them (None: models/sharding.py RULES); drafters follow

    def __post_init__(self):
        self.params = serving_layout(self.params, self.layout, mixed=self.cfg.mixed_layers)

    @property
    def model(self) -> Decoder:
        """The target as a Flax NNX module holding the same arrays as `params` (nothing is copied).

        For notebooks: `nnx.display(target.model)`, `target.model(token_ids)` (fp32 logits for every
        position). The loops take `params` (the module's state as a dict) and merge it inside their jit.
        """
        return merge(self.cfg, self.params)

    def encode(self, text: str) -> list[int]:
        """Tokenise text with the checkpoint's tokenizer.json (special tokens as the tokenizer adds them).

        Args:
            text: the text.

        Returns:
            Its token ids.

        Raises:
            ValueError: the checkpoint has no tokenizer.json (pass token-id lists to generate instead).
        """
        return self._need_tokenizer().encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Detokenise token ids with the checkpoint's tokenizer.json.

        Args:
            ids: token ids (e.g. one row of `generate(...).tokens`).
            skip_special_tokens: leave out special tokens (EOS, chat markers), as `generate`'s texts do.

        Returns:
            The text.

        Raises:
            ValueError: the checkpoint has no tokenizer.json.
        """
        return self._need_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path or 'this model'} has no tokenizer.json; pass token-id lists, not strings")
        return self.tokenizer

    def __repr__(self) -> str:
        """One line of facts (not the weights and tokenizer the dataclass repr would dump)."""
        path = f", path='{self.path}'" if self.path is not None else ""
        mesh = f", mesh={dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))}" if self.mesh is not None else ""
        formats = quantized_formats(self.params)
        quant = f", quantized={' + '.join(formats)}" if formats else ""
        return f"Target({model_summary(self.cfg, self.attn_impl)}{quant}{mesh}{path})"


def model_summary(cfg: ModelConfig, attn_impl: str) -> str:
    """'family=llama, params=3.95M, dtype=float32, vocab=256, layers=3, attn_impl=auto': for one-line reprs."""
    return (f"family={cfg.family}, params={format_count(cfg.num_params())}, dtype={cfg.dtype}, "
            f"vocab={cfg.vocab_size}, layers={cfg.num_layers}, attn_impl={attn_impl}")


def format_count(n: int) -> str:
    """A parameter count to three significant digits with a K/M/B/T suffix: 3949056 -> '3.95M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale * 0.9995:  # 999,600 rounds up to '1M', not '1e+03K'
            return f"{n / scale:.3g}{suffix}"
    return str(n)


LAYOUTS = ("auto", "stacked", "per_layer")


def cpu_layout() -> str:
    """What "auto" picks on CPU: per_layer, or SPECJAX_CPU_LAYOUT ("per_layer" or "stacked")."""
    layout = os.environ.get("SPECJAX_CPU_LAYOUT", "per_layer")
    if layout not in ("per_layer", "stacked"):
        raise ValueError(f"SPECJAX_CPU_LAYOUT must be 'per_layer' or 'stacked', got {layout!r}")
    return layout


def serving_layout(params: dict, layout: str = "auto", mixed: bool = False) -> dict:
    """The layer layout the loops run: per-layer arrays and KV buffers, or stacked layers under `lax.scan`.

    "auto": per-layer on CPU (XLA CPU copies a layer out of a stacked array: 3x the memory
    traffic), stacked elsewhere (the accelerator path: scan, one stacked cache, the kernel
    indexing the layer). "stacked" on CPU runs the GPU graph, for tests and lowering.
    SPECJAX_CPU_LAYOUT=stacked makes "auto" pick it on CPU too: the layers compiled once under
    scan rather than unrolled, which the test suite, compile-bound on tiny models, takes.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if mixed:  # layers of two kinds (a hybrid; dense and sparse MLPs): no single stacked layer to scan
        if layout == "stacked":
            raise ValueError("a target whose layers differ (a hybrid such as Qwen3.5, or an MoE with dense layers) "
                             "runs per-layer weights: pass layout='auto' or 'per_layer'")
        layout = "per_layer"
    if layout == "auto":
        layout = cpu_layout() if jax.default_backend() == "cpu" else "stacked"
    return with_layout(params, per_layer=layout == "per_layer")
