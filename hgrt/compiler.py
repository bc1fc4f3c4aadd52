"""``hgrt.build``: a model and a device list → graph JSON + one library + params.

>>> import hgrt
>>> res = hgrt.build("model.onnx", ["cpu:0", "cpu:1"],
...                  hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))  # doctest: +SKIP
>>> m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0), tvm.cpu(1)])  # doctest: +SKIP
>>> m.load_params(res.params)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm

from hgrt import providers
from hgrt.devices import DEFAULT_CUDA_ARCH, parse_devices
from hgrt.frontend import import_model
from hgrt.graph import Graph
from hgrt.importer import recurrent
from hgrt.lifetimes import DeviceMemory, memory_report
from hgrt.relay_passes.apply_tuning import apply_tuning
from hgrt.relay_passes.assign_targets import assign_targets
from hgrt.relay_passes.build_library import build_library
from hgrt.relay_passes.fold_batch_norm import fold_batch_norm
from hgrt.relay_passes.graph.assign_streams import assign_streams, check_stream_options
from hgrt.relay_passes.graph.concat_views import concat_views
from hgrt.relay_passes.graph.plan_memory import plan_memory
from hgrt.relay_passes.graph_codegen import graph_codegen, static_shape
from hgrt.relay_passes.inner.tuning_db import ApplyReport
from hgrt.relay_passes.insert_copies import insert_copies
from hgrt.relay_passes.legalize_and_fuse import legalize_and_fuse
from hgrt.relay_passes.place_devices import Placement, place_devices
from hgrt.relay_passes.schedule_cpu import schedule_cpu
from hgrt.relay_passes.schedule_gpu import schedule_gpu
from hgrt.relay_passes.split_concat import split_concat
from hgrt.relay_passes.util.context import BuildContext, LoweringOptions, PlacementRow, Weights
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.pipeline import Pass, check_order, located, run_passes

__all__ = ["BuildResult", "Kernels", "Placement", "build", "lower_model"]

def passes() -> tuple[tuple[str, Pass], ...]:
    """The build's passes, in order, with the passes of each registered kernel provider at its
    slots (``hgrt.providers.SLOTS``)."""
    return (
        ("place_devices", place_devices),
        ("insert_copies", insert_copies),
        ("split_concat", split_concat),
        # each kernel provider's claim passes, in registration order (lower_model's default
        # kernels="tvm" leaves all to TVM)
        *(p for provider in providers.registered() for p in provider.compile_passes("claim")),
        ("fold_batch_norm", fold_batch_norm),
        *(p for provider in providers.registered() for p in provider.compile_passes("tail")),
        ("legalize_and_fuse", legalize_and_fuse),
        ("assign_targets", assign_targets),  # lower_model stops here unscheduled: what is tuned
        ("apply_tuning", apply_tuning),
        ("schedule_cpu", schedule_cpu),
        ("schedule_gpu", schedule_gpu),  # lower_model(schedule=True) stops here
        ("build_library", build_library),
        ("graph_codegen", graph_codegen),
        ("concat_views", concat_views),  # concats whose pieces are written in place: views
        ("assign_streams", assign_streams),
        ("plan_memory", plan_memory),
    )


PASSES = passes()  # the passes of the providers registered when hgrt is imported
_PASSES_OF = providers.registered()
check_order(PASSES)  # each pass's contract says which passes it needs before it


def _passes() -> tuple[tuple[str, Pass], ...]:
    """``PASSES``, or anew where a provider was registered or removed since."""
    return PASSES if providers.registered() == _PASSES_OF else passes()


@dataclass
class BuildResult:
    """What ``build`` returns: run it with ``hgrt.create(graph_json, lib, devices)``."""

    graph_json: str
    graph: Graph  # what graph_json says, parsed
    lib: tvm.runtime.Module
    params: dict[str, np.ndarray]
    devices: list[str]
    placement_report: list[PlacementRow] = field(default_factory=list)
    memory_report: list[DeviceMemory] = field(default_factory=list)
    targets: dict[str, str] = field(default_factory=dict)  # device name -> TVM target it got
    tuning: ApplyReport | None = None  # kernels tuned / fallen back (tuning_db given)

    def print_placement(self) -> str:
        """The placement report as a table (also what ``verbose=True`` prints)."""
        rows = [("node", "op", "device", "kernels", "reason", "kernels_why")]
        rows += [(r.node, r.op, r.device, r.kernels, r.reason, r.kernels_why)
                 for r in self.placement_report]
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                         for r in rows)


def _context(model: Any, devices: Any, placement: Placement | None, params: Any,
             input_shapes: Any, cuda_arch: str, verbose: bool, targets: Any = None
             ) -> tuple[tvm.IRModule, BuildContext]:
    devs = parse_devices(devices, cuda_arch, targets)  # the one parse of the device list
    ctx = BuildContext(devices=devs, placement=Placement.of(placement), verbose=verbose)
    for d in devs:
        ctx.log(f"device {d.name}: target {d.target}")
    with located("'import_model' failed"):
        mod, weights = import_model(model, params, input_shapes)
    # the recurrent kernels' unroll for the CPUs of the build (a Relax module handed in too)
    mod = recurrent.for_targets(mod, [d.target for d in devs if not d.is_gpu])
    main = mod["main"]
    for p in main.params:
        static_shape(p.ty, f"input {p.name!r}")
    ctx.weights = Weights(dict(weights), inputs=frozenset(
        p.name for p in main.params[:int(main.attrs["num_input"])]))
    return mod, ctx


def build(model: Any, devices: Any, placement: Placement | None = None,
          params: dict[str, Any] | None = None, *, input_shapes: dict[str, Any] | None = None,
          tuning_db: str | None = None, tuning_verdicts: bool = True,
          streams: dict[str, Any] | None = None, kernels: str | Kernels = "auto",
          target: Any = None,
          cuda_arch: str = DEFAULT_CUDA_ARCH, verbose: bool = False) -> BuildResult:
    """Compile ``model`` (ONNX ModelProto / path, Relax IRModule + ``params``, or a
    ``tvm.relax.frontend.nn.Module`` with ``input_shapes`` for its ``forward``'s arguments and
    its weights in ``params`` or its ``Parameter.data``) for ``devices``.

    ``devices``: names (``"cpu"``, ``"cpu:1"``, ``"cuda"``) or TVM targets; position i is
    ``device_index`` i of the graph and must match the i-th device given to ``hgrt.create``.
    A CPU named by kind gets this host's target (its mcpu and core count, see
    ``BuildResult.targets``); give a ``tvm.target.Target`` to build for another CPU.
    ``target``: the target of the devices named by kind, for another machine than this one:
    ``{"cpu": "raspberry-pi/4b-aarch64"}`` (a TVM tag, JSON or dict target, or a ``Target``;
    see ``hgrt.devices.kind_targets``); save the result with ``hgrt.save`` (cross-linked).
    ``placement`` says which op runs where (default: everything on ``devices[0]``).
    ``tuning_db``: a directory written by ``hgrt tune``; kernels found there get their tuned
    schedule (``BuildResult.tuning`` says which), the others the default schedule, as do
    tuned kernels that ``hgrt tune`` found slower inside the model (``tuning_verdicts=False``
    applies them anyway).
    ``streams``: ``{"per_device": n}`` streams per device for independent branches (default
    1; fewer where they would grow a device's pool over 1.10x the sequential plan's, unless
    ``"memory_slack": None``), ``{"single_stream": True}`` for none (everything in node order).
    ``kernels``: who computes each op: a registered kernel provider (``hgrt.providers.names()``;
    ``"onednn"`` computes convolutions and dense layers on x86-64 CPUs with the ``onednn`` extra,
    a BuildError without it), ``"tvm"``, or ``"auto"``: each provider where it is installed and
    pays (oneDNN: unless the model is too small to pay for its per-call cost, then per op where
    what it saves pays for the switches between its threads and TVM's, see docs/kernels.md; the
    placement report's ``kernels`` column says who got each op);
    or per op, like a device: ``hgrt.Kernels("onednn", rules={"matmul": "tvm"},
    overrides={"lv12": "tvm"})`` (an override names a conv2d or matmul binding as
    ``print_placement()`` lists it).
    """
    start = time.perf_counter()
    stream_options = check_stream_options(streams)
    mod, ctx = _context(model, devices, placement, params, input_shapes, cuda_arch, verbose,
                        target)
    ctx.options = LoweringOptions(tuning_db, tuning_verdicts, kernels)
    ctx.streams = stream_options
    graph_json = run_passes(mod, ctx, _passes()).to_json()
    graph = Graph.from_json(graph_json)  # the runtime's own validation, before anyone ships it
    if verbose:
        ctx.log(f"built in {time.perf_counter() - start:.1f} s")
    w = ctx.weights
    return BuildResult(graph_json=graph_json, graph=graph, lib=ctx.lowered.lib,
                       params={name: w.values[src] for name, src in w.source.items()},
                       devices=[d.name for d in ctx.devices], tuning=ctx.lowered.tuning,
                       placement_report=list(ctx.placed.report), memory_report=memory_report(graph),
                       targets={d.name: str(d.target) for d in ctx.devices})


def lower_model(model: Any, devices: Any = "cpu", placement: Placement | None = None,
                params: dict[str, Any] | None = None, *,
                input_shapes: dict[str, Any] | None = None, schedule: bool = False,
                tuning_db: str | None = None, kernels: str | Kernels = "tvm",
                cuda_arch: str = DEFAULT_CUDA_ARCH,
                verbose: bool = False) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """The placed, fused module of ``build`` before its library is built, and its weights by
    ``main`` parameter name.

    Unscheduled (the default) it is what ``hgrt tune`` tunes (given tune's ``kernels``): each
    PrimFunc carries the ``target`` of its device, so the structural hashes and targets of its
    kernels are the ones ``build(..., tuning_db=)`` looks up. With ``schedule=True`` the
    kernels are the ones ``build`` compiles (tuned from ``tuning_db``, else default), e.g. to
    hand to the Relax VM.
    ``kernels``: as ``build``'s; the default ``"tvm"`` leaves every op to TVM kernels (the Relax
    VM runs no provider's kernel), ``"auto"`` or a provider leave out the ops it computes.
    """
    mod, ctx = _context(model, devices, placement, params, input_shapes, cuda_arch, verbose)
    ctx.options = LoweringOptions(tuning_db, kernels=kernels)
    last = "schedule_gpu" if schedule else "assign_targets"
    order = _passes()
    mod = run_passes(mod, ctx, order[:[n for n, _ in order].index(last) + 1])
    w = ctx.weights
    return mod, {var: w.values[w.source[name]]
                 for var, name in w.graph_names.items() if name in w.source}
