"""specjax: speculative decoding for JAX/XLA."""

from .config import ModelConfig, SamplingConfig
from .drafters import NgramDrafter, load_drafter, replay_drafter
from .generate import GenerateOutput, generate
from .target import Target, convert, load

__all__ = ["ModelConfig", "SamplingConfig", "GenerateOutput", "NgramDrafter", "Target", "convert", "generate", "load",
           "load_drafter", "replay_drafter"]
