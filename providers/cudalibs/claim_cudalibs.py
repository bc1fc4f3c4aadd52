"""claim_cudalibs: hand convolutions, dense layers and matmuls on CUDA GPUs to cuBLAS/cuDNN.

The provider is chosen per op like oneDNN on the CPU (``hgrt.build(..., kernels=)``): "tvm"
leaves the op to TVM's GPU schedules, "cudalibs" claims it (a ``BuildError`` for a node an
override names that cuBLAS/cuDNN cannot compute), "auto" claims it where the NVIDIA wheels are
installed (the ``cuda`` extra) and the op is one where a library call pays (``pays``: measured
per op shape on an H200); it says once why not where the wheels are missing. Runs after the
batch norms are folded (``fold_batch_norm``: each is a per-channel multiply and add), so that a
chain

    conv2d(x, W)      [* per-channel c]* [+ per-channel c]* [+ residual] [+ per-channel c]*
                      [relu | clip(0, hi) | silu | sigmoid | tanh]
    matmul(x, W)      [reshape]* [+ bias] [relu]  W a constant [K, N]: a dense layer (its
                                                  reshapes keep N last)
    matmul(a, b)      [relu]                      b may be permute_dims(b', last two swapped)

on a CUDA device, each intermediate read once and on the same device, becomes one
``R.call_dps_packed("hgrt.cudalibs.<kind>_<attrs>", args, out)`` bound to the chain's last
variable (``names.py``). Scales are folded into W (a new weight that takes the old one's name
where nothing else reads it); biases become one [C] weight. Graph node attrs: ``provider``,
``cudalibs_op`` (what the kernel computes), ``flops``; the placement report's rows of claimed
ops say ``kernels: cudalibs``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import BuildError
from hgrt.providers.cudalibs import PROVIDER, names
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import (
    MainReader,
    bindings,
    copied_in,
    op_name,
    per_channel,
    scalar,
)
from hgrt.relay_passes.util.relax_util import float32_shape as _shape

__all__ = ["AUTO_MIN_DENSE_K", "AUTO_MIN_REDUCTION", "claim_cudalibs", "pays", "pays_why"]

_log = logging.getLogger("hgrt.build")
_said: set[str] = set()
# "auto": where a library call pays, measured per op on an H200 (each op alone as an hgrt
# module, run() medians; BENCHMARKS.md, "cuBLAS/cuDNN or TVM per op"). A cuBLAS/cuDNN call costs
# ~15-35 us more than a TVM kernel launch, so it pays where TVM's dlight schedules are slow:
# convolutions with a long reduction over few pixels (3x3 128->128 on 28x28: 70 vs 108 us;
# 512->512 on 7x7: 145 vs 397 us) and depthwise ones (96 channels on 112x112: 91 vs 936 us);
# dense layers with a long inner dimension (128x3072x768: 53 vs 137 us). TVM keeps 1x1
# convolutions (1024->256 on 14x14: 54 vs 133 us), wide 3x3 ones (64->64 on 56x56: 56 vs 119
# us), the stem, and dense layers of K <= 2048 (128x768x3072: 56 vs 64 us).
AUTO_MIN_REDUCTION = 1152  # a convolution's C_in/groups * kh * kw
AUTO_MIN_DENSE_K = 2048  # a dense layer's or matmul's inner dimension (more than this)


def pays(c: Chain) -> bool:
    """Whether "auto" gives the chain to cuBLAS/cuDNN (see AUTO_MIN_REDUCTION)."""
    return pays_why(c)[0]


def pays_why(c: Chain) -> tuple[bool, str]:
    """``pays`` and why, as the placement report's ``kernels_why`` says it."""
    if c.kind == "conv2d":
        o, i, kh, kw = c.weight.shape
        groups = int(c.root.value.attrs.groups)
        if groups > 1:
            what = "depthwise" if i == 1 else "grouped"
            return True, f"pays: {what} convolution {kh}x{kw} (cuDNN pays for grouped ones)"
        if (kh, kw) == (1, 1):
            return False, f"TVM faster: 1x1 convolution {i}->{o} (auto)"
        r = i * kh * kw
        return (True, f"pays: convolution {kh}x{kw} {i}->{o}, reduction {r} >= "
                      f"{AUTO_MIN_REDUCTION}") if r >= AUTO_MIN_REDUCTION else \
            (False, f"TVM faster: convolution {kh}x{kw} {i}->{o}, reduction {r} < "
                    f"{AUTO_MIN_REDUCTION} (auto)")
    k = int(_shape(c.args[0])[-1])
    return (True, f"pays: {c.kind} inner dimension {k} > {AUTO_MIN_DENSE_K}") \
        if k > AUTO_MIN_DENSE_K else \
        (False, f"TVM faster: {c.kind} inner dimension {k} <= {AUTO_MIN_DENSE_K} (auto)")


FLOAT32 = ("", "None", "void", "float32")  # an op's out_dtype that keeps float32
ACTIVATIONS = {"relax.nn.relu": "relu", "relax.nn.silu": "silu", "relax.sigmoid": "sigmoid",
               "relax.tanh": "tanh", "relax.clip": "clip"}


@dataclass
class Chain:
    kind: str  # "conv2d" | "dense" | "matmul"
    root: relax.VarBinding
    args: list[relax.Expr]  # x, W (conv2d, dense) or a, b (matmul)
    weight: np.ndarray | None = None  # conv2d: W with scales folded in
    bias: np.ndarray | None = None
    members: list[relax.Var] = field(default_factory=list)
    scaled: bool = False
    residual: relax.Var | None = None
    act: str | None = None
    clip_hi: float = 0.0
    trans_b: bool = False
    label: list[str] = field(default_factory=list)
    macs: int = 0

    @property
    def end(self) -> relax.Var:
        return self.members[-1]


class _Graph(MainReader):
    def __init__(self, func: relax.Function, ctx: BuildContext) -> None:
        super().__init__(func, ctx)
        self.copied = copied_in(func)
        self.producer = {b.var: b for b in bindings(func)}
        self.claimed: set[relax.Var] = set()

    def device(self, v: relax.Var) -> int | None:
        """The device a binding's result lives on: placed, or (a binding a later pass made,
        such as a folded batch norm's) its type's."""
        placed = self.ctx.placed.op_device.get(v.name)
        return placed if placed is not None else \
            self.ctx.device_of_vdevice(getattr(v.ty, "vdevice", None))

    def activation(self, v: relax.Expr) -> bool:
        return isinstance(v, relax.Var) and v not in self.weights


def _conv2d(g: _Graph, b: relax.VarBinding) -> Chain | None:
    call, a = b.value, b.value.attrs
    layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout))
    x, w = call.args
    xs, out, wv = _shape(x), _shape(b.var), g.value(w)
    pad = [int(p) for p in a.padding]
    if (layouts != ("NCHW", "OIHW", "NCHW") or str(a.out_dtype) not in FLOAT32
            or not g.activation(x) or xs is None or out is None or len(xs) != 4 or wv is None
            or wv.ndim != 4 or wv.dtype != np.float32 or pad[0] != pad[2] or pad[1] != pad[3]):
        return None
    return Chain("conv2d", b, [x, w], wv.copy(), np.zeros(out[1], "float32"), [b.var],
                 label=["conv2d"], macs=int(np.prod(out)) * int(np.prod(wv.shape[1:])))


def _matmul(g: _Graph, b: relax.VarBinding) -> Chain | None:
    x, w = b.value.args
    xs, ws, out = _shape(x), _shape(w), _shape(b.var)
    if (str(b.value.attrs.out_dtype) not in FLOAT32 or not g.activation(x)
            or xs is None or ws is None or out is None or len(xs) < 2):
        return None
    wv = g.value(w)
    if wv is not None:  # a dense layer: x [..., K] @ W [K, N]
        if (wv.ndim != 2 or wv.dtype != np.float32 or len(out) != len(xs)
                or xs[:-1] != out[:-1] or wv.shape != (xs[-1], out[-1])):
            return None
        return Chain("dense", b, [x, w], members=[b.var], label=["dense"],
                     macs=int(np.prod(out)) * xs[-1])
    if (not g.activation(w) or len(ws) != len(xs) or len(out) != len(xs)
            or xs[:-2] != ws[:-2] or out[:-2] != xs[:-2] or ws[-2] != xs[-1]):
        return None  # (broadcast batches stay TVM's)
    chain = Chain("matmul", b, [x, w], members=[b.var], label=["matmul"],
                  macs=int(np.prod(out)) * xs[-1])
    src = g.producer.get(w)
    perm = None if src is None or op_name(src.value) != "relax.permute_dims" else \
        src.value.attrs.axes
    r = len(ws)
    if (perm is not None and [int(i) for i in perm] == [*range(r - 2), r - 1, r - 2]
            and g.only_user(w) is b and w not in g.claimed and w not in g.copied
            and g.device(w) == g.device(b.var)):
        chain.args[1], chain.trans_b = src.value.args[0], True  # read b' transposed
        chain.members.insert(0, w)
        chain.label.insert(0, "transpose")
    return chain


def _step(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
    """Absorb ``b`` (the one reader of the chain's end) into the chain, if the kernel can."""
    op = op_name(b.value)
    if op == "relax.clip":
        lo, hi = scalar(b.value.args[1]), scalar(b.value.args[2])
        if lo != 0.0 or not np.isfinite(hi) or c.kind != "conv2d" or c.act is not None:
            return False
        c.act, c.clip_hi, tag = "clip", hi, "clip"
    elif op in ACTIVATIONS:
        if c.act is not None or (c.kind != "conv2d" and ACTIVATIONS[op] != "relu"):
            return False
        c.act = tag = ACTIVATIONS[op]
    elif op == "relax.reshape" and c.kind == "dense":  # rows regrouped: the same bytes
        shape = _shape(b.var)
        if shape is None or not shape or shape[-1] != _shape(c.end)[-1]:
            return False
        tag = "reshape"
    elif op in ("relax.add", "relax.multiply") and c.act is None and c.kind != "matmul":
        tag = _affine(g, c, b, op)
        if tag is None:
            return False
    else:
        return False
    c.members.append(b.var)
    c.label.append(tag)
    return True


def _affine(g: _Graph, c: Chain, b: relax.VarBinding, op: str) -> str | None:
    """A per-channel scale or bias, or a residual, absorbed: its label, or None."""
    lhs, rhs = b.value.args
    if lhs.same_as(rhs) or _shape(b.var) != _shape(c.end):
        return None
    other = rhs if lhs.same_as(c.end) else lhs
    value = g.value(other)
    scale = None if value is None else per_channel(value, _shape(c.end),
                                                   1 if c.kind == "conv2d" else -1)
    if op == "relax.multiply":  # a scale: into W and the bias, before any residual
        if scale is None or c.kind != "conv2d" or c.residual is not None:
            return None
        c.weight = (c.weight * scale.reshape(-1, 1, 1, 1)).astype("float32")
        c.bias = (c.bias * scale).astype("float32")
        c.scaled = True
        return "scale"
    if scale is not None:
        c.bias = scale if c.bias is None else (c.bias + scale).astype("float32")
        return "bias"
    if (c.kind == "conv2d" and c.residual is None and g.activation(other)
            and _shape(other) == _shape(c.end) and other not in g.copied):
        c.residual = other
        return "add"
    return None


def _grow(g: _Graph, c: Chain, block: set[relax.Var]) -> Chain:
    device = g.device(c.root.var)
    while True:
        b = g.only_user(c.end)
        if (b is None or b.var in g.claimed or b.var not in block
                or g.device(b.var) != device or not _step(g, c, b)):
            return c


def _cannot(b: relax.VarBinding) -> str:
    """Why cuBLAS/cuDNN cannot compute the conv2d or matmul of ``b`` (``_conv2d``, ``_matmul``
    said None)."""
    a = b.value.attrs
    if op_name(b.value) == "relax.nn.conv2d" and len(a.padding) == 4:
        pad = [int(p) for p in a.padding]
        if pad[0] != pad[2] or pad[1] != pad[3]:
            return f"asymmetric padding {pad}"
    return ("its kernels take float32 NCHW convolutions with symmetric padding, matmuls by a "
            "constant 2-D weight and matmuls of equal batch dimensions")


def find_chains(g: _Graph, kernels: Kernels, unusable: str | None) -> list[Chain]:
    """The chains cuBLAS/cuDNN compute, in binding order (see module doc); ``unusable``: why
    "auto" takes none here (the wheels missing), or None. The report's rows of the ops it
    could take say why it did or did not."""
    roots = {"relax.nn.conv2d": _conv2d, "relax.matmul": _matmul}
    chains = []
    for block in g.func.body.blocks:
        in_block = {b.var for b in block.bindings}
        for b in block.bindings:
            op = op_name(b.value)
            if op not in roots or b.var in g.claimed:
                continue
            choice, named = kernels.choice(b.var.name, op)
            if choice not in ("auto", PROVIDER.name):
                continue
            device = g.device(b.var)
            on_gpu = device is not None and PROVIDER.serves(g.ctx.devices[device])
            chain = roots[op](g, b) if on_gpu else None
            if chain is None:
                if on_gpu:
                    g.ctx.placed.say_why({b.var.name}, f"cuBLAS/cuDNN cannot: {_cannot(b)}")
                if named and choice == PROVIDER.name:
                    why = ("it is not on a CUDA device" if not on_gpu else
                           "cuBLAS/cuDNN kernels take float32 NCHW convolutions with symmetric "
                           "padding, matmuls by a constant 2-D weight and matmuls of equal "
                           "batch dimensions")
                    raise BuildError(f"kernels override {b.var.name!r}='cudalibs': cuBLAS/cuDNN "
                                     f"cannot compute this {op}: {why}")
                continue
            took, why = pays_why(chain) if choice == "auto" else \
                (True, f"asked: {kernels.said(b.var.name, op)}")
            if choice == "auto" and unusable is not None:
                took, why = False, f"cuBLAS/cuDNN unavailable: {unusable}"
            if not took:
                g.ctx.placed.say_why({b.var.name}, why)
                continue
            chains.append(_grow(g, chain, in_block))
            g.claimed.update(chains[-1].members)
            g.ctx.placed.say_why({v.name for v in chains[-1].members}, why, PROVIDER.name)
            # (a folded batch norm's bindings have no row: the root's speaks for them)
            g.ctx.placed.row_of.update({v.name: b.var.name for v in chains[-1].members})
    return chains


def _new_weight(g: _Graph, pname: str, value: np.ndarray, vdevice, taken: set[str],
                takes_over: bool) -> relax.Var:
    w = g.ctx.weights
    if not (takes_over and pname in w.source):
        pname = w.free_name(pname + ".cudalibs")
    return w.new_param(pname, value, vdevice, taken, "cuBLAS/cuDNN")


def _call(g: _Graph, c: Chain, taken: set[str], new: list[relax.Var]) -> relax.Call:
    vdevice = c.end.ty.vdevice
    args = list(c.args)
    if c.kind == "conv2d":
        w = c.args[1]
        pname = g.weights.get(w, c.root.var.name) if isinstance(w, relax.Var) else c.root.var.name
        if c.scaled:
            only_here = all(u is not None and u.var is c.root.var for u in g.users.get(w, [None]))
            args[1] = _new_weight(g, pname, c.weight, vdevice, taken, only_here)
            new.append(args[1])
        args.append(_new_weight(g, pname + ".bias", c.bias, vdevice, taken, False))
        new.append(args[-1])
        if c.residual is not None:
            args.append(c.residual)
        a = c.root.value.attrs
        name = names.conv2d_name([int(s) for s in a.strides], [int(p) for p in a.padding[:2]],
                                 [int(d) for d in a.dilation], int(a.groups),
                                 c.residual is not None, c.act, c.clip_hi)
    elif c.kind == "dense":
        if c.bias is not None:
            pname = g.weights.get(c.args[1], c.root.var.name)
            args.append(_new_weight(g, pname + ".bias", c.bias, vdevice, taken, False))
            new.append(args[-1])
        name = names.dense_name(c.bias is not None, c.act)
    else:
        name = names.matmul_name(c.trans_b, c.act)
    func = relax.ExternFunc(name)
    for key, value in {"provider": PROVIDER.name, "cudalibs_op": "+".join(c.label),
                       "flops": str(2 * c.macs)}.items():
        func = func.with_attr(key, value)
    return relax.op.call_dps_packed(func, relax.Tuple(args), c.end.ty)


def _rewrite(g: _Graph, chains: list[Chain]) -> relax.Function:
    func, ctx = g.func, g.ctx
    taken = {p.name for p in func.params} | {b.var.name for b in bindings(func)}
    new: list[relax.Var] = []
    calls = {c.end: _call(g, c, taken, new) for c in chains}
    drop = {v for c in chains for v in c.members[:-1]}
    blocks = []
    for block in func.body.blocks:
        kept = [relax.VarBinding(b.var, calls[b.var]) if b.var in calls else b
                for b in block.bindings if b.var not in drop]
        blocks.append(relax.DataflowBlock(kept) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(kept))
    body = relax.SeqExpr(blocks, func.body.body)
    used = set(relax.analysis.free_vars(body))
    n_in = int(func.attrs["num_input"])
    params = list(func.params[:n_in])
    w = ctx.weights
    new_names = {w.graph_names[v.name] for v in new}
    for p in func.params[n_in:]:
        if p in used:
            params.append(p)
            continue
        pname = w.graph_names.pop(p.name, p.name)
        if pname not in new_names:
            w.source.pop(pname, None)
    return relax.Function(params + new, body, func.ret_ty, func.is_pure, func.attrs)


def _unusable(ctx: BuildContext, kernels: Kernels) -> str | None:
    """Why "auto" takes no cuBLAS/cuDNN in this build (the wheels not installed here), or None;
    asking for "cudalibs" by name claims either way (a build for another machine)."""
    from hgrt.providers.cudalibs import kernels as runtime

    reason = runtime.unavailable_reason()
    if reason is None:
        return None
    if any(p == "auto" for _, p in kernels.choices()) and any(
            PROVIDER.serves(d) for d in ctx.devices):
        if reason not in _said:
            _said.add(reason)
            _log.warning("kernels: tvm on CUDA devices (%s)", reason)
        ctx.log(f"kernels: tvm on CUDA devices ({reason})")
    return reason


@contract(reads={"devices", "options", "placed", "weights"}, writes={"placed", "weights"},
          after=("insert_copies", "fold_batch_norm"), before=("legalize_and_fuse",))
def claim_cudalibs(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Claim what cuBLAS/cuDNN compute (see module doc); ``mod`` untouched when nothing is."""
    kernels = Kernels.of(ctx.options.kernels)
    func = mod["main"]
    asked = {p for _, p in kernels.choices()}
    if "num_input" not in (func.attrs or {}) or PROVIDER.name not in asked and (
            "auto" not in asked or not any(PROVIDER.serves(d) for d in ctx.devices)):
        return mod  # (asked for by name, it is checked even without a CUDA device)
    g = _Graph(func, ctx)
    chains = find_chains(g, kernels, _unusable(ctx, kernels))
    if not chains:
        return mod
    ctx.log(f"cuBLAS/cuDNN claim {len(chains)} ops: "
            + ", ".join(sorted({"+".join(c.label) for c in chains})))
    new = mod.clone()
    new.update_func(new.get_global_var("main"), _rewrite(g, chains))
    return new
