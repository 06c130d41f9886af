"""specjax: speculative decoding for JAX/XLA."""

from .config import ModelConfig, SamplingConfig
from .generate import GenerateOutput, generate
from .target import Target, convert, load

__all__ = ["ModelConfig", "SamplingConfig", "GenerateOutput", "Target", "convert", "generate", "load"]
