"""Loading targets and drafters from their directories: the checkpoint formats in, the models and drafters out."""

from specjax.loading.drafter import drafter_family, load_drafter
from specjax.loading.target import convert, load

__all__ = ["convert", "drafter_family", "load", "load_drafter"]
