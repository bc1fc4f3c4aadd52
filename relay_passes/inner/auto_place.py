"""Automatic placement: each op on the device that minimises its estimated time plus the copies
it causes, within each device's memory budget for weights; then one decision for the whole
model (auto_plan.py): that per-op plan, every op on one device, or either refined, whichever
costs least in total, copies included.

With a profile (``hgrt profile DIR --json FILE``: each device's measured FLOP/s and bytes/s)
the times come from it; without one, an estimate: a kernel costs its launch (``LAUNCH_S``) +
max(FLOPs / the device's compute rate, bytes moved / its memory bandwidth). A copy costs the
link's latency plus bytes / its bandwidth: the profile's ``links`` where given, else measured
once for a local CUDA GPU (``hgrt.devices.link_of``), else ``DEFAULT_LINK``. Ops are taken in
dataflow order; a tie
keeps an op where its first input is, so devices of equal speed end up with whole regions and
few copies, and a budget that runs out moves the rest of the model, not every other op. The
explanation goes into the placement report ("auto: 1.20 ms on cuda:0 vs 9.80 ms on cpu:0") and
the comparison of plans into the build log ("auto: split 1.2 ms (4 copies) vs cuda:0 only
0.9 ms (1 copy) -> cuda:0 only").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import DEFAULT_LINK, DeviceSpec, Link
from hgrt.errors import BuildError
from hgrt.relay_passes.inner.auto_plan import Copy, PlanModel, decide
from hgrt.relay_passes.util.relax_util import HINT_ON_DEVICE, TO_VDEVICE, bindings, op_name

# Rough rates: what a kernel of hgrt's default schedule sustains per device kind.
# is_gpu -> (FLOP/s, bytes/s); a CPU's FLOP/s are what hgrt's matmul kernels sustain on 2
# AVX-512 cores (TVM's schedule 98-104 GFLOP/s on GPT-2's matmuls, BENCHMARKS.md, "TVM kernels
# on transformers"; oneDNN more)
RATES = {False: (100e9, 10e9), True: (5e12, 500e9)}
# what a kernel costs before it computes anything: a GPU kernel's launch (a TVM kernel on an
# H200, alone in an hgrt module: ~5-7 us over the module's own run(); BENCHMARKS.md, "cuBLAS/cuDNN
# or TVM per op"), a CPU kernel's call; without it a tiny op looks free on a GPU
LAUNCH_S = {False: 1e-6, True: 5e-6}


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
    launch = LAUNCH_S[dev.is_gpu]
    if cost.flops > 2 * cost.nbytes and "flops_per_s" in got:  # a conv / matmul
        return launch + cost.flops / got["flops_per_s"]
    if "bytes_per_s" in got:
        return launch + cost.nbytes / got["bytes_per_s"]
    return launch + max(cost.flops / rate, cost.nbytes / bandwidth)


def read_rates(path: str | None, key: str = "rates") -> dict:
    """``{"cpu:0": {"flops_per_s": ..., "bytes_per_s": ...}}`` from ``hgrt profile --json``;
    ``key="links"``: its links (``{"cuda:0": {"latency_s": ..., "bytes_per_s": ...}}``), which
    a profile may lack."""
    if not path:
        return {}
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        return dict(data.get(key, {}) if key == "links" else data[key])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BuildError(f"auto placement: cannot read the profile {path!r} (write one with "
                         f"`hgrt profile DIR --json FILE`): {e}") from e


def copy_cost(links: dict[int, Link]) -> Copy:
    """(bytes, from, to) -> seconds: the slower link of the two ends (``links``: the GPU devices
    and those a profile names), ``DEFAULT_LINK`` between two devices without one (two CPUs)."""
    def seconds(nbytes: float, a: int, b: int) -> float:
        ends = [links[d].seconds(nbytes) for d in (a, b) if d in links]
        return max(ends, default=DEFAULT_LINK.seconds(nbytes))
    return seconds


def describe_links(devices: list[DeviceSpec], links: dict[int, Link]) -> str:
    """The log line that says what a copy was priced at, and where that came from."""
    if not links:
        return f"auto: a copy costs {DEFAULT_LINK.describe()}: no GPU in the device list"
    return "auto: a copy costs " + ", ".join(
        f"{devices[d].name} <-> host {link.describe()}" + (
            ": no CUDA GPU here to measure" if link.source == "default" else "")
        for d, link in sorted(links.items()))


def _tensors(expr, alias: dict[str, list[str]]) -> list[str]:
    """The tensors an expression stands for (through aliases and tuples; weights: none)."""
    if isinstance(expr, relax.Var):
        return alias.get(expr.name, [])
    if isinstance(expr, relax.Tuple):
        return [t for f in expr.fields for t in _tensors(f, alias)]
    return []


def plan_model(func: relax.Function, devices: list[DeviceSpec], fixed: dict[str, int],
               weights: dict[str, np.ndarray], allowed: Callable[[str, DeviceSpec], bool],
               measured: dict) -> PlanModel:
    """Each op's time per device and the tensors it reads and makes, in binding order."""
    m = PlanModel()
    alias = {p.name: [p.name] for p in func.params if p.name not in weights}
    m.nbytes.update({p.name: _nbytes(p.ty) for p in func.params if p.name not in weights})
    for b in bindings(func):
        value, name, op = b.value, b.var.name, op_name(b.value)
        if isinstance(value, relax.TupleGetItem):
            src = _tensors(value.tuple_value, alias)
            if len(src) == 1 and src[0] in m.made_by and not isinstance(value.tuple_value.ty,
                                                                         relax.TensorType):
                i = m.made_by[name] = m.made_by[src[0]]  # an output of a multi-output op
                m.outs[i].append(name)
                m.nbytes[name] = _nbytes(b.var.ty)
                alias[name] = [name]
            else:
                alias[name] = src[value.index:value.index + 1] or src
        elif op is None or op in (HINT_ON_DEVICE, TO_VDEVICE):
            alias[name] = _tensors(value.args[0] if op else value, alias)
        else:
            cost = op_cost(value, b.var.ty, weights)
            reads = [t for a in value.args for t in _tensors(a, alias)]
            m.add_op(name, [(name, _nbytes(b.var.ty))], reads,
                     [op_seconds(cost, dev, measured) for dev in devices],
                     [allowed(name, dev) for dev in devices], name in fixed, cost.weights)
            alias[name] = [name]
    return m


def _per_op(m: PlanModel, devices: list[DeviceSpec], fixed: dict[str, int],
            budgets: dict[int, int], copy: Copy) -> tuple[list[int], list[str]]:
    """Each op in turn on the device where it costs least with the copies it causes."""
    assign: list[int] = []
    why: list[str] = []
    on: dict[int, dict[str, int]] = {d: {} for d in range(len(devices))}  # weights held

    def home(t: str, d: int) -> int:
        if t in m.made_by:
            return assign[m.made_by[t]]
        first = m.readers[t][0]
        return m.input_home.get(t, d if first == len(assign) else assign[first])

    for i, name in enumerate(m.names):
        if m.fixed[i]:
            dev, reason = fixed[name], ""
        else:
            options = []
            first = home(m.reads[i][0], 0) if m.reads[i] else 0
            for d in range(len(devices)):
                extra = {w: n for w, n in m.weights[i].items() if w not in on[d]}
                room = budgets.get(d, float("inf")) - sum(on[d].values())
                if not m.allowed[i][d] or sum(extra.values()) > room:
                    continue
                copies = sum(copy(m.nbytes[t], home(t, d), d) for t in dict.fromkeys(m.reads[i])
                             if home(t, d) != d)
                options.append((m.seconds[i][d] + copies, d != first, d))
            if not options:
                held = {devices[d].name: sum(w.values()) for d, w in on.items()}
                raise BuildError(f"auto placement: no device can hold the weights of {name} "
                                 f"within its budget ({held} bytes used)")
            options.sort()
            dev = options[0][2]
            alt = ", ".join(f"{t * 1e3:.3f} ms on {devices[d].name}" for t, _, d in options[1:2])
            refused = [dv.name for d, dv in enumerate(devices) if not m.allowed[i][d]]
            reason = f"auto: {options[0][0] * 1e3:.3f} ms on {devices[dev].name}" + \
                (f" vs {alt}" if alt else "") + \
                (f" ({', '.join(refused)} cannot compile it)" if refused else "")
        on[dev].update(m.weights[i])
        assign.append(dev)
        why.append(reason)
    return assign, why


def auto_place(func: relax.Function, devices: list[DeviceSpec], fixed: dict[str, int],
               weights: dict[str, np.ndarray], budgets: dict[int, int],
               allowed: Callable[[str, DeviceSpec], bool],
               measured: dict | None = None, links: dict[int, Link] | None = None,
               log: Callable[[str], None] | None = None) -> dict[str, tuple[int, str]]:
    """binding name -> (device, reason) for every op binding not in ``fixed`` (placed by a
    hint, an override or a rule, which win). ``budgets``: device -> bytes of weights it may
    hold; ``allowed(name, device)``: whether the device can run the op bound to ``name``;
    ``measured``: rates per device name from a profile (``read_rates``), which replace the
    estimates where given;
    ``links``: what a copy to or from each GPU device costs (``hgrt.devices.link_of``);
    ``log`` gets the line that compares the whole plans."""
    copy = copy_cost(links or {})
    m = plan_model(func, devices, fixed, weights, allowed, measured or {})
    m.input_home = {n: d for n, d in fixed.items() if n in m.nbytes and n not in m.made_by}
    per_op, why = _per_op(m, devices, fixed, budgets, copy)
    names = [d.name for d in devices]
    best, line = decide(m, per_op, names, copy, budgets)
    if log is not None:
        log(line)
    out = {}
    for i, name in enumerate(m.names):
        if m.fixed[i]:
            continue
        d, was = best.assign[i], per_op[i]
        out[name] = (d, why[i] if d == was else
                     f"auto: {m.seconds[i][d] * 1e3:.3f} ms on {names[d]} vs "
                     f"{m.seconds[i][was] * 1e3:.3f} ms on {names[was]} alone; plan {best.label}")
    return out
