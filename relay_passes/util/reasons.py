"""Why each kernel of a build runs where it does and by whom, as graph node attrs.

The placement report says it per op binding of the placed ``main``: ``PlacementRow.reason``
for the device (place_devices), ``kernels_why`` for the provider (each provider's claim pass,
for the ops it could take). After FuseOps one kernel computes several bindings:
``fused_members`` finds, per call of the fused ``main``, the bindings of the ``main`` before it
that the call computes, and ``kernel_reasons`` turns their rows into the node attrs
``DEVICE_WHY`` and ``PROVIDER_WHY`` (``hgrt.graph_format``), each ``"<kind>: <detail>"``.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from hgrt.graph_format import DEVICE_WHY, PROVIDER_WHY
from hgrt.relay_passes.util.context import BuildContext, PlacementRow
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.relax_util import (
    CALL_DPS_PACKED,
    CALL_TIR,
    bindings,
    callee,
    op_name,
    tensor_args,
)

__all__ = ["aliases", "fused_members", "kernel_reasons"]

# the device of a kernel that computes no op of the placement report (a rewrite made it)
MADE = "operands: a kernel the build made, on its operands' device"


def _key(value: relax.Expr, env: dict) -> tuple | None:
    """What a binding computes from which variables (those of ``env`` read as their values):
    the same key in two functions is the same computation."""
    if isinstance(value, relax.TupleGetItem):
        return "item", env.get(value.tuple_value, value.tuple_value), value.index
    if not isinstance(value, relax.Call):
        return None
    op = op_name(value)
    what = callee(value)[0] if op in (CALL_TIR, CALL_DPS_PACKED) else op
    if what is None:
        return None
    return what, tuple(env.get(a, a) for a in tensor_args(value) if isinstance(a, relax.Var))


def fused_members(before: relax.Function, after: tvm.IRModule) -> dict[relax.Var, list[str]]:
    """Per call binding of ``after["main"]`` (FuseOps' result on ``before``), the names of the
    bindings of ``before`` it computes. FuseOps shares one fused function among groups that
    compute alike, so a call's bindings are found by walking its function with the call's
    operands, not from the names inside it."""
    index: dict[tuple, relax.Var] = {}
    for b in bindings(before):
        key = _key(b.value, {})
        if key is not None:
            index.setdefault(key, b.var)
    out: dict[relax.Var, list[str]] = {}
    outer: dict[Any, Any] = {}  # a variable of after's main -> the value of before's it holds
    for b in bindings(after["main"]):
        value = b.value
        if isinstance(value, relax.TupleGetItem):
            held = outer.get(value.tuple_value)
            if isinstance(held, tuple) and value.index < len(held):
                outer[b.var] = held[value.index]
            continue
        if not isinstance(value, relax.Call):
            continue
        func = after[value.op] if isinstance(value.op, relax.GlobalVar) else None
        if not isinstance(func, relax.Function):  # not fused: the binding itself
            out[b.var] = [b.var.name]
            continue
        env: dict[Any, Any] = {p: outer.get(a, a)
                               for p, a in zip(func.params, value.args, strict=True)}
        names = []
        for inner in bindings(func):
            key = _key(inner.value, env)
            found = None if key is None else index.get(key)
            if found is not None:
                env[inner.var] = found
                names.append(found.name)
        result = func.body.body
        outer[b.var] = tuple(env.get(f) for f in result.fields) \
            if isinstance(result, relax.Tuple) else env.get(result)
        out[b.var] = names
    return out


def _provider_why(rows: list[PlacementRow], kernels: Kernels) -> str:
    """The provider's reason of a kernel computing ``rows``: the one a claim pass recorded,
    else TVM's because it was asked, or because no provider computes these ops."""
    said = next((r.kernels_why for r in rows if r.kernels_why), None)
    if said is not None:
        return said
    first = rows[0]
    if kernels.choice(first.node, first.op)[0] == "tvm":
        return f"asked: {kernels.said(first.node, first.op)}"
    ops = ", ".join(dict.fromkeys(r.op.removeprefix("relax.") for r in rows))
    return f"no provider: none took {ops}"


def aliases(func: relax.Function) -> dict[str, str]:
    """Variable name -> the name of the binding it renames (``y = x``), followed to its end:
    the lowering's CanonicalizeBindings binds the op to the alias (often main's output)."""
    out: dict[str, str] = {}
    for b in bindings(func):
        if isinstance(b.value, relax.Var):
            out[b.var.name] = out.get(b.value.name, b.value.name)
    return out


def kernel_reasons(mod: tvm.IRModule, ctx: BuildContext, members: dict[relax.Var, list[str]],
                   renamed: dict[str, str]) -> dict[relax.Var, dict[str, str]]:
    """Per kernel binding of the lowered ``mod["main"]`` (``members``: what ``fused_members``
    found; ``renamed``: the ``aliases`` of the placed main), the node attrs that say why it
    runs on its device and by its provider (``MADE`` for a kernel that computes no binding of
    the placement report)."""
    rows = {r.node: r for r in ctx.placed.report}
    rows |= {n: rows[r] for n, r in ctx.placed.row_of.items() if n not in rows and r in rows}
    kernels = Kernels.of(ctx.options.kernels)
    out = {}
    for b in bindings(mod["main"]):
        if op_name(b.value) not in (CALL_TIR, CALL_DPS_PACKED):
            continue
        found = [rows[n] for n in (renamed.get(n, n) for n in members.get(b.var, ()))
                 if n in rows]
        if found:
            anchor = next((r for r in found if r.kernels_why), found[0])
            out[b.var] = {DEVICE_WHY: anchor.reason, PROVIDER_WHY: _provider_why(found, kernels)}
        else:  # (a provider's own kernel of this kind says why in its callee's attrs)
            out[b.var] = {DEVICE_WHY: MADE, PROVIDER_WHY: "no provider: a kernel the build made"}
    return out

