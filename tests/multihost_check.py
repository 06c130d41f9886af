"""One process of a two-process job (jax.distributed on localhost, 4 CPU devices each, gloo collectives).

tests/test_multihost.py starts two of these with the same arguments but the process id, on checkpoints it built;
each joins the job, builds the global meshes over all 8 devices (TP 8, and DP 2 x TP 4: one data replica per
process), decodes and writes what it got to WORKDIR/process-I.json: every loop's tokens, and the largest part
of each safetensors tensor this process read. The test compares both files with one device's tokens. Then
specjax.Engine runs over the DP 2 x TP 4 mesh: process 0 submits requests at seeded random times and aborts one
mid-decoding,
its policy switching at random between off and a chain; each process reports the shapes it ran and what it
compiled after warmup, process 0 its requests' tokens.

    python tests/multihost_check.py PROCESS_ID PORT WORKDIR      # twice, PROCESS_ID 0 and 1
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
MESHES = {"tp8": (1, 8), "dp2_tp4": (2, 4)}
ROOT = Path(__file__).resolve().parent.parent
KW = dict(max_new_tokens=10, eos_token_id=[])
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=[3, 4, 5])
# The loops each mesh runs (compiles are most of the time): TP across the processes plain and speculative, DP 2 x TP 4
# (a data replica per process) everything.
LOOPS = {"tp8": ("dense/plain", "dense/draft_chain", "tiny/eagle3_chain"), "dp2_tp4": None}
# One device decodes only what greedy speculation's equality with plain decoding does not give (the suite checks that
# equality everywhere): each target's plain loop, the sampled ones, inspect_draft. A greedy speculative loop on a mesh
# must equal its target's plain one-device tokens (`one_device_tokens`).
ONE_DEVICE = ("dense/plain", "dense/sampled_plain", "dense/sampled_draft_chain", "tiny/plain", "tiny/inspect_draft")
READ = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight")


# the engine's requests: prompt, max_new_tokens (prompt + budget within its max_len of 32)
ENGINE_REQUESTS = [([5, 17, 99, 3, 42, 8, 200, 61, 7], 12), ([11, 12, 13, 14], 9), ([250, 1, 2, 3, 4, 5, 6], 14),
                   ([7, 7, 9], 10), ([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], 8), ([42], 13)]
ENGINE_ABORTED = 5  # aborted once its first tokens are out: mid-decoding, so every process must drop it


def prompts() -> list[list[int]]:
    """Three ragged prompts for the dense HF target's 256-token vocabulary (and the tiny target's 4096)."""
    return [[5, 17, 99, 3, 42, 8, 200, 61, 7], [11, 12, 13, 14], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def loops(dense, draft, tiny, eagle3, dspark) -> dict:
    """The loops the test compares, on targets already loaded (one device or a mesh): name -> a call that decodes
    (building the table runs nothing)."""
    import specjax

    p = prompts()

    def streamed() -> list[list[int]]:
        rows = [[] for _ in p]
        for chunk in specjax.stream(tiny, p, **KW):
            rows[chunk.index] += chunk.token_ids
        return rows

    return {
        "dense/plain": lambda: specjax.generate(dense, p, **KW).tokens,
        "dense/draft_chain": lambda: specjax.generate(dense, p, drafter=draft, num_draft_tokens=3, **KW).tokens,
        "dense/draft_tree": lambda: specjax.generate(dense, p, drafter=draft, tree="kary:2,1", **KW).tokens,
        "dense/sampled_plain": lambda: specjax.generate(dense, p, **SAMPLED, **KW).tokens,
        "dense/sampled_draft_chain": lambda: specjax.generate(dense, p, drafter=draft, num_draft_tokens=2, **SAMPLED,
                                                              **KW).tokens,
        "tiny/plain": lambda: specjax.generate(tiny, p, **KW).tokens,
        "tiny/eagle3_chain": lambda: specjax.generate(tiny, p, drafter=eagle3, num_draft_tokens=3, **KW).tokens,
        "tiny/stream": streamed,
        "tiny/dspark_confidence_scheduler": lambda: specjax.generate(tiny, p, drafter=dspark, num_draft_tokens=4,
                                                                     scheduler="confidence", **KW).tokens,
        "tiny/inspect_draft": lambda: specjax.inspect_draft(tiny, eagle3, p[1], num_draft_tokens=3).tokens.tolist(),
    }


def decode(*models, only: tuple[str, ...] | None = None) -> dict:
    """Every loop's tokens on `models` (those of `loops`), or those of the loops named in `only`: name -> tokens."""
    return {name: run() for name, run in loops(*models).items() if only is None or name in only}


def one_device_tokens(want: dict, loop: str) -> list:
    """What `loop` must decode: its one-device tokens when run (ONE_DEVICE), else its target's plain tokens."""
    return want[loop] if loop in want else want[loop.split("/")[0] + "/plain"]


def load_all(work: Path, mesh=None, dense=None):
    """The dense HF target (or `dense`, loaded already) and its draft model (safetensors, built by the test), the
    shipped tiny target (orbax) and its EAGLE-3 and DSpark heads, on `mesh` (one device when None)."""
    import specjax

    kw = {} if mesh is None else {"mesh": mesh}
    dense = specjax.load(work / "dense", **kw) if dense is None else dense
    tiny = specjax.load(ROOT / "checkpoints/tiny/target", **kw)
    heads = [specjax.load_drafter(ROOT / "checkpoints/tiny" / name, tiny) for name in ("eagle3", "dspark")]
    return dense, specjax.load_drafter(work / "draft", dense), tiny, *heads


def main(process_id: int, port: int, work: Path) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=NUM_PROCESSES, process_id=process_id)
    import numpy as np
    from sharded_check import ReadLog

    import specjax
    from specjax.models.sharding import device_mesh
    from specjax.multihost import agreed, agreed_json

    start = time.perf_counter()
    report = {"process_index": jax.process_index(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(), "meshes": {}}
    for name, shape in MESHES.items():
        mesh = device_mesh(*shape)
        with ReadLog() as reads:
            dense = specjax.load(work / "dense", mesh=mesh)
        models = load_all(work, mesh, dense)
        began = time.perf_counter()
        report["meshes"][name] = {"tokens": decode(*models, only=LOOPS[name]),
                                  "largest_read": {k: reads.largest.get(k) for k in READ},
                                  "q_proj_local_shards": [list(s.data.shape) for s in
                                                          dense.params["layers"][0]["wq"].addressable_shards],
                                  "seconds": time.perf_counter() - began}
    report["engine"] = run_engine(*models[:2])
    # prompts that differ between the processes are refused on every process; unseeded sampling is process 0's draw
    try:
        specjax.generate(models[2], [prompts()[process_id]], max_new_tokens=2)
        report["different_prompts"] = "decoded"
    except ValueError as err:
        report["different_prompts"] = str(err)
    report["unseeded"] = specjax.generate(models[2], prompts(), temperature=1.0, **KW).tokens
    # what the host decides from timings is process 0's everywhere
    report["agreed"] = [int(agreed(np.asarray(jax.process_index()))), agreed_json({"from": jax.process_index()})]
    report["seconds"] = time.perf_counter() - start
    (work / f"process-{process_id}.json").write_text(json.dumps(report))


def run_engine(target, draft) -> dict:
    """specjax.Engine over the target's mesh: process 0 submits ENGINE_REQUESTS at seeded random times (aborting
    one), choosing "off" or "chain:2" at random each chunk; every process reports the shapes its chunks ran, its
    counters and its compiles after warmup."""
    import random

    import jax

    import specjax
    from specjax.engine import engine as engine_module

    engine_module.MAX_ROUNDS = 2  # short chunks: rows outlive an "off" chunk, so speculation resumes by catch-up
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    report = {}
    with specjax.Engine(target, draft, max_slots=2, max_len=32, auto_chains=(2,), sampling=False,
                        max_prefill_batch=2) as engine:
        report["warmup_s"] = engine.warmup()
        before, events = engine.stats()["compiles"], len(compiles)
        rng = random.Random(7)
        if jax.process_index() == 0:
            turn = iter(range(10 ** 9))
            engine.policy.choose = lambda nb, live, current: engine.labels[(next(turn) + (rng.random() < 0.2)) % 2]
            handles = []
            for prompt, budget in ENGINE_REQUESTS:
                handles.append(engine.submit(prompt, max_new_tokens=budget, eos_token_id=[], temperature=0.0))
                time.sleep(rng.random() * 0.05)
            next(iter(handles[ENGINE_ABORTED]))
            engine.abort(handles[ENGINE_ABORTED])
            outs = [h.result(timeout=600) for h in handles]
            report["tokens"] = [o.tokens for o in outs]
            report["finish_reasons"] = [o.finish_reason for o in outs]
        else:
            try:
                engine.submit(ENGINE_REQUESTS[0][0])
            except RuntimeError as err:
                report["submit_elsewhere"] = str(err)
    stats = engine.stats()
    report.update(shapes=[[live, label] for _, live, label in stats["shapes_over_time"]],
                  counters={k: stats[k] for k in ("chunks", "prefills", "prefill_rows", "catch_up_rows",
                                                  "tokens_emitted", "requests_finished", "requests_aborted")},
                  compiled_after_warmup=engine._compiled[before:], jax_compiles_after_warmup=len(compiles) - events)
    return report


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
