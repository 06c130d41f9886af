"""A generic training loop: optax AdamW, a jitted step around any loss hook, orbax resume.

The loop knows nothing about models: it trains `params` against `loss_fn(params, batch, frozen)`
(see losses.py) on `batch_fn(step)`, evaluates on fixed batches, and checkpoints the whole
state (params, optimizer state, step) with an orbax CheckpointManager so an interrupted run
resumes where it stopped. Batches are functions of the step, so a resumed run is identical
to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import TqdmWarning

from specjax.train.losses import LossFn

with warnings.catch_warnings():  # in a notebook kernel without ipywidgets tqdm.auto warns, then uses the text bar
    warnings.simplefilter("ignore", TqdmWarning)
    from tqdm.auto import tqdm


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation hyper-parameters and loop cadence of one run."""

    steps: int
    peak_lr: float = 3e-3
    warmup_steps: int = 50
    end_lr_fraction: float = 0.1  # cosine decays to peak_lr * this
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b2: float = 0.95
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 100
    keep: int = 2  # checkpoints kept on disk


def make_schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up to peak_lr, then cosine decay to peak_lr * end_lr_fraction at tc.steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.peak_lr, warmup_steps=tc.warmup_steps,
        decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.peak_lr * tc.end_lr_fraction)


def _decay_mask(params):
    """Weight decay on weight matrices only, not on norms or biases (layer-stacked, so go by name)."""

    def decays(path, x) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return x.ndim >= 2 and "norm" not in name and "bias" not in name and name not in ("bq", "bk", "bv")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW with the warm-up + cosine schedule."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip_norm),
        optax.adamw(make_schedule(tc), b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay, mask=_decay_mask),
    )


def init_state(params, optimizer: optax.GradientTransformation) -> dict:
    """The full training state: a pytree that orbax saves and restores as one item.

    The params are copied, so donating the state to the train step leaves the caller's arrays alive.
    """
    params = jax.tree.map(jnp.array, params)
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


@functools.lru_cache(maxsize=32)
def make_train_step(loss_fn: LossFn, tc: TrainConfig):
    """A jitted `step(state, batch, frozen) -> (state, metrics)`; the old state is donated.

    Cached on (loss_fn, tc), so a resumed or repeated run in one process reuses the compiled step.
    """
    optimizer, schedule = make_optimizer(tc), make_schedule(tc)

    def step(state: dict, batch: dict, frozen):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, frozen)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, donate_argnums=(0,))


@functools.lru_cache(maxsize=32)
def _jit(fn):
    return jax.jit(fn)


def evaluate(loss_fn: LossFn, params, batches: Iterable[dict], frozen=None) -> dict[str, float]:
    """Token-weighted mean of every metric over the batches (uses each loss's `tokens` count)."""
    fn = _jit(loss_fn)
    sums: dict[str, float] = {}
    total = 0.0
    for batch in batches:
        loss, metrics = fn(params, batch, frozen)
        n = float(metrics["tokens"])
        total += n
        for name, value in {**metrics, "loss": loss}.items():
            if name != "tokens":
                sums[name] = sums.get(name, 0.0) + float(value) * n
    if total == 0:
        raise ValueError("evaluate got no labelled tokens: pass at least one non-empty batch")
    return {name: s / total for name, s in sums.items()} | {"tokens": total}


def checkpoint_manager(run_dir: Path, tc: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=tc.keep, create=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def _log(run_dir: Path, record: dict) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_log(run_dir: Path) -> list[dict]:
    """The run's metric records; after a resume, records past the restored step are superseded."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept: list[dict] = []
    for r in records:
        if r.get("event") == "resume":
            kept = [k for k in kept if k["step"] <= r["step"]]
        kept.append(r)
    return kept


def train(run_dir: str | Path, tc: TrainConfig, params, loss_fn: LossFn, batch_fn: Callable[[int], dict], *,
          eval_batches: Iterable[dict] = (), frozen=None, until: int | None = None, desc: str = "train",
          eval_loss_fn: LossFn | None = None) -> dict:
    """Train from `params` (or resume from run_dir's latest checkpoint) to tc.steps; return the state.

    batch_fn(step) gives batch `step`; eval_batches are evaluated every tc.eval_every steps and
    at the end with eval_loss_fn (default loss_fn). `until` stops early at that step (a
    checkpoint is written), as an interruption would. Metrics go to run_dir/metrics.jsonl.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    step_fn = make_train_step(loss_fn, tc)
    state = init_state(params, make_optimizer(tc))
    eval_batches = list(eval_batches)
    stop = tc.steps if until is None else min(until, tc.steps)
    with checkpoint_manager(run_dir, tc) as mgr:
        start = mgr.latest_step() or 0
        if start:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            state = mgr.restore(start, args=ocp.args.StandardRestore(abstract))
            _log(run_dir, {"event": "resume", "step": start})
        bar = tqdm(range(start, stop), initial=start, total=tc.steps, desc=desc, dynamic_ncols=True, mininterval=5)
        t0 = time.perf_counter()
        for step in bar:
            state, metrics = step_fn(state, batch_fn(step), frozen)
            done = step + 1
            if done % tc.log_every == 0 or done == stop:
                record = {k: float(v) for k, v in metrics.items()}
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}")
                _log(run_dir, {"event": "train", "step": done, "time_s": time.perf_counter() - t0, **record})
            if eval_batches and (done % tc.eval_every == 0 or done == tc.steps):
                val = evaluate(eval_loss_fn or loss_fn, state["params"], eval_batches, frozen)
                bar.write(f"{desc} step {done}: validation " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
                _log(run_dir, {"event": "validation", "step": done, **val})
            if done % tc.ckpt_every == 0 or done == stop:
                mgr.save(done, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    return state


def host(tree):
    """A pytree's arrays as numpy (for saving and comparisons)."""
    return jax.tree.map(np.asarray, tree)
