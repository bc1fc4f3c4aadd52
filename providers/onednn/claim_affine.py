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
and no TVM kernel before it loses an epilogue it would have fused), the chain's result is not
read by one TVM kernel alone (that kernel would fuse the chain into itself: one kernel and one
pass over the tensor, against two claimed; with a second reader the chain is a kernel of its
own either way), every link's constant is a weight or constant known at build that broadcasts
along the LAST axis only (channels-last, as ``channels_last`` keeps tensors between oneDNN
kernels), each intermediate is read by the next link alone, all on one device and float32 with
static shapes; the chain ends after its activation. A divisor with a zero does not fold, nor
does a constant divided by the tensor. The folded values live in a new weight ``<first
constant's name>.affine`` (float32: activation kind, its two bounds, scale, shift); constants
nothing else reads go. The node may write over ``x`` (``attrs.inplace``: the plan takes it
where ``x`` dies there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from hgrt.providers.onednn import PROVIDER
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import (
    CALL_DPS_PACKED,
    TO_VDEVICE,
    MainReader,
    bindings,
    callee,
    op_name,
    per_channel,
    scalar,
)
from hgrt.relay_passes.util.relax_util import float32_shape as _shape

ONEDNN_PREFIX = PROVIDER.func_prefix  # what its kernels' graph nodes call

FUNC_NAME = ONEDNN_PREFIX + "affine"
ACT = {"none": 0, "relu": 1, "clip": 2}  # providers/onednn/onednn_layout.cc AffineAct
LINKS = frozenset({"relax.multiply", "relax.add", "relax.subtract", "relax.divide"})
ACTIVATIONS = frozenset({"relax.nn.relu", "relax.clip"})


@dataclass
class _Chain:
    x: relax.Var
    scale: np.ndarray  # float64, one per channel
    shift: np.ndarray
    members: list[relax.Var] = field(default_factory=list)
    read: list[relax.Var] = field(default_factory=list)  # the weights it folded
    label: list[str] = field(default_factory=list)
    act: tuple[int, float, float] = (ACT["none"], 0.0, 0.0)

    @property
    def end(self) -> relax.Var:
        return self.members[-1]


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
            lo, hi = scalar(call.args[1]), scalar(call.args[2])
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
    vec = None if value is None or value.dtype.kind != "f" \
        else per_channel(value, shape, axis=-1)
    if vec is None:
        return False
    vec = vec.astype("float64")
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
        and callee(b.value)[0].startswith(ONEDNN_PREFIX)


def _candidates(g: MainReader, producer: dict) -> list[_Chain]:
    """Every chain that folds, in binding order: one starts at a link or activation reading a
    oneDNN kernel's result (or an earlier candidate's), grows while the next link is its result's
    only reader (same block, same device) and stops after its activation."""
    ctx = g.ctx
    chains: list[_Chain] = []
    ends: set[relax.Var] = set()
    taken: set[relax.Var] = set()

    def after_onednn(v: relax.Expr) -> bool:
        return isinstance(v, relax.Var) and (_onednn_result(producer.get(v)) or v in ends)

    for block in g.func.body.blocks:
        in_block = {b.var for b in block.bindings}
        for b in block.bindings:
            op = op_name(b.value)
            if b.var in taken or (op not in LINKS and op not in ACTIVATIONS):
                continue
            args = b.value.args[:1] if op in ACTIVATIONS else b.value.args
            x = next((a for a in args if after_onednn(a)), None)
            shape = _shape(x) if x is not None else None
            if not shape or shape[-1] < 1:
                continue
            # (bindings a pass made after placement, fold_batch_norm's, have no row: x's)
            device = ctx.placed.op_device.get(x.name)
            c = _Chain(x, np.ones(shape[-1]), np.zeros(shape[-1]))
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


def find_chains(g: MainReader) -> list[_Chain]:
    """The chains to claim, in binding order: the candidates whose input is a oneDNN kernel's
    result or a claimed chain's, and whose result is not read by one TVM kernel alone (FuseOps
    folds a chain into its only reader: one kernel and one pass over the tensor, against two
    when claimed). Dropping a chain can drop the chain that reads it: repeated until none
    changes."""
    producer = {b.var: b for b in bindings(g.func)}
    chains = _candidates(g, producer)
    while True:
        starts = {c.members[0] for c in chains}
        ends = {c.end for c in chains}
        kept = [c for c in chains  # (the input test holds by construction today: a chain
                # is dropped only after the one chain that reads it; kept as the invariant)
                if (_onednn_result(producer.get(c.x)) or c.x in ends)
                and not _fused_into_reader(g.users.get(c.end, []), starts)]
        if len(kept) == len(chains):
            return kept
        chains = kept


def _fused_into_reader(readers: list, starts: set[relax.Var]) -> bool:
    """A chain's result with these ``readers`` would be fused into a TVM kernel: its one reader
    is a TVM op (not the function's result, a oneDNN kernel, a copy, or the first link of a
    claimed chain)."""
    if len(readers) != 1 or readers[0] is None:
        return False
    reader = readers[0]
    return not (_onednn_result(reader) or op_name(reader.value) == TO_VDEVICE
                or reader.var in starts)


def _params(c: _Chain) -> np.ndarray:
    kind, lo, hi = c.act
    return np.concatenate([[kind, lo, hi], c.scale, c.shift]).astype("float32")


# after fold_batch_norm: the batch norms it leaves are the multiplies and adds claimed here
@contract(reads={"placed", "weights"}, writes={"placed", "weights"},
          after=("fold_batch_norm", "claim_onednn"), before=("legalize_and_fuse",))
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
    ctx.placed.say_why({v.name for c in chains for v in c.members},
                       "follows: a per-channel scale and shift after a oneDNN kernel", "onednn")
    ctx.log(f"claim_affine: {len(chains)} per-channel chains on oneDNN: "
            + ", ".join(sorted({"+".join(c.label) for c in chains})))
    new = mod.clone()
    new.update_func(new.get_global_var("main"), relax.Function(
        params + new_params, body, func.ret_ty, func.is_pure, func.attrs))
    return new
