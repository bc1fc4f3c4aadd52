"""Readers of Relax and TIR IR that the passes share: bindings, op names, operands, PrimFuncs."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from hgrt.devices import DeviceSpec, resolve_dl_device
from hgrt.relay_passes.util.context import BuildContext

CALL_TIR = "relax.call_tir"
CALL_DPS_PACKED = "relax.call_dps_packed"  # a kernel that is a global function (claim_onednn)
TO_VDEVICE = "relax.to_vdevice"
HINT_ON_DEVICE = "relax.hint_on_device"
SCHEDULED_ATTR = "tirx.is_scheduled"
# a PrimFunc attr: why no GPU target can schedule it (its value, a reason); placement keeps the
# call_tir of such a kernel on a CPU unless told otherwise, schedule_gpu refuses it
NO_GPU_SCHEDULE_ATTR = "hgrt.no_gpu_schedule"


def bindings(func: relax.Function) -> Iterator[relax.VarBinding]:
    """The bindings of ``func``'s body, block after block."""
    for block in func.body.blocks:
        yield from block.bindings


def copied_in(func: relax.Function) -> set[relax.Var]:
    """The variables of ``func`` bound to a copy from another device (``R.to_vdevice``)."""
    return {b.var for b in bindings(func) if op_name(b.value) == TO_VDEVICE}


def op_name(expr: relax.Expr) -> str | None:
    """``"relax.add"`` for a call of a Relax op; None for anything else."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def tensor_args(call: relax.Call) -> list[relax.Expr]:
    """What a call reads: a call_tir's (call_dps_packed's) argument tuple, another call's
    arguments."""
    return list(call.args[1].fields) if op_name(call) in (CALL_TIR, CALL_DPS_PACKED) \
        else list(call.args)


def callee(call: relax.Call) -> tuple[str, dict[str, str]]:
    """The function a call_tir or call_dps_packed calls, and the attrs its callee carries for
    the graph node (an ExternFunc's, e.g. ``provider``)."""
    func = call.args[0]
    if isinstance(func, relax.ExternFunc):
        return str(func.global_symbol), {str(k): str(v) for k, v in (func.attrs or {}).items()}
    return func.name_hint, {}


def called(value: relax.Expr) -> str:
    """What a binding computes, for messages: an op, a kernel, an extern function's name."""
    if not isinstance(value, relax.Call):
        return type(value).__name__
    if op_name(value) in (CALL_TIR, CALL_DPS_PACKED):
        return callee(value)[0]
    op = value.op
    return str(getattr(op, "name", None) or getattr(op, "global_symbol", None)
               or getattr(op, "name_hint", type(op).__name__))


def site(b: relax.Binding, ctx: BuildContext, dev: int | None = None) -> str:
    """Where a binding is, for errors: ``binding 'lv3' (relax.add) on cpu:1``."""
    where = f"binding {b.var.name!r} ({called(getattr(b, 'value', None))})"
    return where if dev is None else f"{where} on {ctx.devices[dev].name}"


def alone(call: relax.Call, mod: tvm.IRModule) -> tvm.IRModule:
    """A module whose ``main`` computes ``call`` alone from its operands (and ``mod``'s
    vdevices): to find which op of a module a whole-module TVM pass fails on."""
    params: dict[relax.Var, relax.Var] = {}

    def param(e: relax.Expr) -> relax.Expr:
        if isinstance(e, relax.Tuple):
            return relax.Tuple([param(f) for f in e.fields])
        return params.setdefault(e, relax.Var(e.name, e.ty)) if isinstance(e, relax.Var) else e

    call = relax.Call(call.op, [param(a) for a in call.args], call.attrs, call.ty_args)
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        bb.emit_func_output(bb.emit(call))
    new = bb.finalize()
    if "vdevice" in mod.global_infos:
        new.update_global_info("vdevice", list(mod.global_infos["vdevice"]))
    return new


def hinted_device(call: relax.Call, devices: list[DeviceSpec]) -> int:
    """The position in ``devices`` that an ``R.hint_on_device`` call names."""
    kind, index = int(call.attrs.device_type), int(call.attrs.index)
    return resolve_dl_device(kind, index, devices, f"R.hint_on_device({kind}, {index})")


def moved_to(expr: relax.Expr, ctx: BuildContext) -> int | None:
    """The device an ``R.hint_on_device`` or ``R.to_vdevice`` puts its operand on, else None."""
    op = op_name(expr)
    if op == HINT_ON_DEVICE:
        return hinted_device(expr, ctx.devices)
    return ctx.device_of_vdevice(expr.attrs.dst_vdevice) if op == TO_VDEVICE else None


def prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The PrimFuncs of ``mod`` by name."""
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def func_target(func: tirx.PrimFunc, default: tvm.target.Target | None = None
                ) -> tvm.target.Target | None:
    """A PrimFunc's ``target`` attr, else ``default``."""
    return func.attrs["target"] if "target" in (func.attrs or {}) else default


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool((func.attrs or {}).get(SCHEDULED_ATTR, False))


def no_gpu_schedule(func: Any) -> str | None:
    """Why no GPU target can schedule the PrimFunc ``func`` (``NO_GPU_SCHEDULE_ATTR``), or None."""
    attrs = getattr(func, "attrs", None) or {}
    return str(attrs[NO_GPU_SCHEDULE_ATTR]) if NO_GPU_SCHEDULE_ATTR in attrs else None


def static_dims(ty: relax.Type) -> tuple[int, ...] | None:
    """The shape of a tensor type when it is known at build time (else None)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        return None
    return tuple(int(d) for d in ty.shape.values)


def float32_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a float32 tensor ``expr`` (None: another dtype, or not static)."""
    return static_dims(expr.ty) if getattr(expr.ty, "dtype", None) == "float32" else None


def per_channel(value: np.ndarray, out: tuple[int, ...], axis: int = 1) -> np.ndarray | None:
    """``value`` as one number per output channel (``axis`` of ``out``: 1, NCHW's; -1 for
    channels last), if it broadcasts so."""
    axis %= len(out)
    if value.size == 1:
        return np.full(out[axis], value.reshape(()), "float32")
    if value.ndim > len(out):
        return None
    shape = (1,) * (len(out) - value.ndim) + value.shape
    if shape[axis] != out[axis] or any(s != 1 for i, s in enumerate(shape) if i != axis):
        return None
    return value.reshape(out[axis]).astype("float32")


def scalar(expr: Any) -> float:
    """The number a PrimValue / FloatImm / Python number holds (an op's bound, e.g. clip's)."""
    value = getattr(expr, "value", expr)
    return float(getattr(value, "value", value))


def reads_only_item0(users: dict, tup: relax.Var) -> bool:
    """Every reader of the tuple ``tup`` (``users``: variable -> reading bindings, None for the
    function's result) takes an item of it, and only item 0 is read further (TVM's ONNX
    importer also takes items 1 and 2 of a batch norm, unread)."""
    reads = users.get(tup, [])
    return bool(reads) and all(
        u is not None and isinstance(u.value, relax.TupleGetItem)
        and (u.value.index == 0 or not users.get(u.var)) for u in reads)


class MainReader:
    """Who reads what in ``func`` (a placed ``main``), and its weights: ``users`` maps a
    variable to the bindings that read it (None: the function's result); ``weights`` maps a
    weight parameter to its graph name; ``value`` gives a weight's or constant's value."""

    def __init__(self, func: relax.Function, ctx: BuildContext) -> None:
        self.func, self.ctx = func, ctx
        n_in = int(func.attrs["num_input"]) if "num_input" in (func.attrs or {}) else 0
        self.weights = {p: ctx.weights.graph_names.get(p.name, p.name)
                        for p in func.params[n_in:]}
        self.users: dict[relax.Var, list[relax.VarBinding | None]] = {}
        for b in bindings(func):
            for v in relax.analysis.free_vars(b.value):
                self.users.setdefault(v, []).append(b)
        for v in relax.analysis.free_vars(func.body.body):
            self.users.setdefault(v, []).append(None)  # the function's result

    def value(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of a weight or constant, else None."""
        if isinstance(expr, tvm.ir.expr.Constant):
            return expr.value.numpy()
        w = self.ctx.weights
        if isinstance(expr, relax.Var) and self.weights.get(expr) in w.source:
            return w.values[w.source[self.weights[expr]]]
        return None

    def only_user(self, var: relax.Var) -> relax.VarBinding | None:
        """The one binding that reads ``var`` (None: several, none, or the result reads it)."""
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 and users[0] is not None else None


def match_op_rule(op_name: str, rules: dict[str, Any]) -> str | None:
    """The key of ``rules`` that names ``op_name`` (``relax.nn.conv2d``): the op itself, with
    or without ``relax.``, before the first fnmatch pattern that matches (``nn.*pool*``); None
    when none does. Placement rules and kernel-provider rules read op names this way."""
    short = op_name.removeprefix("relax.")
    for key in rules:
        if key in (op_name, short):
            return key
    for key in rules:
        if fnmatch.fnmatchcase(op_name, key) or fnmatch.fnmatchcase(short, key):
            return key
    return None
