"""The verify cost curve the prefix scheduler optimises: a profile, a fresh measurement or the roofline.

`generate` resolves `scheduler_profile=` here and hands the loop a cost model; the loop itself
(specjax/decoding/scheduler.py) only tabulates whatever cost model it is given.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from pathlib import Path
from typing import Sequence

from specjax.models.sharding import mesh_label
from specjax.planning.profile import (
    CostModel,
    Profile,
    device_kind,
    load_profile,
    local_roofline,
    model_name,
    profile,
    profile_key,
    profile_key_for,
)

# Target -> {(batch, widths, cache_len): Profile}: per Target object, and a target on another mesh is another object
_MEASURED: weakref.WeakKeyDictionary | None = None


def scheduler_cost(target, source, batch: int, widths: Sequence[int], cache_len: int):
    """The verify cost model the scheduler optimises, with `.source` saying where it came from.

    source: a `Profile` or `CostModel`; a profile JSON path; "measure" (time this target's verify rounds
    at this batch and the compiled widths now, cached per target); "roofline" (this device's estimate);
    None: the profile in $SPECJAX_PROFILE when it holds this device and model, else the roofline.
    """
    mesh = getattr(target, "mesh", None)  # a profile's entry for this target is the one measured on its mesh
    if isinstance(source, CostModel):
        return source
    if isinstance(source, Profile):
        return source.cost(cache_len)
    if source == "measure":
        global _MEASURED
        if _MEASURED is None:
            _MEASURED = weakref.WeakKeyDictionary()
        cached = _MEASURED.setdefault(target, {})
        k = (batch, tuple(widths), cache_len)
        if k not in cached:
            cached[k] = profile(target, None, (batch,), tuple(widths), (cache_len,), repeats=3)
        cost = cached[k].cost(cache_len)
        return dataclasses.replace(cost, source=f"measured now at batch {batch}, widths {list(widths)}: {cost.source}")
    if source == "roofline" or source is None:
        path = os.environ.get("SPECJAX_PROFILE") if source is None else None
        key = profile_key_for(target.cfg, path, mesh) if path else None
        if key is not None:
            return load_profile(path, key).cost(cache_len)
        cost = local_roofline(target, None, cache_len, 0.0)
        key = profile_key(device_kind(), model_name(target.cfg), str(target.cfg.dtype), mesh_label(mesh))
        why = "" if source == "roofline" or path == "roofline" else \
            f" (no profile for {key} in $SPECJAX_PROFILE)" if path else " ($SPECJAX_PROFILE unset)"
        return dataclasses.replace(cost, source=f"estimate: {cost.source}{why}")
    if isinstance(source, (str, Path)):
        return load_profile(source, profile_key_for(target.cfg, source, mesh)).cost(cache_len)
    raise ValueError(f"scheduler_profile must be a Profile, a CostModel, a profile JSON path, 'measure', 'roofline' "
                     f"or None; got {source!r}")
