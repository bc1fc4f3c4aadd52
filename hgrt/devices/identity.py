"""Device identity: the kinds hgrt knows, the ``kind[:id]`` grammar of their names, their DLPack
device types, and every question "is it a GPU / a CPU / remote / can a tensor at a byte offset
be a view"; the tvm Device of a name (local, or of an RPC session), and the device a placement
setting names in a build's device list (``DeviceSpec``, ``resolve_device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
from tvm.rpc.base import RPC_SESS_MASK

from hgrt.devices.backends import ensure_backend
from hgrt.errors import DeviceError


@dataclass(frozen=True)
class Kind:
    """A device kind: its TVM target kind, its DLPack device type, whether it is a GPU, and
    whether its pointers allow arithmetic (a tensor at a byte offset of a buffer is a view)."""

    name: str
    target_kind: str
    dl_type: int
    is_gpu: bool
    offset_views: bool


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("cpu", "llvm", 1, False, True), Kind("cuda", "cuda", 2, True, True),
    Kind("opencl", "opencl", 4, True, False), Kind("vulkan", "vulkan", 7, True, False),
    Kind("metal", "metal", 8, True, False), Kind("rocm", "rocm", 10, True, True))}
ALIASES = {"llvm": "cpu", "c": "cpu", "gpu": "cuda", "cuda_host": "cpu"}
# DLPack device types of memory that is no kind of its own: pinned CUDA host memory is a CPU's;
# CUDA managed and ROCm host memory are known here only for their pointer arithmetic
KDL_CUDA_HOST, KDL_CUDA_MANAGED, KDL_ROCM_HOST = 3, 11, 13
_BY_DL_TYPE = {k.dl_type: k for k in KINDS.values()} | {KDL_CUDA_HOST: KINDS["cpu"]}
_OFFSET_VIEW_DL_TYPES = frozenset(
    {k.dl_type for k in KINDS.values() if k.offset_views}
    | {KDL_CUDA_HOST, KDL_CUDA_MANAGED, KDL_ROCM_HOST})
_BY_TARGET_KIND = {k.target_kind: k for k in KINDS.values()} | {"c": KINDS["cpu"]}


def split_device(name: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", 0)``; aliases resolved."""
    kind, _, index = str(name).strip().lower().partition(":")
    kind = ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise DeviceError(f"device {name!r}: unknown kind {kind!r}; known: "
                          f"{sorted([*KINDS, *ALIASES])}")
    if index and not index.isdigit():
        raise DeviceError(f"device {name!r}: index {index!r} is not a non-negative integer")
    return kind, int(index or 0)


def format_device(kind: str, index: int) -> str:
    """The name of device ``index`` of ``kind``: ``format_device("cuda", 1)`` -> ``"cuda:1"``."""
    return f"{kind}:{index}"


def canonical_name(obj: Any) -> str:
    """``kind:id`` of a name (``"gpu:1"`` -> ``"cuda:1"``, ``"cpu"`` -> ``"cpu:0"``) or of a tvm
    Device, local or of an RPC session (``device_name`` also says "remote")."""
    if isinstance(obj, tvm.runtime.Device):
        return format_device(kind_of(obj).name, obj.index)
    return format_device(*split_device(obj))


def device_list(devices: Any) -> list:
    """The devices given to ``hgrt.load`` or a ``Host`` as a list: one tvm Device, a string of
    names separated by commas (``"cpu:0,cuda:0"``), or a sequence of names and Devices; empty
    for None or an empty string."""
    if isinstance(devices, tvm.runtime.Device):
        return [devices]
    if isinstance(devices, str):
        return [d for d in devices.split(",") if d.strip()]
    return list(devices) if devices else []


def normalize_devices(devices: Any) -> list:
    """One Device or a list of them (what ``hgrt.create`` takes) -> a non-empty list of tvm
    Devices."""
    if isinstance(devices, tvm.runtime.Device):
        return [devices]
    try:
        devs = list(devices)
    except TypeError:
        raise DeviceError(f"devices must be a tvm Device or a list of them, got {devices!r}") \
            from None
    if not devs:
        raise DeviceError("devices is empty: give at least one device, e.g. [tvm.cpu(0)]")
    for i, d in enumerate(devs):
        if not isinstance(d, tvm.runtime.Device):
            raise DeviceError(f"devices[{i}] = {d!r} is not a tvm Device (use tvm.cpu(0), ...)")
        if not is_remote(d):
            ensure_backend(kind_of(d).name)  # a runtime-only TVM's GPU backend and extras
    return devs


def kind_of(obj: Any) -> Kind:
    """The kind of a name, a ``Target``, a ``DeviceSpec``, a (local or remote) ``Device`` or a
    tensor on one."""
    if isinstance(obj, DeviceSpec):
        return KINDS[obj.kind]
    if isinstance(obj, tvm.target.Target):
        kind = _BY_TARGET_KIND.get(obj.kind.name)
        if kind is None:
            raise DeviceError(f"target kind {obj.kind.name!r} is not a device hgrt knows")
        return kind
    if isinstance(obj, tvm.runtime.Tensor):
        obj = obj.device
    if isinstance(obj, tvm.runtime.Device):
        dl_type = obj.dlpack_device_type() % RPC_SESS_MASK
        if dl_type not in _BY_DL_TYPE:
            raise DeviceError(f"device {obj}: DLPack device type {dl_type} is not one hgrt knows")
        return _BY_DL_TYPE[dl_type]
    return KINDS[split_device(obj)[0]]


def is_gpu(obj: Any) -> bool:
    return kind_of(obj).is_gpu


def is_cpu(obj: Any) -> bool:
    return kind_of(obj).name == "cpu"


def is_remote(obj: Any) -> bool:
    """Whether a Device, or a tensor, belongs to an RPC session."""
    dev = obj.device if isinstance(obj, tvm.runtime.Tensor) else obj
    return isinstance(dev, tvm.runtime.Device) and dev.dlpack_device_type() >= RPC_SESS_MASK


def _device(obj: Any) -> tvm.runtime.Device:
    return obj.device if isinstance(obj, tvm.runtime.Tensor) else obj


def is_local_cpu(obj: Any) -> bool:
    """Whether a Device, or a tensor, is a CPU of this process: DLPack's kDLCPU itself, not
    pinned CUDA host memory, not a device of an RPC session."""
    return _device(obj).dlpack_device_type() == KINDS["cpu"].dl_type


def is_local_cuda(obj: Any) -> bool:
    """Whether a Device, or a tensor, is a CUDA GPU of this process (not of an RPC session)."""
    return _device(obj).dlpack_device_type() == KINDS["cuda"].dl_type


def is_pinned_host(obj: Any) -> bool:
    """Whether a Device, or a tensor, is pinned CUDA host memory (``pinned_host_device``)."""
    return _device(obj).dlpack_device_type() == KDL_CUDA_HOST


def pinned_host_device() -> tvm.runtime.Device:
    """Where TVM allocates pinned (page-locked) CUDA host memory: memory of the CPU that a CUDA
    GPU reads and writes by DMA (TVM's ``cuda_host``, present where its CUDA runtime is)."""
    return tvm.runtime.Device(KDL_CUDA_HOST, 0)


def is_numpy_device(obj: Any) -> bool:
    """Whether a Device, or a tensor, is where a numpy array's memory is: this process's cpu(0)
    (what DLPack reports for host memory)."""
    dev = _device(obj)
    return is_local_cpu(dev) and dev.index == 0


def takes_offset_views(obj: Any) -> bool:
    """Whether a tensor at a byte offset of a buffer on ``obj`` (a name, a ``DeviceSpec``, a
    Device or a tensor) can be a view of it: the device's pointers allow arithmetic (CPU, CUDA,
    ROCm, their host and managed memory). A device of an RPC session: no (views are made where
    the memory is); a name of no known kind raises ``DeviceError``."""
    if isinstance(obj, (tvm.runtime.Device, tvm.runtime.Tensor)):
        return _device(obj).dlpack_device_type() in _OFFSET_VIEW_DL_TYPES
    return kind_of(obj).offset_views


def dlpack_device(obj: Any) -> tuple[int, int]:
    """(DLPack device type, device id) of a Device or a tensor, as a DLPack producer reports
    it."""
    dev = _device(obj)
    return dev.dlpack_device_type(), dev.index


def rpc_session_index(dev: tvm.runtime.Device) -> int:
    """TVM's session table index of a device of an RPC session (its DLPack type carries it)."""
    return dev.dlpack_device_type() // RPC_SESS_MASK - 1


def runtime_device(name: Any, session: Any = None) -> tvm.runtime.Device:
    """A tvm Device for ``name`` (a name or a Device); with an RPC ``session``, that session's
    device of the same kind and id."""
    if isinstance(name, tvm.runtime.Device):
        if session is None or is_remote(name):
            return name
        kind, index = kind_of(name).name, name.index
    else:
        kind, index = split_device(name)
    if session is not None:
        return session.device(kind, index)
    ensure_backend(kind)  # a runtime-only TVM loads no GPU backend by itself
    return tvm.device(kind, index)


def device_name(dev: tvm.runtime.Device) -> str:
    """``cpu:1`` for a local device; ``remote cpu:1`` for a device of an RPC session."""
    name = canonical_name(dev)
    return f"remote {name}" if is_remote(dev) else name


def sync(devices: list) -> None:
    """Wait for the work queued on every device that is not a (synchronous) CPU."""
    for d in devices:
        if not is_cpu(d):
            d.sync()


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a build: its name (``cpu:1``), TVM target and position in the list."""

    name: str
    kind: str
    device_id: int
    target: tvm.target.Target
    index: int

    @property
    def is_gpu(self) -> bool:
        return KINDS[self.kind].is_gpu

    def vdevice(self):
        """The Relax VDevice of this device (its ``vdevice_id`` is the device id)."""
        from tvm import relax  # the Relax stack is loaded only when something is compiled

        return relax.VDevice(self.target, self.device_id, "global")


def resolve_device(name: Any, devices: list[DeviceSpec], what: str) -> int:
    """A device named in a placement setting → its position in ``devices``.

    ``name`` is a position, a name (``"cpu:1"``; a bare kind ``"cuda"`` means the only device of
    that kind) or a ``Target`` (the device built for that very target, else the only device of
    its kind). Several devices that fit a bare kind or target are refused, never guessed."""
    known = [d.name for d in devices]
    if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(devices):
        return name
    if isinstance(name, tvm.target.Target):
        exact = [d for d in devices if str(d.target) == str(name)]
        fits = exact or [d for d in devices if d.kind == kind_of(name).name]
        label = f"target {name.kind.name!r}" + (f" ({exact[0].name})" if exact else "")
    elif isinstance(name, str):
        kind, did = split_device(name)
        bare = ":" not in name  # a bare kind: any device of that kind, if it is the only one
        fits = [d for d in devices
                if (d.kind == kind if bare else d.name == format_device(kind, did))]
        label = f"device {name!r}"
    else:
        fits, label = [], f"device {name!r}"
    if len(fits) == 1:
        return fits[0].index
    if fits:
        raise DeviceError(f"{what}: {label} fits {[d.name for d in fits]}; name one of them")
    raise DeviceError(f"{what}: {label} is not in the device list {known}")


def resolve_dl_device(dl_type: int, device_id: int, devices: list[DeviceSpec], what: str) -> int:
    """The position of the device that ``R.device(dl_type, device_id)`` names."""
    kind = _BY_DL_TYPE.get(int(dl_type))
    if kind is None:
        raise DeviceError(f"{what}: DLPack device type {dl_type} is not one hgrt knows; "
                          f"the devices are {[d.name for d in devices]}")
    return resolve_device(format_device(kind.name, int(device_id)), devices, what)
