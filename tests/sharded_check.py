"""Sharded decoding checked against one device, on 8 fake CPU devices, in a process of its own.

XLA_FLAGS must give the device count before jax is imported, and the suite's processes import jax on one device,
so the tests (test_sharding*.py) run this file with `run_part(part, workdir)`: a subprocess with
--xla_force_host_platform_device_count=8 that prints one JSON object {check name: {"ok": bool, "detail": str}} and
the seconds it took. Each part builds its tiny models, runs the plain loop (and the sampled ones) on one device
(device 0), runs the loops on each mesh (TP 2, TP 8, DP 2 x TP 4) and compares their tokens with it (greedy
speculative output equals plain decoding, which the rest of the suite checks on one device); it also checks how
the weights and caches are split and which slices of the safetensors files were read.

    python tests/sharded_check.py dense /tmp/work      # by hand: prints the JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICES = 8
PARTS = ("dense", "heads", "hybrid", "moe", "kernel", "engine", "quantized")


def run_part(part: str, workdir: Path, timeout: int = 900) -> tuple[dict, float]:
    """Run one part in a fresh process with 8 CPU devices: (its checks, its seconds)."""
    import specjax

    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["SPECJAX_CPU_LAYOUT"] = "per_layer"  # CPU's own layout: the checks read per-layer weight slices
    root = str(Path(specjax.__file__).resolve().parent.parent)  # the specjax this test process imported
    env["PYTHONPATH"] = os.pathsep.join([root, str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), part, str(workdir)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"sharded_check.py {part} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    report = json.loads(lines[-1])
    return report["checks"], report["seconds"]


def failed(checks: dict, *words: str) -> tuple[int, dict]:
    """(how many checks have all of `words` in their name, the details of those that failed)."""
    picked = {k: v for k, v in checks.items() if all(w in k for w in words)}
    return len(picked), {k: v["detail"] for k, v in picked.items() if not v["ok"]}


# ---- everything below runs inside the subprocess ------------------------------------------------------------


class Checks:
    """Named pass/fail results with a detail line each."""

    def __init__(self):
        self.results: dict[str, dict] = {}

    def add(self, name: str, ok: bool, detail="") -> None:
        if name in self.results:
            raise ValueError(f"check {name!r} recorded twice")
        self.results[name] = {"ok": bool(ok), "detail": str(detail)[:600]}

    def same(self, name: str, got, want) -> None:
        self.add(name, got == want, "" if got == want else f"got {got} want {want}")


def meshes() -> dict:
    """The meshes every part runs on, and whether all of its loops run there (else plain and one speculative loop,
    to keep the compiles few): TP 2 (the first 2 local devices) and TP 8 (kv heads that do not divide replicate)
    partly, DP 2 x TP 4 (a data axis and a model axis) whole."""
    import jax

    from specjax.models.sharding import tensor_parallel_mesh

    dp2_tp4 = jax.make_mesh((2, 4), ("data", "model"))  # jax's default Explicit axes: load takes them as Auto
    return {"tp2": (tensor_parallel_mesh(2), False), "tp8": (tensor_parallel_mesh(8), False),
            "dp2_tp4": (dp2_tp4, True)}


def load_on(path: Path, mesh, **kw):
    import specjax

    return specjax.load(path, mesh=mesh, **kw) if mesh is not None else specjax.load(path, **kw)


def model_size(mesh) -> int:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))["model"]


def split_check(checks: Checks, name: str, arr, dim: int | None, units: int, mesh) -> None:
    """`arr` split on `dim` over "model" when the model axis divides `units` (heads, experts, width), else
    replicated: its spec and its first device's slice."""
    n = model_size(mesh)
    splits = dim is not None and units % n == 0
    want_spec = [None] * arr.ndim
    shard = list(arr.shape)
    if splits:
        want_spec[dim] = "model"
        shard[dim] //= n
    spec = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))
    got = (spec, tuple(arr.addressable_shards[0].data.shape))
    checks.same(name, (got[0], got[1]), (tuple(want_spec), tuple(shard)))


class ReadLog:
    """Which elements of each safetensors tensor load() read: the largest single read per tensor, as a fraction."""

    def __init__(self):
        from specjax.convert import lazy

        self.lazy, self.original, self.largest = lazy, lazy.Stored.read, {}

    def __enter__(self):
        import numpy as np

        log, original = self, self.original

        def read(stored, index):
            out = original(stored, index)
            frac = out.size / max(1, int(np.prod(stored.shape)))
            log.largest[stored.name] = max(log.largest.get(stored.name, 0.0), frac)
            return out

        self.lazy.Stored.read = read
        return self

    def __exit__(self, *exc):
        self.lazy.Stored.read = self.original


def prompts_for(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(11)
    return [rng.integers(3, vocab, size=n).tolist() for n in (9, 4, 13)]  # ragged; 3 rows: a batch bucket of 4


def cache_specs(target, drafter=None) -> dict:
    """The speculative loop's state after prefill (spec_start_jit: the caches it allocated inside its jit, the
    target's and the drafter's) and its array arguments, for their shardings."""
    from specjax.config import SamplingConfig
    from specjax.decoding.drafter import Settings
    from specjax.decoding.request import prepare
    from specjax.decoding.speculative import spec_start_jit
    from specjax.decoding.tree import chain
    from specjax.drafters import NgramDrafter
    from specjax.models.sharding import use_mesh

    drafter = drafter or NgramDrafter()
    spec = chain(2)
    req = prepare(target, prompts_for(target.cfg.vocab_size), 4, SamplingConfig(), [], None, 0,
                  draft_nodes=spec.cache_slots)
    configured = drafter.configure(Settings(spec, req.lc.drafting, req.lc.cache_len, req.lc.out_len))
    arrays = req.arrays()
    with use_mesh(target.mesh):
        state = spec_start_jit(target.params, configured.params, *arrays, lc=req.lc, drafter=configured)
    return state, arrays


def spec_of(x) -> tuple:
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


# ---- part "dense": an HF dense target, draft model, n-gram, sampling, inspect_draft, per-slice reads ------------


def part_dense(work: Path, checks: Checks) -> None:
    from hf_tiny import build_hf_model, save_hf_model

    import specjax
    from specjax.drafters import NgramDrafter

    target_dir = save_hf_model(build_hf_model("qwen2", seed=5, num_attention_heads=8, num_key_value_heads=4,
                                              num_hidden_layers=2, intermediate_size=128), work / "dense")
    draft_dir = save_hf_model(build_hf_model("llama", seed=6, num_hidden_layers=1, hidden_size=32,
                                             intermediate_size=64), work / "draft")
    prompts = prompts_for(256)
    kw = dict(max_new_tokens=10, eos_token_id=[])
    sampled = dict(temperature=0.9, top_p=0.95, seed=[3, 4, 5])

    def gen(target, drafter=None, **extra):
        return specjax.generate(target, prompts, drafter=drafter, **extra, **kw).tokens

    # One device: greedy speculative output equals plain (the suite checks that everywhere), so each mesh's greedy
    # loops are compared with this plain run; the sampled loops and inspect_draft with their own one-device runs.
    one = load_on(target_dir, None)
    one_draft = specjax.load_drafter(draft_dir, one)
    want = {"plain": gen(one), "sampled_plain": gen(one, **sampled),
            "sampled_draft_chain": gen(one, one_draft, num_draft_tokens=2, **sampled),
            "inspect_draft": specjax.inspect_draft(one, one_draft, prompts[1], num_draft_tokens=3).tokens.tolist()}
    checks.add("dense/greedy rows differ", len({tuple(t) for t in want["plain"]}) == 3)
    checks.add("dense/sampling differs from greedy", want["sampled_plain"] != want["plain"])
    for name, (mesh, full) in meshes().items():
        with ReadLog() as reads:
            target = load_on(target_dir, mesh)
        draft = specjax.load_drafter(draft_dir, target)
        got = {"plain": gen(target), "draft_chain": gen(target, draft, num_draft_tokens=3)}
        if full:
            got.update(draft_tree=gen(target, draft, tree="kary:2,1"),
                       ngram=gen(target, NgramDrafter(), num_draft_tokens=3),
                       sampled_plain=gen(target, **sampled),
                       sampled_draft_chain=gen(target, draft, num_draft_tokens=2, **sampled),
                       inspect_draft=specjax.inspect_draft(target, draft, prompts[1],
                                                           num_draft_tokens=3).tokens.tolist())
        if name == "dp2_tp4":  # "auto" on the mesh, its pass costs from a profile measured there
            got["auto"] = auto_on_mesh(checks, f"dense/{name}", work, target, draft, prompts, kw)
        for kind, tokens in got.items():
            checks.same(f"dense/{name}/{kind} equals one device", tokens, want.get(kind, want["plain"]))
        n = model_size(mesh)
        layer = target.params["layers"][0]
        for key, dim, units in (("wq", 1, 8), ("wk", 1, 4), ("wv", 1, 4), ("bq", 0, 8), ("bk", 0, 4), ("wo", 0, 8),
                                ("w_gate", 1, 128), ("w_up", 1, 128), ("w_down", 0, 128)):
            split_check(checks, f"dense/{name}/{key} split", layer[key], dim, units, mesh)
        split_check(checks, f"dense/{name}/embed split", target.params["embed"], 0, 256, mesh)
        split_check(checks, f"dense/{name}/lm_head split", target.params["lm_head"], 1, 256, mesh)
        split_check(checks, f"dense/{name}/norm replicated", layer["attn_norm"], None, 1, mesh)
        split_check(checks, f"dense/{name}/draft model wq split", draft.params["layers"][0]["wq"], 1, 4, mesh)
        # each device read only its slice of every split weight (kv heads replicate at TP 8: read whole)
        for hf_name, units in (("model.layers.0.self_attn.q_proj.weight", 8), ("model.layers.1.mlp.down_proj.weight",
                               128), ("model.embed_tokens.weight", 256), ("lm_head.weight", 256),
                               ("model.layers.0.self_attn.k_proj.weight", 4)):
            frac = reads.largest.get(hf_name)
            want_frac = 1 / n if units % n == 0 else 1.0
            checks.add(f"dense/{name}/read {hf_name}", frac is not None and abs(frac - want_frac) < 1e-9,
                       f"largest read {frac}, want {want_frac}")
        state, arrays = cache_specs(target, draft)
        data = data_axis(mesh)
        checks.same(f"dense/{name}/target kv cache split", spec_of(state.cache.k[0]),
                    (data, None, "model" if 4 % n == 0 else None, None))
        checks.same(f"dense/{name}/draft model kv cache split", spec_of(state.dstate[0].k[0]),
                    (data, None, "model" if 2 % n == 0 else None, None))
        checks.same(f"dense/{name}/prompts split over data", spec_of(arrays.prompt_BT), (data, None))
        checks.same(f"dense/{name}/per-row settings split over data", spec_of(arrays.rows.sampling.temperature),
                    (data,))


def auto_on_mesh(checks: Checks, name: str, work: Path, target, drafter, prompts, kw: dict) -> list:
    """profile() on the target's mesh (finite positive times, keyed by the mesh), saved beside a one-device entry;
    then generate(..., "auto") with $SPECJAX_PROFILE at that file, which must plan from the mesh's entry. The
    tokens it generated (the loops "auto" times run on the mesh too)."""
    import dataclasses
    import json
    import math

    import specjax
    from specjax.models.sharding import mesh_label
    from specjax.planning.profile import profile, save_profile

    prof = profile(target, drafter, batches=(1,), nodes=(1, 2), cache_lens=(16,), draft_depths=(1,), repeats=1)
    seconds = [r["seconds"] for r in prof.verify + prof.propose]
    checks.add(f"{name}/profile times finite and positive", len(seconds) == 3
               and all(math.isfinite(x) and x > 0 for x in seconds), f"seconds {seconds}")
    label = mesh_label(target.mesh)
    checks.add(f"{name}/profile keyed by the mesh", label == "dp2xtp4" and prof.key.endswith("|dp2xtp4"),
               f"key {prof.key}")
    path = work / "profiles.json"
    one_device = dataclasses.replace(prof, mesh="")
    save_profile(one_device, path)
    save_profile(prof, path)
    entries = json.loads(path.read_text())["profiles"]
    checks.add(f"{name}/one-device profile entry unchanged", sorted(entries) == sorted([one_device.key, prof.key])
               and "mesh" not in entries[one_device.key] and entries[prof.key]["mesh"] == label, sorted(entries))
    os.environ["SPECJAX_PROFILE"] = str(path)
    try:
        out = specjax.generate(target, prompts, drafter=drafter, num_draft_tokens="auto", **kw)
    finally:
        del os.environ["SPECJAX_PROFILE"]
    plan = out.stats.get("plan") or {}
    checks.add(f"{name}/auto planned from the mesh's profile", "shape" in plan and
               str(plan.get("cost")).startswith(f"measured profile {prof.key} "), f"plan {plan}")
    return out.tokens


def data_axis(mesh) -> str | None:
    """"data" when the mesh has data-parallel replicas (a size-1 axis never appears in a spec)."""
    return "data" if dict(zip(mesh.axis_names, mesh.axis_sizes))["data"] > 1 else None


# ---- part "heads": the embedded target (orbax) with EAGLE-3 and MTP ---------------------------------------------


def part_heads(work: Path, checks: Checks) -> None:
    import specjax
    from specjax.loading.embedded import embedded

    prompts = prompts_for(4096)
    kw = dict(max_new_tokens=8, eos_token_id=[])

    def gen(target, drafter=None, **extra):
        return specjax.generate(target, prompts, drafter=drafter, **extra, **kw).tokens

    want = gen(load_on(embedded("target"), None))
    for name, (mesh, full) in meshes().items():
        target = load_on(embedded("target"), mesh)  # an orbax checkpoint: restored straight into the shardings
        eagle3 = specjax.load_drafter(embedded("eagle3"), target)
        mtp = specjax.load_drafter(embedded("mtp"), target)
        got = {"plain": gen(target), "eagle3_chain": gen(target, eagle3, num_draft_tokens=3)}
        if full:
            dspark = specjax.load_drafter(embedded("dspark"), target)
            got.update(eagle3_tree=gen(target, eagle3, tree="kary:2,1"), mtp_chain=gen(target, mtp, num_draft_tokens=2),
                       dflash_chain=gen(target, specjax.load_drafter(embedded("dflash"), target), num_draft_tokens=3),
                       dspark_chain=gen(target, dspark, num_draft_tokens=3))
        if name == "dp2_tp4":  # the prefix scheduler over DSpark's confidences, its cost curve measured on the mesh
            out = specjax.generate(target, prompts, drafter=dspark, num_draft_tokens=3, scheduler="confidence",
                                   scheduler_profile="measure", **kw)
            got["dspark_scheduler"] = out.tokens
            cost = out.stats["scheduler"]["cost"]
            checks.add(f"heads/{name}/scheduler cost measured on the mesh", "|dp2xtp4 " in cost, cost)
        if name == "dp2_tp4":  # the chunked loop (start, then advance with the state donated back)
            streamed = [[] for _ in prompts]
            for chunk in specjax.stream(target, prompts, drafter=eagle3, num_draft_tokens=3, **kw):
                streamed[chunk.index].extend(chunk.token_ids)
            got["stream_eagle3_chain"] = streamed
        for kind, tokens in got.items():
            checks.same(f"heads/{name}/{kind} equals one device", tokens, want)
        layer = target.params["layers"][0]  # 4 heads, 2 kv heads, mlp 688, vocab 4096
        for key, dim, units in (("wq", 1, 4), ("wk", 1, 2), ("wo", 0, 4), ("w_up", 1, 688), ("w_down", 0, 688)):
            split_check(checks, f"heads/{name}/orbax {key} split", layer[key], dim, units, mesh)
        split_check(checks, f"heads/{name}/orbax embed split", target.params["embed"], 0, 4096, mesh)
        split_check(checks, f"heads/{name}/eagle3 head replicated", eagle3.params["layer"]["wq"], None, 1, mesh)
        block = mtp.params["layers"][0]["block"]
        split_check(checks, f"heads/{name}/mtp block wq split", block["wq"], 1, 4, mesh)
        split_check(checks, f"heads/{name}/mtp block w_gate split", block["w_gate"], 1, 688, mesh)
        state, _ = cache_specs(target, eagle3)
        checks.same(f"heads/{name}/eagle3 cache replicated over model", spec_of(state.dstate[0].k[0]),
                    (data_axis(mesh), None, None, None))


# ---- parts "hybrid" and "moe": a Qwen3.5 (Gated DeltaNet) target and a Qwen3-MoE one -----------------------------


def part_hybrid(work: Path, checks: Checks) -> None:
    from hf_tiny import build_qwen35, save_hf_model

    import specjax
    from specjax.drafters import NgramDrafter

    # one DeltaNet layer and one gated attention layer; 8 heads, 4 kv heads, 4 key and 8 value DeltaNet heads
    hybrid_dir = save_hf_model(build_qwen35(seed=7, num_hidden_layers=2, layer_types=["linear_attention",
                                            "full_attention"], num_attention_heads=8, num_key_value_heads=4,
                                            linear_num_key_heads=4, linear_num_value_heads=8), work / "hybrid")
    prompts = prompts_for(256)
    kw = dict(max_new_tokens=10, eos_token_id=[])
    sampled = dict(temperature=0.9, seed=[6, 7, 8])

    def gen(target, drafter=None, **extra):
        return specjax.generate(target, prompts, drafter=drafter, **extra, **kw).tokens

    one = load_on(hybrid_dir, None)
    want = {"plain": gen(one), "sampled_plain": gen(one, **sampled)}
    for name, (mesh, full) in meshes().items():
        n, data = model_size(mesh), data_axis(mesh)
        target = load_on(hybrid_dir, mesh)
        got = {"plain": gen(target), "ngram": gen(target, NgramDrafter(), num_draft_tokens=3)}
        if full:
            got["sampled_plain"] = gen(target, **sampled)
        for kind, tokens in got.items():
            checks.same(f"hybrid/{name}/{kind} equals one device", tokens, want.get(kind, want["plain"]))
        delta, attn = target.params["layers"][0], target.params["layers"][1]
        for key, dim, units in (("w_z", 1, 8), ("w_b", 1, 8), ("w_out", 0, 8), ("A_log", 0, 8), ("w_qkv", 1, 256),
                                ("conv_w", 1, 256), ("w_gate", 1, 128)):
            split_check(checks, f"hybrid/{name}/deltanet {key} split", delta[key], dim, units, mesh)
        for key, dim, units in (("wq", 1, 8), ("wg", 1, 8), ("wk", 1, 4), ("wo", 0, 8)):
            split_check(checks, f"hybrid/{name}/gated attention {key} split", attn[key], dim, units, mesh)
        state, _ = cache_specs(target)
        checks.same(f"hybrid/{name}/deltanet state split", spec_of(state.cache.state[0]),
                    (data, "model" if 8 % n == 0 else None, None, None))
        checks.same(f"hybrid/{name}/conv window split", spec_of(state.cache.conv[0]), (data, None, "model"))
        checks.same(f"hybrid/{name}/attention kv cache split", spec_of(state.cache.kv.k[0]),
                    (data, None, "model" if 4 % n == 0 else None, None))


def part_moe(work: Path, checks: Checks) -> None:
    from hf_tiny import build_moe, save_hf_model

    import specjax
    from specjax.drafters import NgramDrafter
    from specjax.models.sharding import EXPERT_PARALLEL

    # layer 0 sparse (8 experts of width 32, 2 a token), layer 1 dense; 8 heads, 4 kv heads
    moe_dir = save_hf_model(build_moe("qwen3_moe", seed=8, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4), work / "moe")
    prompts = prompts_for(256)
    kw = dict(max_new_tokens=10, eos_token_id=[])
    sampled = dict(temperature=0.9, seed=[6, 7, 8])

    def gen(target, drafter=None, **extra):
        return specjax.generate(target, prompts, drafter=drafter, **extra, **kw).tokens

    one = load_on(moe_dir, None)
    want = {"plain": gen(one), "sampled_plain": gen(one, **sampled)}
    for name, (mesh, full) in meshes().items():
        target = load_on(moe_dir, mesh)
        got = {"plain": gen(target), "ngram": gen(target, NgramDrafter(), num_draft_tokens=3)}
        if full:
            expert_parallel = load_on(moe_dir, mesh, rules=EXPERT_PARALLEL)
            got.update(sampled_plain=gen(target, **sampled), expert_parallel_plain=gen(expert_parallel),
                       expert_parallel_ngram=gen(expert_parallel, NgramDrafter(), num_draft_tokens=3))
            checks.add(f"moe/{name}/expert parallel runs whole experts per device under shard_map",
                       expert_parallel.cfg.moe.expert_parallel and not target.cfg.moe.expert_parallel)
            ep = expert_parallel.params["layers"][0]["moe"]
            split_check(checks, f"moe/{name}/expert parallel w_gate", ep["w_gate"], 0, 8, mesh)
            split_check(checks, f"moe/{name}/expert parallel w_down", ep["w_down"], 0, 8, mesh)
        for kind, tokens in got.items():
            checks.same(f"moe/{name}/{kind} equals one device", tokens, want.get(kind, want["plain"]))
        experts = target.params["layers"][0]["moe"]
        split_check(checks, f"moe/{name}/w_gate split inside experts", experts["w_gate"], 2, 32, mesh)
        split_check(checks, f"moe/{name}/w_down split inside experts", experts["w_down"], 1, 32, mesh)
        split_check(checks, f"moe/{name}/router replicated", experts["router"], None, 1, mesh)
        split_check(checks, f"moe/{name}/dense layer w_up split", target.params["layers"][1]["w_up"], 1, 128, mesh)
        split_check(checks, f"moe/{name}/attention wq split", target.params["layers"][0]["wq"], 1, 8, mesh)


# ---- part "kernel": the Pallas kernel under shard_map (interpret mode), and the TP-8 loop lowered for CUDA --------


def part_kernel(work: Path, checks: Checks) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from hf_tiny import build_hf_model, save_hf_model
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import specjax
    import specjax.kernels
    from specjax.kernels import sharded_tree_attention, tree_attention_reference
    from specjax.models.sharding import check_mesh, use_mesh

    # The kernel alone: on TP 8 (8 kv heads: split), DP 2 x TP 4 (rows and heads split), TP 8 over 4 kv heads (heads
    # whole on every device), one layer and a stacked cache indexed by a layer; equal to the XLA reference.
    rng = np.random.default_rng(0)
    for name, (mesh, _) in meshes().items():
        mesh = check_mesh(mesh)  # Auto axes, as load() keeps them
        for kv_heads, stacked in ((8, False), (4, True)):
            b, n, s, d, g = 4, 5, 32, 16, 2
            q = rng.standard_normal((b, n, kv_heads * g, d), np.float32)
            kv_shape = (3, b, s, kv_heads, d) if stacked else (b, s, kv_heads, d)
            k, v = (rng.standard_normal(kv_shape, np.float32) for _ in range(2))
            lengths = np.array([0, 7, 20, 27], np.int32)
            mask = np.tril(np.ones((n, n), bool))[None].repeat(b, 0)
            mask[1, 3, 1] = False  # a tree, not a chain
            layer = 2 if stacked else None
            want = tree_attention_reference(q, k, v, lengths, mask, layer=layer)
            with use_mesh(mesh):
                got = jax.jit(lambda *a: sharded_tree_attention(*a, mesh=mesh, layer=layer, interpret=True))(
                    q, k, v, lengths, mask)
            err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
            checks.add(f"kernel/{name}/{kv_heads} kv heads{' stacked' if stacked else ''} equals the reference",
                       err < 1e-4, f"max abs error {err}")

    # The loops with attn_impl="pallas" (the kernel interpreted, under shard_map in every layer): greedy tokens equal
    # one device's XLA-attention plain decoding, plain and speculative, on the stacked (accelerator) layout.
    target_dir = save_hf_model(build_hf_model("llama", seed=9, num_attention_heads=8, num_key_value_heads=8,
                                              head_dim=16, num_hidden_layers=2, intermediate_size=128), work / "kernel_target")
    draft_dir = save_hf_model(build_hf_model("llama", seed=10, num_hidden_layers=1, hidden_size=32,
                                             head_dim=16, intermediate_size=64), work / "kernel_draft")  # 2 kv heads
    prompts = prompts_for(256)
    kw = dict(max_new_tokens=6, eos_token_id=[])
    want = specjax.generate(load_on(target_dir, None, attn_impl="xla"), prompts, **kw).tokens
    for name in ("tp8", "dp2_tp4"):
        target = load_on(target_dir, meshes()[name][0], attn_impl="pallas", layout="stacked")
        drafter = specjax.load_drafter(draft_dir, target)
        got = {"plain": specjax.generate(target, prompts, **kw).tokens,
               "draft tree": specjax.generate(target, prompts, drafter=drafter, tree="kary:2,1", **kw).tokens}
        for kind, tokens in got.items():
            checks.same(f"kernel/{name}/pallas {kind} equals one device", tokens, want)

    # A Llama-3-8B-shaped speculative loop at TP 8, weights as sharded shapes only, lowered for CUDA: the Triton
    # kernel is inside a shard_map (its manual computation), and the module is partitioned 8 ways.
    from test_gpu_path import TRITON_CALL, abstract_request, llama3_8b_shaped

    from specjax.decoding.decode import LoopConfig
    from specjax.decoding.drafter import Settings
    from specjax.decoding.speculative import spec_generate
    from specjax.decoding.tree import kary
    from specjax.drafters import DraftModelDrafter
    from specjax.loading.target import target_shardings
    from specjax.models.model import param_shapes

    mesh = meshes()["tp8"][0]
    specjax.kernels.on_gpu = lambda: True  # attention takes the compiled kernel, as on a GPU (this process only)

    def sharded_shapes(cfg):
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(cfg),
                              is_leaf=lambda x: isinstance(x, tuple))
        shardings = target_shardings(shapes, cfg, mesh)
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)

    def replicated_args(args):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), args)

    cfg = llama3_8b_shaped(layers=2, dtype="bfloat16")
    draft_cfg = dataclasses.replace(cfg, hidden_size=2048, intermediate_size=8192, num_layers=1, head_dim=64)
    lc = LoopConfig(cfg, False, out_len=32, cache_len=256, attn_impl="auto")
    drafter = DraftModelDrafter(draft_cfg, None, attn_impl="auto").configure(
        Settings(kary([3, 2]), lc.drafting, lc.cache_len, lc.out_len))
    params = sharded_shapes(cfg)
    checks.same("kernel/lowering/wq split 8 ways", tuple(params["layers"]["wq"].sharding.spec), (None, None, "model"))
    with use_mesh(mesh):
        lowered = spec_generate.trace(params, sharded_shapes(draft_cfg), *replicated_args(abstract_request(8, 64)),
                                      lc=lc, drafter=drafter).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    checks.add("kernel/lowering/triton kernel in the TP-8 loop", text.count(TRITON_CALL) >= 2,
               f"{text.count(TRITON_CALL)} Triton calls")
    checks.add("kernel/lowering/kernel under shard_map", "manual_computation" in text or "SPMDFullToShardShape" in text)
    checks.add("kernel/lowering/partitioned 8 ways", "mhlo.num_partitions = 8" in text)
    # inside the shard_map each device's kernel reads its one kv head of the stacked cache [L, B, S, 1, D]
    calls = [line for line in text.splitlines() if TRITON_CALL in line]
    local_kv = f"tensor<{cfg.num_layers}x8x{lc.cache_len}x1x{cfg.head_dim}xbf16>"
    checks.add("kernel/lowering/kernel reads one kv head per device", any(local_kv in line for line in calls),
               calls[0][-400:] if calls else "no call")


# ---- part "engine": specjax.Engine on a mesh (slots split over "data", kv heads over "model") ------------------


def part_engine(work: Path, checks: Checks) -> None:
    """Greedy requests through the engine at TP 2 and DP 2 x TP 4, with a draft model whose shape switches between
    off and a chain at random, equal one device's plain decoding; no compile after warmup."""
    import random

    from hf_tiny import build_hf_model, save_hf_model

    import specjax

    target_dir = save_hf_model(build_hf_model("qwen2", seed=5, num_attention_heads=8, num_key_value_heads=4,
                                              num_hidden_layers=2, intermediate_size=128), work / "dense")
    draft_dir = save_hf_model(build_hf_model("llama", seed=6, num_hidden_layers=1, hidden_size=32,
                                             intermediate_size=64), work / "draft")
    prompts = prompts_for(256) + [[5, 6, 7, 8, 9]]
    budgets = [10, 6, 12, 8]
    one = load_on(target_dir, None)
    want = [specjax.generate(one, [p], max_new_tokens=n, eos_token_id=[]).tokens[0] for p, n in zip(prompts, budgets)]
    meshes_ = {"tp2": jax_mesh((1, 2)), "dp2_tp4": jax_mesh((2, 4))}  # slots over "data", heads over "model"
    for name, mesh in meshes_.items():
        target = load_on(target_dir, mesh)
        draft = specjax.load_drafter(draft_dir, target)
        with specjax.Engine(target, draft, max_slots=4, max_len=32, auto_chains=(2,), sampling=False,
                            max_prefill_batch=2) as engine:
            engine.warmup()
            compiles = engine.stats()["compiles"]
            rng = random.Random(0)
            engine.policy.choose = lambda nb, live, current: rng.choice(engine.labels)
            handles = [engine.submit(p, max_new_tokens=n, temperature=0.0) for p, n in zip(prompts, budgets)]
            got = [h.result(timeout=600).tokens for h in handles]
            # the engine keeps the checkpoint's EOS: compare up to where it stopped
            checks.add(f"engine/{name} equals one device", all(g == w[:len(g)] for g, w in zip(got, want)),
                       f"got {got} want {want}")
            late = engine._compiled[compiles:]
            checks.add(f"engine/{name} compiles after warmup", not late, f"compiled after warmup: {late}")


def jax_mesh(shape):
    import jax

    return jax.make_mesh(shape, ("data", "model"))


def part_quantized(work: Path, checks: Checks) -> None:
    """A block FP8 target (32 x 32 blocks) at TP 2 and DP 2 x TP 4: outputs equal one device's; each quantized
    weight's values split as the plain weight would be, its scales with their blocks (TP 2: a device's 32 columns
    of wq are one block column, so both split; TP 4: 16 columns would cut a block, so wq and its scales stay whole;
    w_down's 128 rows split in whole blocks at both). Then block-FP8 MoE experts and a block-FP8 hybrid."""
    from hf_quant import write_block_fp8
    from hf_tiny import build_hf_model, save_hf_model

    import specjax

    target_dir = write_block_fp8(build_hf_model("qwen2", seed=5, num_attention_heads=8, num_key_value_heads=4,
                                                num_hidden_layers=2, intermediate_size=128), work / "fp8",
                                 block=(32, 32))
    draft_dir = save_hf_model(build_hf_model("llama", seed=6, num_hidden_layers=1, hidden_size=32,
                                             intermediate_size=64), work / "draft")
    prompts = prompts_for(256)
    kw = dict(max_new_tokens=10, eos_token_id=[])
    one = load_on(target_dir, None, dtype="float32")  # fp32 compute: bf16 sums in another order flip near ties
    want = specjax.generate(one, prompts, **kw).tokens
    for name, (mesh, _) in meshes().items():
        if name == "tp8":
            continue
        target = load_on(target_dir, mesh, dtype="float32")
        draft = specjax.load_drafter(draft_dir, target)
        checks.same(f"quantized/{name}/plain equals one device", specjax.generate(target, prompts, **kw).tokens, want)
        checks.same(f"quantized/{name}/draft chain equals one device",
                    specjax.generate(target, prompts, drafter=draft, num_draft_tokens=3, **kw).tokens, want)
        n = model_size(mesh)
        layer = target.params["layers"][0]
        wq, w_down = layer["wq"], layer["w_down"]
        checks.same(f"quantized/{name}/wq values and scales", (spec_of(wq.q), spec_of(wq.scale)),
                    ((None, "model"), (None, "model")) if n == 2 else ((None, None), (None, None)))
        checks.same(f"quantized/{name}/w_down values and scales", (spec_of(w_down.q), spec_of(w_down.scale)),
                    (("model", None), ("model", None)))
        checks.same(f"quantized/{name}/w_down shard", tuple(w_down.q.addressable_shards[0].data.shape),
                    (128 // n, 64))
    # block-FP8 experts, kept quantized ([E, ...] values and scales): split inside the experts, and whole experts
    # per device (expert parallel, the values and scales of each expert under shard_map together)
    from hf_tiny import build_moe

    from specjax.models.sharding import EXPERT_PARALLEL
    from specjax.quant.qarray import QuantizedWeight

    moe_dir = write_block_fp8(build_moe("qwen3_moe", seed=8, num_hidden_layers=2, num_attention_heads=8,
                                        num_key_value_heads=4), work / "moe_fp8", block=(16, 16))
    want = specjax.generate(load_on(moe_dir, None, dtype="float32"), prompts, **kw).tokens
    mesh = meshes()["dp2_tp4"][0]
    for how, rules in (("inside experts", None), ("expert parallel", EXPERT_PARALLEL)):
        target = load_on(moe_dir, mesh, dtype="float32", rules=rules)
        experts = target.params["layers"][0]["moe"]["w_gate"]
        checks.add(f"quantized/moe {how}/experts stay quantized", isinstance(experts, QuantizedWeight),
                   type(experts).__name__)
        checks.same(f"quantized/moe {how}/plain equals one device", specjax.generate(target, prompts, **kw).tokens,
                    want)
    # a block-FP8 hybrid (Qwen3.5; part "hybrid"'s shapes): its linear_attn projections and the gated attention's
    # per-head q / gate split stay quantized over DP 2 x TP 4, values and 16 x 16 scales split together
    from hf_tiny import build_qwen35

    hybrid_dir = write_block_fp8(build_qwen35(seed=7, num_hidden_layers=2, layer_types=[
        "linear_attention", "full_attention"], num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
        linear_num_value_heads=8), work / "hybrid_fp8", block=(16, 16))
    want = specjax.generate(load_on(hybrid_dir, None, dtype="float32"), prompts, **kw).tokens
    target = load_on(hybrid_dir, mesh, dtype="float32")
    checks.same("quantized/hybrid dp2_tp4/plain equals one device", specjax.generate(target, prompts, **kw).tokens,
                want)
    delta, attn = target.params["layers"][0], target.params["layers"][1]
    for key, w, dim in (("w_qkv", delta["w_qkv"], 1), ("w_out", delta["w_out"], 0), ("wq", attn["wq"], 1),
                        ("wg", attn["wg"], 1)):
        spec = tuple("model" if d == dim else None for d in range(2))
        checks.same(f"quantized/hybrid dp2_tp4/{key} values and scales", (isinstance(w, QuantizedWeight),
                    spec_of(w.q), spec_of(w.scale)), (True, spec, spec))


def main(part: str, workdir: str) -> None:
    import jax

    start = time.perf_counter()
    if jax.device_count() < DEVICES:
        raise SystemExit(f"needs {DEVICES} devices, got {jax.device_count()}: run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} JAX_PLATFORMS=cpu")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    {"dense": part_dense, "heads": part_heads, "hybrid": part_hybrid, "moe": part_moe,
     "kernel": part_kernel, "engine": part_engine, "quantized": part_quantized}[part](work, checks)
    print(json.dumps({"checks": checks.results, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in PARTS:
        raise SystemExit(f"usage: python tests/sharded_check.py {{{','.join(PARTS)}}} WORKDIR")
    if "force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # by hand: before jax is imported
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1], sys.argv[2])
