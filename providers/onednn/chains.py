"""The chains of ``main`` that one oneDNN kernel computes, found for ``claim_onednn``. A chain

    conv2d(x, W)  [+ per-channel weight | batch_norm]*  [post-op]*  [max_pool]
    matmul(x, W)  [+ bias]  [post-op]*

a post-op being a residual add (one), an activation, or a quantize read only by a dequantize of
the same scale and zero point (a QDQ model's activations: the grid as a post-op), up to
``MAX_POST_OPS`` of them, on a CPU device, W a weight, each intermediate read once (the max pool
only after a convolution of the model's input: a stem, run in oneDNN's blocked layout), starts
at a root op (``ROOTS``) and absorbs what follows it, one binding at a time (``STEPS``, a rule
per op). Per-channel multiplies and adds (batch norms, scale layers, a bias after a residual
add) are folded into W and the bias as they are absorbed. ``header`` is a chain's blob
header (``onednn_blob.make_header``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tvm import relax

from hgrt.errors import BuildError
from hgrt.providers.onednn import channels_last
from hgrt.providers.onednn.blob import MAX_POST_OPS, SLOT, make_header
from hgrt.providers.onednn.policy import runs_onednn
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.relax_util import (
    MainReader,
    bindings,
    copied_in,
    match_op_rule,
    op_name,
    per_channel,
    reads_only_item0,
    scalar,
)
from hgrt.relay_passes.util.relax_util import float32_shape as _shape


@dataclass
class Chain:
    """A claimed chain: its root op, the bindings it absorbs, and what it computes."""

    kind: str  # "conv2d" | "dense"
    root: relax.VarBinding
    x: relax.Var
    weight: np.ndarray  # plain (OIHW, or OI for dense), float32, batch norms folded in
    bias: np.ndarray
    members: list[relax.Var] = field(default_factory=list)  # root first, end last
    read: list[relax.Expr] = field(default_factory=list)  # weights the chain absorbed
    residual: relax.Var | None = None
    residual_at: relax.Var | None = None  # the member that reads the residual
    post: list[tuple[str, float, float]] = field(default_factory=list)
    label: list[str] = field(default_factory=list)
    pool: list[int] | None = None  # a max pool after it (its last member): kh, kw, sh, sw,
    # pads t, l, b, r
    choice: str = "auto"  # the provider asked for it: "auto" or "onednn" (Kernels)
    # an int8 kernel (int8.to_int8; weight then int8): its input's uint8 grid (scale, zero
    # point) and the weights' scales per output channel (the input's scale folded in)
    grid: tuple[float, int] | None = None
    wscale: np.ndarray | None = None
    # what the auto choice models: the chain would compute in int8 (``int8.int8_able`` on a
    # host with VNNI)
    int8_able: bool = False

    @property
    def end(self) -> relax.Var:
        return self.members[-1]

    @property
    def conv_result(self) -> relax.Var:
        """The convolution's (or dense layer's) result with its post-ops: the pool's input."""
        return self.members[-2] if self.pool is not None else self.end

    def tail(self) -> np.ndarray:
        """What the blob holds after the weights: the bias, then an int8 kernel's scales."""
        return self.bias if self.wscale is None else np.concatenate([self.bias, self.wscale])

    @property
    def macs(self) -> int:
        """Multiply-adds of the convolution or dense layer (without its post-ops)."""
        out = _shape(self.root.var) or ()
        return int(np.prod(out)) * (self.weight.size // max(self.weight.shape[0], 1))


class ChainGraph(MainReader):
    """What matching needs to know about ``main``: who reads a variable, what is a weight
    (``MainReader``), which chains claimed what, and what was copied in."""

    def __init__(self, func: relax.Function, ctx: BuildContext) -> None:
        super().__init__(func, ctx)
        self.claimed: set[relax.Var] = set()
        # tensors copied in from another device: a chain never waits for one (see _add)
        self.copied = copied_in(func)
        self.declined: dict[str, str] = {}  # root binding asked of oneDNN -> why it cannot
        # the dataflow block of each binding (a chain never spans two)
        self.block_of = {b.var: k for k, block in enumerate(func.body.blocks)
                         for b in block.bindings}
        self.binding_of = {b.var: b for b in bindings(func)}


# ---- chain roots: the op a kernel computes -------------------------------------------------

def _fp32_out(call: relax.Call) -> bool:
    return str(call.attrs.out_dtype) in ("", "None", "void", "float32")


def _conv2d(g: ChainGraph, b: relax.VarBinding) -> Chain | None:
    call, a = b.value, b.value.attrs
    layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout))
    if layouts != ("NCHW", "OIHW", "NCHW") or not _fp32_out(call):
        return None
    x, w = call.args
    xs, out, wv = _shape(x), _shape(b.var), g.value(w)
    if (not isinstance(x, relax.Var) or x in g.weights or xs is None or out is None
            or len(xs) != 4 or wv is None or wv.ndim != 4 or wv.dtype != np.float32):
        return None
    return Chain("conv2d", b, x, wv.copy(), np.zeros(out[1], "float32"), [b.var], [w],
                 label=["conv2d"])


def _dense(g: ChainGraph, b: relax.VarBinding) -> Chain | None:
    """An activation of any rank times a constant 2-D weight: the leading dimensions are rows
    of one inner product (a contiguous tensor's bytes are the same either way)."""
    x, w = b.value.args
    xs, out, wv = _shape(x), _shape(b.var), g.value(w)
    if (not _fp32_out(b.value) or not isinstance(x, relax.Var)
            or x in g.weights or xs is None or out is None or len(xs) < 2 or wv is None
            or wv.ndim != 2 or wv.dtype != np.float32 or len(out) != len(xs)
            or xs[:-1] != out[:-1] or wv.shape != (xs[-1], out[-1])):
        return None
    return Chain("dense", b, x, np.ascontiguousarray(wv.T), np.zeros(out[-1], "float32"),
                 [b.var], [w], label=["dense"])


def _channel_axis(c: Chain) -> int:
    """The axis of the chain's output channels: NCHW's 1, a dense layer's last."""
    return -1 if c.kind == "dense" else 1


# ---- chain steps: what a kernel absorbs after its op ---------------------------------------

def _add(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    lhs, rhs = b.value.args
    if lhs.same_as(rhs) or _shape(b.var) != _shape(c.end):
        return False
    other = rhs if lhs.same_as(c.end) else lhs
    value = g.value(other)
    if value is not None:  # a per-channel weight: into the bias, before any post-op but a
        # sum (it adds either side of a residual: split_concat puts the bias after the sum)
        bias = None if any(p[0] != "sum" for p in c.post) \
            else per_channel(value, _shape(c.end), _channel_axis(c))
        if bias is None:
            return False
        c.bias, c.label = c.bias + bias, [*c.label, "bias"]
        c.read.append(other)
    elif (isinstance(other, relax.Var) and _shape(other) == _shape(c.end) and c.residual is None
          and len(c.post) < MAX_POST_OPS and other not in g.copied):
        # (a residual copied from another device would make this kernel wait for that
        # device: the add of two devices' work stays a TVM kernel of its own,
        # inner/lowering_rewrites.py)
        c.residual, c.residual_at, c.label = other, b.var, [*c.label, "add"]
        c.post.append(("sum", 0.0, 0.0))
    else:
        return False
    c.members.append(b.var)
    return True


def _multiply(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    """A per-channel weight times the chain's result: into the weights and the bias."""
    lhs, rhs = b.value.args
    other = rhs if lhs.same_as(c.end) else lhs
    value = g.value(other)
    if value is None or c.post or c.residual is not None or _shape(b.var) != _shape(c.end):
        return False
    scale = per_channel(value, _shape(c.end), _channel_axis(c))
    if scale is None:
        return False
    c.weight = (c.weight * scale.reshape((-1,) + (1,) * (c.weight.ndim - 1))).astype("float32")
    c.bias = (c.bias * scale).astype("float32")
    c.members.append(b.var)
    c.read.append(other)
    c.label.append("scale")
    return True


def _outputs(g: ChainGraph, b: relax.VarBinding) -> tuple[relax.Var | None, list[relax.Var]]:
    """The variable that takes output 0 of the tuple ``b`` makes, and the unused others."""
    if not reads_only_item0(g.users, b.var):
        return None, []
    items = g.users[b.var]
    first = [u.var for u in items if u.value.index == 0]
    unused = [u.var for u in items if u.value.index != 0]
    return (first[0], unused) if len(first) == 1 else (None, [])


def _batch_norm(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    call, a = b.value, b.value.attrs
    values = [g.value(v) for v in call.args[1:]]
    item, unused = _outputs(g, b)
    if (c.post or int(a.axis) != 1 or any(v is None for v in values) or item is None
            or getattr(a, "training", False) or (c.kind == "dense" and len(_shape(c.end)) != 2)):
        return False
    channels = _shape(c.end)[1]
    if any(v.size != channels for v in values):  # one value per channel of axis 1
        return False
    gamma, beta, mean, var = (v.reshape(channels).astype("float32") for v in values)
    gamma = gamma if a.scale else np.ones_like(gamma)
    beta = beta if a.center else np.zeros_like(beta)
    scale = gamma / np.sqrt(var + np.float32(float(a.epsilon)))
    c.weight = (c.weight * scale.reshape((-1,) + (1,) * (c.weight.ndim - 1))).astype("float32")
    c.bias = ((c.bias - mean) * scale + beta).astype("float32")
    c.members += [b.var, *unused, item]
    c.read += list(call.args[1:])
    c.label.append("batch_norm")
    return True


# Relax's activations that oneDNN computes as an eltwise post-op: its POST_OP and (alpha, beta)
ACTIVATIONS = {"relax.nn.relu": ("relu", 0.0, 0.0), "relax.nn.gelu": ("gelu_erf", 0.0, 0.0),
               "relax.nn.gelu_tanh": ("gelu_tanh", 0.0, 0.0), "relax.nn.silu": ("swish", 1.0, 0.0),
               "relax.sigmoid": ("sigmoid", 0.0, 0.0), "relax.tanh": ("tanh", 0.0, 0.0)}


def _activation(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    op = op_name(b.value)
    if len(c.post) >= MAX_POST_OPS or str(b.var.ty.dtype) != "float32":
        return False
    if op == "relax.clip":
        kind, lo, hi = "clip", scalar(b.value.args[1]), scalar(b.value.args[2])
    else:
        kind, lo, hi = ACTIVATIONS[op]
    c.post.append((kind, lo, hi))
    c.members.append(b.var)
    c.label.append(kind)
    return True


# a quantize's int8 or uint8 grid: the post-op that rounds onto it
QUANT_POST = {"int8": "quant_s8", "uint8": "quant_u8"}


def quant_scalars(g: ChainGraph, call: relax.Call) -> tuple[float, float] | None:
    """The scale and zero point of a quantize or dequantize where both are one number."""
    s, z = g.value(call.args[1]), g.value(call.args[2])
    if s is None or z is None or s.size != 1 or z.size != 1:
        return None
    scale, zero = float(s.reshape(())), float(z.reshape(()))
    with np.errstate(over="ignore", divide="ignore"):
        inverse = np.float32(1) / np.float32(scale)  # what the post-op multiplies by
    return (scale, zero) if np.isfinite(scale) and scale > 0 and np.isfinite(inverse) else None


def _quantize(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    """A quantize read only by a dequantize of the same scale and zero point (how a QDQ model
    writes its activations): the float result rounded onto the grid and clipped to it, one
    post-op (the shim's ``quant_s8`` or ``quant_u8``: its scale and zero point)."""
    dq = g.only_user(b.var)
    kind = QUANT_POST.get(str(b.value.attrs.out_dtype))
    if (dq is None or kind is None or op_name(dq.value) != "relax.dequantize"
            or len(c.post) >= MAX_POST_OPS or str(dq.var.ty.dtype) != "float32"
            or dq.var in g.claimed or g.block_of.get(dq.var) != g.block_of.get(b.var)
            or g.ctx.placed.op_device.get(dq.var.name) != g.ctx.placed.op_device.get(
                c.root.var.name)):
        return False
    grid = quant_scalars(g, b.value)
    if grid is None or grid != quant_scalars(g, dq.value):
        return False
    c.post.append((kind, *grid))
    c.members += [b.var, dq.var]
    c.label.append("quantize")
    return True


def _max_pool(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    """A max pool after a convolution of the model's input (its stem: squeezenet, resnet,
    inception, densenet). oneDNN picks a blocked layout for a convolution of a few plain
    channels; the pool runs in it too, and only its 4x smaller result is reordered (squeezenet's
    stem: 370 us + a 90 us pool of NHWC vs onnxruntime's 190 us, AVX-512)."""
    a = b.value.attrs
    window = channels_last.pool_window(a)
    if (c.kind != "conv2d" or not any(c.x.same_as(p) for p in g.func.params)
            or c.residual is not None or window is None or window[8:] != [1, 1]
            or str(a.layout) != "NCHW" or str(a.out_layout or "NCHW") != "NCHW"):
        return False
    c.pool = window[:8]
    c.members.append(b.var)
    c.label.append("max_pool")
    return True


def _reshape(g: ChainGraph, c: Chain, b: relax.VarBinding) -> bool:
    """A reshape of a dense layer's result that keeps its last axis (rows merged or split, the
    same bytes) where a step the chain takes reads it next (an activation, the bias, a
    residual): the chain goes on through it (an exporter's ``x.view(-1, n) @ W`` then
    ``.view(b, s, n)`` before the GELU)."""
    src, dst, after = _shape(c.end), _shape(b.var), g.only_user(b.var)
    if (c.kind != "dense" or src is None or dst is None or src[-1:] != dst[-1:]
            or int(np.prod(src)) != int(np.prod(dst)) or after is None
            or STEPS.get(op_name(after.value)) not in (_add, _activation)):
        return False
    c.members.append(b.var)
    return True


ROOTS: dict[str, Callable[[ChainGraph, relax.VarBinding], Chain | None]] = {
    "relax.nn.conv2d": _conv2d, "relax.matmul": _dense}
STEPS: dict[str, Callable[[ChainGraph, Chain, relax.VarBinding], bool]] = {
    "relax.add": _add, "relax.multiply": _multiply, "relax.nn.batch_norm": _batch_norm,
    "relax.clip": _activation, "relax.nn.max_pool2d": _max_pool, "relax.quantize": _quantize,
    "relax.reshape": _reshape,
    **{op: _activation for op in ACTIVATIONS}}


def check_choices(func: relax.Function, kernels: Kernels, also: frozenset[str] = frozenset()
                  ) -> None:
    """Every node an override names is a convolution or matmul of ``main`` (or an op of
    ``also``: the row kernels'), and every rule can match one (a provider is chosen for those
    ops only)."""
    chosen = set(ROOTS) | also
    ops = {b.var.name: op_name(b.value) for b in bindings(func)}
    roots = [name for name, op in ops.items() if op in chosen]
    for name in kernels.overrides:
        if ops.get(name) not in chosen:
            parts = [r for r in roots if r.startswith(f"{name}_part")]
            what = ("is not a binding of main" if name not in ops else f"is a {ops[name]}") + (
                f" (split_concat split its convolution into {parts}: name those)" if parts else "")
            raise BuildError(f"kernels override {name!r}: {what}; providers are chosen for "
                             f"convolutions, matmuls, layer norms and softmaxes: {roots[:20]}"
                             f"{' ...' if len(roots) > 20 else ''}")
    for rule in kernels.rules:
        if not any(match_op_rule(op, {rule: None}) for op in chosen):
            raise BuildError(f"kernels rule {rule!r} matches no op a provider is chosen for: "
                             f"{sorted(op.removeprefix('relax.') for op in chosen)}")


def _grow(g: ChainGraph, chain: Chain, block: set[relax.Var]) -> Chain:
    device = g.ctx.placed.op_device.get(chain.root.var.name)
    while True:
        b = g.only_user(chain.end)
        step = None if b is None else STEPS.get(op_name(b.value))
        if (step is None or chain.pool is not None or b.var in g.claimed or b.var not in block
                or g.ctx.placed.op_device.get(b.var.name) != device or not step(g, chain, b)):
            return chain


def find_chains(g: ChainGraph, kernels: Kernels,
                claim: frozenset[str] = frozenset({"auto", "onednn"})) -> list[Chain]:
    """The chains of ``main`` that oneDNN kernels compute, in binding order: those whose root
    op ``kernels`` gives to a provider in ``claim`` and that oneDNN can compute. A node that an
    override gives to "onednn" and oneDNN cannot compute is a BuildError."""
    ctx = g.ctx
    chains = []
    for block in g.func.body.blocks:
        in_block = {b.var for b in block.bindings}
        for b in block.bindings:
            root = ROOTS.get(op_name(b.value))
            if root is None:
                continue
            choice, named = kernels.choice(b.var.name, op_name(b.value))
            if choice not in claim:
                continue
            device = ctx.placed.op_device.get(b.var.name)
            if device is None or not runs_onednn(ctx, device):
                chain = None
                why = "it is not on an x86-64 CPU" if device is not None else "it has no device"
            else:
                chain = root(g, b)
                why = ("oneDNN kernels take float32 NCHW convolutions and matmuls of an "
                       "activation by a constant 2-D weight, or of two activations of rank 2 "
                       "or more")
            if chain is None:
                if device is None or not ctx.devices[device].is_gpu:  # (a GPU's: not ours)
                    g.declined[b.var.name] = why
                two = op_name(b.value) == "relax.matmul" and all(  # (a row kernel's, rows.py)
                    isinstance(a, relax.Var) and a not in g.weights for a in b.value.args)
                if named and choice == "onednn" and not two:
                    raise BuildError(f"kernels override {b.var.name!r}='onednn': oneDNN cannot "
                                     f"compute this {op_name(b.value)}: {why}")
                continue
            chain.choice = choice
            chains.append(_grow(g, chain, in_block))
            g.claimed.update(chain.members)
    return chains


def header(chain: Chain) -> np.ndarray:
    """The blob header of ``chain`` (``make_header`` from its ops' attributes)."""
    if chain.kind == "dense":  # leading dimensions as rows
        xs, out = _shape(chain.x), _shape(chain.end)
        return make_header("dense", (int(np.prod(xs[:-1])), xs[-1]),
                           (int(np.prod(out[:-1])), out[-1]), post=chain.post, grid=chain.grid)
    a = chain.root.value.attrs
    h = make_header("conv2d", _shape(chain.x), _shape(chain.conv_result),
                    chain.weight.shape[2:], a.strides, a.padding, a.dilation, int(a.groups),
                    chain.post, chain.grid)
    if chain.pool is not None:
        names = ("kh", "kw", "sh", "sw", "pad_t", "pad_l", "pad_b", "pad_r")
        for name, value in zip(names, chain.pool, strict=True):
            h[SLOT[f"pool_{name}"]] = value
        h[SLOT["pool_oh"]], h[SLOT["pool_ow"]] = _shape(chain.end)[2:]
    return h
