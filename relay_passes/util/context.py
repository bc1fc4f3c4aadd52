"""What the passes share: the build's devices (``hgrt.devices.DeviceSpec``) and a context of
small groups, each written by one pass (or the caller) and read by the passes after it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import DeviceSpec, format_device
from hgrt.errors import BuildError

_log = logging.getLogger("hgrt.build")


@dataclass
class PlacementRow:
    """One line of the placement report."""

    node: str
    op: str
    device: str
    reason: str
    kernels: str = "tvm"  # who computes it: "tvm", or the provider whose claim pass took it
    # why ``kernels`` computes it, "<kind>: <detail>" (a provider's claim pass writes it for the
    # ops it could take; ``util.reasons`` says why for the rest); the graph's ``provider_why``
    kernels_why: str = ""


@dataclass
class Placed:
    """Written by place_devices, read by insert_copies; ``report`` goes to the BuildResult."""

    op_device: dict[str, int] = field(default_factory=dict)  # binding name -> device index
    input_device: dict[str, int] = field(default_factory=dict)  # hinted inputs -> device index
    report: list[PlacementRow] = field(default_factory=list)
    # a binding a later pass bound an op to that has no row of its own (a claimed chain's call
    # bound to a batch norm's item) -> the node of the row that speaks for it
    row_of: dict[str, str] = field(default_factory=dict)

    def say_why(self, names: set[str], why: str, kernels: str | None = None) -> None:
        """The rows of the bindings ``names`` say ``why`` their provider computes them (and
        that ``kernels`` does, when given): a claim pass's record of its decision."""
        for row in self.report:
            if row.node in names:
                row.kernels_why = why
                if kernels is not None:
                    row.kernels = kernels


@dataclass
class Weights:
    """``values`` from the model (by main param name); insert_copies fills ``source`` and
    ``graph_names``; the providers' claim passes and fold_batch_norm add weights of their own
    (``new_param``) and remove those they replaced; graph_codegen adds the inline constants to all
    three."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # graph param -> weight it holds
    graph_names: dict[str, str] = field(default_factory=dict)  # main param -> graph node name
    inputs: frozenset[str] = frozenset()  # the user inputs' graph names: no weight takes one

    def free_name(self, pname: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
        """``pname``, or it with ``_`` appended until no weight, input (nor ``taken``) has the
        name: a graph name for a new weight that replaces none."""
        while pname in self.source or pname in self.inputs or pname in taken:
            pname += "_"
        return pname

    def new_param(self, pname: str, value: np.ndarray, vdevice: relax.VDevice | None,
                  taken: set[str],
                  origin: str) -> relax.Var:
        """A new parameter of ``main`` holding ``value``, made by a pass (``origin``), under
        the graph name ``pname`` (a weight of that name is replaced: its value is no longer
        the model's); ``taken``: the names ``main`` already uses, the new one added."""
        rname = param_identifier(pname, {**self.graph_names, **dict.fromkeys(taken)})
        taken.add(rname)
        self.graph_names[rname] = pname
        self.source[pname] = key = f"{pname} ({origin})"  # a value of its own
        self.values[key] = value
        return relax.Var(rname, relax.TensorType(value.shape, str(value.dtype), vdevice))

    def kept_params(self, func: relax.Function, body: relax.SeqExpr,
                    replaced: set[relax.Var]) -> list[relax.Var]:
        """``func``'s parameters for its new ``body``: the inputs, and every weight but those of
        ``replaced`` that ``body`` no longer reads (those leave the weights too)."""
        used = set(relax.analysis.free_vars(body))
        n_in = int(func.attrs["num_input"])
        params = list(func.params[:n_in])
        for p in func.params[n_in:]:
            if p in used or p not in replaced:
                params.append(p)
            else:
                self.source.pop(self.graph_names.pop(p.name, p.name), None)
        return params


def param_identifier(name: str, taken: dict[str, str]) -> str:
    """A C identifier for a param name ("1", "w@cpu:1"): TVM names kernel arguments after it."""
    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit():
        ident = f"p_{ident}"
    base, k = ident, 1
    while ident in taken:
        ident, k = f"{base}_{k}", k + 1
    return ident


@dataclass
class LoweringOptions:
    """Written by the caller, read by apply_tuning and the kernel providers' claim passes."""

    tuning_db: str | None = None  # MetaSchedule database applied before the default schedules
    tuning_verdicts: bool = True  # honour `hgrt tune`'s "default faster in the model"
    # who computes each op, read by the providers' claim passes: "auto", "tvm", a provider's
    # name, or a util.kernels.Kernels (that module imports this one)
    kernels: Any = "tvm"


@dataclass
class Lowered:
    """Written by legalize_and_fuse, apply_tuning, schedule_cpu, build_library. (The reports'
    classes live in the modules of those passes, which import this one.)"""

    tuning: Any = None  # tuning_db.ApplyReport
    cpu_schedule: Any = None  # schedule_cpu.ScheduleReport
    lib: tvm.runtime.Module | None = None
    # legalize_and_fuse: per kernel binding of the lowered main (keyed by its variable: names
    # repeat after FuseOps), the graph node attrs that say why it runs where and by whom
    # (``util.reasons``); graph_codegen adds them to the node
    why: dict[Any, dict[str, str]] = field(default_factory=dict)
    # legalize_and_fuse: the kernel bindings that only copy one aligned range of their input,
    # with its byte offset (``inner.slice_views``); graph_codegen writes them as ``__slice``
    slices: dict[Any, int] = field(default_factory=dict)


@dataclass
class BuildContext:
    """The build's devices and placement, and the groups above that passes hand each other."""

    devices: list[DeviceSpec]
    placement: Any = None  # place_devices.Placement (that module imports this one)
    verbose: bool = False
    placed: Placed = field(default_factory=Placed)
    weights: Weights = field(default_factory=Weights)
    options: LoweringOptions = field(default_factory=LoweringOptions)
    lowered: Lowered = field(default_factory=Lowered)
    streams: dict[str, Any] = field(default_factory=dict)  # assign_streams' options (caller)

    def device_of_vdevice(self, vdev: relax.VDevice | None) -> int | None:
        if vdev is None:
            return None
        key = (vdev.target.kind.name, int(vdev.vdevice_id))  # VDevice == recurses in TVM 0.27
        for d in self.devices:
            if (d.target.kind.name, d.device_id) == key:
                return d.index
        # a VDevice built by the frontend with another id: fall back to the kind alone
        kinds = [d.index for d in self.devices if d.target.kind.name == key[0]]
        if len(kinds) > 1:  # which of them is meant cannot be told
            kind = self.devices[kinds[0]].kind
            missing = format_device(kind, key[1])
            raise BuildError(f"the module places tensors on vdevice {key[0]}:{key[1]} (in its "
                             f"types or an R.to_vdevice), but the build has no {missing} "
                             f"(its {kind} devices: {[self.devices[i].name for i in kinds]}): "
                             f"add it to the device list")
        return kinds[0] if kinds else None

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"[hgrt.build] {msg}", flush=True)
        else:
            _log.debug(msg)
