"""What the passes share: the device list (name, TVM target, Relax VDevice) and a build context.

A device is written ``kind[:id]`` (``"cpu"``, ``"cpu:1"``, ``"cuda:0"``; ``"llvm"`` means cpu) or
given as a ``tvm.target.Target``. Two devices of one kind are told apart by their id, which
becomes the Relax ``vdevice_id`` (and so the position the graph's ``device_index`` refers to).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import DeviceError

_log = logging.getLogger("hgrt.build")
DEFAULT_CUDA_ARCH = os.environ.get("HGRT_CUDA_ARCH", "sm_80")
# device kind -> (target kind, is a GPU); "llvm" is accepted as another name of cpu
KIND_TARGETS: dict[str, tuple[str, bool]] = {
    "cpu": ("llvm", False),
    "llvm": ("llvm", False),
    "cuda": ("cuda", True),
    "gpu": ("cuda", True),
}
TARGET_KINDS: dict[str, str] = {"llvm": "cpu", "c": "cpu", "cuda": "cuda"}
GPU_TARGET_KINDS = ("cuda", "rocm", "vulkan", "metal", "opencl", "webgpu")


@dataclass(frozen=True)
class DeviceSpec:
    """One device of the build: its name (``cpu:1``), TVM target and position in the list."""

    name: str
    kind: str
    device_id: int
    target: tvm.target.Target
    index: int

    @property
    def is_gpu(self) -> bool:
        return self.target.kind.name in GPU_TARGET_KINDS

    def vdevice(self) -> relax.VDevice:
        return relax.VDevice(self.target, self.device_id, "global")


def _target_for(kind: str, cuda_arch: str) -> tvm.target.Target:
    """The target of a device named by kind: a CPU is this host (``host_target``: its mcpu and
    core count), unless ``HGRT_CPU_TARGET`` names another (``llvm`` for a plain x86-64 build)."""
    tkind, is_gpu = KIND_TARGETS[kind]
    if is_gpu:
        return tvm.target.Target({"kind": tkind, "arch": cuda_arch}, host="llvm")
    spec = os.environ.get("HGRT_CPU_TARGET", "")
    if spec:
        return tvm.target.Target(spec)
    from hgrt.relay_passes.schedule_cpu import host_target

    return host_target()


def parse_device(spec: Any, index: int, cuda_arch: str = DEFAULT_CUDA_ARCH) -> DeviceSpec:
    """``"cuda:1"`` / ``"cpu"`` / ``Target`` → DeviceSpec at position ``index``."""
    if isinstance(spec, DeviceSpec):
        return DeviceSpec(spec.name, spec.kind, spec.device_id, spec.target, index)
    if isinstance(spec, tvm.target.Target):
        kind = TARGET_KINDS.get(spec.kind.name, spec.kind.name)
        target = spec
        if spec.kind.name in GPU_TARGET_KINDS and spec.host is None:
            target = tvm.target.Target(spec, host="llvm")
        return DeviceSpec(f"{kind}:0", kind, 0, target, index)
    if not isinstance(spec, str):
        raise DeviceError(f"device {index}: expected a name like 'cpu:1' or a tvm Target, "
                          f"got {type(spec).__name__}")
    kind, _, dev_id = spec.strip().lower().partition(":")
    if kind not in KIND_TARGETS:
        raise DeviceError(f"device {index}: unknown device kind {kind!r} in {spec!r} "
                          f"(known: {sorted(KIND_TARGETS)})")
    if dev_id and not dev_id.isdigit():
        raise DeviceError(f"device {index}: {spec!r} has a device id that is not a number")
    kind = "cpu" if kind == "llvm" else "cuda" if kind == "gpu" else kind
    did = int(dev_id or 0)
    return DeviceSpec(f"{kind}:{did}", kind, did, _target_for(kind, cuda_arch), index)


def parse_devices(specs: Any, cuda_arch: str = DEFAULT_CUDA_ARCH) -> list[DeviceSpec]:
    """Parse a device list; refuses an empty list and a device named twice."""
    if isinstance(specs, (str, tvm.target.Target)):
        specs = [specs]
    devices = [parse_device(s, i, cuda_arch) for i, s in enumerate(specs)]
    if not devices:
        raise DeviceError("the device list is empty")
    seen: dict[tuple[str, int], str] = {}
    for d in devices:
        key = (d.target.kind.name, d.device_id)
        if key in seen:
            raise DeviceError(f"device {d.index} {d.name!r} repeats device {seen[key]!r}: give "
                              f"two devices of one kind different ids ('cpu:0', 'cpu:1')")
        seen[key] = d.name
    return devices


def vdevice_key(vdev: relax.VDevice | None) -> tuple[str, int] | None:
    """A comparable key (target kind, id); ``VDevice ==`` recurses forever in TVM 0.27."""
    if vdev is None:
        return None
    return (vdev.target.kind.name, int(vdev.vdevice_id))


@dataclass
class PlacementRow:
    """One line of the placement report."""

    node: str
    op: str
    device: str
    reason: str


@dataclass
class BuildContext:
    """State the passes read and fill; each pass documents what it adds."""

    devices: list[DeviceSpec]
    params: dict[str, np.ndarray] = field(default_factory=dict)  # weights by function param name
    placement: Any = None  # hgrt Placement
    verbose: bool = False
    op_device: dict[str, int] = field(default_factory=dict)  # place_devices: binding -> device
    input_device: dict[str, int] = field(default_factory=dict)  # place_devices: hinted inputs
    report: list[PlacementRow] = field(default_factory=list)  # place_devices
    param_source: dict[str, str] = field(default_factory=dict)  # insert_copies: param -> weight
    graph_names: dict[str, str] = field(default_factory=dict)  # insert_copies: param -> node name
    lib: Any = None  # build_library: the compiled runtime module
    schedule: bool = True  # lower: schedule kernels (False: fused, unscheduled, for tuning)
    tuning_db: str | None = None  # lower: MetaSchedule database applied before the defaults
    tuning_verdicts: bool = True  # lower: honour `hgrt tune`'s "default faster in the model"
    tuning: Any = None  # lower: hgrt.tune.ApplyReport when a database was given
    cpu_schedule: Any = None  # lower: schedule_cpu.ScheduleReport of the default schedule

    def device_of_vdevice(self, vdev: relax.VDevice | None) -> int | None:
        key = vdevice_key(vdev)
        if key is None:
            return None
        for d in self.devices:
            if (d.target.kind.name, d.device_id) == key:
                return d.index
        # a VDevice built by the frontend with another id: fall back to the kind alone
        kinds = [d.index for d in self.devices if d.target.kind.name == key[0]]
        return kinds[0] if len(kinds) == 1 else None

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"[hgrt.build] {msg}", flush=True)
        else:
            _log.debug(msg)
