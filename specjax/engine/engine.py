"""`specjax.Engine`: continuous batching with speculation that follows the live number of requests.

A thread of its own runs the loop: between chunks it admits waiting requests (prefilled at a power-of-two prompt
bucket, several at once, inserted into free slots by a jitted donated scatter), hands out tokens, retires finished
or aborted requests (the last live row moved into the freed slot, so live rows stay at the lowest indices) and
picks the next chunk's draft shape from the number of slots decoding (`policy.LoadPolicy`). A chunk is up to R
rounds of the speculative loop (or plain steps when speculation is off) over the first nb slots, nb the occupancy
bucket, ending early when a row finishes while a request waits. The next chunk is dispatched before the host reads
the last one's tokens (as `specjax.stream` does).

Every executable is keyed by (occupancy bucket, shape, greedy or sampled) for chunks and (prompt bucket, prefill
batch) for prefills; `warmup()` compiles them all, and a run after it compiles nothing.

In a multi-process job (jax.distributed, the target on a mesh spanning every process) every process runs this loop
over the one global mesh. What the host decides and could decide differently on another process is process 0's,
sent to the others once or twice a gap (multihost.Broadcast): the aborts and the requests admitted (their prompt
ids and settings, fresh seeds drawn), then the chunk's shape, rounds and early exit (chosen from process 0's
timings). Everything else follows from those and from the tokens read, the same on every process. Requests
enter on process 0; the others replay its decisions (`_follow`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.chat import render_prompts
from specjax.config import SamplingConfig
from specjax.decoding.decode import GREEDY, SAMPLED, LoopConfig, RowSettings
from specjax.decoding.drafter import Settings, check_drafter_argument
from specjax.decoding.params import SamplingParams, merged
from specjax.decoding.penalties import RowPenalties
from specjax.decoding.request import GenerateOutput, batch_bucket, bucket, prepare, round_cache_length
from specjax.decoding.sampling import RowSampling
from specjax.decoding.scheduler import cost_table, verify_widths
from specjax.decoding.speculative import SCHEDULERS, Scheduler, check_drafter_fits
from specjax.decoding.stream import RowText, StreamChunk, finish_reason
from specjax.decoding.tree import DynamicTreeSpec, parse_tree
from specjax.engine import slots as ops
from specjax.engine.handle import RequestHandle, RequestOutput
from specjax.engine.policy import OFF, LoadPolicy, shape_size
from specjax.generate import _options, _sampling
from specjax.models.sharding import axis_size, use_mesh
from specjax.models.target import Target
from specjax.multihost import Broadcast, agreed, to_host
from specjax.planning.scheduler_cost import scheduler_cost

AUTO_CHAINS = (1, 2, 4)  # the chains "auto" chooses among, besides off
STOP_IDS = 8  # stop ids a request may have (EOS included): a fixed column count of the slots' settings
CHUNK_TARGET_S = 0.05  # a chunk runs the fewest power-of-two rounds that take this long, up to MAX_ROUNDS
MAX_ROUNDS = 32
WARMUP_ROUNDS = 4  # rounds of each timed warmup chunk
WARMUP_TIMINGS = 3  # timed warmup chunks per (occupancy bucket, shape), each on fresh dummy rows
SETTINGS = {f.name for f in dataclasses.fields(SamplingParams)}  # a request's settings: SamplingParams' fields
LIST_SETTINGS = ("stop", "stop_token_ids", "eos_token_id")
FOLLOW_WAIT_S = 1.0  # a process other than 0 waits for process 0's next message in turns of (at least) this long
_ENGINES = itertools.count()  # engines built in this process: the same order on every process names their messages


@dataclasses.dataclass(eq=False)  # compared by identity (a request is itself, whatever its fields)
class _Active:
    """A request between submission and retirement, as the host tracks it."""

    handle: RequestHandle
    ids: list[int]
    req: Any  # decoding.request.Request of this one prompt (batch 1): its validated per-row settings
    text: RowText
    submitted: float
    slot: int = -1
    seen: int = 0  # tokens read from the device so far
    device_tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    stale: bool = False  # its drafter state missed tokens decoded with speculation off
    stats_row: tuple[int, int, int] = (0, 0, 0)  # its speculative rounds, emitted and accepted tokens
    first_token_at: float | None = None
    prefilling: bool = False  # a long prompt entering its slot piece by piece (the row is not decoding yet)
    # Bounds on its device count once every chunk dispatched so far has run: the count last read plus, per chunk
    # dispatched since, its rounds (a round emits at least one token) or its rounds x its shape's depth + 1 (at
    # most); the prefill emits the first token. They tell whether a chunk is sure to, or may, end it by its budget.
    floor: int = 1
    ceiling: int = 1
    offset: int = 0  # prompt tokens already in the slot's cache
    features: Any = ()  # while prefilling: the drafter's features over the prompt so far, on the device
    aborted: bool = False
    finished: bool = False
    wire: Any = None  # in a multi-process job: the request as process 0 sends it to the others (prompt ids, settings)


@dataclasses.dataclass
class _Chunk:
    """A dispatched chunk, until the host reads it: its snapshot, the requests in its rows (None where no row
    decoded), its shape, row bucket and rows decoding, whether no gap work ran before it (`clean`), when it was
    dispatched, the rounds it may run, the most tokens a round emits (`width`), and whether it is read before the next
    gap (`drain`: a row's budget may run out in it)."""
    snap: tuple
    owners: list
    label: str
    nb: int
    live: int
    clean: bool
    dispatched: float
    rounds: int
    width: int
    drain: bool


class Engine:
    """Continuous batching over `max_slots` decode slots, each with its own KV cache row (and drafter state).

    Requests arrive and leave while a thread of the engine's own runs the loop: between chunks of the speculative
    loop it admits waiting requests into free slots, retires finished ones, and picks the next chunk's draft shape
    from the number of slots decoding (docs/engine.md). The constructor allocates the slots and starts that thread;
    use the engine as a context manager, or call `close()`, to stop it.

    Args:
        target: a `specjax.Target` (`specjax.load`), on one device or a mesh.
        drafter: a loaded drafter (`specjax.load_drafter`, `NgramDrafter`, `replay_drafter`), or None to decode
            plainly.
        max_slots: requests decoding at once; a multiple of the mesh's data-parallel size.
        max_len: the most positions a request may use, prompt plus max_new_tokens.
        num_draft_tokens: "auto" (off, chains of `auto_chains` drafts and the trees of `auto_trees`, chosen per
            chunk from the live occupancy), K (a fixed chain of K drafts), or "off".
        tree: a fixed tree spec instead of a chain, as `generate` takes it.
        logprobs: the most top logprobs a request may ask (0: each token's own logprob only; None: requests may not
            ask logprobs). Computing them costs every round.
        penalties: whether requests may use repetition / presence / frequency penalties and min_tokens (their token
            counts cost memory [slots, vocab] and every round).
        sampling: whether requests may sample (False compiles the greedy path only).
        max_prefill_batch: the most waiting requests prefilled together in one gap between chunks.
        prefill_tokens_per_gap: prompt tokens prefilled per gap (at least one request, or one piece of a long
            prompt).
        auto_chains: the chain lengths "auto" chooses among, besides off.
        auto_trees: tree specs "auto" chooses among too (static trees as `generate` takes them, e.g.
            "kary:3,2,1", or one-pass dynamic trees); none by default, since each adds an executable per occupancy
            bucket.
        scheduler: "confidence" or "prefix" (with a drafter that reports confidences, e.g. DSpark, and a fixed
            chain): each round verifies only the drafts worth their cost across all live slots, decided from the
            drafter's confidences alone (lossless).
        scheduler_profile: the scheduler's verify cost curve, as `generate` takes it (None: $SPECJAX_PROFILE or
            this device's roofline).
        prefill_chunk: a power of two >= 16; a prompt longer than this enters its slot in pieces of this many
            tokens, between chunks, so the requests decoding meanwhile wait at most about one piece's prefill per
            gap.

    Raises:
        TypeError: `target` is not a Target, or `drafter` is not a loaded drafter (a path, a Target).
        ValueError: a size that is not a positive int, a `prefill_chunk` that is not a power of two >= 16, a bad
            `logprobs`, `num_draft_tokens`, `tree`, `auto_chains` or `auto_trees` (or a shape without a drafter,
            or `auto_trees` with a fixed shape), a drafter whose vocabulary or hidden-state taps do not fit the
            target, a `scheduler` without a confidence drafter and a fixed chain, candidate shapes whose drafter
            states differ, `max_slots` not a multiple of the data-parallel size, or slots that do not fit the
            device's free memory (the message says which max_slots would).

    Example:
        ```python
        target = specjax.load(specjax.embedded("target"))
        drafter = specjax.load_drafter(specjax.embedded("draft"), target)
        with specjax.Engine(target, drafter, max_slots=8, max_len=256) as engine:
            engine.warmup()
            handle = engine.submit("def quicksort(xs):", max_new_tokens=32)
            print(handle.result().text)
        ```

    In a multi-process job (jax.distributed) build it on every process over a target on the job's global mesh:
    requests enter on process 0 (submit / abort / generate elsewhere raise), whose host decisions every process's
    loop follows; warmup() on process 0 warms all, and process 0's close() ends all (elsewhere close() waits).
    """

    def __init__(self, target: Target, drafter=None, *, max_slots: int = 8, max_len: int = 1024,
                 num_draft_tokens="auto", tree=None, logprobs: int | None = None, penalties: bool = False,
                 sampling: bool = True, max_prefill_batch: int = 4, prefill_tokens_per_gap: int = 4096,
                 auto_chains: Sequence[int] = AUTO_CHAINS, auto_trees: Sequence[str] = (), scheduler: str | None = None,
                 scheduler_profile=None, prefill_chunk: int = 512):
        if not isinstance(target, Target):
            raise TypeError(f"Engine's first argument must be a specjax Target, got {type(target).__name__}")
        for name, value in (("max_slots", max_slots), ("max_len", max_len), ("max_prefill_batch", max_prefill_batch),
                            ("prefill_tokens_per_gap", prefill_tokens_per_gap)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 16 or \
                prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= 16, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be None or the most top logprobs a request may ask (an int >= 0), "
                             f"got {logprobs!r}")
        self.target, self.max_slots, self.max_len = target, max_slots, max_len
        self.mesh = getattr(target, "mesh", None)
        # a multi-process job: process 0 decides, the others replay (None in one process: nothing is sent)
        self._broadcast = None
        if jax.process_count() > 1:
            if self.mesh is None:
                raise ValueError("in a multi-process job the engine runs over one mesh of every process's devices: "
                                 "load the target with specjax.load(path, mesh=...)")
            self._broadcast = Broadcast(f"specjax/engine/{next(_ENGINES)}")
        self.leader = jax.process_index() == 0
        self.data = axis_size(self.mesh, "data")  # data-parallel replicas: every row batch is a multiple of it
        if max_slots % self.data:
            raise ValueError(f"max_slots={max_slots} must be a multiple of the mesh's data-parallel size {self.data} "
                             f"(the slots are split over \"data\")")
        max_prefill_batch = min(max_prefill_batch, max_slots)  # a prefill fills free slots: never more than all
        if max_prefill_batch % self.data:
            max_prefill_batch = -(-max_prefill_batch // self.data) * self.data
        self.max_top_logprobs, self.penalties, self.sampling = logprobs, penalties, sampling
        self.max_prefill_batch, self.prefill_tokens_per_gap = max_prefill_batch, prefill_tokens_per_gap
        self.labels, specs = _shapes(drafter, num_draft_tokens, tree, auto_chains, auto_trees)
        if drafter is not None:
            check_drafter_argument(drafter)
            check_drafter_fits(drafter, target)
        if scheduler is not None:
            if scheduler not in SCHEDULERS:
                raise ValueError(f"scheduler must be one of {SCHEDULERS} or None, got {scheduler!r}")
            spec = specs.get(self.labels[0]) if len(self.labels) == 1 else None
            if drafter is None or spec is None or not spec.is_chain:
                raise ValueError(f"scheduler={scheduler!r} verifies prefixes of one chain: give a drafter that reports "
                                 f"confidences and num_draft_tokens=K")
        self.scheduler, self.scheduler_profile = scheduler, scheduler_profile
        self._sched_costs: dict[int, Any] = {}
        self.drafter = None if self.labels == [OFF] else drafter  # "off": the drafter is never run, nor kept
        nodes = max((s.cache_slots for s in specs.values()), default=0)
        self.cache_len = round_cache_length(max(max_len + nodes, bucket(max_len - 1)))  # holds any prompt bucket
        self.out_len = max_len
        self.depth, self.ranks = shape_size(specs.values())  # what the acceptance counts hold: depths, sibling ranks
        self.lc = {sampled: LoopConfig(target.cfg, sampled, self.out_len, self.cache_len, target.attn_impl,
                                       penalties=penalties, logprobs=-1 if logprobs is None else logprobs)
                   for sampled in ((False, True) if sampling else (False,))}
        # Every configured drafter (per shape and sampling mode) must carry the same state structure: the slots
        # hold one drafter state whatever shape the next chunk runs.
        self.configured = {(label, sampled): self._configure(specs[label], sampled)
                           for label in specs for sampled in self.lc}
        self.policy = LoadPolicy(self.labels, specs)
        self._prefill_drafter = self.configured.get((_first_spec(self.labels), max(self.lc)))
        self._trace_axes()
        self.memory = self._check_memory()
        self._compiles = 0
        self._compiled: list = []  # what compiled, in order
        self._compile_s = 0.0
        self._executables: dict[tuple, Any] = {}
        self.warmed_up = False
        self._warmup_requested: threading.Event | None = None
        self._last_read: float | None = None  # when the host last finished reading a chunk (the next chunk's time
        # starts there, its gap included; None after the loop idled)
        self._last_step: int | None = None  # the slots' round counter at that read
        self._depth_base = (0, 0)  # per-depth counts before the first request (warmup's dummies)
        self._last_counts = (0, 0)  # verified drafts per (depth, rank) and row-rounds at the last read: per chunk
        self._offered_D = self._accepted_D = np.zeros((0,), np.int64)  # drafts offered / accepted per depth since
        # host mirrors of the slots' per-row settings
        self._rows = _empty_rows(max_slots)
        self._max_new = np.zeros((max_slots,), np.int32)
        self._live: list[_Active | None] = [None] * max_slots
        self._waiting: collections.deque[_Active] = collections.deque()
        self._abort_asked: list[_Active] = []  # aborts of admitted requests, applied at the next gap
        self._warmed = threading.Event()
        self._requests: dict[int, _Active] = {}  # every request not yet finished, by id
        self._inflight: collections.deque[tuple] = collections.deque()
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._shape: str | None = None
        self._gap_work = 0  # prefills, prompt pieces and catch-ups dispatched since the last chunk
        self._history: list[tuple[float, int, str]] = []
        self._counters = collections.Counter({k: 0 for k in (
            "chunks", "prefills", "prefill_rows", "draftless_prefill_rows", "chunked_prefills", "catch_up_rows",
            "tokens_emitted", "requests_finished", "requests_aborted")})
        self._started = time.perf_counter()
        self._slots = self._fresh_slots()
        self._slot_shardings = jax.tree.map(lambda x: x.sharding, self._slots)
        self._replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if self.mesh is None else \
            jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(self, prompt, **settings) -> RequestHandle:
        """Queue one request; returns its handle at once, without waiting for a slot.

        Bad input raises here, for this request alone: the engine and the other requests carry on.

        Args:
            prompt: a string, a list of token ids, or a chat (a list of {"role", "content"} messages, rendered by
                the checkpoint's chat template).
            **settings: `generate`'s per-request settings, each one value: max_new_tokens, temperature, top_k,
                top_p, min_p, seed (unset: a fresh seed per request), stop, stop_token_ids, eos_token_id, logprobs,
                top_logprobs, repetition_penalty, presence_penalty, frequency_penalty, min_tokens,
                include_stop_str_in_output, skip_special_tokens; also chat_template_kwargs, and sampling_params (a
                `SamplingParams` the keywords override).

        Returns:
            The request's `RequestHandle`: `result()`, iteration over its `StreamChunk`s, `await`.

        Raises:
            TypeError: an unknown setting, or a setting of the wrong type.
            ValueError: a setting out of its range; a prompt that with max_new_tokens needs more than `max_len`
                positions; sampling, penalties or logprobs (or more top_logprobs) than the engine was built for;
                more than 8 stop token ids, EOS included.
            RuntimeError: the engine is closed, or stopped after an error.
        """
        self._check_leader("submit")
        active = self._validate(prompt, settings)
        with self._lock:
            self._check_open()
            self._waiting.append(active)
            self._requests[active.handle.request_id] = active
            self._lock.notify_all()
        return active.handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request wherever it is (queued or decoding); its handle finishes with finish_reason "abort".

        A queued request ends at once; a decoding one at the next gap between chunks, its slot freed. A request that
        has already finished is left as it is.

        Args:
            handle: the `RequestHandle` that `submit` returned.

        Raises:
            TypeError: `handle` is not a RequestHandle.
        """
        if not isinstance(handle, RequestHandle):
            raise TypeError(f"abort() takes the RequestHandle submit() returned, got {type(handle).__name__}")
        self._check_leader("abort")
        with self._lock:
            a = self._requests.get(handle.request_id)
            if a is None or a.handle is not handle or a.finished:
                return
            if a in self._waiting:
                a.aborted = True
                self._waiting.remove(a)
                self._finish(a, "abort")
            else:  # admitted: every process drops it at the same gap (_admit)
                self._abort_asked.append(a)
            self._lock.notify_all()

    def generate(self, prompts: Sequence, **settings) -> GenerateOutput:
        """Every prompt through the engine at full occupancy (offline batch work), like `specjax.generate`.

        The prompts are submitted at once and the engine keeps its slots full, admitting the next prompt as each one
        finishes.

        Args:
            prompts: a non-empty list of prompts, each as `submit` takes one.
            **settings: `submit`'s settings, each one value for every prompt or a list of one per prompt (for stop,
                stop_token_ids and eos_token_id, themselves lists: a list of lists is one per prompt).

        Returns:
            A `GenerateOutput` in prompt order: tokens, texts, finish_reasons, stop_reasons, logprobs when every
            request asked them, and stats (tokens_per_s, decode_s, generated_tokens, and engine: `stats()`).

        Raises:
            ValueError: `prompts` is not a non-empty list, or a per-prompt list has another length.
            TypeError, ValueError, RuntimeError: as `submit` raises them for any one prompt; a request the
                engine failed on raises `RuntimeError` from its result.
        """
        self._check_leader("generate")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        n = len(prompts)
        per = {}
        for name, value in settings.items():
            many = isinstance(value, (list, tuple))
            if name in LIST_SETTINGS:  # a list of lists is one per prompt; a flat list is every prompt's
                many = many and bool(value) and all(isinstance(v, (list, tuple)) for v in value)
            if many and len(value) != n:
                raise ValueError(f"{name} has {len(value)} values for {n} prompts: pass one value per prompt or one "
                                 f"for all")
            per[name] = list(value) if many else [value] * n
        start = time.perf_counter()
        handles = [self.submit(p, **{k: v[i] for k, v in per.items()}) for i, p in enumerate(prompts)]
        outs = [h.result() for h in handles]
        seconds = time.perf_counter() - start
        tokens = sum(len(o.tokens) for o in outs)
        out = GenerateOutput([o.tokens for o in outs], {"tokens_per_s": tokens / seconds, "decode_s": seconds,
                                                       "generated_tokens": tokens, "engine": self.stats()},
                             texts=None if self.target.tokenizer is None else [o.text for o in outs],
                             finish_reasons=[o.finish_reason for o in outs],
                             stop_reasons=[o.stop_reason for o in outs])
        if all(o.logprobs is not None for o in outs):
            out.logprobs = [o.logprobs for o in outs]
            if all(o.top_logprobs is not None for o in outs):
                out.top_logprobs = [o.top_logprobs for o in outs]
        return out

    def warmup(self) -> float:
        """Compile every executable the engine can use and time each chunk shape at each occupancy bucket.

        The timings are the shape policy's cost profile; after warmup, serving compiles nothing. Without it, each
        executable compiles the first time it is needed and each shape is timed when first run.

        In a multi-process job call it on every process (or on process 0 alone): process 0's call runs it
        everywhere, another process's waits for that to end.

        Returns:
            The seconds it took.

        Raises:
            RuntimeError: requests are queued or decoding (warm up before submitting), or the engine is closed or
                stopped after an error.
        """
        start = time.perf_counter()
        if not self.leader:
            while not self._warmed.wait(FOLLOW_WAIT_S) and self._thread.is_alive():
                pass
            self._check_open()
            return time.perf_counter() - start
        with self._lock:
            self._check_open()
            if self._waiting or self._live_count():
                raise RuntimeError("warmup() runs on an idle engine: call it before submitting requests")
            done = self._warmup_requested = threading.Event()
            self._lock.notify_all()
        done.wait()
        self._check_open()
        return time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's state and counters (what `specjax serve` exports on /metrics).

        Returns:
            A dict: occupancy (requests in slots), max_slots, queue_length, shape (the current chunk's draft shape),
            shapes (the candidates), shapes_over_time ((seconds since start, rows decoding, shape) at each
            change), compiles and compile_s (an engine after `warmup()` adds none), warmed_up, cache_len, memory
            (the slots' byte plan), offered_at_depth and accepted_at_depth (drafts per depth, warmup's excluded),
            the counters chunks, prefills, prefill_rows, draftless_prefill_rows (rows admitted while speculation was
            off: the drafter's prefill skipped), chunked_prefills, catch_up_rows, tokens_emitted, requests_finished,
            requests_aborted, and the policy's acceptance_at_depth (a chain's), acceptance_depth_rank
            (p[depth][rank]), tau (per shape), round_ms, realized_factor and realized_row_rate (tokens per live row
            per second), per "bucket/shape", and dropped shapes.
        """
        with self._lock:
            live = sum(a is not None and not a.finished for a in self._live)
            return {"occupancy": live, "memory": self.memory, "max_slots": self.max_slots, "queue_length": len(self._waiting),
                    "shape": self._shape, "shapes": list(self.labels), "shapes_over_time": list(self._history),
                    "compiles": self._compiles, "compile_s": self._compile_s, "warmed_up": self.warmed_up,
                    "cache_len": self.cache_len, "offered_at_depth": [int(x) for x in self._offered_D],
                    "accepted_at_depth": [int(x) for x in self._accepted_D], **dict(self._counters),
                    **self.policy.summary()}

    def close(self) -> None:
        """Stop the loop and wait for its thread; queued and decoding requests end with finish_reason "abort".

        Leaving a `with Engine(...)` block calls it. Calling it again does nothing more; `submit` and `warmup` then
        raise RuntimeError. In a multi-process job process 0's close stops every process's loop; another process's
        close waits for that.

        The compiled executables stay in JAX's process-wide caches (an engine of the same configuration reuses
        them); a process that builds many differently configured engines frees them with `jax.clear_caches()` (on
        the CPU each holds memory mappings, of which Linux allows 65,530 a process by default).
        """
        with self._lock:
            if self.leader:
                self._closed = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine(slots={self.max_slots}, max_len={self.max_len}, shapes={self.labels}, "
                f"drafter={getattr(self.drafter, 'name', None)})")

    # ------------------------------------------------------------------ requests
    def _check_leader(self, what: str) -> None:
        if not self.leader:
            raise RuntimeError(f"{what}() on process {jax.process_index()}: requests enter a multi-process engine on "
                               f"process 0, and the other processes' engines replay its decisions (call {what}() "
                               f"on process 0; here, close() waits for process 0 to close)")

    def _validate(self, prompt, settings: dict, request_id: int | None = None) -> _Active:
        """One request checked alone (specjax.SamplingParams' rules, then what this engine can run). request_id:
        process 0's id of a request it sent (on another process of a multi-process job)."""
        settings = dict(settings)
        sampling_params = settings.pop("sampling_params", None)
        chat_template_kwargs = settings.pop("chat_template_kwargs", None)
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise TypeError(f"submit() got unexpected keyword argument(s) {unknown}; its settings are "
                            f"{sorted(SETTINGS)}, chat_template_kwargs and sampling_params")
        if "seed" not in settings and (sampling_params is None or sampling_params.seed == 0):
            settings["seed"] = None  # a fresh seed per request (generate's default of 0 would give all the same)
        t = self.target
        params = merged(sampling_params, settings).validate(t.cfg.vocab_size, n_prompts=1)
        sampling, options = _sampling(t, params), _options(t, params)
        max_new = params.max_new_tokens
        prompts = render_prompts(t, [prompt], chat_template_kwargs)
        req = prepare(t, prompts, max_new, sampling, params.eos_token_id, None, params.seed, options=options,
                      agree=False)
        ids = req.ids[0]
        if len(ids) + max_new > self.max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new} it needs "
                             f"{len(ids) + max_new} positions, more than this engine's max_len={self.max_len}")
        if not sampling.greedy and not self.sampling:
            raise ValueError("this engine was built with sampling=False: pass temperature=0 (greedy), or build it "
                             "with Engine(..., sampling=True)")
        if options.penalties.active and not self.penalties:
            raise ValueError("this engine was built without penalties: drop the penalties and min_tokens, or build "
                             "it with Engine(..., penalties=True)")
        if options.logprobs >= 0 and (self.max_top_logprobs is None or options.logprobs > self.max_top_logprobs):
            cap = ("no logprobs (build it with Engine(..., logprobs=n))" if self.max_top_logprobs is None
                   else f"top_logprobs of at most {self.max_top_logprobs}")
            raise ValueError(f"top_logprobs={options.logprobs} asked, but this engine computes {cap}")
        if len(req.stop_ids) > STOP_IDS:
            raise ValueError(f"{len(req.stop_ids)} stop token ids (EOS included); the engine takes at most {STOP_IDS}")
        text = RowText(t, options.row_stops(1)[0], options.include_stop_str_in_output, options.skip_special_tokens,
                       options.penalties.min_tokens)
        active = _Active(RequestHandle(next(self._ids) if request_id is None else request_id), ids, req, text,
                         time.perf_counter())
        if self._broadcast is not None:  # what the other processes rebuild it from: its ids, settings and seed
            active.wire = {"id": active.handle.request_id, "ids": ids,
                           "settings": {**dataclasses.asdict(params), "seed": req.seeds_used, "max_tokens": None}}
        return active

    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError("the engine is closed")

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        if not self.leader:
            return self._follow()
        try:
            while True:
                with self._lock:
                    while (not self._closed and not self._waiting and not self._inflight and not self._live_count()
                           and self._warmup_requested is None):
                        self._lock.wait()
                        self._last_read = None  # idle: the next chunk's time starts at its dispatch
                    if self._closed:
                        break
                    warm = self._warmup_requested
                if warm is not None and not warm.is_set():
                    self._send({"kind": "warmup"})
                    self._run_warmup()
                    warm.set()
                    self._warmup_requested = None
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001  fail every request in flight with it, never hang them
            self._error = e
        finally:
            self._shutdown()
            if self._broadcast is not None:  # the other processes' loops end too
                self._broadcast.send({"kind": "close", "error": None if self._error is None else repr(self._error)})

    def _follow(self) -> None:
        """The loop of a process other than 0 in a multi-process job: each gap as process 0 sends it."""
        try:
            while True:
                message = self._receive("gap", "warmup")
                if message["kind"] == "warmup":
                    self._run_warmup()
                else:
                    self._step(message)
        except _Closed as closed:
            if closed.error is not None:
                self._error = RuntimeError(f"process 0's engine stopped after an error: {closed.error}")
        except BaseException as e:  # noqa: BLE001
            self._error = e
        finally:
            with self._lock:
                self._closed = True
            self._shutdown()
            self._warmed.set()

    def _send(self, message: dict) -> None:
        """Process 0's decisions to the other processes (nothing in one process)."""
        if self._broadcast is not None:
            self._broadcast.send(message)

    def _receive(self, *kinds: str) -> dict:
        """Process 0's next message (of one of `kinds`), waiting as long as it takes; _Closed when it closed."""
        while (message := self._broadcast.receive(FOLLOW_WAIT_S)) is Broadcast.WAITING:
            pass
        if message["kind"] == "close":
            raise _Closed(message["error"])
        if message["kind"] not in kinds:
            raise RuntimeError(f"process {jax.process_index()} expected one of {kinds} from process 0, got "
                               f"{message['kind']!r}: the processes' engines went out of step")
        return message

    def _run_warmup(self) -> None:
        """Warm up on the loop's thread (every process at once in a multi-process job), then count from zero."""
        self._warmup()
        # the dummies' drafts are no one's acceptance: counted from here on
        self._depth_base = to_host((self._slots.stats.offered_D, self._slots.stats.accepted_D))
        self._last_counts = to_host((self._slots.stats.verified_rank_DR, self._slots.stats.row_rounds))
        self.warmed_up = True
        self._warmed.set()

    def _step(self, gap: dict | None = None) -> None:
        """One gap between chunks: retire and admit, dispatch the next chunk, then read the previous one. gap:
        process 0's decisions for it (on another process of a multi-process job)."""
        if self._inflight and self._inflight[0].drain:  # a row may end in it: its slot is turned around in this gap
            self._read(self._inflight.popleft())
        self._retire()
        self._admit(gap)
        decoding = sum(a is not None and not a.prefilling for a in self._live)
        if decoding:
            self._dispatch(decoding)
        if self._inflight and (len(self._inflight) > 1 or not decoding):
            self._read(self._inflight.popleft())

    def _live_count(self) -> int:
        return sum(a is not None for a in self._live)

    def _retire(self) -> None:
        """Free the slots of finished and aborted requests; keep the live rows at the lowest indices."""
        with self._lock:
            ended = [a for a in self._live if a is not None and (a.finished or a.aborted)]
        if not ended:
            return
        mark = np.zeros((self.max_slots,), bool)
        for a in ended:
            if a.aborted and not a.finished:
                self._finish(a, "abort")
            mark[a.slot] = True
            self._free(a.slot)
        self._slots = self._exec("mark_done", ops.mark_done, donate=0)(self._slots, jnp.asarray(mark))
        for hole in sorted(a.slot for a in ended):
            last = max((i for i, a in enumerate(self._live) if a is not None), default=-1)
            if last > hole and self._live[hole] is None:
                self._slots = self._exec("move", ops.move, donate=0, axes=self.axes)(
                    self._slots, jnp.int32(last), jnp.int32(hole))
                moved = self._live[last]
                self._copy_row(last, hole)
                moved.slot = hole
                self._free(last)

    def _free(self, slot: int) -> None:
        self._live[slot] = None
        self._max_new[slot] = 0
        _set_row(self._rows, slot, _empty_rows(1), 0)

    def _copy_row(self, src: int, dst: int) -> None:
        self._live[dst] = self._live[src]
        self._max_new[dst] = self._max_new[src]
        _set_row(self._rows, dst, self._rows, src)

    def _admit(self, gap: dict | None = None) -> None:
        """Apply the aborts asked since the last gap, then prefill waiting requests into free slots: grouped by
        prompt bucket, up to max_prefill_batch a group and prefill_tokens_per_gap prompt tokens a gap (at least one
        request). In a multi-process job process 0 chooses and sends its choice (`gap` on the others) before any
        of it runs."""
        if gap is None:
            with self._lock:
                aborts, self._abort_asked = self._abort_asked, []
                for a in aborts:
                    a.aborted = True
                pieces, budget = self._piece_plan(self.prefill_tokens_per_gap)
                chosen, long = self._choose(budget)
            self._send({"kind": "gap", "aborts": [a.handle.request_id for a in aborts],
                        "admit": [a.wire for a in chosen], "long": [a.wire for a in long]})
        else:
            for request_id in gap["aborts"]:
                if request_id in self._requests:
                    self._requests[request_id].aborted = True
            pieces, _ = self._piece_plan(self.prefill_tokens_per_gap)
            chosen, long = ([self._replica(w) for w in gap[k]] for k in ("admit", "long"))
        for a, n in pieces:
            for _ in range(n):
                self._next_piece(a)
        with self._lock:
            for a in long:  # a long prompt: its slot now, its pieces gap by gap
                a.slot, a.prefilling = self._live.index(None), True
                self._live[a.slot] = a
        if not chosen:
            return
        groups = collections.defaultdict(list)
        for a in chosen:
            groups[bucket(len(a.ids))].append(a)
        for length, group in sorted(groups.items()):
            for i in range(0, len(group), self.max_prefill_batch):
                self._prefill(group[i: i + self.max_prefill_batch], length)

    def _choose(self, budget: int) -> tuple[list[_Active], list[_Active]]:
        """The waiting requests admitted now (under the lock), with `budget` prompt tokens left this gap: (prompts
        prefilled at once, long prompts that enter their slots in pieces)."""
        free = self.max_slots - self._live_count()
        chosen, long = [], []
        while self._waiting and len(chosen) + len(long) < free:
            a = self._waiting[0]
            if len(a.ids) > self.prefill_chunk:
                long.append(self._waiting.popleft())
                continue
            need = bucket(len(a.ids))
            if (chosen or budget < self.prefill_tokens_per_gap) and need > budget:
                break
            chosen.append(self._waiting.popleft())
            budget -= need
        return chosen, long

    def _replica(self, wire: dict) -> _Active:
        """A request process 0 admitted, rebuilt on another process from what it sent."""
        a = self._validate(wire["ids"], wire["settings"], request_id=wire["id"])
        self._requests[a.handle.request_id] = a
        return a

    def _piece_plan(self, budget: int) -> tuple[list[tuple[_Active, int]], int]:
        """The pieces this gap runs of the long prompts entering their slots, oldest first, while `budget` prompt
        tokens last (at least one piece a gap): [(request, pieces)] and the budget left. Planned before any runs,
        so process 0 can send what it admits with this gap's budget first."""
        c, plan, spent = self.prefill_chunk, [], False
        for a in [a for a in self._live if a is not None and a.prefilling and not a.aborted]:
            offset, n, pieces = a.offset, len(a.ids), 0
            while offset < n and (not spent or budget >= c):
                step = c if n - offset > c else n - offset  # as _next_piece takes it
                budget, offset, pieces, spent = budget - step, offset + step, pieces + 1, True
            if pieces:
                plan.append((a, pieces))
        return plan, max(budget, 0)

    def _next_piece(self, a: _Active) -> int:
        """One piece of a's prompt into its slot; the last one makes the row decode. Returns its tokens."""
        self._gap_work += 1
        c, n = self.prefill_chunk, len(a.ids)
        p = bucket(n)
        ids = np.zeros((1, p), np.int32)
        ids[0, :n] = a.ids
        capture = () if self._prefill_drafter is None else self._prefill_drafter.feature_layers
        lc = self.lc[max(self.lc)]
        if n - a.offset > c:
            first = a.offset == 0
            out = (self._slot_shardings, (self._replicated,) * len(capture))  # the features stay whole
            self._slots, a.features = self._exec(("extend", p, first), ops.extend, donate=1, out=out, lc=lc,
                                                 cache_axes=self.cache_axes, capture=capture, first=first,
                                                 prompt_bucket=p)(
                self.target.params, self._slots, jnp.int32(a.slot), ids[:, a.offset: a.offset + c],
                jnp.int32(a.offset), a.features)
            a.offset += c
            return c
        rest = n - a.offset
        t = bucket(rest)
        piece = np.zeros((1, t), np.int32)
        piece[0, :rest] = a.ids[a.offset:]
        req = a.req
        self._slots = self._exec(("finish", p, t), ops.finish_prefill, donate=2, lc=lc, drafter=self._prefill_drafter,
                                 depth=self.depth, ranks=self.ranks, axes=self.axes, cache_axes=self.cache_axes)(
            self.target.params, self._draft_params(), self._slots, jnp.int32(a.slot), piece,
            np.full((1,), rest, np.int32), jnp.int32(a.offset), a.features, ids, np.full((1,), n, np.int32),
            req.max_new_B[:1], req.seeds_B[:1], req.fold_B[:1], _as_rows(req.rows, 1))
        a.prefilling, a.features, a.offset = False, (), n
        self._max_new[a.slot] = req.max_new_B[0]
        _set_row(self._rows, a.slot, req.rows, 0)
        self._counters["chunked_prefills"] += 1
        return rest

    def _rows_bucket(self, n: int) -> int:
        """Rows a chunk or a prefill of n rows runs: a power of two, a multiple of the data-parallel size."""
        return min(batch_bucket(n, self.data), self.max_slots)

    def _prefill(self, group: list[_Active], length: int, draftless: bool | None = None) -> None:
        """Prefill `group` (prompts of bucket `length`) and insert them into the next free slots. While speculation
        is off (`draftless`, by default whether the shape in use is "off" in an engine that may speculate) the
        drafter's prefill is skipped: its state for these rows stays stale, caught up only if speculation resumes
        while they live ("off" costs no draft forward)."""
        if draftless is None:
            draftless = self._shape == OFF and self._prefill_drafter is not None
        self._gap_work += 1
        pb = self._rows_bucket(len(group))
        base = self._live_count()
        dst = np.full((pb,), self.max_slots, np.int32)  # padding rows are dropped by the insert
        prompt_BT = np.zeros((pb, length), np.int32)
        prompt_len_B, max_new_B = np.ones((pb,), np.int32), np.zeros((pb,), np.int32)
        seeds_B, fold_B = np.zeros((pb,), np.uint32), np.zeros((pb,), np.uint32)
        rows = _empty_rows(pb)
        for i, a in enumerate(group):
            slot = base + i
            prompt_BT[i, :len(a.ids)] = a.ids
            prompt_len_B[i], max_new_B[i] = len(a.ids), a.req.max_new_B[0]
            seeds_B[i], fold_B[i] = a.req.seeds_B[0], a.req.fold_B[0]
            _set_row(rows, i, a.req.rows, 0)
            dst[i] = slot
            a.slot = slot
            with self._lock:
                self._live[slot] = a
            self._max_new[slot] = max_new_B[i]
            _set_row(self._rows, slot, a.req.rows, 0)
        sampled = max(self.lc)
        args = (prompt_BT, prompt_len_B, max_new_B, seeds_B, fold_B, _as_rows(rows))
        if draftless:
            new = self._exec(("prefill", pb, length), ops.prefill, lc=self.lc[sampled], drafter=None,
                             depth=self.depth, ranks=self.ranks)(self.target.params, None, *args)
            self._slots = self._exec(("insert_target", pb), ops.insert_target, donate=0, axes=self.target_axes)(
                self._slots, new, jnp.asarray(dst))
            for a in group:
                a.stale = True
            self._counters["draftless_prefill_rows"] += len(group)
        else:
            new = self._exec(("prefill", pb, length), ops.prefill, lc=self.lc[sampled], drafter=self._prefill_drafter,
                             depth=self.depth, ranks=self.ranks)(self.target.params, self._draft_params(), *args)
            self._slots = self._exec(("insert", pb), ops.insert, donate=0, axes=self.axes)(self._slots, new,
                                                                                           jnp.asarray(dst))
        self._counters["prefills"] += 1
        self._counters["prefill_rows"] += len(group)

    def _dispatch(self, live: int) -> None:
        """The next chunk over every occupied slot; its shape from the `live` rows decoding (prefills not counted)."""
        nb = self._rows_bucket(self._live_count())
        owners = [a if a is not None and not a.prefilling else None for a in self._live]
        budgets = [(a, int(m)) for a, m in zip(owners, self._max_new) if a is not None]
        if self.leader:
            fixed = len(self.labels) == 1
            label = self.labels[0] if fixed else self.policy.choose(nb, live, self._shape)
            rounds, width = chunk_rounds(self.policy.cost(nb, label)), self._width(label)
            if label == OFF:  # a plain step emits one token a row: the chunk ends where the first budget does
                rounds = max(1, min([rounds] + [m - a.floor for a, m in budgets if a.floor < m]))
            # A row whose budget may run out in this chunk: the chunk ends when a row finishes, and the host reads it
            # before the next gap (no chunk dispatched behind it), so the slot is retired and refilled at once
            # rather than idle through one more chunk.
            drain = any(a.ceiling + rounds * width >= m for a, m in budgets)
            chunk = {"kind": "chunk", "label": label, "rounds": rounds, "exit_early": bool(self._waiting) or drain,
                     "drain": drain}
            self._send(chunk)
        else:  # timings and the queue are process 0's
            chunk = self._receive("chunk")
            label, rounds, width = chunk["label"], chunk["rounds"], self._width(chunk["label"])
        for a, _ in budgets:
            a.floor, a.ceiling = a.floor + rounds, a.ceiling + rounds * width
        if label != self._shape:
            self._history.append((round(time.perf_counter() - self._started, 4), live, label))
            self._shape = label
        if label != OFF and any(a is not None and a.stale and not a.prefilling for a in self._live):
            self._catch_up()
        sampled = any(a is not None and a.req.lc.sampled for a in self._live)
        if label == OFF:
            for a in self._live:
                if a is not None and not a.prefilling:
                    a.stale = self.drafter is not None
        self._chunk(label, nb, sampled, rounds, chunk["exit_early"])
        clean, self._gap_work = not self._gap_work, 0  # no prefill or catch-up ran on the device before it
        self._inflight.append(_Chunk(self._snapshot(), owners, label, nb, live, clean, time.perf_counter(), rounds,
                                     width, chunk["drain"]))

    def _width(self, label: str) -> int:
        """The most tokens a row emits in a round of shape `label`: its deepest path of drafts and the bonus."""
        return 1 if label == OFF else self.configured[(label, max(self.lc))].settings.tree.max_depth + 1

    def _chunk(self, label: str, nb: int, sampled: bool, rounds: int, exit_early: bool) -> None:
        """Dispatch one chunk of `label` over the first nb slots (the slots donated)."""
        args = (_device_copy(self._max_new[:nb]), _as_rows(self._rows, nb))
        if label == OFF:
            fn = self._exec(("plain", nb, sampled), ops.plain_chunk, donate=3, lc=self.lc[sampled], nb=nb,
                            axes=self.axes)
            self._slots = fn(self.target.params, *args, self._slots, jnp.int32(rounds), jnp.bool_(exit_early))
        else:
            drafter = self.configured[(label, sampled)]
            sched, seconds_T = self._scheduler_for(nb, drafter)
            fn = self._exec(("spec", nb, label, sampled), ops.spec_chunk, donate=4, lc=self.lc[sampled],
                            drafter=drafter, nb=nb, axes=self.axes, sched=sched)
            self._slots = fn(self.target.params, self._draft_params(), *args, self._slots, jnp.int32(rounds),
                             jnp.bool_(exit_early), seconds_T)

    def _scheduler_for(self, nb: int, drafter) -> tuple[Scheduler | None, Any]:
        """The prefix scheduler and its verify cost curve at nb rows (priced once per bucket), or (None, None)."""
        if self.scheduler is None:
            return None, None
        n = drafter.settings.tree.num_nodes
        sched = Scheduler(self.scheduler, verify_widths(n))
        if nb not in self._sched_costs:
            cost = scheduler_cost(self.target, self.scheduler_profile, nb, sched.widths, self.cache_len // 2)
            table = cost_table(cost.verify_s, nb, n, cost.draft_s(nb, n - 1))
            self._sched_costs[nb] = jnp.asarray(agreed(np.asarray(table)))
        return sched, self._sched_costs[nb]

    def _read(self, chunk: "_Chunk") -> None:
        """Hand out one chunk's tokens; learn from its timing and acceptance."""
        owners, label, nb, live = chunk.owners, chunk.label, chunk.nb, chunk.live
        out_BO, count_B, done_B, step, stats, logprobs = jax.device_get(chunk.snap)
        now = time.perf_counter()
        # from the previous read: the host's gap work before this chunk's dispatch (admissions, a catch-up's
        # preparation, the pipeline drained at a switch) is time the live rows waited, charged to this chunk
        since = chunk.dispatched if self._last_read is None else self._last_read
        self._last_read = now
        tokens = 0
        for slot, a in enumerate(owners):
            if a is None or a.finished or a.aborted:
                continue
            tokens += self._take(a, slot, out_BO, count_B, done_B, stats, logprobs, now)
            later = [c for c in self._inflight if any(o is a for o in c.owners)]  # dispatched since, not yet read
            a.floor = int(count_B[slot]) + sum(c.rounds for c in later)
            a.ceiling = int(count_B[slot]) + sum(c.rounds * c.width for c in later)
        rounds = int(step) - (int(step) if self._last_step is None else self._last_step)
        self._last_step = int(step)
        if rounds > 0:
            self.policy.record(nb, live, label, rounds, tokens, now - since, chunk.clean)
        self._offered_D, self._accepted_D = stats.offered_D - self._depth_base[0], stats.accepted_D - self._depth_base[1]
        self.policy.learn(label, stats.verified_rank_DR - self._last_counts[0],
                          int(stats.row_rounds) - int(self._last_counts[1]))
        self._last_counts = (stats.verified_rank_DR, stats.row_rounds)
        self._counters["chunks"] += 1
        self._counters["tokens_emitted"] += tokens

    def _take(self, a: _Active, slot: int, out_BO, count_B, done_B, stats, logprobs, now: float) -> int:
        new = out_BO[slot, a.seen: count_B[slot]].tolist()
        start = a.seen
        a.seen = int(count_B[slot])
        a.device_tokens.extend(new)
        kept_before = len(a.text.tokens)
        for tok in new:
            if a.text.stopped:
                break
            a.text.push(tok)
        kept = a.text.tokens[kept_before:]
        lp = tops = None
        if logprobs is not None and a.req.options.logprobs >= 0:
            lp = logprobs.token_BO[slot, start: start + len(kept)].tolist()
            a.logprobs.extend(lp)
            n = a.req.options.logprobs
            if n > 0:
                tops = [list(zip(logprobs.top_ids_BOK[slot, j, :n].tolist(), logprobs.top_BOK[slot, j, :n].tolist()))
                        for j in range(start, start + len(kept))]
                a.top_logprobs.extend(tops)
        if kept and a.first_token_at is None:
            a.first_token_at = now
        finished = a.text.stopped or bool(done_B[slot])
        tokens, text = a.text.new_output(finished)
        reason = stop = None
        if finished:
            reason, stop = finish_reason(a.text.tokens, a.text.stop_reason, a.req.stop_ids)
        if tokens or text or finished:
            a.handle._push(StreamChunk(0, tokens, text, reason, lp, tops, stop))
        if finished:
            a.stats_row = (int(stats.rounds_B[slot]), int(stats.emitted_B[slot]), int(stats.accepted_B[slot]))
            self._finish(a, reason, stop)
        return len(new)

    def _finish(self, a: _Active, reason: str, stop=None) -> None:
        a.finished = True
        self._requests.pop(a.handle.request_id, None)
        if reason == "abort":
            tokens, text = a.text.new_output(True)
            a.handle._push(StreamChunk(0, tokens, text, "abort"))
        now = time.perf_counter()
        rounds, emitted, accepted = a.stats_row
        stats = {"prompt_tokens": len(a.ids), "completion_tokens": len(a.text.tokens), "rounds": rounds,
                 "accepted_drafts": accepted, "acceptance_length": emitted / rounds if rounds else None,
                 "queue_s": None, "ttft_s": None if a.first_token_at is None else a.first_token_at - a.submitted,
                 "e2e_s": now - a.submitted, "seed": a.req.seeds_used}
        n = len(a.text.tokens)
        want = a.req.options.logprobs
        out = RequestOutput(a.handle.request_id, a.ids, list(a.text.tokens), a.text.text, reason, stop,
                            a.logprobs[:n] if want >= 0 else None, a.top_logprobs[:n] if want > 0 else None, stats)
        a.handle._finish(out)
        self._counters["requests_finished" if reason != "abort" else "requests_aborted"] += 1

    def _catch_up(self) -> None:
        """Speculation resumes: every row decoded with it off gets a drafter state over its whole sequence."""
        while self._inflight:  # the host needs every row's tokens so far
            self._read(self._inflight.popleft())
        stale = [a for a in self._live if a is not None and a.stale and not (a.finished or a.aborted or a.prefilling)]
        groups = collections.defaultdict(list)
        for a in stale:
            groups[bucket(len(a.ids) + max(len(a.device_tokens), 1) - 1)].append(a)  # unread: the prompt alone
        for length, group in sorted(groups.items()):
            for i in range(0, len(group), self.max_prefill_batch):
                self._catch_up_group(group[i: i + self.max_prefill_batch], length)
        for a in stale:
            a.stale = False

    def _catch_up_group(self, group: list[_Active], length: int) -> None:
        self._gap_work += 1
        pb = self._rows_bucket(len(group))
        seq_BT = np.zeros((pb, length), np.int32)
        seq_len_B = np.ones((pb,), np.int32)
        dst = np.full((pb,), self.max_slots, np.int32)  # padding rows (and warmup's) are dropped
        for j, a in enumerate(group):
            seq = a.ids + a.device_tokens[:-1]  # the root, its last token, is the slot's own (ops.catch_up)
            seq_BT[j, :len(seq)], seq_len_B[j], dst[j] = seq, len(seq), a.slot
        dstate = self._exec(("catch_up", pb, length), ops.catch_up, lc=self.lc[max(self.lc)],
                            drafter=self._prefill_drafter)(self.target.params, self._draft_params(), seq_BT,
                                                           seq_len_B, self._slots.root_B, jnp.asarray(dst))
        new_dstate = self._exec(("insert_dstate", pb), ops.insert, donate=0, axes=self.dstate_axes)(
            self._slots.dstate, dstate, jnp.asarray(dst))
        self._slots = dataclasses.replace(self._slots, dstate=new_dstate)
        self._counters["catch_up_rows"] += sum(a.slot < self.max_slots for a in group)

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._waiting) + [a for a in self._live if a is not None and not a.finished]
            self._waiting.clear()
        for a in pending:
            if self._error is not None:
                a.handle._finish(error=self._error)
            else:
                self._finish(a, "abort")
        warm = self._warmup_requested
        if warm is not None:
            warm.set()

    # ------------------------------------------------------------------ compiled operations
    def _exec(self, key, fn, donate: int | None = None, out=None, **static):
        """`fn` jitted with `static` (and argument `donate` donated), compiled once per key and argument signature;
        every compile is counted (a run after warmup must add none). What a donating operation returns (the slots,
        or their drafter state) is laid out in the slots' own shardings, so on a mesh every operation sees its
        input in the one layout it was compiled for (XLA would otherwise pick per executable, and the next call
        would compile again)."""
        key = (key, *sorted((k, v) for k, v in static.items() if k != "axes"))
        jitted = self._executables.get(key)
        if jitted is None:
            if donate is not None and out is None:
                dstate_only = isinstance(key[0], tuple) and key[0][0] == "insert_dstate"
                out = self._slot_shardings.dstate if dstate_only else self._slot_shardings
            jitted = jax.jit(fn, static_argnames=tuple(static), donate_argnums=() if donate is None else (donate,),
                             out_shardings=out)
            self._executables[key] = jitted
        return _Counted(self, jitted, static, key[0])

    def _snapshot(self):
        """What the host reads after a chunk; in a multi-process job whole on every process (a row's data-parallel
        shard may live on another process's devices)."""
        return self._exec("snapshot", ops.snapshot, out=None if self._broadcast is None else self._replicated)(
            self._slots)

    def _draft_params(self):
        return None if self.drafter is None else self.drafter.params

    def _configure(self, spec, sampled: bool):
        if self.drafter is None or spec is None:
            return None
        return self.drafter.configure(Settings(spec, SAMPLED if sampled else GREEDY, self.cache_len, self.out_len))

    def _prefill_args(self, b: int) -> tuple:
        """ops.prefill's array arguments for b empty rows (one-token prompts, no budget: done at once)."""
        return (self.target.params, self._draft_params(), np.zeros((b, 16), np.int32), np.ones((b,), np.int32),
                np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.zeros((b,), np.uint32),
                _as_rows(_empty_rows(b)))

    def _prefill_shapes(self, b: int, drafter) -> Any:
        with use_mesh(self.mesh):
            return jax.eval_shape(partial(ops.prefill, lc=self.lc[max(self.lc)], drafter=drafter, depth=self.depth,
                                          ranks=self.ranks),
                                  *self._prefill_args(b))

    def _fresh_slots(self):
        """All slots empty (done, no budget)."""
        with use_mesh(self.mesh):
            return jax.jit(partial(ops.prefill, lc=self.lc[max(self.lc)], drafter=self._prefill_drafter,
                                   depth=self.depth, ranks=self.ranks))(*self._prefill_args(self.max_slots))

    def _check_memory(self) -> dict[str, float]:
        """What the slots will hold (their exact shapes, traced) and the prefill's scratch, against the device's free
        memory (per device on a mesh: the total over its devices); refused before anything is allocated."""
        one = _nbytes(self._prefill_shapes(self.data, self._prefill_drafter)) / self.data  # a slot, all it holds
        devices = 1 if self.mesh is None else self.mesh.size
        slots = one * self.max_slots / devices
        scratch = one * self.max_prefill_batch / devices  # a prefill (or catch-up) allocates its rows' caches
        free = _free_bytes()
        plan = {"slot_bytes": one, "slots_bytes": slots, "prefill_scratch_bytes": scratch, "free_bytes": free}
        if free is not None and slots + scratch > free:
            fit = max(0, int((free - scratch) // (one / devices)))
            raise ValueError(f"max_slots={self.max_slots} x max_len={self.max_len} needs {slots / 2**30:.2f} GiB a "
                             f"device for the slots ({one / 2**20:.1f} MiB a slot: KV cache, drafter state, buffers) "
                             f"plus {scratch / 2**30:.2f} GiB of prefill scratch, but {free / 2**30:.2f} GiB is free: "
                             f"use max_slots <= {fit} or a smaller max_len")
        return plan

    def _trace_axes(self) -> None:
        """The batch axis of every leaf of the slots (and of the drafter state alone), by tracing at two sizes;
        and a check that every configured drafter keeps the same state structure."""
        small = self._prefill_shapes(3 * self.data, self._prefill_drafter)
        large = self._prefill_shapes(5 * self.data, self._prefill_drafter)
        self.axes = ops.batch_axes(small, large)
        self.dstate_axes = ops.batch_axes(small.dstate, large.dstate)
        self.cache_axes = ops.batch_axes(small.cache, large.cache)
        self.target_axes = self.axes if self._prefill_drafter is None else ops.batch_axes(  # rows prefilled draftless
            self._prefill_shapes(3 * self.data, None), self._prefill_shapes(5 * self.data, None))
        for (label, sampled), drafter in self.configured.items():
            if drafter is not None and jax.tree.structure(self._prefill_shapes(self.data, drafter).dstate) != \
                    jax.tree.structure(small.dstate):
                raise ValueError(f"the drafter keeps a different state for shape {label!r} than for "
                                 f"{_first_spec(self.labels)!r}; the engine switches shapes between chunks over one "
                                 f"drafter state: give shapes of one kind (chains, or one tree)")

    def _warmup(self) -> None:
        """Compile every executable and time every chunk shape at every occupancy bucket (the policy's cost profile):
        prefill, insert and catch-up at every prompt bucket and prefill batch; per occupancy bucket nb, nb dummy
        requests run each shape's chunk (greedy and sampled) twice, the second timed; then every slot is freed."""
        lengths = _buckets(16, bucket(self.max_len - 1))
        for pb in sorted({self._rows_bucket(n) for n in range(1, self.max_prefill_batch + 1)}):
            for length in lengths:
                if self._prefill_drafter is not None and OFF in self.labels:  # the prefill "off" admits with
                    self._prefill([self._dummy(min(length, self.max_len - 1)) for _ in range(pb)], length,
                                  draftless=True)
                    self._retire_all()
                dummies = [self._dummy(min(length, self.max_len - 1)) for _ in range(pb)]
                self._prefill(dummies, length, draftless=False)
                self._retire_all()
                if self.drafter is not None:
                    for a in dummies:
                        a.device_tokens, a.slot = [0], self.max_slots
                    self._catch_up_group(dummies, length)
        for nb in sorted({self._rows_bucket(n) for n in range(1, self.max_slots + 1)}):
            for label in self.labels:
                for sampled in self.lc:
                    timings = []
                    for _ in range(1 + (WARMUP_TIMINGS if sampled == max(self.lc) else 0)):  # the first compiles
                        dummies = [self._dummy(1, self.max_len - 1) for _ in range(nb)]
                        for i in range(0, nb, self.max_prefill_batch):
                            self._prefill(dummies[i: i + self.max_prefill_batch], 16)
                        jax.block_until_ready(self._slots)
                        start = time.perf_counter()
                        self._chunk(label, nb, sampled, WARMUP_ROUNDS, False)
                        jax.block_until_ready(self._slots)
                        timings.append((time.perf_counter() - start) / WARMUP_ROUNDS)
                        self._snapshot()
                        self._retire_all()
                    if len(timings) > 1:  # the least: a timing is only ever slowed by what else runs
                        self.policy.warm_s[(nb, label)] = min(timings[1:])
        for n in self._chunked_lengths():  # every (prompt bucket, piece) executable of a chunked prefill
            a = self._dummy(n)
            a.slot, a.prefilling = self._live_count(), True
            self._live[a.slot] = a
            while a.prefilling:
                self._next_piece(a)
            self._retire_all()
        if self.max_slots > 1:  # a retirement below a live row moves that row down
            dummies = [self._dummy(1, 2) for _ in range(2)]
            self._prefill(dummies, 16)
            dummies[0].finished = True
            self._retire()
            self._retire_all()
        self._gap_work = 0  # warmup's prefills are no chunk's

    def _piece_keys(self, n: int) -> set:
        """The executables a chunked prefill of an n-token prompt runs."""
        c, p = self.prefill_chunk, bucket(n)
        keys, offset = set(), 0
        while n - offset > c:
            keys.add(("extend", p, offset == 0))
            offset += c
        return keys | {("finish", p, bucket(n - offset))}

    def _chunked_lengths(self) -> list[int]:
        """Prompt lengths whose chunked prefills together run every executable a prompt that fits can need."""
        lengths, seen = [], set()
        for n in range(self.max_len - 1, self.prefill_chunk, -1):
            keys = self._piece_keys(n)
            if not keys <= seen:
                lengths.append(n)
                seen |= keys
        return lengths

    def _dummy(self, prompt_len: int, max_new: int = 1) -> _Active:
        return self._validate([1] * max(1, prompt_len), {"max_new_tokens": max_new, "temperature": 0.0, "seed": 0})

    def _retire_all(self) -> None:
        for a in self._live:
            if a is not None:
                a.finished = True
        self._retire()


_LOWERINGS: collections.Counter = collections.Counter()  # thread id -> executables lowered (traced anew) on it


def _count_lowering(event: str, duration: float, **kw) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _LOWERINGS[threading.get_ident()] += 1


jax.monitoring.register_event_duration_secs_listener(_count_lowering)


class _Closed(Exception):
    """Process 0's engine closed (error: what stopped it, or None)."""

    def __init__(self, error: str | None):
        super().__init__(error)
        self.error = error


class _Counted:
    """A jitted function whose calls count what they compiled on the engine: JAX lowering a new executable (a new
    argument signature), whether XLA then compiles it or the persistent cache supplies it."""

    def __init__(self, engine: Engine, jitted, static: dict, name):
        self.engine, self.jitted, self.static, self.name = engine, jitted, static, name

    def __call__(self, *args):
        thread = threading.get_ident()
        before = _LOWERINGS[thread]
        start = time.perf_counter()
        with use_mesh(self.engine.mesh):
            out = self.jitted(*args, **self.static)
        if _LOWERINGS[thread] != before:
            self.engine._compiles += 1
            self.engine._compiled.append(self.name)
            self.engine._compile_s += time.perf_counter() - start
        return out


def _shapes(drafter, num_draft_tokens, tree, auto_chains: Sequence[int], auto_trees: Sequence[str] = ()
            ) -> tuple[list[str], dict]:
    """The engine's candidate shapes: labels in order and their tree specs ("off" has none)."""
    if drafter is None:
        if num_draft_tokens not in ("auto", "off", None) or tree is not None:
            raise ValueError("num_draft_tokens= / tree= shape a speculative draft but no drafter was given: pass "
                             "drafter=, or leave them unset")
        return [OFF], {}
    if tree is not None:
        if num_draft_tokens not in ("auto", None):
            raise ValueError(f"pass either num_draft_tokens={num_draft_tokens!r} or tree={tree!r}, not both")
        spec = parse_tree(tree, None)
        return [_label(spec)], {_label(spec): spec}
    if num_draft_tokens == "off":
        return [OFF], {}
    if num_draft_tokens == "auto":
        if not auto_chains or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in auto_chains):
            raise ValueError(f"auto_chains must be a non-empty list of positive chain lengths, got {auto_chains!r}")
        specs = {f"chain:{k}": parse_tree(None, k) for k in sorted(set(auto_chains))}
        if isinstance(auto_trees, str):
            raise ValueError(f"auto_trees is a list of tree specs, got the string {auto_trees!r}: pass [{auto_trees!r}]")
        for text in auto_trees:
            spec = parse_tree(text, None)
            specs.setdefault(_label(spec, text), spec)
        return [OFF, *specs], specs
    if auto_trees:
        raise ValueError(f"auto_trees={list(auto_trees)!r} adds trees to what num_draft_tokens='auto' chooses among; "
                         f"with num_draft_tokens={num_draft_tokens!r} the shape is fixed: pass 'auto', or tree= alone")
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be 'auto', 'off' or a positive int K, got {num_draft_tokens!r}")
    spec = parse_tree(None, num_draft_tokens)
    return [_label(spec)], {_label(spec): spec}


def _label(spec, text: str | None = None) -> str:
    """A shape's name in stats and the policy: its chain length, its dynamic spec, or the tree as it was given."""
    if isinstance(spec, DynamicTreeSpec):
        return f"dynamic:top_k={spec.top_k},depth={spec.depth},total_tokens={spec.total_tokens}"
    if spec.is_chain:
        return f"chain:{spec.num_nodes - 1}"
    return f"tree:{text}" if isinstance(text, str) else f"tree:{spec.num_nodes}n/d{spec.max_depth}"


def _first_spec(labels: list[str]) -> str:
    return next((lb for lb in labels if lb != OFF), OFF)


def _nbytes(tree) -> float:
    return float(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                     if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def _free_bytes() -> float | None:
    """Free memory of the first device (its allocator's limit less what is in use), or the host's available memory
    on the CPU; None when neither can be read."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def chunk_rounds(round_s: float | None) -> int:
    """Rounds of a chunk at `round_s` seconds a round (the policy's cost for this bucket and shape, or None): the
    fewest, a power of two, that take CHUNK_TARGET_S, up to MAX_ROUNDS; 1 while the cost is unknown. A chunk bounds
    how long an arrival waits for its slot and a stream for its next tokens, and each chunk costs a host gap. Sized
    from the cost the policy keeps per bucket, a shape runs full chunks from its first: rounds grown chunk by chunk
    from 1 made the first chunks of a shape just switched to (an exploration's trial) mostly host gaps, and it
    measured far below what it realized in its own engine."""
    if not round_s or round_s <= 0:
        return 1
    return min(MAX_ROUNDS, 1 << max(0, math.ceil(math.log2(CHUNK_TARGET_S / round_s))))


def _buckets(low: int, high: int) -> list[int]:
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    return out + [bucket(high, minimum=low)] if not out or out[-1] < high else out


def _empty_rows(b: int) -> RowSettings:
    """Host RowSettings for b rows, every row greedy, unpenalised, without stop ids."""
    return RowSettings(RowSampling.of(SamplingConfig(), 0, b), RowPenalties.of(_NO_PENALTIES, 0, b),
                       np.full((b, STOP_IDS), -1, np.int32))


def _set_row(rows: RowSettings, i: int, src: RowSettings, j: int) -> None:
    """Host row i of `rows` set from row j of `src` (stop ids padded to STOP_IDS)."""
    for dst_leaf, src_leaf in zip(jax.tree.leaves(rows), jax.tree.leaves(src)):
        if dst_leaf.ndim == 2:
            dst_leaf[i] = -1
            dst_leaf[i, :src_leaf.shape[1]] = src_leaf[j]
        else:
            dst_leaf[i] = src_leaf[j]


def _as_rows(rows: RowSettings, n: int | None = None) -> RowSettings:
    """The first n rows as device arrays (copies: see _device_copy)."""
    return jax.tree.map(lambda x: _device_copy(x if n is None else x[:n]), rows)


def _device_copy(x: np.ndarray) -> jax.Array:
    """A host array on the device, from a copy: on the CPU a transfer may alias the numpy buffer, and a computation
    dispatched now runs later, after the host has changed these mirrors for the next chunk (a freed slot's budget set
    to 0 would end the row it still holds)."""
    return jnp.asarray(np.array(x, copy=True))


from specjax.config import PenaltyConfig  # noqa: E402

_NO_PENALTIES = PenaltyConfig()
