"""`specjax serve`'s flags, kept apart from main.py so that building the `specjax` command needs none of the server's
packages (FastAPI, uvicorn)."""

from __future__ import annotations

import argparse

from specjax.multihost import add_job_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a specjax or Hugging Face checkpoint directory")
    p.add_argument("--drafter", default=None, help="a drafter directory of any family, or 'ngram'")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded at once (each has a KV cache row)")
    p.add_argument("--max-len", type=int, default=1024, help="prompt + output tokens of one request, at most")
    p.add_argument("--num-draft-tokens", type=draft_shape, default=None,
                   help="auto (the shape follows the live load; the default with a drafter), off, or a chain length K")
    p.add_argument("--tree", default=None, help="a draft tree instead of a chain, e.g. kary:3,2,1")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="D,M",
                   help="data-parallel replicas x tensor-parallel devices")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: CKPT's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a slot; past it a request is answered 503 at once")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most alternatives a request may ask per token (vLLM's default); -1: no logprobs at all")
    p.add_argument("--greedy-only", action="store_true",
                   help="compile the greedy path only (half the executables): unset temperature means 0, and a "
                        "request with temperature > 0 is refused")
    p.add_argument("--no-penalties", action="store_true",
                   help="refuse presence/frequency/repetition penalties and min_tokens (the loop then skips them)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGINT/SIGTERM before they are aborted")
    p.add_argument("--attn-impl", choices=["auto", "xla", "pallas"], default="auto")
    add_job_arguments(p)  # a multi-process job: process 0 serves, every process runs the engine over one mesh
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def draft_shape(text: str) -> int | str:
    """--num-draft-tokens: auto, off, or K."""
    if text in ("auto", "off"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a chain length K, 'auto' or 'off', got {text!r}") from None


def mesh_shape(text: str) -> tuple[int, int]:
    """--mesh: 'D,M', the data-parallel and tensor-parallel sizes."""
    try:
        data, model = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D,M (data-parallel replicas, tensor-parallel devices) like 2,4, "
                                         f"got {text!r}") from None
    return data, model
