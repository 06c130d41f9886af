"""`specjax serve CKPT`: load a target (and a drafter), start an Engine, warm it up, serve it over HTTP.

At startup it prints the memory plan of the slots (weights, KV cache of --max-slots x --max-len, the drafter's
share), the warm-up time and the URL. SIGINT or SIGTERM stop it: the listening socket closes at once (no new
requests), requests in flight get --shutdown-timeout seconds to finish and are then aborted, the engine is closed,
and the process exits 0. A second SIGINT quits at once.

In a multi-process job (--coordinator or --distributed; the target on a --mesh over every process's devices)
every process loads, builds the engine and warms it up; process 0 serves HTTP and decides, the others replay its
engine's decisions until process 0 stops (specjax/engine/engine.py), then exit 0 too.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

GIB = 2.0**30


class QuietSignalServer(uvicorn.Server):
    """uvicorn's server, except that after a signal has stopped it the signal is not raised again: uvicorn re-raises
    it once shut down, which would end the process by the signal instead of with exit code 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Run an app with uvicorn on a thread of this process (port 0: a free one); yields its base URL, and stops it
    on exit. For scripts and tests that drive an engine they built themselves."""
    sock = socket.socket()
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def memory_lines(target, engine, tensor_parallel: int) -> list[str]:
    """This server's memory per device: the target's weights (specjax/planning/memory.py's count) and what the
    engine's slots hold (its own plan, from the slots' traced shapes: KV cache, drafter state, buffers)."""
    from specjax.planning.profile import DTYPE_BYTES
    from specjax.planning.tensor_parallel import split_model

    cfg = target.cfg
    weights = cfg.num_params(shards=split_model(cfg, tensor_parallel).shards) * DTYPE_BYTES.get(str(cfg.dtype), 4)
    plan = engine.stats().get("memory") or {}
    line = f"memory plan (per device, tensor parallel {tensor_parallel}): target weights {weights / GIB:.3f} GiB"
    if plan:
        line += (f"; {engine.max_slots} slots x {engine.max_len} tokens {plan['slots_bytes'] / GIB:.3f} GiB "
                 f"({plan['slot_bytes'] / 2**20:.1f} MiB a slot: KV cache, drafter state, buffers) + prefill scratch "
                 f"{plan['prefill_scratch_bytes'] / GIB:.3f} GiB")
        if plan.get("free_bytes") is not None:
            line += f"; {plan['free_bytes'] / GIB:.2f} GiB free before"
    return [line]


def serving_mesh(tensor_parallel: int | None, mesh: tuple[int, int] | None):
    """The mesh --tensor-parallel N or --mesh D,M ask for, or None."""
    from specjax.models.sharding import device_mesh, tensor_parallel_mesh

    if mesh is not None and tensor_parallel is not None:
        raise ValueError("pass --mesh D,M or --tensor-parallel N, not both (--tensor-parallel N is --mesh 1,N)")
    if mesh is not None:
        return device_mesh(*mesh)
    return None if tensor_parallel is None else tensor_parallel_mesh(tensor_parallel)


def load_drafter(spec: str | None, target):
    """--drafter: None, 'ngram', or a drafter directory."""
    if spec is None:
        return None
    if spec == "ngram":
        from specjax.drafters import NgramDrafter

        return NgramDrafter()
    from specjax.loading.drafter import load_drafter as load

    return load(spec, target)


def main(args) -> int:
    import jax

    from specjax.engine import Engine
    from specjax.loading.target import load
    from specjax.multihost import join_job
    from specjax.serve.app import Server, build_app

    if args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs must be >= 0, or -1 for none, got {args.max_logprobs}")
    join_job(args)
    started = time.perf_counter()
    target = load(args.ckpt, attn_impl=args.attn_impl, mesh=serving_mesh(args.tensor_parallel, args.mesh))
    drafter = load_drafter(args.drafter, target)
    shape = args.num_draft_tokens
    if drafter is not None and shape is None and args.tree is None:
        shape = "auto"
    if shape == "off":  # speculation off: the plain loop, no drafter to hold or warm up
        drafter = None
    max_logprobs = None if args.max_logprobs < 0 else args.max_logprobs
    engine = Engine(target, drafter, max_slots=args.max_slots, max_len=args.max_len, num_draft_tokens=shape,
                    tree=args.tree, logprobs=max_logprobs, penalties=not args.no_penalties,
                    sampling=not args.greedy_only)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    try:
        for line in memory_lines(target, engine, args.tensor_parallel or (args.mesh[1] if args.mesh else 1)):
            say(line, flush=True)
        devices = jax.devices()
        say(f"warming up: compiling every executable ({len(devices)} {devices[0].platform} device(s))", flush=True)
        warm = engine.warmup()
        say(f"warm-up: {warm:.1f} s (startup {time.perf_counter() - started:.1f} s)", flush=True)
        if jax.process_index() > 0:  # the engine's loop replays process 0's; close() returns when process 0 stops
            engine.close()
            return 0
        name = args.served_model_name or Path(args.ckpt).resolve().name
        server = Server(engine, target, name, max_len=args.max_len, max_queue=args.max_queue,
                        max_logprobs=max_logprobs)
        config = uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout)
        http = QuietSignalServer(config)
        print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops it)", flush=True)
        http.run()
        if not http.started:
            print(f"specjax serve: error: could not listen on {args.host}:{args.port}", file=sys.stderr)
            return 1
    finally:
        engine.close()
    print("stopped", flush=True)
    return 0
