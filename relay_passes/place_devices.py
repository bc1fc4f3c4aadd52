"""place_devices: give every op binding of ``main`` a device (a position in the device list).

The most specific setting wins:
  1. ``R.hint_on_device(x, dev)`` in the input pins the op that produces ``x`` (or input ``x``);
     so does a vdevice already in the type of a binding or input;
  2. per-node overrides: ``{"lv12": "cpu:1"}`` by binding name;
  3. per-op rules: ``{"nn.conv2d": "cuda"}``; keys are Relax op names with or without the
     ``relax.`` prefix, or fnmatch patterns (``"nn.*"``); an exact name beats a pattern, and
     patterns are tried in the order given; a pattern passes over an op its device cannot
     compile (``gpu_refusals``), an exact name does not;
  4. the preferred device, unless its target cannot compile the op;
  5. the fallback device, or where it cannot compile the op the first device that can;
  with ``auto=True``, 4 and 5 give way to the cheapest plan of the whole model, copies counted
  (auto_place.py, auto_plan.py); the build log says which plans were compared.

The pass does not change the IR: it writes ``ctx.placed`` (``op_device``: binding name → device
index, ``input_device``: hinted inputs, ``report``) and attaches the module's vdevice list.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import DeviceSpec, link_of, resolve_device
from hgrt.errors import BuildError, did_you_mean
from hgrt.relay_passes.inner.auto_place import auto_place, describe_links, read_rates
from hgrt.relay_passes.util.context import BuildContext, PlacementRow
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import (
    CALL_TIR,
    HINT_ON_DEVICE,
    TO_VDEVICE,
    bindings,
    hinted_device,
    match_op_rule,
    no_gpu_schedule,
    op_name,
)

_GPU_SORT = ("TVM's GPU sort (topi.gpu) does not legalize in a build whose first device is a "
             "CPU: it reads max_num_threads from the CPU target")
# ops whose legalization a GPU target cannot schedule or run, and why (tried with TVM 0.27 and
# the dlight default schedule of schedule_gpu)
GPU_UNSUPPORTED_OPS: dict[str, str] = {
    "relax.nonzero": "data-dependent output shape",
    "relax.unique": "data-dependent output shape",
    "relax.print": "host-only op",
    "relax.assert_op": "host-only op",
    "relax.topk": _GPU_SORT,
    "relax.sort": _GPU_SORT,
    "relax.argsort": _GPU_SORT,
    "relax.cumsum": "TVM's GPU scan reshapes with vm.builtin.reshape, which only the Relax VM "
                    "runs (no graph-executor form)",
    "relax.scatter_elements": "dlight leaves topi.gpu.scatter_elements unscheduled",
}


@dataclass
class Placement:
    """Where ops go. Devices are named as in the build's device list ("cpu", "cuda:0", ...).

    >>> Placement(rules={"nn.conv2d": "cuda", "nn.*pool*": "cuda"}, fallback="cpu")
    ... # doctest: +SKIP
    """

    rules: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    preferred: Any = None
    fallback: Any = None
    auto: bool = False  # ops no hint/override/rule places go where they cost least (auto_place)
    budgets: dict[str, int] = field(default_factory=dict)  # auto: weight bytes per device
    profile: str | None = None  # auto: rates measured by `hgrt profile DIR --json FILE`

    def __post_init__(self) -> None:
        for name in ("rules", "overrides", "budgets"):
            value = getattr(self, name)
            if value is None:  # as none given
                object.__setattr__(self, name, {})
            elif not isinstance(value, Mapping):
                raise BuildError(f"Placement.{name} must be a dict ({_FIELD_HELP[name]}), got "
                                 f"{type(value).__name__} {value!r:.80}")
        for dev, nbytes in self.budgets.items():
            if not isinstance(nbytes, (int, float, np.number)) or isinstance(nbytes, bool) \
                    or not 0 <= nbytes < float("inf"):
                raise BuildError(f"Placement.budgets[{dev!r}] must be bytes (a number >= 0), "
                                 f"got {nbytes!r}")
        if self.auto not in (True, False):  # 0 and 1 too
            raise BuildError(f"Placement.auto must be True or False, got {self.auto!r}")
        if self.profile is not None and not isinstance(self.profile, (str, os.PathLike)):
            raise BuildError(f"Placement.profile must be a path (what `hgrt profile DIR --json "
                             f"FILE` writes), got {type(self.profile).__name__}")

    @classmethod
    def of(cls, value: Any) -> Placement:
        """``value`` as a Placement: one, None (everything on the first device) or a dict of
        its fields (``{"rules": {"nn.conv2d": "cpu:1"}}``, as a JSON file would hold it)."""
        known = [f.name for f in fields(cls)]
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in known]
            if unknown:
                raise BuildError(f"placement field {did_you_mean(unknown[0], known)}")
            return cls(**value)
        raise BuildError(f"placement must be an hgrt.Placement or a dict of its fields {known}, "
                         f"got {type(value).__name__} {value!r:.80}")


_FIELD_HELP = {"rules": "op name or pattern -> device, e.g. {'nn.conv2d': 'cpu:1'}",
               "overrides": "binding name -> device, as print_placement() lists them",
               "budgets": "device -> bytes of weights it may hold"}


def op_bindings(mod: tvm.IRModule) -> Iterator[tuple[str, str]]:
    """(binding name, op name) of every op call in ``main``, in order: what overrides can name."""
    for binding in bindings(mod["main"]):
        op = op_name(binding.value)
        if op is not None and op not in (HINT_ON_DEVICE, TO_VDEVICE):
            yield binding.var.name, op


def _annotated_device(var: relax.Var, ctx: BuildContext) -> int | None:
    """A vdevice already in the input's types counts as a hint (a Relax module that says where
    its tensors live, e.g. around its own R.to_vdevice)."""
    vdev = getattr(var.ty, "vdevice", None)
    return None if vdev is None else ctx.device_of_vdevice(vdev)


def gpu_refusals(mod: tvm.IRModule) -> dict[str, str]:
    """binding name -> why no GPU device can compile its op: a Relax op of
    ``GPU_UNSUPPORTED_OPS``, or a call_tir of a PrimFunc that says so (``NO_GPU_SCHEDULE_ATTR``,
    e.g. the importer's recurrent kernels)."""
    out = {}
    for b in bindings(mod["main"]):
        op = op_name(b.value)
        why = GPU_UNSUPPORTED_OPS.get(op or "")
        if op == CALL_TIR and isinstance(b.value.args[0], relax.GlobalVar):
            why = no_gpu_schedule(mod[b.value.args[0]])
        if why is not None:
            out[b.var.name] = why
    return out


def _compiles_on(name: str, device: DeviceSpec, refused: dict[str, str]) -> str | None:
    """None if ``device`` can run the op bound to ``name``, else why not."""
    return refused.get(name) if device.is_gpu else None


def _check_rules(rules: dict[str, int], model_ops: list[str]) -> None:
    """A rule key must name a Relax op (``nn.conv2d``) or be a pattern (``nn.*pool*``): one that
    is neither (``Conv``, ``conv2d``, a typo) placed nothing without a word. A rule for an op
    this model lacks is fine (one placement serves many models)."""
    known = [str(n) for n in tvm.ir.Op.list_op_names() if str(n).startswith("relax.")]
    names = {n.removeprefix("relax.") for n in known} | set(known)
    for key in rules:
        if key in names or any(c in key for c in "*?["):
            continue
        ops_here = sorted({op.removeprefix("relax.") for op in model_ops})
        close = difflib.get_close_matches(key, sorted(set(ops_here) | names), n=3)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise BuildError(f"placement rule {key!r} names no Relax op{hint}; rules name ops as "
                         f"Relax does (nn.conv2d, or a pattern nn.*pool*); this model's ops: "
                         f"{ops_here[:30]}")


def _fallback(name: str, devs: list[DeviceSpec], fallback: int, preferred: int | None,
              refused: dict[str, str]) -> tuple[int, str]:
    """The fallback device, or the first device that can compile the op bound to ``name``
    where it cannot."""
    asked = preferred if preferred is not None else fallback
    why = _compiles_on(name, devs[asked], refused)
    if why is None:
        return fallback, "fallback"
    able = [fallback] + [d.index for d in devs if d.index != fallback]
    dev = next((d for d in able if _compiles_on(name, devs[d], refused) is None), fallback)
    return dev, f"fallback ({devs[asked].name}: {why})"


def _auto(func: relax.Function, ctx: BuildContext, fixed: dict[str, int],
          refused: dict[str, str]) -> dict:
    """auto_place with the budgets, profile and links of this build, its comparison logged."""
    p, devs = ctx.placement, ctx.devices
    budgets = {resolve_device(k, devs, "budget"): int(v) for k, v in p.budgets.items()}
    profile_links = read_rates(p.profile, "links")
    links = {d.index: link_of(d.name, profile_links) for d in devs
             if d.is_gpu or d.name in profile_links}
    ctx.log(describe_links(devs, links))
    return auto_place(func, devs, fixed, ctx.weights.values, budgets,
                      lambda name, dev: _compiles_on(name, dev, refused) is None,
                      read_rates(p.profile), links, ctx.log)


@contract(reads={"devices", "placement", "weights"}, writes={"placed"})  # weights: auto's sizes
def place_devices(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Fill ``ctx.placed``; return ``mod`` with the vdevice list attached."""
    p = ctx.placement
    devs = ctx.devices
    rules = {k: resolve_device(v, devs, f"rule {k!r}") for k, v in (p.rules or {}).items()}
    _check_rules(rules, [op for _, op in op_bindings(mod)])
    overrides = {k: resolve_device(v, devs, f"override {k!r}")
                 for k, v in (p.overrides or {}).items()}
    preferred = None if p.preferred is None else resolve_device(p.preferred, devs, "preferred")
    fallback = 0 if p.fallback is None else resolve_device(p.fallback, devs, "fallback")

    func = mod["main"]
    producer: dict[str, str] = {}  # var name -> name of the op binding that produced it
    hinted: dict[str, int] = {}
    names: set[str] = set()
    for b in bindings(func):
        if b.var.name in names:
            raise BuildError(f"binding name {b.var.name!r} appears twice in main; hgrt needs "
                             f"unique names to place nodes")
        names.add(b.var.name)
        value = b.value
        if isinstance(value, relax.Var):
            producer[b.var.name] = producer.get(value.name, value.name)
        elif op_name(value) == HINT_ON_DEVICE:
            src = value.args[0]
            target = hinted_device(value, devs)
            if isinstance(src, relax.Var):
                hinted[producer.get(src.name, src.name)] = target
        elif op_name(value) is not None:
            producer[b.var.name] = b.var.name
            annotated = _annotated_device(b.var, ctx)
            if annotated is not None and op_name(value) != TO_VDEVICE:
                hinted.setdefault(b.var.name, annotated)

    for param in func.params:
        annotated = _annotated_device(param, ctx)
        if annotated is not None:
            hinted.setdefault(param.name, annotated)
    param_names = {v.name for v in func.params}
    placed = ctx.placed
    placed.input_device = {n: d for n, d in hinted.items() if n in param_names}
    missing = sorted(set(overrides) - names)
    if missing:
        raise BuildError(f"placement overrides name bindings that main does not have: {missing}; "
                         f"known: {sorted(names)[:20]}")

    placed.op_device.clear()
    placed.report.clear()
    refused = gpu_refusals(mod)
    explicit = {}
    for name, op in op_bindings(mod):
        if name in hinted:
            explicit[name] = hinted[name], "hint"
        elif name in overrides:
            explicit[name] = overrides[name], "override"
        elif (rule := match_op_rule(op, rules)) is not None:
            exact = rule in (op, op.removeprefix("relax."))
            explicit[name] = (rules[rule], f"rule {rule!r}") if exact or _compiles_on(
                name, devs[rules[rule]], refused) is None else _fallback(
                name, devs, fallback, rules[rule], refused)
    if p.auto:
        explicit |= _auto(func, ctx, {**placed.input_device,
                                      **{k: d for k, (d, _) in explicit.items()}}, refused)
    for name, op in op_bindings(mod):
        if name in explicit:
            dev, why = explicit[name]
        elif preferred is not None and _compiles_on(name, devs[preferred], refused) is None:
            dev, why = preferred, "preferred"
        else:
            dev, why = _fallback(name, devs, fallback, preferred, refused)
        placed.op_device[name] = dev
        placed.report.append(PlacementRow(name, op, devs[dev].name, why))
    ctx.log(f"placed {len(placed.op_device)} ops: " + ", ".join(
        f"{d.name}={sum(1 for v in placed.op_device.values() if v == d.index)}" for d in devs))
    mod = mod.clone()
    mod.update_global_info("vdevice", [d.vdevice() for d in devs])
    return mod
