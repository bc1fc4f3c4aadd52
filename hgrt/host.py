"""``hgrt.Host``: physical devices with a memory budget each, onto which models are provisioned.

A compiled graph names LOGICAL devices: its ``device_index`` positions, built for the kinds in
``graph.device_names``. ``Host.add`` maps each onto a physical device of that kind with room for
its weights and activations (largest need first, onto the device with the most free memory, as
Glow's provisioner does), allocates the pools, streams the weights from ``params.bin`` one
tensor at a time, and undoes all of it when any step fails.

>>> host = hgrt.Host(["cpu:0", "cpu:1"], budgets=512 << 20)   # doctest: +SKIP
>>> m = host.add("resnet", "out/")                              # doctest: +SKIP
>>> host                                                        # doctest: +SKIP
Host(cpu:0 403.1 of 512.0 MiB free, cpu:1 512.0 of 512.0 MiB free; resnet on ['cpu:0'])
>>> host.remove("resnet")                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Mapping
from typing import Any

import tvm

from hgrt import artifacts, providers
from hgrt import devices as hdev
from hgrt.api import create_loaded, devices_for
from hgrt.errors import DeviceError, ProvisionError, did_you_mean
from hgrt.graph import Graph
from hgrt.lifetimes import memory_report
from hgrt.runtime.module_api import GraphModuleAPI

try:
    import psutil
except ImportError:  # the test extra installs it; /proc/meminfo serves without
    psutil = None

MIB = 1 << 20


@dataclasses.dataclass
class Budget:
    """One physical device of a host: its memory budget and the bytes its models hold."""

    device: tvm.runtime.Device
    total: int
    used: int = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def name(self) -> str:
        return hdev.device_name(self.device)

    def __str__(self) -> str:
        return f"{self.name} {_mib(self.free)} of {_mib(self.total)} MiB free"


def _provider_notes(graph: Graph, device: int) -> str:
    """What the kernel providers say of a logical device's weights (``device_note``: oneDNN's
    Winograd convolutions take 4x the bytes of direct ones), where they say anything."""
    return "".join(p.device_note(graph, device) for p in providers.registered()
                   if p.device_note is not None)


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f}"


def available_memory(device: tvm.runtime.Device) -> int:
    """Free bytes of ``device``: what it reports (CUDA and other GPUs), else for a CPU of this
    machine the available RAM. Every local CPU answers with the same RAM: give budgets to
    split it between ``cpu:0``, ``cpu:1``, ..."""
    free = device.available_global_memory
    if free:
        return int(free)
    if hdev.is_cpu(device) and not hdev.is_remote(device):
        if psutil is not None:
            return int(psutil.virtual_memory().available)
        with contextlib.suppress(OSError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise DeviceError(f"{hdev.device_name(device)} does not report its free memory: give the "
                      f"Host a budget for it")


def _budget_list(budgets: Any, devs: list) -> list[int | None]:
    """``budgets`` (None, bytes for all, a list, or a dict by device name) -> one per device."""
    if budgets is None or isinstance(budgets, (int, float)):
        return [None if budgets is None else int(budgets)] * len(devs)
    if isinstance(budgets, Mapping):
        names = [hdev.canonical_name(d) for d in devs]
        out: list[int | None] = [None] * len(devs)
        for key, nbytes in budgets.items():
            name = hdev.canonical_name(key)
            if name not in names:
                raise DeviceError(f"budget for device {did_you_mean(key, names)}")
            out[names.index(name)] = int(nbytes)
        return out
    out = list(budgets)
    if len(out) != len(devs):
        raise DeviceError(f"{len(out)} budgets for {len(devs)} devices: give one per device")
    return out


class Host:
    """Physical devices, of this machine or of one RPC ``session``, with a memory budget each.

    ``budgets``: bytes for every device, a list (one per device) or a dict by name
    (``{"cpu:1": 256 << 20}``); a device without one gets what it reports free
    (``available_memory``). Models are added by name and keep their share of the budgets
    until ``remove``.
    """

    def __init__(self, devices: Any, budgets: Any = None, *, session: Any = None):
        devs = devices_for(None, devices, session)
        remote = {hdev.is_remote(d) for d in devs}
        names = [hdev.device_name(d) for d in devs]
        if len(remote) > 1 or len(set(names)) < len(names):
            raise DeviceError(f"a Host holds distinct devices, all local or all of one RPC "
                              f"session: got {names}")
        self.remote = remote.pop()
        self._devices = [Budget(d, available_memory(d) if b is None else b)
                         for d, b in zip(devs, _budget_list(budgets, devs), strict=True)]
        self._models: dict[str, tuple[GraphModuleAPI, dict[int, int]]] = {}

    def budgets(self) -> dict[str, Budget]:
        """Each device's budget, used and free bytes (copies), by device name."""
        return {b.name: dataclasses.replace(b) for b in self._devices}

    def __repr__(self) -> str:
        models = "; ".join(f"{n} on {[self._devices[p].name for p in r]}"
                           for n, (_, r) in self._models.items())
        return f"Host({', '.join(map(str, self._devices))}{'; ' + models if models else ''})"

    def add(self, name: str, artifacts_or_build: Any) -> GraphModuleAPI:
        """Provision a model (an artifact directory, or a build result) as ``name``: each logical
        device onto a physical one of its kind that fits it, pools allocated, weights streamed
        one tensor at a time. Returns the module. Nothing fits: a ``ProvisionError`` naming the
        device, what the model needs there and what it has. Any failure frees all that was
        allocated for the model, on every device, before it is raised."""
        if name in self._models:
            raise ProvisionError(f"a model named {name!r} is already on this host (models: "
                                 f"{list(self._models)}): remove it first or pick another name")
        graph, lib, params = self._source(artifacts_or_build)
        mapping, needs = self._map(name, graph)
        reserved = {p: sum(needs[i]) for i, p in enumerate(mapping)}
        for p, nbytes in reserved.items():
            self._devices[p].used += nbytes
        try:
            module = create_loaded(graph, lib, [self._devices[p].device for p in mapping], params)
        except BaseException as e:
            for p, nbytes in reserved.items():
                self._devices[p].used -= nbytes
            traceback.clear_frames(e.__traceback__)  # their locals would keep pools alive
            raise
        self._models[name] = (module, reserved)
        return module

    def remove(self, name: str) -> None:
        """Close the model ``name`` (its device memory is freed) and give its bytes back."""
        if name not in self._models:
            raise ProvisionError(f"remove: model {did_you_mean(name, list(self._models))}")
        module, reserved = self._models.pop(name)
        try:
            module.close()
        except BaseException:  # still alive on its server: kept, and remove() may retry
            self._models[name] = (module, reserved)
            raise
        for p, nbytes in reserved.items():
            self._devices[p].used -= nbytes

    def _source(self, art: Any) -> tuple[Graph, Any, Any]:
        """(graph, library, params source) of an artifact directory (the library as a path: a
        remote host uploads it, never loading it here) or a build result."""
        if isinstance(art, (str, os.PathLike)):
            found = artifacts.paths(os.fspath(art))
            graph = Graph.from_json(artifacts.read_graph_text(found[artifacts.GRAPH_FILE]))
            # a path: create() loads it here once the graph's CPU needs are checked
            return graph, found[artifacts.LIB_FILE], found[artifacts.PARAMS_FILE]
        if hasattr(art, "graph_json") and hasattr(art, "lib"):
            graph = getattr(art, "graph", None) or Graph.from_json(art.graph_json)
            return graph, art.lib, art.params or {}
        raise ProvisionError(f"add: expected an artifact directory or a build result, got "
                             f"{type(art).__name__}")

    def _map(self, name: str, graph: Graph) -> tuple[list[int], list[tuple[int, int]]]:
        """Logical device -> position of a free physical device of its kind that fits it, and
        the (weights, activations) bytes of each logical device."""
        report = memory_report(graph)
        n = max(len(report), len(graph.device_names or ()))
        needs = [(m.weight_bytes, m.planned_bytes - m.weight_bytes) for m in report]
        needs += [(0, 0)] * (n - len(report))
        built = graph.device_names or ["cpu"] * n  # no record: built for CPUs, as create assumes
        mapping: dict[int, int] = {}
        # Largest first: a device that fits a larger need fits every smaller one, so when this
        # order finds no room, no mapping exists.
        for i in sorted(range(n), key=lambda i: -sum(needs[i])):
            kind = hdev.split_device(built[i])[0]
            free = [p for p, b in enumerate(self._devices)
                    if p not in mapping.values() and hdev.kind_of(b.device).name == kind]
            what = f"model {name!r}: logical device {i} (built for {built[i]})"
            if not free:
                raise ProvisionError(f"{what} needs a {kind} device of its own; this host has "
                                     f"{[b.name for b in self._devices]}, {len(mapping)} taken "
                                     f"by the model's other logical devices")
            best = self._devices[max(free, key=lambda p: self._devices[p].free)]
            weights, activations = needs[i]
            if weights + activations > best.free:
                raise ProvisionError(
                    f"{what} needs {_mib(weights + activations)} MiB on {best.name}: "
                    f"{_mib(weights)} weights + {_mib(activations)} activations; "
                    f"{_mib(best.free)} MiB free (the most of any free {kind} device; {self})"
                    + _provider_notes(graph, i))
            mapping[i] = self._devices.index(best)
        return [mapping[i] for i in range(n)], needs
