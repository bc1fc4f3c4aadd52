"""Automatic placement: each op on the device that minimises its estimated time plus the copies
it causes, within each device's memory budget for weights.

With a profile (``hgrt profile DIR --json FILE``: each device's measured FLOP/s and bytes/s)
the times come from it; without one, an estimate: a kernel costs max(FLOPs / the device's
compute rate, bytes moved / its memory bandwidth); a copy costs a fixed latency plus bytes /
the link bandwidth. Ops are taken in dataflow order; a tie keeps an op where its first input
is, so devices of equal speed end up with whole regions and few copies, and a budget that
runs out moves the rest of the model, not every other op. The explanation goes into the
placement report: "auto: 1.20 ms on cuda:0 vs 9.80 ms on cpu:0".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import DeviceSpec
from hgrt.errors import BuildError
from hgrt.relay_passes.util.relax_util import bindings, op_name

# Rough rates: what a kernel of hgrt's default schedule sustains per device kind.
RATES = {False: (20e9, 10e9), True: (5e12, 500e9)}  # is_gpu -> (FLOP/s, bytes/s)
COPY = {"latency_s": 5e-6, "bytes_per_s": 8e9}  # one copy between two devices


@dataclass
class OpCost:
    flops: float
    nbytes: float
    weights: dict[str, int]  # weight params it reads -> bytes


def _nbytes(ty) -> float:
    shape = getattr(ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return 0.0
    dims = [int(v) if isinstance(v, tvm.tirx.IntImm) else 1 for v in shape.values]
    return float(np.prod(dims, dtype=np.float64)) * tvm.runtime.DataType(ty.dtype).bits / 8


def op_cost(call: relax.Call, out_ty, weights: dict[str, np.ndarray]) -> OpCost:
    """FLOPs and bytes of one op call, from its output type and operands."""
    out = _nbytes(out_ty)
    elems = out / 4.0
    args = [a for a in call.args if isinstance(a, relax.Expr)]
    ins = sum(_nbytes(a.ty) for a in args if isinstance(a, relax.Var))
    name = op_name(call) or ""
    flops = elems
    if name in ("relax.nn.conv2d", "relax.nn.conv1d", "relax.nn.conv3d") and len(args) > 1:
        w_shape = [int(v) for v in args[1].ty.shape.values]
        flops = 2.0 * elems * float(np.prod(w_shape[1:]))
    elif name in ("relax.matmul", "relax.nn.dense", "relax.linear") and len(args) > 1:
        flops = 2.0 * elems * float(int(args[0].ty.shape.values[-1]))
    used = {a.name: weights[a.name].nbytes for a in args
            if isinstance(a, relax.Var) and a.name in weights}
    return OpCost(flops, ins + out, used)


def op_seconds(cost: OpCost, dev: DeviceSpec, measured: dict) -> float:
    rate, bandwidth = RATES[dev.is_gpu]
    got = measured.get(dev.name, {})
    if cost.flops > 2 * cost.nbytes and "flops_per_s" in got:  # a conv / matmul
        return cost.flops / got["flops_per_s"]
    if "bytes_per_s" in got:
        return cost.nbytes / got["bytes_per_s"]
    return max(cost.flops / rate, cost.nbytes / bandwidth)


def read_rates(path: str | None) -> dict:
    """``{"cpu:0": {"flops_per_s": ..., "bytes_per_s": ...}}`` from ``hgrt profile --json``."""
    if not path:
        return {}
    import json

    try:
        with open(path) as f:
            return dict(json.load(f)["rates"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BuildError(f"auto placement: cannot read the profile {path!r} (write one with "
                         f"`hgrt profile DIR --json FILE`): {e}") from e


def _copy_seconds(nbytes: float) -> float:
    return COPY["latency_s"] + nbytes / COPY["bytes_per_s"]


def auto_place(func: relax.Function, devices: list[DeviceSpec], fixed: dict[str, int],
               weights: dict[str, np.ndarray], budgets: dict[int, int],
               allowed: Callable[[str, DeviceSpec], bool],
               measured: dict | None = None) -> dict[str, tuple[int, str]]:
    """binding name -> (device, reason) for every op binding not in ``fixed`` (placed by a
    hint, an override or a rule, which win). ``budgets``: device -> bytes of weights it may
    hold; ``allowed(op, device)``: whether the device can run the op; ``measured``: rates per
    device name from a profile (``read_rates``), which replace the estimates where given."""
    where: dict[str, int] = {p.name: 0 for p in func.params}  # tensors -> device
    used = dict.fromkeys(range(len(devices)), 0)
    on: dict[int, set[str]] = {d: set() for d in range(len(devices))}  # weights per device
    out: dict[str, tuple[int, str]] = {}
    for b in bindings(func):
        op = op_name(b.value)
        if op is None:
            if isinstance(b.value, relax.Var) and b.value.name in where:
                where[b.var.name] = where[b.value.name]
            continue
        cost = op_cost(b.value, b.var.ty, weights)
        if b.var.name in fixed:
            dev = fixed[b.var.name]
        else:
            dev, why = _choose(b.value, cost, devices, where, used, on, budgets, allowed, op,
                               measured or {})
            out[b.var.name] = (dev, why)
        for w, nbytes in cost.weights.items():
            if w not in on[dev]:
                on[dev].add(w)
                used[dev] += nbytes
        where[b.var.name] = dev
    return out


def _choose(call, cost: OpCost, devices, where, used, on, budgets, allowed, op, measured):
    inputs = [a for a in call.args if isinstance(a, relax.Var) and a.name in where
              and a.name not in cost.weights]
    home = where[inputs[0].name] if inputs else 0
    options = []
    for d, dev in enumerate(devices):
        extra = sum(n for w, n in cost.weights.items() if w not in on[d])
        if not allowed(op, dev) or used[d] + extra > budgets.get(d, float("inf")):
            continue
        copies = sum(_copy_seconds(_nbytes(a.ty)) for a in inputs if where[a.name] != d)
        options.append((op_seconds(cost, dev, measured) + copies, d != home, d))
    if not options:
        raise BuildError(f"auto placement: no device can hold the weights of {op} within its "
                         f"budget ({ {devices[d].name: used[d] for d in used} } bytes used)")
    options.sort()
    best = options[0]
    alt = ", ".join(f"{t * 1e3:.3f} ms on {devices[d].name}" for t, _, d in options[1:2])
    return best[2], f"auto: {best[0] * 1e3:.3f} ms on {devices[best[2]].name}" + \
        (f" vs {alt}" if alt else "")
