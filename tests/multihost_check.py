"""One process of a two-process job (jax.distributed on localhost, 4 CPU devices each, gloo collectives).

tests/test_multihost.py starts two of these with the same arguments but the process id, on checkpoints it built;
each joins the job, builds one global DP 2 x TP 4 mesh over all 8 devices whose two axes both cross the processes
(each data replica, and so each tensor-parallel group, holds two devices of each process), decodes and writes what
it got to WORKDIR/process-I.json: every loop's tokens, and the largest part of each safetensors tensor this process
read. The test compares both files with one device's tokens.

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
DATA, MODEL = 2, 4
ROOT = Path(__file__).resolve().parent.parent
KW = dict(max_new_tokens=10, eos_token_id=[])
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=[3, 4, 5])
READ = ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight")


def prompts() -> list[list[int]]:
    """Three ragged prompts for the dense HF target's 256-token vocabulary (and the tiny target's 4096)."""
    return [[5, 17, 99, 3, 42, 8, 200, 61, 7], [11, 12, 13, 14], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def decode(dense, draft, tiny, eagle3, dspark, only: tuple[str, ...] | None = None) -> dict:
    """The loops the test compares (all, or those named in `only`), on targets already loaded (one device or a
    mesh): name -> tokens."""
    import specjax

    p = prompts()

    def streamed() -> list[list[int]]:
        rows = [[] for _ in p]
        for chunk in specjax.stream(tiny, p, **KW):
            rows[chunk.index] += chunk.token_ids
        return rows

    loops = {
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
    return {name: run() for name, run in loops.items() if only is None or name in only}


def load_all(work: Path, mesh=None, dense=None):
    """The dense HF target (or `dense`, loaded already) and its draft model (safetensors, built by the test), the
    shipped tiny target (orbax) and its EAGLE-3 and DSpark heads, on `mesh` (one device when None)."""
    import specjax

    kw = {} if mesh is None else {"mesh": mesh}
    dense = specjax.load(work / "dense", **kw) if dense is None else dense
    tiny = specjax.load(ROOT / "checkpoints/tiny/target", **kw)
    heads = [specjax.load_drafter(ROOT / "checkpoints/tiny" / name, tiny) for name in ("eagle3", "dspark")]
    return dense, specjax.load_drafter(work / "draft", dense), tiny, *heads


def crossing_mesh():
    """The job's (DATA, MODEL) mesh with both axes across the processes: replica r's model group is devices 2r, 2r+1
    of one process then 2r, 2r+1 of the other (process 0 first in replica 0, last in replica 1), so every
    tensor-parallel collective and the data axis's gathers cross the processes."""
    import jax
    import numpy as np

    from specjax.models.sharding import MESH_AXES

    mine = [[d for d in jax.devices() if d.process_index == p] for p in range(NUM_PROCESSES)]
    rows = [mine[0][0:2] + mine[1][0:2], mine[1][2:4] + mine[0][2:4]]
    return jax.sharding.Mesh(np.asarray(rows), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def main(process_id: int, port: int, work: Path) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=NUM_PROCESSES, process_id=process_id)
    import numpy as np
    from sharded_check import ReadLog

    import specjax
    from specjax.multihost import agreed, agreed_json

    start = time.perf_counter()
    report = {"process_index": jax.process_index(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count()}
    mesh = crossing_mesh()
    with ReadLog() as reads:
        dense = specjax.load(work / "dense", mesh=mesh)
    models = load_all(work, mesh, dense)
    report["tokens"] = decode(*models)
    report["largest_read"] = {k: reads.largest.get(k) for k in READ}
    report["q_proj_local_shards"] = [list(s.data.shape) for s in dense.params["layers"][0]["wq"].addressable_shards]
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


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
