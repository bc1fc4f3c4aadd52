"""Cutting a model into pipeline stages: K contiguous parts of its ops, each an ordinary build.

The model is imported as ``hgrt.build`` imports it; its op bindings, in ``main``'s order, are
cut at K - 1 positions. A stage takes, as inputs, the tensors of earlier stages (or of the
model's inputs) that its ops read, and gives as outputs those that later stages (or the model's
outputs) read; the weights its ops read are its own. Where to cut, unless the user names the
cut points: the positions that minimise the slowest stage's time, each stage's estimated kernel
time (``auto_place.op_cost``, at the rates of ``hgrt profile --json`` when given, else hgrt's
rough rates) plus the time of the tensors that enter it, within each stage's weight budget, and
among equal ones the cuts that carry fewest bytes. Each stage is then built by ``hgrt.build``
on its own devices (placement, kernels and streams inside a stage as for any build).

>>> res = split(model, [["cpu"], ["cpu"]])                 # doctest: +SKIP
>>> print(res.report())                                    # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import BuildError, did_you_mean

# bytes per second a tensor crosses between two stages at, unless split(link_bytes_per_s=)
# says otherwise: board to board through the boards' inboxes over Gigabit Ethernet (about 110
# MB/s of payload). On loopback an inbox took 2.4 MiB in 1.5 ms (about 1.7e9 B/s, Intel Xeon);
# through TVM RPC and the client the same bytes took 46 ms (5e7 B/s)
TRANSFER_BYTES_PER_S = 1.1e8
# elementwise ops that TVM fuses into the kernel of the op just before them: no time of their own
FUSED_AFTER = frozenset(f"relax.{n}" for n in (
    "add", "subtract", "multiply", "divide", "nn.relu", "clip", "sigmoid", "tanh", "nn.gelu",
    "nn.silu", "maximum", "minimum"))
TRANSFER_LATENCY_S = 300e-6  # one hand-over between stages (an RPC round trip)
MAX_WEIGHT_SPLITS = 4  # matmul weights cut in two, one after another, before a budget is refused


@dataclass
class StageSpec:
    """Where a stage runs: ``devices`` (as ``hgrt.build`` takes them), an optional ``budget`` of
    weight bytes, the RPC tracker ``key`` of the board it runs on (None: this machine) and the
    ``target`` it is built for (as ``hgrt.build(target=)`` takes it: a board of another CPU or
    architecture; None: the build's own)."""

    devices: list[str] = field(default_factory=lambda: ["cpu"])
    budget: int | None = None
    key: str | None = None
    target: Any = None

    @classmethod
    def of(cls, value: Any) -> StageSpec:
        if isinstance(value, cls):
            spec = value
        elif isinstance(value, str):
            spec = cls([value])
        elif isinstance(value, (list, tuple)):
            spec = cls(list(value))
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {"devices", "budget", "key", "target"})
            if unknown:
                raise BuildError(f"stage {value!r}: unknown fields {unknown} (devices, budget, "
                                 f"key, target)")
            spec = cls(**value)
        else:
            raise BuildError(f"a stage is a device list, a dict (devices, budget, key) or a "
                             f"StageSpec, got {type(value).__name__}")
        if isinstance(spec.devices, str):
            spec.devices = [spec.devices]
        if spec.budget is not None and (isinstance(spec.budget, bool)
                                        or not isinstance(spec.budget, int | np.integer)
                                        or spec.budget <= 0):
            raise BuildError(f"stage budget {spec.budget!r}: a number of bytes > 0")
        return spec


@dataclass
class Tensor:
    """A tensor that crosses between stages (or a model input or output)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass
class StagePlan:
    """One stage: its bindings [start, end) of ``main``, what it reads and gives, its cost."""

    index: int
    start: int
    end: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    weights: list[str]
    weight_bytes: int
    estimated_s: float
    transfer_s: float


@dataclass
class _Model:
    """``main`` read once: its bindings, costs, and where each value is made and read."""

    mod: tvm.IRModule
    weights: dict[str, np.ndarray]
    bindings: list[relax.VarBinding]
    inputs: list[relax.Var]
    outputs: list[relax.Var]
    cost: np.ndarray  # seconds per binding
    weight_of: list[list[str]]  # weights each binding reads
    reads: list[set]  # the values (not weights) each binding reads
    made: dict[relax.Var, int]  # var -> binding index (-1: a model input)
    last_read: dict[relax.Var, int]  # var -> last binding reading it (len: a model output)


def _read(model: Any, params: dict | None, rates: dict) -> _Model:
    from hgrt.devices import parse_devices
    from hgrt.frontend import import_model
    from hgrt.relay_passes.inner.auto_place import op_cost, op_seconds
    from hgrt.relay_passes.util.relax_util import bindings, op_name

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, weights = import_model(model, params)
    main = mod["main"]
    n_in = int(main.attrs["num_input"])
    inputs = list(main.params[:n_in])
    weight_vars = {p: p.name for p in main.params[n_in:]}
    bs = list(bindings(main))
    result = main.body.body
    outputs = list(result.fields) if isinstance(result, relax.Tuple) else [result]
    if not all(isinstance(o, relax.Var) for o in outputs):
        raise BuildError("a pipeline needs main to return variables (or a tuple of them)")
    cpu = parse_devices(["cpu"])[0]
    if cpu.name not in rates and len(rates) == 1:  # one device's profile: the stages' rate
        rates = {cpu.name: next(iter(rates.values()))}
    cost, weight_of, reads = np.zeros(len(bs)), [], []
    made = {v: -1 for v in inputs}
    last_read: dict[relax.Var, int] = {}
    for i, b in enumerate(bs):
        made[b.var] = i
        free = relax.analysis.free_vars(b.value)
        weight_of.append(sorted({weight_vars[v] for v in free if v in weight_vars}))
        reads.append({v for v in free if v not in weight_vars})
        for v in free:
            if v not in weight_vars:
                last_read[v] = i
        name = op_name(b.value) if isinstance(b.value, relax.Call) else None
        if name and not (name in FUSED_AFTER and i and b.value.args
                         and b.value.args[0].same_as(bs[i - 1].var)):
            cost[i] = op_seconds(op_cost(b.value, b.var.ty, weights), cpu, rates)
    for o in outputs:
        last_read[o] = len(bs)
    return _Model(mod, weights, bs, inputs, outputs, cost, weight_of, reads, made, last_read)


def _tensor(var: relax.Var) -> Tensor | None:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not all(
            isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        return None
    return Tensor(var.name, tuple(int(d) for d in ty.shape.values), str(ty.dtype))


def _crossing(m: _Model, cut: int) -> list[relax.Var] | None:
    """The values made before binding ``cut`` (or model inputs) read at or after it; None when
    one is not a tensor of static shape (a tuple): no cut there."""
    out = []
    for v, i in m.made.items():
        if i < cut <= m.last_read.get(v, -2):
            if _tensor(v) is None:
                return None
            out.append(v)
    return out


def _stage_weights(m: _Model, start: int, end: int) -> list[str]:
    return sorted({w for i in range(start, end) for w in m.weight_of[i]})


def _cut_points(m: _Model, stages: list[StageSpec],
                link: float = TRANSFER_BYTES_PER_S) -> list[int]:
    """K - 1 cut positions: the slowest stage (kernels + what enters it) as fast as can be,
    each stage's weights within its budget, fewer crossing bytes among equals."""
    n, k = len(m.bindings), len(stages)
    if n < k:
        raise BuildError(f"{k} stages for a model of {n} ops")
    prefix = np.concatenate([[0.0], np.cumsum(m.cost)])
    cross_bytes = {}
    for p in range(1, n):
        vs = _crossing(m, p)
        if vs is not None:
            cross_bytes[p] = sum(_tensor(v).nbytes for v in vs)
    wbytes = [sum(m.weights[w].nbytes for w in ws) for ws in m.weight_of]
    wprefix = np.concatenate([[0], np.cumsum(wbytes)])

    first_in = sum(_tensor(v).nbytes for v in m.inputs if _tensor(v) is not None)

    def enter_s(p: int) -> float:  # what crosses into a stage starting at p (the model's input)
        return TRANSFER_LATENCY_S + (cross_bytes[p] if p else first_in) / link

    def fits(s: int, a: int, b: int) -> bool:
        budget = stages[s].budget
        return budget is None or wprefix[b] - wprefix[a] <= budget

    # best[s][b]: (slowest stage, crossing bytes) of stages 0..s covering bindings [0, b)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n + 1):
        if (b == n or b in cross_bytes) and fits(0, 0, b):
            best[0][b] = (prefix[b] + enter_s(0), 0.0)
    for s in range(1, k):
        for b in range(s + 1, n + 1):
            if b != n and b not in cross_bytes:
                continue
            for a in range(s, b):
                prev = best[s - 1][a]
                if a not in cross_bytes or prev[0] == float("inf") or not fits(s, a, b):
                    continue
                cand = (max(prev[0], prefix[b] - prefix[a] + enter_s(a)),
                        prev[1] + cross_bytes[a])
                if cand < best[s][b]:
                    best[s][b], back[s][b] = cand, a
    if best[k - 1][n][0] == float("inf"):
        need = [f"{s.budget}" for s in stages]
        raise BuildError(f"no cut into {k} contiguous stages keeps each stage's weights within "
                         f"its budget (budgets {need} bytes; the model's weights "
                         f"{int(wprefix[-1])} bytes)")
    cuts, b = [], n
    for s in range(k - 1, 0, -1):
        b = back[s][b]
        cuts.append(b)
    return sorted(cuts)


def _named_cuts(m: _Model, names: list[str]) -> list[int]:
    """Cut positions after the bindings ``names`` (as the placement report names them)."""
    where = {b.var.name: i for i, b in enumerate(m.bindings)}
    cuts = []
    for name in names:
        if name not in where:
            raise BuildError(f"cut after {did_you_mean(name, list(where))}")
        p = where[name] + 1
        if p >= len(m.bindings) or _crossing(m, p) is None:
            raise BuildError(f"cannot cut after {name!r}: "
                             + ("it is the last op" if p >= len(m.bindings) else
                                "a value crossing there is not a tensor of static shape"))
        cuts.append(p)
    if sorted(set(cuts)) != cuts:
        raise BuildError(f"cut points {names} must be distinct and in the model's order")
    return cuts


@relax.expr_functor.mutator
class _Renamed(relax.PyExprMutator):
    """Reads of the original variables replaced by the stage's own."""

    def __init__(self, mapping: dict) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        return self.mapping.get(var, var)


def _stage_module(m: _Model, plan: StagePlan) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """The Relax module of one stage (its inputs, then its weights) and its weights."""
    originals = {v.name: v for v in m.made}
    weight_params = {p.name: p for p in m.mod["main"].params[len(m.inputs):]}
    mapping, params = {}, []
    for t in plan.inputs:
        new = relax.Var(t.name, originals[t.name].ty)
        mapping[originals[t.name]] = new
        params.append(new)
    for w in plan.weights:
        new = relax.Var(w, weight_params[w].ty)
        mapping[weight_params[w]] = new
        params.append(new)
    mod = _main_of(params, len(plan.inputs), m.bindings[plan.start:plan.end], mapping,
                   [originals[t.name] for t in plan.outputs])
    return mod, {w: m.weights[w] for w in plan.weights}


def _main_of(params: list, n_in: int, bindings: list, mapping: dict, outputs: list,
             rewrite: Callable | None = None) -> tvm.IRModule:
    """A module whose ``main`` takes ``params`` (the first ``n_in`` its inputs) and re-emits
    ``bindings`` with the variables of ``mapping`` (extended as it goes), returning ``outputs``.
    ``rewrite(bb, i, binding, value)`` may replace binding ``i``'s value."""
    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs={"num_input": n_in}):
        with bb.dataflow():
            for i, b in enumerate(bindings):
                value = _Renamed(mapping).visit_expr(b.value)
                if rewrite is not None:
                    value = rewrite(bb, i, b, value)
                mapping[b.var] = bb.emit(value, name_hint=b.var.name)
            outs = [mapping[o] for o in outputs]
            result = bb.emit_output(relax.Tuple(outs) if len(outs) > 1 else outs[0])
        bb.emit_func_output(result)
    return bb.get()


def _split_widest(m: _Model, parts: int = 2) -> tuple[tvm.IRModule, dict, str] | None:
    """``main`` with its heaviest matmul by a weight split by output columns into ``parts``
    matmuls (each reading a block of the weight's columns) joined by a concat, so that a cut may
    fall between them; None when there is no such matmul. What a weight larger than any stage's
    share of the budget needs (vgg19's 392 MiB fc6)."""
    from hgrt.relay_passes.util.relax_util import op_name

    n_in = len(m.inputs)
    weight_params = {p.name: p for p in m.mod["main"].params[n_in:]}
    readers: dict[str, int] = {}
    for ws in m.weight_of:
        for w in ws:
            readers[w] = readers.get(w, 0) + 1
    found = None
    for i, b in enumerate(m.bindings):
        v = b.value
        if isinstance(v, relax.Call) and op_name(v) == "relax.matmul" \
                and isinstance(v.args[1], relax.Var) and v.args[1].name in m.weights \
                and readers.get(v.args[1].name) == 1 \
                and m.weights[v.args[1].name].ndim == 2 \
                and m.weights[v.args[1].name].shape[1] >= parts:
            if found is None or m.weights[v.args[1].name].nbytes > found[1]:
                found = (i, m.weights[v.args[1].name].nbytes, v.args[1].name)
    if found is None:
        return None
    at, _, name = found
    blocks = [np.ascontiguousarray(c) for c in np.array_split(m.weights[name], parts, axis=1)]
    weights = {k: w for k, w in m.weights.items() if k != name}
    mapping: dict = {}
    params = list(m.inputs)
    for k, p in weight_params.items():
        if k != name:
            params.append(mapping.setdefault(p, relax.Var(k, p.ty)))
    block_vars = []
    for j, c in enumerate(blocks):
        weights[f"{name}.part{j}"] = c
        block_vars.append(relax.Var(f"{name}.part{j}", relax.TensorType(c.shape, str(c.dtype))))
    params += block_vars

    def split_matmul(bb, i, b, value):
        if i != at:
            return value
        out_dtype = getattr(value.attrs, "out_dtype", None)  # None: the inputs'
        out_dtype = None if out_dtype is None or str(out_dtype) == "void" else str(out_dtype)
        pieces = [bb.emit(relax.op.matmul(value.args[0], w, out_dtype=out_dtype),
                          name_hint=f"{b.var.name}_part{j}") for j, w in enumerate(block_vars)]
        return relax.op.concat(pieces, axis=-1)

    mod = _main_of(params, n_in, m.bindings, mapping, m.outputs, split_matmul)
    return mod, weights, name


def plan_stages(m: _Model, cuts: list[int],
                link: float = TRANSFER_BYTES_PER_S) -> list[StagePlan]:
    bounds = [0, *cuts, len(m.bindings)]
    plans = []
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        read = set().union(*m.reads[a:b])
        ins = [v for v, i in m.made.items() if i < a and v in read]  # model inputs first
        outs = [v for v, i in m.made.items() if a <= i < b and m.last_read.get(v, -2) >= b]
        if s == len(bounds) - 2:  # the model's outputs made here, in the model's order
            outs = [o for o in m.outputs if a <= m.made[o] < b]
        weights = _stage_weights(m, a, b)
        tin = [_tensor(v) for v in ins]
        plans.append(StagePlan(
            s, a, b, tin, [_tensor(v) for v in outs], weights,
            sum(m.weights[w].nbytes for w in weights), float(np.sum(m.cost[a:b])),
            TRANSFER_LATENCY_S + sum(t.nbytes for t in tin) / link))
    return plans


@dataclass
class SplitResult:
    """``split``'s result: per stage its spec, plan and ``hgrt.build`` result; the model's own
    inputs and outputs (name, shape, dtype)."""

    stages: list[StageSpec]
    plans: list[StagePlan]
    builds: list[Any]
    inputs: list[Tensor]
    outputs: list[Tensor]
    split_weights: list[str] = field(default_factory=list)  # cut by columns to fit, in order

    def report(self) -> str:
        """Per stage: ops, estimated ms (kernels; entering tensors), weight bytes, the tensors
        that cross into it and their bytes."""
        lines = [f"{'stage':>5} {'devices':<16} {'ops':>5} {'est. ms':>8} {'in ms':>7} "
                 f"{'weights MiB':>11}  tensors in (bytes)"]
        for spec, p in zip(self.stages, self.plans, strict=True):
            crossing = ", ".join(f"{t.name} {list(t.shape)} ({t.nbytes})" for t in p.inputs)
            lines.append(f"{p.index:>5} {','.join(spec.devices):<16} {p.end - p.start:>5} "
                         f"{1e3 * p.estimated_s:>8.2f} {1e3 * p.transfer_s:>7.3f} "
                         f"{p.weight_bytes / 2**20:>11.2f}  {crossing}")
        for name in self.split_weights:
            lines.append(f"weight {name} cut in two by columns, its matmul into two and a "
                         f"concat: no cut kept every stage within its budget")
        return "\n".join(lines)

    def save(self, directory: str) -> None:
        """One artifact directory: ``pipeline.json`` and a ``stage<k>/`` per stage."""
        from hgrt.pipelines import save_split

        save_split(os.fspath(directory), self)


def split(model: Any, stages: int | list[Any], cuts: list[str] | None = None,
          params: dict | None = None, rates: str | dict | None = None,
          link_bytes_per_s: float = TRANSFER_BYTES_PER_S, **build_options: Any) -> SplitResult:
    """``model`` cut into pipeline stages and each built (``hgrt.build(**build_options)``).

    ``stages``: a count (each stage on ``["cpu"]``) or one entry per stage: a device list, a
    dict ``{"devices": [...], "budget": bytes, "key": tracker_key}`` or a ``StageSpec``.
    ``cuts``: the binding names after which to cut (K - 1 of them), else chosen by cost.
    ``rates``: ``hgrt profile --json`` output (a path or its ``rates`` dict) for the estimate.
    ``link_bytes_per_s``: how fast a tensor goes from one stage's board to the next (default:
    Gigabit Ethernet); a cut's bytes cost the stage they enter that much time.
    """
    from hgrt.compiler import build
    from hgrt.relay_passes.inner.auto_place import read_rates

    if isinstance(stages, bool) or not isinstance(stages, int | list | tuple):
        raise BuildError(f"stages={stages!r}: a count or a list of stage specs")
    specs = [StageSpec() for _ in range(stages)] if isinstance(stages, int) \
        else [StageSpec.of(s) for s in stages]
    if len(specs) < 1:
        raise BuildError("a pipeline needs at least one stage")
    if not isinstance(link_bytes_per_s, int | float) or not link_bytes_per_s > 0:
        raise BuildError(f"link_bytes_per_s={link_bytes_per_s!r}: bytes per second > 0")
    measured = rates if isinstance(rates, dict) else read_rates(rates)
    m = _read(model, params, measured)
    split_weights: list[str] = []  # weights cut by columns so that the stages fit
    if cuts is not None:
        if len(cuts) != len(specs) - 1:
            raise BuildError(f"{len(specs)} stages need {len(specs) - 1} cut points, got "
                             f"{len(cuts)}")
        positions = _named_cuts(m, list(cuts))
    else:
        while True:
            try:
                positions = _cut_points(m, specs, link_bytes_per_s)
                break
            except BuildError as e:
                if not any(spec.budget for spec in specs) or "no cut into" not in str(e):
                    raise  # not a budget that no cut meets: cutting a weight would not help
                widest = _split_widest(m) if len(split_weights) < MAX_WEIGHT_SPLITS else None
                if widest is None:
                    raise BuildError(f"{e}; " + (f"even with the weights {split_weights} cut "
                                                 f"by columns" if split_weights else
                                                 "no matmul weight to cut by columns")) from None
                m = _read(widest[0], widest[1], measured)
                split_weights.append(widest[2])
    plans = plan_stages(m, positions, link_bytes_per_s)
    builds = []
    for spec, plan in zip(specs, plans, strict=True):
        mod, weights = _stage_module(m, plan)
        if spec.budget is not None and plan.weight_bytes > spec.budget:
            raise BuildError(f"stage {plan.index}: its weights take {plan.weight_bytes} bytes, "
                             f"over its budget of {spec.budget}")
        options = dict(build_options)
        if spec.target is not None:
            options["target"] = spec.target
        try:
            builds.append(build(mod, spec.devices, params=weights, **options))
        except BuildError as e:
            raise BuildError(f"stage {plan.index} ({', '.join(spec.devices)}): {e}") from e
    return SplitResult(specs, plans, builds, [_tensor(v) for v in m.inputs],
                       [_tensor(v) for v in m.outputs], split_weights)
