"""How a ("data", "model") device mesh splits the weights and the caches: a small table of rules, applied by name.

Every weight carries logical axis names (models/layers.py `param`); `RULES` maps each name to a mesh axis or to
None (replicated). A (1, n) mesh is tensor parallelism over n devices; (d, n) adds d data-parallel replicas, each
holding the whole (tensor-parallel) model and 1/d of the batch. XLA's SPMD partitioner inserts the collectives
(the all-reduce after the row-split wo / w_down / w_out, the vocabulary's reductions); nothing here runs them.

A dimension stays replicated when its mesh axis does not divide it, counted in whole heads for the head axes (8
kv heads on 16 devices: replicated, never split inside a head), and when an earlier dimension of the same weight
already took that mesh axis (an expert tensor [E, D, I] splits its experts, or its mlp width when the axis does
not divide E).

The caches are allocated inside the jitted loops, so their sharding is a `with_sharding_constraint` there, under
the mesh the compile runs in (`use_mesh`, entered by decoding/request.py for a target with a mesh): batch over
"data", kv heads (and a DeltaNet state's value heads) over "model" when the weights that write them are split.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.config import ModelConfig
from specjax.models.cache import HybridCache, KVCache
from specjax.quant.qarray import QuantizedWeight, is_quantized

MESH_AXES = ("data", "model")

# logical axis name -> mesh axis (None: replicated). Names not listed are replicated too.
RULES: dict[str, str | None] = {
    "heads": "model",      # query heads (wq, wg, biases; wo's rows)
    "kv_heads": "model",   # key/value heads (wk, wv, biases); the KV cache's heads follow
    "mlp": "model",        # the SwiGLU width (dense MLP, shared expert, inside an expert when E is not divisible)
    "vocab": "model",      # embedding rows and lm_head columns
    "v_heads": "model",    # Gated DeltaNet value heads (w_z, w_b, w_a, dt_bias, A_log, w_out's rows); the state follows
    "experts": None,       # MoE: each expert split inside by "mlp" (see EXPERT_PARALLEL)
    "embed": None,         # the hidden size: every activation is whole on every device of a replica
    "layers": None,        # the stacked layers axis (scanned)
    "conv": "model",       # DeltaNet's packed [q | k | v] channels (w_qkv, conv_w, the conv window): see below
}
# DeltaNet's conv channels split contiguously, not per head: with C = [q | k | v], a device's slice holds whole heads
# of one kind only, and XLA regroups them into the value heads the state is split by (collective-permutes of the
# layer's [B, T, C / n] activations). Replicating w_qkv cost the same collectives on the tiny hybrid at TP 8 (XLA
# splits the replicated matmul by channel anyway) and n times the memory; a head-aligned packing at conversion would
# remove the regrouping (a later step).

# Whole experts per device instead (an expert tensor [E, D, I] split on E; its mlp width whole): load marks the config
# (`with_expert_parallel`) and each MoE layer runs the slots routed to a device's own experts there under shard_map,
# then one psum (models/moe.py expert_parallel_experts). Not the default: on an accelerator the expert paths gather
# every block's expert matrices (fixed shapes, used or not), so whole experts read up to n times the bytes of an
# inside split at decode; on the CPU it is the faster one (the inside split's loop over blocks takes an all-reduce
# per block). `python scripts/bench_expert_split.py`, docs/architecture_devices.md.
EXPERT_PARALLEL: dict[str, str | None] = {**RULES, "experts": "model"}


def check_mesh(mesh) -> Mesh:
    """`mesh` if it is a jax Mesh over exactly the axes ("data", "model"), with Auto axis types (XLA places the
    activations); else a ValueError saying what to pass."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model'), got {type(mesh).__name__}: "
                         "e.g. jax.make_mesh((1, 8), ('data', 'model')), or pass tensor_parallel=8")
    if sorted(mesh.axis_names) != sorted(MESH_AXES):
        raise ValueError(f"mesh axes must be ('data', 'model'), got {tuple(mesh.axis_names)}: name the data-parallel "
                         "axis 'data' and the tensor-parallel one 'model' (size 1 for either is fine)")
    if any(t != AxisType.Auto for t in mesh.axis_types):  # jax.make_mesh's default is Explicit
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh


def device_mesh(data: int, model: int, what: str = "") -> Mesh:
    """A (data, model) mesh over the job's first data x model devices (`jax.devices()`: every process's, in process
    order, so with `model` a host's device count each host holds one data-parallel replica). `what` names the
    argument `model` came from (data 1), for the errors."""
    devices = jax.devices()
    for name, n in (("data", data), ("model", model)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{what or f'the {name} axis'} must be a positive number of devices, got {n!r}")
    if data * model > len(devices):
        seen = (f"the job's {jax.process_count()} processes see" if jax.process_count() > 1 else "this process sees")
        asked = f"{what}={model}" if what else f"a ({data}, {model}) mesh"
        raise ValueError(f"{asked} needs {data * model} devices, but {seen} {len(devices)} ({devices[0].platform}): "
                         f"use at most {len(devices)}")
    return Mesh(np.asarray(devices[:data * model]).reshape(data, model), MESH_AXES,
                axis_types=(AxisType.Auto, AxisType.Auto))


def tensor_parallel_mesh(n: int) -> Mesh:
    """A (1, n) mesh over the job's first n devices: tensor parallelism, one replica."""
    return device_mesh(1, n, what="tensor_parallel")


def resolve_mesh(mesh, tensor_parallel, rules: dict | None = None) -> Mesh | None:
    """The mesh `load` places a model on: `mesh` (checked), a (1, tensor_parallel) one, or None (one device)."""
    if mesh is not None and tensor_parallel is not None:
        raise ValueError("pass mesh= or tensor_parallel=, not both (tensor_parallel=n is a (1, n) mesh)")
    if rules is not None:
        check_rules(rules)
        if mesh is None and tensor_parallel is None:
            raise ValueError("rules= says how a mesh splits the weights: pass mesh= or tensor_parallel= with it")
    if mesh is not None:
        return check_mesh(mesh)
    if tensor_parallel is not None:
        return tensor_parallel_mesh(tensor_parallel)
    return None


def check_rules(rules: dict | None) -> dict:
    """`rules` (RULES when None) if every entry maps a logical axis name to "model", "data" or None."""
    if rules is None:
        return RULES
    bad = {k: v for k, v in dict(rules).items() if not isinstance(k, str) or v not in (None, *MESH_AXES)}
    if bad:
        raise ValueError(f"rules map logical axis names to a mesh axis ('model', 'data') or None; got {bad}: e.g. "
                         "{**specjax.models.sharding.RULES, 'experts': 'model'}")
    return dict(rules)


def with_expert_parallel(cfg: ModelConfig, mesh, rules=None) -> ModelConfig:
    """cfg with `moe.expert_parallel` set when `rules` put whole experts on each device of `mesh` (the experts
    axis over "model", which divides the expert count): the MoE layers then run each device's own experts
    under shard_map (models/moe.py). Unchanged for a dense model or one device."""
    if cfg.moe is None or mesh is None:
        return cfg
    moe = cfg.moe
    spec = partition_spec(("experts", "embed", "mlp"), (moe.num_experts, cfg.hidden_size, moe.expert_size), mesh,
                          head_counts(cfg), rules)  # as w_gate is split
    return dataclasses.replace(cfg, moe=dataclasses.replace(moe, expert_parallel=spec[0] == "model"))


def axis_size(mesh, axis: str) -> int:
    """The size of a mesh axis (1 without a mesh): a Mesh or an AbstractMesh."""
    if mesh is None:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]


def mesh_label(mesh) -> str:
    """A mesh's shape for keys and file names: "" for none or one device, else "tp8", "dp2", "dp2xtp4"."""
    data, model = axis_size(mesh, "data"), axis_size(mesh, "model")
    return "x".join(f"{name}{size}" for name, size in (("dp", data), ("tp", model)) if size > 1)


def head_counts(cfg: ModelConfig) -> dict[str, int]:
    """For the head axes, the number of heads a flattened [.., heads x head_dim] dimension holds: they split only
    in whole heads. Other names split by their dimension's size."""
    counts = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    if cfg.linear is not None:
        counts["v_heads"] = cfg.linear.num_value_heads
    return counts


def partition_spec(axes: tuple, shape: tuple[int, ...], mesh, counts: dict[str, int], rules=None) -> P:
    """The PartitionSpec `rules` give a weight of `shape` whose dimensions are named `axes` (see the module
    docstring: an axis that does not divide stays replicated; each mesh axis is used once, first dimension first)."""
    rules = check_rules(rules)
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        size = axis_size(mesh, target) if target is not None else 1
        units = counts.get(name, dim)
        if target is None or size == 1 or target in used or units % size or dim % size:
            spec.append(None)
        else:
            spec.append(target)
            used.add(target)
    return P(*spec)


def logical_axes(module: nnx.Module) -> dict:
    """Every weight's logical axis names, as a dict shaped like the module's params (`state.to_params`)."""
    tree: dict = {}
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        value = variable.get_value()
        names = variable.get_metadata().get("out_sharding")
        node[path[-1]] = tuple(names) if names is not None else (None,) * len(value.shape)
    return tree


def abstract(params: dict) -> dict:
    """Params as ShapeDtypeStructs (whatever their leaves are: arrays, lazily read tensors): for merging a module's
    structure without touching its weights."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params)


def param_shardings(module: nnx.Module, cfg: ModelConfig, mesh: Mesh, rules=None) -> dict:
    """A NamedSharding per weight of `module` (merged over its params, e.g. `model.merge(cfg, abstract(params))`),
    by the rules; cfg gives the head counts. The result is shaped like the params (a quantized weight: a
    QuantizedWeight of shardings, one per part, see `quantized_specs`)."""
    counts = head_counts(cfg)

    def sharding(names, value):
        if is_quantized(value):
            return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                quantized_specs(names, value, mesh, counts, rules), is_leaf=lambda x: isinstance(x, P))
        return NamedSharding(mesh, partition_spec(names, tuple(value.shape), mesh, counts, rules))

    return jax.tree.map(sharding, logical_axes(module), nnx.to_pure_dict(nnx.state(module)),
                        is_leaf=lambda x: isinstance(x, tuple))


def quantized_specs(names: tuple, qw: QuantizedWeight, mesh, counts: dict[str, int], rules=None) -> QuantizedWeight:
    """PartitionSpecs for a quantized weight's parts: its values split as a plain weight of its shape would be,
    each scale (and zero point) split with its block. A dimension is split only where every device's slice holds
    whole blocks (else it stays whole, values and scales); a dimension with one scale (per channel, per tensor)
    keeps its scales replicated; with a g_idx (GPTQ act-order) any row may use any group, so scales stay whole
    along the input. A static activation scale (one number a matrix) is replicated."""
    spec = list(partition_spec(names, qw.shape, mesh, counts, rules))
    nd = len(spec)
    blocks = (1,) * (nd - 2) + tuple(qw.block)
    q_spec, s_spec = list(spec), [None] * nd
    for d, axis in enumerate(spec):
        if axis is None or qw.scale.shape[d] == 1 or (d == nd - 2 and qw.g_idx is not None):
            continue
        n = axis_size(mesh, axis)
        if (qw.shape[d] // n) % blocks[d] == 0 and qw.scale.shape[d] % n == 0:
            s_spec[d] = axis
        else:
            q_spec[d] = None
    return dataclasses.replace(qw, q=P(*q_spec), scale=P(*s_spec), zero=None if qw.zero is None else P(*s_spec),
                               g_idx=None if qw.g_idx is None else P(*q_spec[:-1]),
                               input_scale=None if qw.input_scale is None else P())


def replicated(params, mesh: Mesh):
    """A replicated NamedSharding for every leaf of `params` (the small drafter heads: EAGLE-3, DFlash, DSpark)."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), params)


def place(params, shardings):
    """Put every leaf on its sharding, each device reading only its slice: `leaf[index]` of a host array, or of a
    lazily read tensor (convert/lazy.py reads that slice from the safetensors file). Each distinct slice is read
    once, put on the devices that hold it, and dropped before the next: host memory holds one slice at a time."""
    return jax.tree.map(place_leaf, params, shardings)


def place_leaf(leaf, sharding: NamedSharding) -> jax.Array:
    if isinstance(leaf, jax.Array):
        return jax.device_put(leaf, sharding)
    shape = tuple(leaf.shape)
    groups: dict[tuple, tuple[tuple, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        groups.setdefault(key, (index, []))[1].append(device)
    by_device = {}
    for index, devices in groups.values():
        host = np.asarray(leaf[index])
        arrays = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready(arrays)
        by_device.update(zip(devices, arrays))
        del host
    ordered = [by_device[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A batch-leading array (prompts, lengths, seeds, per-row settings) split over "data"."""
    return NamedSharding(mesh, P(split(shape[0], "data", mesh), *([None] * (len(shape) - 1))))


def place_batch(tree, mesh: Mesh | None):
    """Every array of `tree` (leading axis: the batch) on the devices, split over "data" when there is a mesh."""
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, tree)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), batch_sharding(mesh, np.shape(x))), tree)


def use_mesh(mesh: Mesh | None):
    """The context a loop for a target on `mesh` is traced and compiled in (nothing without a mesh): the caches
    allocated inside it take their shardings from it (`constrain_cache`)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def active_mesh():
    """The mesh the current trace runs under, or None (no mesh, or one without the ("data", "model") axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or sorted(mesh.axis_names) != sorted(MESH_AXES):
        return None
    return mesh


def split(dim: int, axis: str, mesh) -> str | None:
    """`axis` when it divides `dim` (and is larger than 1), else None."""
    size = axis_size(mesh, axis)
    return axis if size > 1 and dim % size == 0 else None


def kv_spec(shape: tuple[int, ...], mesh, split_heads: bool) -> P:
    """A K or V buffer, [B, S, Hkv, D] or stacked [L, B, S, Hkv, D]: batch over "data", heads over "model"."""
    b, _, heads, _ = shape[-4:]
    lead = [None] * (len(shape) - 4)
    return P(*lead, split(b, "data", mesh), None, split(heads, "model", mesh) if split_heads else None, None)


def constrain_cache(cache, split_heads: bool = True):
    """The cache under the active mesh's shardings (unchanged without one): batch over "data"; with `split_heads`
    (a model whose attention weights follow the rules: target, draft model, MTP) kv heads over "model" when it
    divides them, a DeltaNet state's value heads and its conv window's channels likewise (as w_qkv's)."""
    mesh = active_mesh()
    if mesh is None:
        return cache

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    if isinstance(cache, HybridCache):
        kv = constrain_cache(cache.kv, split_heads)
        conv = tuple(constrain(c, P(split(c.shape[0], "data", mesh), None,
                                    split(c.shape[2], "model", mesh) if split_heads else None)) for c in cache.conv)
        state = tuple(constrain(s, P(split(s.shape[0], "data", mesh),
                                     split(s.shape[1], "model", mesh) if split_heads else None, None, None))
                      for s in cache.state)
        return dataclasses.replace(cache, kv=kv, conv=conv, state=state)
    k = jax.tree.map(lambda x: constrain(x, kv_spec(x.shape, mesh, split_heads)), cache.k)
    v = jax.tree.map(lambda x: constrain(x, kv_spec(x.shape, mesh, split_heads)), cache.v)
    lengths = constrain(cache.lengths, P(split(cache.lengths.shape[0], "data", mesh)))
    return KVCache(k, v, lengths)
