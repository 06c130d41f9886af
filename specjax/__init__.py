"""specjax: speculative decoding for JAX/XLA."""

from . import compile_cache
from .config import ModelConfig, SamplingConfig
from .drafters import NgramDrafter, load_drafter, replay_drafter
from .generate import GenerateOutput, generate
from .inspect import DraftInspection, inspect_draft
from .target import Target, convert, load

# JAX's persistent compilation cache (see compile_cache.py). JAX opens the directory when it next
# compiles, and importing specjax compiles nothing, so setting it here is early enough.
compile_cache.setup()

__all__ = ["DraftInspection", "GenerateOutput", "ModelConfig", "NgramDrafter", "SamplingConfig", "Target", "convert",
           "generate", "inspect_draft", "load", "load_drafter", "replay_drafter"]
