"""Continuous batching with speculation that follows the live load: `Engine`, its request handles and outputs."""

from specjax.engine.engine import Engine
from specjax.engine.handle import RequestHandle, RequestOutput

__all__ = ["Engine", "RequestHandle", "RequestOutput"]
