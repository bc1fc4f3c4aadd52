"""Readers of Relax and TIR IR that the passes share: bindings, op names, operands, PrimFuncs."""

from __future__ import annotations

from collections.abc import Iterator

import tvm
from tvm import relax, tirx

from hgrt.devices import DeviceSpec, resolve_dl_device
from hgrt.relay_passes.context import BuildContext

CALL_TIR = "relax.call_tir"
TO_VDEVICE = "relax.to_vdevice"
HINT_ON_DEVICE = "relax.hint_on_device"
SCHEDULED_ATTR = "tirx.is_scheduled"


def bindings(func: relax.Function) -> Iterator[relax.VarBinding]:
    """The bindings of ``func``'s body, block after block."""
    for block in func.body.blocks:
        yield from block.bindings


def op_name(expr: relax.Expr) -> str | None:
    """``"relax.add"`` for a call of a Relax op; None for anything else."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def tensor_args(call: relax.Call) -> list[relax.Expr]:
    """What a call reads: a call_tir's argument tuple, another call's arguments."""
    return list(call.args[1].fields) if op_name(call) == CALL_TIR else list(call.args)


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
