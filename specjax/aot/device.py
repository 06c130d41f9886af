"""Where a compile runs: a real GPU when one is attached, else a deviceless topology of the card (XLA's target config).

Deviceless ahead-of-time compilation: jaxlib's CUDA plugin (`pip install -e '.[cuda12]'`) builds a topology of
abstract devices from a GpuTargetConfigProto (the card's SM count, shared memory, registers, memory size; committed
under specjax/aot/targets/, matched to the pinned jaxlib's parser) and a topology name "hosts x 1 x GPUs per host";
arguments sharded on a mesh of those devices lower and compile with the same XLA and Triton passes a GPU host runs,
ptxas included, with JAX_PLATFORMS=cpu and no GPU. On a machine with GPUs the same calls compile on them instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
# --device -> (target config file, the device_kind a real card of that kind reports, in lower case)
DEVICE_TARGETS = {"h100": ("h100_sxm.txtpb", "h100"), "h200": ("h200.txtpb", "h200")}
# --topology examples: one GPU, TP 8 on one host, TP 8 over two hosts of 4 (any "HOSTSx1xGPUS" works)
TOPOLOGIES = ("1x1x1", "1x1x8", "2x1x4")


def parse_topology(topology: str) -> tuple[int, int]:
    """"HOSTSx1xGPUS_PER_HOST" (XLA's GPU topology name) -> (hosts, GPUs per host)."""
    parts = topology.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts) or parts[1] != "1":
        raise ValueError(f"topology must be HOSTSx1xGPUS_PER_HOST, e.g. {', '.join(TOPOLOGIES)}; got {topology!r}")
    return int(parts[0]), int(parts[2])


def cuda_plugin_available() -> bool:
    """Is jaxlib's CUDA plugin installed (the `cuda12` extra)? Deviceless compiles need it; the GPU need not exist."""
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def real_gpus() -> list:
    """The GPUs this process sees ([] with JAX_PLATFORMS=cpu or none attached)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a topology's graphs compile: a ("data", "model") mesh of real or abstract devices, and which."""

    device: str  # "h100" | "h200"
    topology: str  # "1x1x1" | "1x1x8" | "2x1x4"
    mesh: Mesh
    on_gpu: bool  # compiled on the attached GPUs, not deviceless
    device_kind: str

    @property
    def where(self) -> str:
        return (f"{'on the attached ' if self.on_gpu else 'deviceless for '}{self.device_kind}, topology "
                f"{self.topology} ({self.mesh.size} device{'s' if self.mesh.size > 1 else ''})")


def target_config(device: str) -> str:
    """The committed GpuTargetConfigProto text of `device` (h100 | h200)."""
    if device not in DEVICE_TARGETS:
        raise ValueError(f"device must be one of {sorted(DEVICE_TARGETS)}, got {device!r}")
    return (TARGETS_DIR / DEVICE_TARGETS[device][0]).read_text()


def placement(device: str, topology: str = "1x1x1") -> Placement:
    """A mesh for `device` x `topology`: the attached GPUs when they are that kind and enough of them, else the
    deviceless topology (needs the CUDA plugin). TP over every device of the topology: mesh (1, hosts x GPUs)."""
    config = target_config(device)
    hosts, per_host = parse_topology(topology)
    count = hosts * per_host
    gpus = real_gpus()
    if hosts == jax.process_count() and len(gpus) >= count and DEVICE_TARGETS[device][1] in gpus[0].device_kind.lower():
        devices = np.array(gpus[:count]).reshape(1, count)
        return Placement(device, topology, Mesh(devices, ("data", "model")), True, gpus[0].device_kind)
    if not cuda_plugin_available():
        raise ValueError("compiling for a GPU without one needs jaxlib's CUDA plugin: pip install -e '.[cuda12]' "
                         "(keep JAX_PLATFORMS=cpu)")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"{hosts}x1x{per_host}")
    mesh = topologies.make_mesh(topo, (1, count), ("data", "model"))
    return Placement(device, topology, mesh, False, topo.devices[0].device_kind)
