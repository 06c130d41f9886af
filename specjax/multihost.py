"""What crosses processes in a multi-host job (jax.distributed): every process runs the same program on the
same prompts over one global mesh, so results are gathered to every process, host-made decisions are process
0's everywhere, and arrays are moved with collectives where device_put cannot reach. In one process each is the
plain operation (np.asarray, the value itself, device_put)."""

from __future__ import annotations

import functools
import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(tree):
    """Every array of `tree` as a numpy array on this process. One split over other processes' devices as well (the
    batch over a "data" axis that spans hosts) is gathered first, a collective every process runs in the same order,
    so each process gets the whole result (jax.experimental.multihost_utils.process_allgather); one every process
    holds whole (replicated) is read from this process's copy, no collective."""

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))  # every process holds it whole: no collective
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(host, tree)


def agreed(tree):
    """`tree` (numpy arrays of the same shapes on every process) as process 0 has it, on every process. What the
    host decides from timings (an "auto" plan, a scheduler's cost table) must be one decision across a multi-host
    job: processes that chose differently would run different programs. Unchanged in a single process."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def agreed_json(value):
    """A JSON-able value as process 0 has it, on every process (its bytes' length first, then the bytes)."""
    if jax.process_count() == 1:
        return value
    data = np.frombuffer(json.dumps(value, default=float).encode(), np.uint8)
    size = int(agreed(np.asarray(data.size, np.int32)))
    data = agreed(np.pad(data, (0, max(0, size - data.size)))[:size])
    return json.loads(data.tobytes().decode())


def moved_to(tree, shardings):
    """`tree` with every array on its sharding in `shardings`: one already there is kept; one this process holds
    whole is moved by device_put, any other (split over other processes' devices too) by a jitted copy."""

    def move(x, sharding):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if x.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        return _copy_to(sharding)(x)

    return jax.tree.map(move, tree, shardings)


@functools.cache
def _copy_to(sharding):
    return jax.jit(lambda x: x, out_shardings=sharding)


def on_like(host, like: jax.Array) -> jax.Array:
    """A host array placed as `like` is (its sharding, across processes too: each passes the same value)."""
    return jax.device_put(np.asarray(host, like.dtype), like.sharding)


def check_same_everywhere(what: str, value) -> None:
    """A ValueError on every process unless each passed the same `value` (compared by a digest of its repr, all
    processes' digests gathered): a multi-host job runs one program on one batch, so a process that brought other
    prompts would decode someone else's rows or wait forever on a collective."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest()[:8], np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(f"every process of a multi-host job must pass the same {what}: processes {differ} differ "
                         f"from process 0 (each process runs the whole batch; split requests between jobs, not "
                         "between the processes of one)")


class Broadcast:
    """Process 0's host decisions sent to the other processes of a job, one JSON value at a time and in order,
    through jax.distributed's key-value store (the coordinator's, process 0's): no device collective, nothing to
    compile, and a process may wait on the next message for as long as it takes (a server idle for hours),
    which a collective could not. Each receiver has its own copy of a message and deletes it once read, so the
    store holds only what is not yet read. `name` must be the same on every process and unique in the job."""

    WAITING = object()  # receive's answer when no message came in time

    def __init__(self, name: str):
        from jax._src import distributed  # the job's client: what multihost_utils itself uses

        self.name, self.sent, self.received = name, 0, 0
        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("a multi-process job needs jax.distributed.initialize() before anything runs")

    def send(self, value) -> None:
        """On process 0: `value` to every other process."""
        data = json.dumps(value, default=_plain)
        for p in range(1, jax.process_count()):
            self.client.key_value_set(f"{self.name}/{p}/{self.sent}", data)
        self.sent += 1

    def receive(self, timeout_s: float):
        """On another process: process 0's next value, or `Broadcast.WAITING` if none came within timeout_s (then
        the same message is asked for again next time; jaxlib's store may also just wait on, as it did here)."""
        key = f"{self.name}/{jax.process_index()}/{self.received}"
        try:
            data = self.client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" in str(err):
                return self.WAITING
            raise
        self.client.key_value_delete(key)
        self.received += 1
        return json.loads(data)


def _plain(x):
    """numpy values as JSON has them (ints stay ints)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


def add_job_arguments(p) -> None:
    """The command-line flags that join a multi-process job (`specjax generate`, `specjax serve`)."""
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join a multi-process job (jax.distributed): process 0's address; with --num-processes, "
                        "--process-id; every process runs the same command and process 0 prints (and serves)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--distributed", action="store_true",
                   help="join a multi-process job by JAX's cluster detection (SLURM, Open MPI, ...) instead")


def join_job(args) -> None:
    """Join a multi-process job (jax.distributed) before anything touches the devices: --coordinator HOST:PORT with
    --num-processes and --process-id, or --distributed for JAX's own cluster detection (SLURM, Open MPI, ...);
    nothing without them. A ValueError names what is missing."""
    given = [flag for flag, v in (("--num-processes", args.num_processes), ("--process-id", args.process_id))
             if v is not None]
    if args.coordinator is None and not args.distributed:
        if given:
            raise ValueError(f"{' and '.join(given)} join a multi-process job: add --coordinator HOST:PORT "
                             "(process 0's address), or use --distributed for JAX's cluster detection")
        return
    if args.coordinator is not None and len(given) < 2:
        raise ValueError("--coordinator needs --num-processes N and --process-id I (0 on the coordinator's host)")
    if args.coordinator is not None and args.distributed:
        raise ValueError("pass --coordinator (with --num-processes, --process-id) or --distributed, not both")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of several processes talk by gloo
    if args.distributed:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
