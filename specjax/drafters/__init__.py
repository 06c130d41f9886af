"""Drafter families behind one protocol (specjax/decoding/drafter.py); `specjax.loading` loads them from a path."""

from specjax.drafters.dflash import DFlashDrafter
from specjax.drafters.dflash2 import DFlash2Drafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.dspark import DSparkDrafter
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.mtp import MtpDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.replay import ReplayDrafter, replay_drafter

__all__ = ["DFlash2Drafter", "DFlashDrafter", "DSparkDrafter", "DraftModelDrafter", "Eagle3Drafter", "MtpDrafter", "NgramDrafter",
           "ReplayDrafter", "replay_drafter"]
