"""The targets of a build's devices: a TVM target from any form a user gives (``as_target``: a
``Target``, dict, JSON, tag or classic option string), the default target of a device named by
kind (``target_for``: this host for a CPU), targets given per kind or device (``kind_targets``),
and the one parse of a build's device list into ``DeviceSpec``s (``parse_devices``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import replace
from typing import Any

import tvm

from hgrt.devices.host_cpu import host_target, is_host_triple, machine_arch, target_triple
from hgrt.devices.identity import KINDS, DeviceSpec, format_device, kind_of, split_device
from hgrt.errors import DeviceError, did_you_mean

DEFAULT_CUDA_ARCH = os.environ.get("HGRT_CUDA_ARCH", "sm_80")


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
