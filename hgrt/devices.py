"""The device vocabulary: one grammar, ``kind[:id]``, for every layer of hgrt.

``"cpu"``, ``"cpu:1"``, ``"cuda:0"``; ``"llvm"`` is another name of cpu and ``"gpu"`` of cuda.
Here a name becomes a build device (``DeviceSpec``: its TVM target and position in the device
list), a runtime device (``tvm.cpu(1)``, or a device of an RPC session), and every question
"is it a GPU / a CPU / remote / can a tensor at a byte offset be a view" is answered once: no
other module splits a device name or compares DLPack device types.

A device built for another machine than this one carries its target: ``targets={"cpu":
"raspberry-pi/4b-aarch64"}`` (a TVM target tag, a JSON/dict target or a ``Target``) for every
device of a kind, or ``device_spec("cpu:1", target)`` for one.

>>> split_device("gpu:1")
('cuda', 1)
>>> [d.name for d in parse_devices(["cpu", "cpu:1"])]  # doctest: +SKIP
['cpu:0', 'cpu:1']
>>> [d.name for d in parse_devices(["cpu:0", "cpu:1"],
...                                targets={"cpu": "raspberry-pi/4b-aarch64"})]  # doctest: +SKIP
['cpu:0', 'cpu:1']
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
from dataclasses import dataclass, replace
from typing import Any

import tvm
from tvm.rpc.base import RPC_SESS_MASK

from hgrt.errors import DeviceError, did_you_mean


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
DEFAULT_CUDA_ARCH = os.environ.get("HGRT_CUDA_ARCH", "sm_80")


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
    return session.device(kind, index) if session is not None else tvm.device(kind, index)


def device_name(dev: tvm.runtime.Device) -> str:
    """``cpu:1`` for a local device; ``remote cpu:1`` for a device of an RPC session."""
    name = canonical_name(dev)
    return f"remote {name}" if is_remote(dev) else name


def sync(devices: list) -> None:
    """Wait for the work queued on every device that is not a (synchronous) CPU."""
    for d in devices:
        if not is_cpu(d):
            d.sync()


# ---- build devices -------------------------------------------------------------------------

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


def _option_value(kind: str, key: str, value: str | None, types: dict[str, str],
                  where: str) -> Any:
    """One ``-key[=value]`` of a classic option string, typed by ``kind``'s option schema."""
    if key not in types or key in ("kind", "tag"):
        known = [f"-{k}" for k in types if k not in ("kind", "tag")]
        raise DeviceError(f"{where}: {kind} option {did_you_mean(f'-{key}', known, limit=40)}")
    typ = types[key]
    if value is None:  # a bare -flag: true, for a boolean option only
        if typ == "bool":
            return True
        raise DeviceError(f"{where}: -{key} needs a value (-{key}=...)")
    if typ == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
            raise DeviceError(f"{where}: -{key}={value}: expected true or false")
        return value.lower() in ("true", "1")
    if typ == "int":
        try:
            return int(value)
        except ValueError:
            raise DeviceError(f"{where}: -{key}={value}: expected an integer") from None
    if typ.startswith("Array"):
        return [v for v in value.split(",") if v]
    return value


def _target_from_options(spec: str, what: str = "target") -> dict:
    """A classic TVM option string (``"llvm -mcpu=haswell -num-cores=2 -mattr=+avx2,+fma"``;
    TVM 0.27's ``Target`` takes none) -> the dict target it means: the kind (or a tag) first,
    then ``-key=value`` options typed by the kind's option schema (``-mattr`` a list,
    ``-num-cores`` an int, a bare ``-flag`` true). A malformed or unknown option is a
    DeviceError naming it.

    >>> _target_from_options("llvm -mcpu=haswell -mattr=+avx2,+fma")
    {'kind': 'llvm', 'mcpu': 'haswell', 'mattr': ['+avx2', '+fma']}
    """
    try:
        head, *options = shlex.split(spec)
    except ValueError as e:
        raise DeviceError(f"{what} {spec!r}: {e}") from e
    if "/" in head:  # a tag with options: the tag's target, the options on top
        out = json.loads(str(as_target(head, what)))
        out.pop("tag", None)
    else:
        out = {"kind": head}
    try:
        types = tvm.target.TargetKind.options_from_name(out["kind"])
    except Exception:
        known = sorted({k.target_kind for k in KINDS.values()})
        raise DeviceError(f"{what} {spec!r}: target kind "
                          f"{did_you_mean(out['kind'], known)}") from None
    for option in options:
        key, sep, value = option.partition("=")
        if not key.startswith("-") or key.strip("-") == "" or (sep and not value):
            raise DeviceError(f"{what} {spec!r}: {option!r} is not an option; expected "
                              f"-key=value (e.g. -mcpu=haswell) or a bare -flag")
        out[key.lstrip("-")] = _option_value(out["kind"], key.lstrip("-"),
                                             value if sep else None, types, f"{what} {spec!r}")
    return out


def as_target(spec: Any, what: str = "target") -> tvm.target.Target:
    """A TVM target from a ``Target``, a dict, a JSON string, one of TVM's target tags
    (``"raspberry-pi/4b-aarch64"``, ``"nvidia/jetson-orin-nano"``; ``tvm.target.list_tags()``),
    a bare kind (``"llvm"``) or a classic option string (``"llvm -mcpu=haswell"``, which TVM
    0.27 refuses; ``_target_from_options`` translates it)."""
    if isinstance(spec, tvm.target.Target):
        return spec
    if isinstance(spec, str) and spec.strip().startswith("{"):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise DeviceError(f"{what} {spec!r} is not valid JSON: {e}") from e
    given = spec
    if isinstance(spec, str) and re.search(r"\s", spec.strip()):  # tags have no spaces
        spec = _target_from_options(spec.strip(), what)
    if not isinstance(spec, (str, dict)):
        raise DeviceError(f"{what}: expected a tvm Target, a dict, JSON, a tag or an option "
                          f"string, got {type(spec).__name__}")
    try:
        target = tvm.target.Target(spec)
    except Exception as e:
        if isinstance(spec, dict):
            raise DeviceError(f"{what} {given!r}: {str(e).splitlines()[0]}") from e
        known = sorted(tvm.target.list_tags()) + sorted({k.target_kind for k in KINDS.values()})
        raise DeviceError(f"{what} {did_you_mean(spec.strip(), known)}") from e
    for cpu in (target, target.host):
        if cpu is not None and cpu.kind.name == "llvm":
            _check_llvm_cpu(cpu, f"{what} {given!r}")
    return target


def _check_llvm_cpu(target: tvm.target.Target, what: str) -> None:
    """Refuse an ``mcpu`` LLVM does not know for the target's triple: LLVM would only log a
    line and build for a generic CPU of that architecture (slow code, silently)."""
    from tvm.target.codegen import llvm_get_cpu_archlist, llvm_is_valid_cpu

    mcpu = str(target.attrs.get("mcpu", "") or "")
    if not mcpu or mcpu in ("generic", "native"):
        return
    triple = str(target.attrs.get("mtriple", "") or "")
    if llvm_is_valid_cpu(mcpu, triple or str(tvm.target.codegen.llvm_get_system_triple())):
        return  # (LLVM's aliases too: apple-m1, which the archlist below does not name)
    bare = tvm.target.Target({"kind": "llvm", **({"mtriple": triple} if triple else {})})
    known = [str(c) for c in llvm_get_cpu_archlist(bare)]
    if known:
        raise DeviceError(f"{what}: mcpu {did_you_mean(mcpu, known)} (the CPUs LLVM knows for "
                          f"{triple or 'this host'})")


def _without_host(target: tvm.target.Target) -> tvm.target.Target:
    # a CPU tag may carry itself as host ("raspberry-pi/4b-aarch64"); a CPU device needs none
    if target.host is None:
        return target
    spec = json.loads(str(target))
    spec.pop("host")
    return tvm.target.Target(spec)


def target_triple(target: tvm.target.Target) -> str:
    """The LLVM triple of a target's CPU code (a GPU target's host), this host's by default."""
    cpu = target.host if target.kind.name != "llvm" and target.host is not None else target
    triple = str(cpu.attrs.get("mtriple", "") or "") if cpu.kind.name == "llvm" else ""
    return triple or str(tvm.target.codegen.llvm_get_system_triple())


# `uname -m` and triple names -> one name per architecture (as ELF headers name them)
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "i386": "x86", "i686": "x86",
          "aarch64": "aarch64", "arm64": "aarch64", "aarch64_be": "aarch64", "arm": "arm",
          "riscv64": "riscv", "riscv32": "riscv", "ppc64le": "ppc64", "ppc64": "ppc64",
          "mips": "mips", "loongarch64": "loongarch"}


def machine_arch(name: str) -> str:
    """One name per architecture for a ``uname -m`` or the first part of a triple:
    ``arm64``/``aarch64`` -> ``aarch64``, ``amd64`` -> ``x86_64``, ``armv8l`` -> ``arm``."""
    name = str(name).split("-")[0].lower()
    if name in ARCHES:
        return ARCHES[name]
    if name.startswith(("armv", "thumb")):
        return "arm"
    return name


def is_host_triple(triple: str) -> bool:
    """Whether code for ``triple`` runs on this machine's architecture."""
    return machine_arch(triple) == machine_arch(platform.machine())


def target_for(kind: str, cuda_arch: str = DEFAULT_CUDA_ARCH,
               host: tvm.target.Target | None = None) -> tvm.target.Target:
    """The target of a device named by kind: a CPU is this host (``host_target``), unless
    ``HGRT_CPU_TARGET`` names another (a tag, JSON, or ``llvm`` for a plain x86-64 build); a
    GPU gets ``cuda_arch`` and ``host`` (default: an llvm host)."""
    if KINDS[kind].is_gpu:
        try:
            return tvm.target.Target({"kind": KINDS[kind].target_kind, "arch": cuda_arch},
                                     host=host if host is not None else "llvm")
        except Exception as e:  # TVM raises ValueError or its own types
            raise DeviceError(f"{kind}: cuda_arch {cuda_arch!r} is not an architecture TVM "
                              f"takes (e.g. 'sm_80'): {e}") from e
    spec = os.environ.get("HGRT_CPU_TARGET", "")
    return _without_host(as_target(spec, "HGRT_CPU_TARGET")) if spec else host_target()


def device_target(kind: str, target: Any, cpu: tvm.target.Target | None = None
                  ) -> tvm.target.Target:
    """A device's target from ``target``: a CPU keeps no host; a GPU target without one gets
    ``cpu`` (the CPU devices' target, else this host's plain llvm) as host."""
    target = as_target(target, f"target for {kind}")
    if kind_of(target).name != kind:
        raise DeviceError(f"target {target.kind.name!r} is given for {kind} devices")
    if not KINDS[kind].is_gpu:
        return _without_host(target)
    return target if target.host is not None else \
        tvm.target.Target(target, host=cpu if cpu is not None else "llvm")


def kind_targets(targets: Any) -> dict[str, tvm.target.Target]:
    """``targets`` (one target, or ``{kind or device name: target}``) -> ``{key: Target}``
    with kinds and names canonical. A GPU target whose host is another machine's CPU (a
    Jetson tag) also gives the CPU devices that target, unless ``"cpu"`` is named."""
    keys = _target_keys(targets)
    cpu = device_target("cpu", keys["cpu"]) if "cpu" in keys else None
    out = {key: device_target(split_device(key)[0], value, cpu) for key, value in keys.items()}
    for t in list(out.values()):
        if "cpu" not in out and t.host is not None and not is_host_triple(target_triple(t)):
            out["cpu"] = _without_host(t.host)
    return out


def _target_keys(targets: Any) -> dict[str, Any]:
    """``targets`` by canonical key: a kind (``"cpu"``) or a device name (``"cpu:1"``)."""
    if targets is None:
        return {}
    if not isinstance(targets, dict) or "kind" in targets:
        one = as_target(targets)
        targets = {kind_of(one).name: one}
    keys = {}
    for key, value in targets.items():
        kind, did = split_device(key)
        keys[format_device(kind, did) if ":" in str(key) else kind] = value
    return keys


def device_spec(name: str, target: Any = None, index: int = 0) -> DeviceSpec:
    """One device of a build with its own target: ``device_spec("cpu:1",
    "raspberry-pi/4b-aarch64")`` (its position is set by the device list it goes into)."""
    kind, did = split_device(name)
    t = device_target(kind, target) if target is not None else target_for(kind)
    return DeviceSpec(format_device(kind, did), kind, did, t, index)


def _is_target(spec: Any) -> bool:
    """A device given as a target (a Target, dict, JSON or tag) rather than by name."""
    return isinstance(spec, (tvm.target.Target, dict)) or (
        isinstance(spec, str) and ("/" in spec or spec.strip().startswith("{")))


def parse_device(spec: Any, index: int, cuda_arch: str = DEFAULT_CUDA_ARCH,
                 targets: dict[str, tvm.target.Target] | None = None) -> DeviceSpec:
    """``"cuda:1"`` / ``"cpu"`` / a ``Target`` (or a tag, JSON, dict) → the DeviceSpec at
    position ``index``; a device named by kind takes its target from ``targets`` (as
    ``kind_targets`` returns them: by device name, else by kind) when it is there."""
    if isinstance(spec, DeviceSpec):
        return replace(spec, index=index)
    if _is_target(spec):
        target = as_target(spec, f"device {index}")
        kind = kind_of(target)
        return DeviceSpec(format_device(kind.name, 0), kind.name, 0,
                          device_target(kind.name, target), index)
    if not isinstance(spec, str):
        raise DeviceError(f"device {index}: expected a name like 'cpu:1', a tvm Target or a "
                          f"target tag, got {type(spec).__name__}")
    kind, did = split_device(spec)
    if kind not in ("cpu", "cuda"):
        raise DeviceError(f"device {index} {spec!r}: hgrt builds for cpu and cuda devices by "
                          f"name; give a tvm Target for {kind}")
    targets = targets or {}
    target = targets.get(format_device(kind, did), targets.get(kind))
    if target is None:  # a GPU's host is the CPU devices' target when one is given
        target = target_for(kind, cuda_arch, targets.get("cpu"))
    return DeviceSpec(format_device(kind, did), kind, did, target, index)


def parse_devices(specs: Any, cuda_arch: str = DEFAULT_CUDA_ARCH,
                  targets: Any = None) -> list[DeviceSpec]:
    """Parse a device list; refuses an empty list, a device named twice and CPU code for two
    architectures (one library holds every kernel).

    Devices given as targets (no id) take the lowest ids their kind has free, so
    ``[arm, arm]`` is ``cpu:0, cpu:1``. ``targets``: see ``kind_targets``."""
    if isinstance(specs, (str, tvm.target.Target, DeviceSpec, dict)):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise DeviceError(f"devices must be a name ('cpu:1'), a target, or a list of them, got "
                          f"{type(specs).__name__}")
    by_kind = kind_targets(targets)
    devices = [parse_device(s, i, cuda_arch, by_kind) for i, s in enumerate(specs)]
    if not devices:
        raise DeviceError("the device list is empty")
    unnamed = [i for i, s in enumerate(specs) if _is_target(s)]
    taken = {d.name for i, d in enumerate(devices) if i not in unnamed}
    for i in unnamed:
        d = devices[i]
        did = next(n for n in range(len(devices) + 1) if format_device(d.kind, n) not in taken)
        taken.add(format_device(d.kind, did))
        devices[i] = replace(d, name=format_device(d.kind, did), device_id=did)
    names = [d.name for d in devices]
    for d in devices:
        if names.index(d.name) != d.index:
            raise DeviceError(f"device {d.index} {d.name!r} repeats device {names.index(d.name)}: "
                              f"give two devices of one kind different ids ('cpu:0', 'cpu:1')")
    used = {*names, *(d.kind for d in devices)} | ({"cpu"} if any(d.is_gpu for d in devices)
                                                   else set())  # "cpu": the GPUs' host too
    unused = [k for k in _target_keys(targets) if k not in used]
    if unused:  # a typo, or a device left out of the list: it would build for the default
        raise DeviceError(f"targets are given for {unused}, but the devices are {names}: name "
                          f"a kind ('cpu') or one of the devices")
    _check_one_arch(devices)
    return devices


def _check_one_arch(devices: list[DeviceSpec]) -> None:
    arch = {d.name: machine_arch(target_triple(d.target)) for d in devices}
    if len(set(arch.values())) > 1:
        raise DeviceError(f"the devices' CPU code is for several architectures {arch}: one "
                          f"library holds every kernel, so give every CPU device (and every "
                          f"GPU's host) a target of one architecture")


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


# ---- the host CPU ----------------------------------------------------------------------------

# The process's affinity mask when hgrt is imported: a TVM thread pool that starts with TVM's
# default mode pins its calling thread to one core, after which sched_getaffinity(0) answers 1.
_AFFINITY = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask; when that is one core, the mask when
    hgrt was imported (TVM's pinning, not the user's choice), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        now = len(os.sched_getaffinity(0))
        return max(1, _AFFINITY if now == 1 else now)
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """The host CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^flags\s*:(.*)$", f.read(), re.M)
        return set(m.group(1).split()) if m else set()
    except OSError:
        return set()


# LLVM's names of the x86 instruction-set extensions that generated code may use, and the
# /proc/cpuinfo flag that shows each: code built for a target runs only where every one that
# its mcpu/mattr enables is there (else SIGILL: an AVX-512 build on an AVX2 host)
X86_FEATURE_FLAGS = {
    "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2",
    "lzcnt": "abm", "movbe": "movbe", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512cd": "avx512cd",
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avxvnni": "avx_vnni", "amx-tile": "amx_tile", "amx-bf16": "amx_bf16",
    "amx-int8": "amx_int8",
}


def cpu_requirements(target: tvm.target.Target) -> dict | None:
    """What code built for the CPU ``target`` needs of the machine that runs it: its
    architecture and (x86) the instruction-set extensions LLVM enables for the target's
    ``mcpu``/``mattr``; None for a target that is not a CPU's."""
    if target.kind.name != "llvm":
        return None
    triple = target_triple(target) if "mtriple" in target.attrs else platform.machine()
    arch = machine_arch(triple)
    features: list[str] = []
    if arch == "x86_64":
        from tvm.target.codegen import llvm_get_cpu_features

        features = sorted(set(llvm_get_cpu_features(target)) & set(X86_FEATURE_FLAGS))
    return {"arch": arch, "features": features}


def check_runs_here(needs: dict, device: str) -> None:
    """A ``DeviceError`` when this machine cannot run code that ``needs`` (``cpu_requirements``)
    on ``device``: another architecture, or an instruction-set extension its CPU lacks."""
    here = machine_arch(platform.machine())
    if needs["arch"] != here:
        raise DeviceError(f"{device}: the library was built for {needs['arch']}, this machine "
                          f"is {here}: run it on such a board through RPC (hgrt.load(..., "
                          f"session=...) or hgrt run --rpc-tracker), or rebuild for this host")
    flags = cpu_flags()
    missing = [f for f in needs["features"] if flags and X86_FEATURE_FLAGS.get(f, f) not in flags]
    if missing and os.environ.get("HGRT_CPU_CHECK", "1") != "0":
        raise DeviceError(f"{device}: the library was built for {', '.join(missing)}, which "
                          f"this CPU lacks (a kernel that uses one dies of an illegal "
                          f"instruction): rebuild on this host, or for it with --target "
                          f"'cpu=llvm -mcpu=...' (hgrt compile prints the ISA it built for); "
                          f"HGRT_CPU_CHECK=0 runs it anyway")


@dataclass(frozen=True)
class VectorISA:
    """What a CPU target's kernels can use: its widest vector ISA, the vector width and the
    number of vector registers (what a register tile must fit in)."""

    name: str  # "avx512", "avx2", "avx", "sse", "neon", "scalar"
    bits: int
    registers: int

    def lanes(self, dtype_bits: int = 32) -> int:
        return max(1, self.bits // dtype_bits)


def vector_isa(target: tvm.target.Target) -> VectorISA:
    """The vector ISA that code built for ``target`` runs with, from LLVM's features of its
    ``mcpu``/``mattr`` (TVM 0.27's ``llvm_get_vector_width`` answers 512 for every x86 target,
    so it is not asked). An x86 target without ``mcpu`` is generic x86-64: SSE2."""
    from tvm.target.codegen import target_has_features

    triple = target_triple(target) if "mtriple" in target.attrs else platform.machine()
    arch = machine_arch(triple)
    if arch == "aarch64":
        return VectorISA("neon", 128, 32)
    if arch != "x86_64":
        return VectorISA("scalar", 128, 16)

    def has(*features: str) -> bool:
        try:
            return bool(target_has_features(list(features), target))
        except Exception:  # an mcpu LLVM does not know
            return False

    if has("avx512f"):
        return VectorISA("avx512", 512, 32)
    if has("avx2", "fma"):
        return VectorISA("avx2", 256, 16)
    if has("avx"):
        return VectorISA("avx", 256, 16)
    return VectorISA("sse", 128, 16)


# an LLVM CPU name per vector ISA the host's flags show, for hosts LLVM cannot name (or names a
# CPU with features the host hides, as a VM may do with AVX-512): the oldest CPU that has them
_CPU_BY_FLAGS = (({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "skylake-avx512"),
                 ({"avx2", "fma", "bmi2"}, "haswell"), ({"avx"}, "sandybridge"),
                 ({"sse4_2"}, "nehalem"))


def host_target(num_cores: int | None = None) -> tvm.target.Target:
    """An llvm target for this machine: its CPU (vector features) and its core count.

    ``mcpu`` is LLVM's name for the host CPU (``llvm_get_system_cpu``), kept when /proc/cpuinfo
    has every instruction-set extension that name implies (``cpu_requirements``: a VM may hide
    AVX-512 from a CPU that has it); otherwise the oldest CPU with the ISA the flags show
    (``haswell`` for AVX2 + FMA) whose extensions are all there, so a build is never silently
    generic x86-64 and always runs where it was built. ``num-cores``: the cores this process
    may run on.

    >>> host_target(2)  # doctest: +SKIP
    {"kind":"llvm","mcpu":"znver4","num-cores":2,...}
    """
    from tvm.target.codegen import llvm_get_system_cpu

    spec: dict = {"kind": "llvm", "num-cores": int(num_cores or usable_cores())}
    cpu = llvm_get_system_cpu()
    flags = cpu_flags()
    def fits(mcpu: str) -> bool:  # every extension LLVM enables for it is in the flags
        needs = cpu_requirements(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
        return not flags or all(X86_FEATURE_FLAGS.get(f, f) in flags for f in needs["features"])

    if cpu and cpu != "generic" and fits(cpu):
        spec["mcpu"] = cpu
    if "mcpu" not in spec and machine_arch(platform.machine()) == "x86_64":
        spec["mcpu"] = next((name for need, name in _CPU_BY_FLAGS
                             if need <= flags and fits(name)), "x86-64")
    return tvm.target.Target(spec)
