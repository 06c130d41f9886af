"""Safetensors read lazily, by slice (convert/lazy.py): what lets each device of a mesh read only its part of a weight.

Views (transpose, cast, slice, stack, deferred transforms) read what numpy indexing of the whole tensor gives, and
every Hugging Face conversion path gives, lazily, exactly the weights it gives reading the files whole.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from hf_tiny import build_hf_model, build_moe, build_qwen35, save_fused_experts, save_hf_model
from safetensors.torch import save_file

from specjax.convert.hf import load_hf
from specjax.convert.lazy import LazyTensors, stack


def test_lazy_views_read_what_numpy_indexing_gives(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 10, 4)).astype(np.float32)
    b = rng.standard_normal((6, 10, 4)).astype(np.float32)
    save_file({"a": torch.from_numpy(a), "b": torch.from_numpy(b).to(torch.bfloat16)}, str(tmp_path / "t.safetensors"))
    tensors = LazyTensors([tmp_path / "t.safetensors"])
    la, lb = tensors["a"], tensors["b"]
    assert la.shape == (6, 10, 4) and str(lb.dtype) == "bfloat16"
    b16 = np.asarray(lb).astype(np.float32)
    cases = [
        (la.T, a.T), (la.transpose(0, 2, 1), a.transpose(0, 2, 1)), (la[..., :3], a[..., :3]),
        (la[:, 0, :].T, a[:, 0, :].T), (la.astype(np.float16), a.astype(np.float16)),
        (la.transpose(0, 2, 1)[..., 4:], a.transpose(0, 2, 1)[..., 4:]),
        (stack([la[1], la[3]]), np.stack([a[1], a[3]])), (stack([la[2], lb[4].astype(np.float32)]), np.stack([a[2], b16[4]])),
    ]
    for view, want in cases:
        view = view.astype(np.float32)
        np.testing.assert_array_equal(np.asarray(view), want)
        index = tuple(slice(1, n - 1) if n > 2 else slice(None) for n in view.shape)
        np.testing.assert_array_equal(np.asarray(view[index]), want[index])
        np.testing.assert_array_equal(np.asarray(view[1]), want[1])


def assert_lazy_equals_whole(path):
    """load_hf(lazy=True) gives every weight of load_hf() exactly, whole and by slices."""
    _, _, whole = load_hf(path)
    _, _, lazy = load_hf(path, lazy=True)
    flat_whole = jax.tree_util.tree_flatten_with_path(whole)[0]
    flat_lazy = jax.tree_util.tree_flatten_with_path(lazy)[0]
    assert [jax.tree_util.keystr(p) for p, _ in flat_lazy] == [jax.tree_util.keystr(p) for p, _ in flat_whole]
    lazily_read = 0
    for (path_, want), (_, got) in zip(flat_whole, flat_lazy):
        name = jax.tree_util.keystr(path_)
        lazily_read += not isinstance(got, np.ndarray)
        assert tuple(got.shape) == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
        half = tuple(slice(n // 2, n) for n in want.shape)
        np.testing.assert_array_equal(np.asarray(got[half]), want[half], err_msg=name)
    return lazily_read, len(flat_whole)


@pytest.mark.parametrize("build", ["llama", "qwen3_5_conditional", "qwen3_5_moe_fused", "qwen3_next", "qwen3_moe"])
def test_lazy_conversion_equals_reading_whole(tmp_path, build):
    """Every conversion path (stacked layers, Qwen3.5's gated q split and conv, fused and per-expert experts,
    Qwen3-Next's fused projections, a vision tower skipped) reads lazily to the same weights."""
    if build == "llama":
        model = build_hf_model("llama", tie_word_embeddings=False)
    elif build == "qwen3_5_conditional":
        model = build_qwen35("conditional")
    elif build == "qwen3_5_moe_fused":
        model = build_moe("qwen3_5_moe")
    else:
        model = build_moe(build)
    path = save_hf_model(model, tmp_path / build)
    if build == "qwen3_5_moe_fused":
        save_fused_experts(path)
    lazily_read, total = assert_lazy_equals_whole(path)
    assert lazily_read == total  # nothing was read whole at conversion (the MTP-free tree is all views)


def test_a_truncated_file_is_named_as_it_is_read_whole(tmp_path):
    path = save_hf_model(build_hf_model("llama", num_hidden_layers=1), tmp_path / "m")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file .* truncated or corrupt"):
        load_hf(path, lazy=True)
