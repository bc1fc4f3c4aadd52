"""claim_affine: a per-channel affine chain after a oneDNN kernel becomes one oneDNN kernel.

What is left between oneDNN kernels once ``claim_onednn`` has folded every batch norm it could
into a convolution is a chain of element-wise ops over a channels-last tensor:

    x  [* a | + b | - b | b - | / a]*  [relu | clip]      a, b: one number per channel

(densenet121's 62 pre-activation batch norms, a batch norm and a scale layer each, then a ReLU:
``fold_batch_norm`` has made them multiplies and adds). As a TVM kernel such a chain runs on its
caller's thread alone (``threads.solo``: oneDNN's OpenMP threads still spin on the other cores
when it starts); folded at build into one ``scale`` and one ``shift`` per channel it is oneDNN's
binary multiply with an add and an eltwise post-op, ``hgrt.onednn.affine``, on oneDNN's own
threads. Measured on densenet121 (2 threads, AVX-512): its 62 chains 3.4 -> 1.5 ms in ``hgrt
profile``; the same model built with and without this pass, ``run()`` interleaved in one
process, 25.6 -> 22.6 ms (0.88x); hgrt / onnxruntime 0.83 -> 0.73, and 1.21 -> 1.13 on the AVX2
build (``bench_models.py --kernels onednn``).

Taken where ``x`` is the result of a oneDNN kernel (so the build uses oneDNN on that device,
and no TVM kernel before it loses an epilogue it would have fused), every link's constant is a
weight or constant known at build that broadcasts along the LAST axis only (channels-last, as
``channels_last`` keeps tensors between oneDNN kernels), each intermediate is read by the next
link alone, all on one device and float32 with static shapes; the chain ends after its
activation. A divisor with a zero is not folded. The folded values live in a new weight
``<first constant's name>.affine`` (float32: activation kind, its two bounds, scale, shift);
constants nothing else reads go. The node may write over ``x`` (``attrs.inplace``: the plan
takes it where ``x`` dies there). Runs after ``fold_batch_norm``, before lowering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from hgrt.relay_passes.context import BuildContext
from hgrt.relay_passes.relax_util import CALL_DPS_PACKED, MainReader, bindings, callee, op_name
from hgrt.relay_passes.relax_util import float32_shape as _shape

FUNC_NAME = "hgrt.onednn.affine"
ACT = {"none": 0, "relu": 1, "clip": 2}  # runtime/onednn_shim.cc AffineAct
LINKS = frozenset({"relax.multiply", "relax.add", "relax.subtract", "relax.divide"})
ACTIVATIONS = frozenset({"relax.nn.relu", "relax.clip"})


@dataclass
class _Chain:
    x: relax.Var
    device: int | None
    scale: np.ndarray  # float64, one per channel
    shift: np.ndarray
    members: list[relax.Var] = field(default_factory=list)
    read: list[relax.Var] = field(default_factory=list)  # the weights it folded
    label: list[str] = field(default_factory=list)
    act: tuple[int, float, float] = (ACT["none"], 0.0, 0.0)

    @property
    def end(self) -> relax.Var:
        return self.members[-1]


def _per_last_axis(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``value`` as one float64 number per entry of ``shape``'s last axis, if it broadcasts
    along that axis only."""
    if value.dtype.kind != "f" or value.ndim > len(shape):
        return None
    if value.size == 1:
        return np.full(shape[-1], float(value.reshape(())), "float64")
    padded = (1,) * (len(shape) - value.ndim) + value.shape
    if padded[-1] != shape[-1] or any(s != 1 for s in padded[:-1]):
        return None
    return value.reshape(-1).astype("float64")


def _float(expr) -> float:
    value = getattr(expr, "value", expr)
    return float(getattr(value, "value", value))


def _link(g: MainReader, c: _Chain, b: relax.VarBinding, shape: tuple[int, ...]) -> bool:
    """Fold ``b`` (reading the chain's end) into ``c``; False (``c`` untouched) if it does not
    fold."""
    call, op = b.value, op_name(b.value)
    if _shape(b.var) != shape:
        return False
    if op in ACTIVATIONS:
        if op == "relax.nn.relu":
            c.act = (ACT["relu"], 0.0, 0.0)
        else:
            lo, hi = _float(call.args[1]), _float(call.args[2])
            if not lo <= hi:
                return False
            c.act = (ACT["clip"], lo, hi)
        c.members.append(b.var)
        c.label.append(op.rsplit(".", 1)[-1])
        return True
    a, b2 = call.args
    first = isinstance(a, relax.Var) and a.same_as(c.end if c.members else c.x)
    const = b2 if first else a
    value = g.value(const)
    vec = None if value is None else _per_last_axis(value, shape)
    if vec is None:
        return False
    if op == "relax.multiply":
        c.scale, c.shift = c.scale * vec, c.shift * vec
    elif op == "relax.add":
        c.shift = c.shift + vec
    elif op == "relax.subtract" and first:
        c.shift = c.shift - vec
    elif op == "relax.subtract":  # b - x
        c.scale, c.shift = -c.scale, vec - c.shift
    elif op == "relax.divide" and first and np.all(vec != 0) and np.all(np.isfinite(vec)):
        c.scale, c.shift = c.scale / vec, c.shift / vec
    else:
        return False
    if isinstance(const, relax.Var):
        c.read.append(const)
    c.members.append(b.var)
    c.label.append(op.rsplit(".", 1)[-1])
    return True


def _onednn_result(b: relax.VarBinding | None) -> bool:
    return b is not None and op_name(b.value) == CALL_DPS_PACKED \
        and callee(b.value)[0].startswith("hgrt.onednn.")


def find_chains(g: MainReader) -> list[_Chain]:
    """The affine chains of ``main`` after oneDNN kernels, in binding order."""
    ctx = g.ctx
    producer = {b.var: b for b in bindings(g.func)}
    chains: list[_Chain] = []
    ends: set[relax.Var] = set()  # claimed chains' results: oneDNN's too
    taken: set[relax.Var] = set()
    for block in g.func.body.blocks:
        in_block = {b.var for b in block.bindings}
        for b in block.bindings:
            op = op_name(b.value)
            if b.var in taken or (op not in LINKS and op not in ACTIVATIONS):
                continue
            x = b.value.args[0] if op in ACTIVATIONS else next(
                (a for a in b.value.args if isinstance(a, relax.Var)
                 and (_onednn_result(producer.get(a)) or a in ends)), None)
            shape = _shape(x) if isinstance(x, relax.Var) else None
            if shape is None or not shape or shape[-1] < 1 or not (
                    _onednn_result(producer.get(x)) or x in ends):
                continue
            # (bindings a pass made after placement, fold_batch_norm's, have no row: x's)
            device = ctx.placed.op_device.get(x.name)
            c = _Chain(x, device, np.ones(shape[-1]), np.zeros(shape[-1]))
            nxt = b
            while nxt is not None and nxt.var not in taken and nxt.var in in_block \
                    and ctx.placed.op_device.get(nxt.var.name, device) == device \
                    and (op_name(nxt.value) in LINKS or op_name(nxt.value) in ACTIVATIONS) \
                    and c.act[0] == ACT["none"] and _link(g, c, nxt, shape):
                nxt = g.only_user(c.end)
            if c.members:
                chains.append(c)
                taken.update(c.members)
                ends.add(c.end)
    return chains


def _params(c: _Chain) -> np.ndarray:
    kind, lo, hi = c.act
    return np.concatenate([[kind, lo, hi], c.scale, c.shift]).astype("float32")


def claim_affine(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Claim the affine chains after oneDNN kernels (see module doc); ``mod`` untouched when
    there are none."""
    func = mod["main"]
    if "num_input" not in (func.attrs or {}):
        return mod
    g = MainReader(func, ctx)
    chains = find_chains(g)
    if not chains:
        return mod
    w = ctx.weights
    taken = {p.name for p in func.params} | {b.var.name for b in bindings(func)}
    graph_names = {p.name for p in func.params} | set(w.graph_names.values())
    new_params: list[relax.Var] = []
    calls: dict[relax.Var, relax.Expr] = {}
    for c in chains:
        first = c.read[0] if c.read else None
        base = g.weights.get(first, c.end.name) if first is not None else c.end.name
        pname = w.free_name(f"{base}.affine", graph_names)
        graph_names.add(pname)
        param = w.new_param(pname, _params(c), c.x.ty.vdevice, taken, "oneDNN affine")
        new_params.append(param)
        extern = relax.ExternFunc(FUNC_NAME)
        for key, value in (("provider", "onednn"), ("onednn_op", "+".join(c.label)),
                           ("inplace", "0")):
            extern = extern.with_attr(key, value)
        calls[c.end] = relax.op.call_dps_packed(extern, relax.Tuple([c.x, param]), c.end.ty)
    gone = {v for c in chains for v in c.members[:-1]}
    blocks = []
    for block in func.body.blocks:
        kept = [relax.VarBinding(b.var, calls[b.var]) if b.var in calls else b
                for b in block.bindings if b.var not in gone]
        blocks.append(type(block)(kept))
    body = relax.SeqExpr(blocks, func.body.body)
    params = w.kept_params(func, body, {v for c in chains for v in c.read})
    members = {v.name for c in chains for v in c.members}
    for row in ctx.placed.report:
        if row.node in members:
            row.kernels = "onednn"
    ctx.log(f"claim_affine: {len(chains)} per-channel chains on oneDNN: "
            + ", ".join(sorted({"+".join(c.label) for c in chains})))
    new = mod.clone()
    new.update_func(new.get_global_var("main"), relax.Function(
        params + new_params, body, func.ret_ty, func.is_pure, func.attrs))
    return new
