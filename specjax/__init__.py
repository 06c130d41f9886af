"""specjax: speculative decoding for JAX/XLA."""

from specjax import compile_cache
from specjax.chat import apply_chat_template, chat_text
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.inspect import DraftInspection, inspect_draft
from specjax.decoding.params import SamplingParams
from specjax.drafters import NgramDrafter, replay_drafter
from specjax.engine import Engine, RequestHandle, RequestOutput
from specjax.generate import GenerateOutput, StreamChunk, generate, stream
from specjax.loading.drafter import load_drafter
from specjax.loading.embedded import embedded
from specjax.loading.target import convert, load
from specjax.models.target import Target

# JAX's persistent compilation cache (see compile_cache.py). JAX opens the directory when it next
# compiles, and importing specjax compiles nothing, so setting it here is early enough.
compile_cache.setup()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specjax")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        return "0+unknown"


__version__ = _version()
del _version

__all__ = ["DraftInspection", "Engine", "GenerateOutput", "ModelConfig", "NgramDrafter", "RequestHandle",
           "RequestOutput", "SamplingConfig", "SamplingParams", "StreamChunk", "Target", "__version__",
           "apply_chat_template", "chat_text", "convert", "embedded", "generate", "inspect_draft", "load",
           "load_drafter", "replay_drafter", "stream"]
