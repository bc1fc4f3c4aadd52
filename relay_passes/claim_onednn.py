"""claim_onednn: hand convolutions and dense layers on x86-64 CPUs to oneDNN kernels.

The kernel provider is chosen per op at build, like a device (``hgrt.build(..., kernels=)``: a
provider for the whole build, or ``Kernels`` with rules by op and overrides by node): ``"tvm"``
leaves the op to TVM; ``"onednn"`` claims it, and is a ``BuildError`` where oneDNN cannot run
or, for a node named by an override, cannot compute it; ``"auto"`` claims where it can and
otherwise says once why not. Runs after insert_copies
(devices known, weights per device) and split_concat, before legalization. A chain

    conv2d(x, W)  [+ per-channel weight | batch_norm]*  [+ residual [+ bias]]  [relu | clip]
                  [max_pool]
    matmul(x, W)  [+ bias]                                                      [relu | clip]

on a CPU device, W a weight, each intermediate read once (the max pool only after a convolution
of the model's input: a stem, run in oneDNN's blocked layout), becomes one
``R.call_dps_packed("hgrt.onednn.conv2d", (x, packed[, residual]), out)`` bound to the chain's
last variable. ``packed`` is a new weight (a uint8 blob): a header (``HEADER_SLOTS``), W with
batch norms folded in, packed once in the layout oneDNN picks on this machine, then the bias.
The residual add and the activation are oneDNN post-ops (a binary add that reads an NHWC
residual in place, else ``sum``; ``eltwise``); the node offers the output the residual's bytes
(``attrs.inplace``), and where the memory plan takes the offer the kernel adds with ``sum``
into them, reading the residual once. Per-channel multiplies and adds (batch norms,
scale layers) are folded into W and the bias. Weights the chains read are dropped when nothing
else reads them. Activations stay NHWC between oneDNN
kernels and through the TVM ops between them where ``channels_last`` says so; a reorder node
turns them back to NCHW before any other reader. The ExternFunc's attrs become graph node attrs
(``provider``, ``onednn_op``, ``onednn_isa``, ``onednn_impl``, ``onednn_layouts``, ``flops``,
``inplace``), and the placement report's rows of claimed ops say ``kernels: onednn``.

Reads ``ctx.options.kernels`` and ``ctx.options.onednn`` (the runtime side, handed down by the
caller: ``unavailable_reason()``, ``pack()``, ``isa()``, ``implementation()``,
``layout_name()``), ``ctx.placed`` and ``ctx.weights``; writes new weights to ``ctx.weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import resolve_device
from hgrt.errors import BuildError
from hgrt.graph import ONEDNN_PREFIX
from hgrt.relay_passes import channels_last
from hgrt.relay_passes.context import BuildContext
from hgrt.relay_passes.relax_util import (
    MainReader,
    bindings,
    copied_in,
    match_op_rule,
    op_name,
    per_channel,
    reads_only_item0,
    scalar,
)
from hgrt.relay_passes.relax_util import float32_shape as _shape

KERNELS = ("auto", "tvm", "onednn")
# version 4 (5 for Winograd, set at pack): the checksum covers the header and the weights
MAGIC, HEADER_VERSION, HEADER_INT64 = 0x4C4E4E4454524748, 4, 64
MAX_POST_OPS = 3
# the blob header, int64 slots; runtime/onednn_shim.cc `enum Slot` names the same positions
HEADER_SLOTS = ("magic", "version", "kind", "n", "ic", "ih", "iw", "oc", "oh", "ow", "kh", "kw",
                "sh", "sw", "pad_t", "pad_l", "pad_b", "pad_r", "dil_h", "dil_w", "groups",
                *(f"post{k}{s}" for k in range(MAX_POST_OPS) for s in ("", "_alpha", "_beta")),
                "wei_tag", "wei_offset", "wei_bytes", "bias_offset", "isa", "dnnl_version",
                "src_tag", "dst_tag", "res_tag",  # activations: 0 NCHW, or NHWC
                "checksum",  # of the packed bytes
                # a max pool after the convolution (a model's stem; 0: none), its output H, W
                "pool_kh", "pool_kw", "pool_sh", "pool_sw", "pool_pad_t", "pool_pad_l",
                "pool_pad_b", "pool_pad_r", "pool_oh", "pool_ow",
                "algo")  # a convolution's algorithm: 0 direct, 1 Winograd F(4x4, 3x3)
SLOT = {name: i for i, name in enumerate(HEADER_SLOTS)}
KIND = {"conv2d": 1, "dense": 2}
POST_OP = {"relu": 1, "clip": 2, "sum": 3}
FUNC_NAME = {kind: ONEDNN_PREFIX + kind for kind in ("conv2d", "dense")}
_log = logging.getLogger("hgrt.build")
_said: set[str] = set()
# "auto" leaves a model to TVM when all it would claim is fewer multiply-adds than this: a
# oneDNN call costs ~4.5 us where a small TVM kernel takes ~1.5 us, and a lone convolution
# adds reorders at its plain input and output (2 vCPUs, AVX-512: 16->16 3x3 on 8x8, 147k
# multiply-adds, 6.0 us TVM vs 9.3 us oneDNN; 32->32 3x3 on 16x16, 2.4M, 28.6 vs 28.6 us)
AUTO_MIN_MACS = 1 << 21
# by default Winograd's larger weights (4x a convolution's) may add at most this share of the
# model's weight bytes: the convolutions with the most output tiles first, as they save the
# most time per byte. Over the zoo this keeps the default build's planned bytes within 1.10x
# of a build on TVM's kernels (the direct oneDNN build plans 0.77-1.10x of it);
# ``Kernels(winograd=True)`` takes every convolution where Winograd is faster.
WINOGRAD_SHARE = 0.10


@dataclass
class Kernels:
    """Who computes each convolution and dense layer of a build, chosen per op like a device:
    an ``overrides`` entry for the node (the binding name of its conv2d or matmul, as
    ``BuildResult.print_placement()`` lists it), else the first of ``rules`` whose op pattern
    matches (as ``Placement`` rules: ``"nn.conv2d"``, ``"matmul"``, ``"nn.*"``), else
    ``default``; each one of ``KERNELS``. ``hgrt.build(kernels="onednn")`` is
    ``Kernels("onednn")``. ``winograd``: oneDNN's 3x3 convolutions between NHWC tensors run as
    Winograd F(4x4, 3x3) where that measured faster (``winograd_pays``), and their weights then
    take 4x the bytes (36 numbers per filter instead of 9). A number (default
    ``WINOGRAD_SHARE``, 0.10) bounds the bytes Winograd adds by that share of the model's
    weights, the convolutions with the most output tiles first; ``True`` takes every one where
    it is faster, ``False`` none. The build log says what the choice costs.

    >>> Kernels("onednn", rules={"matmul": "tvm"}, overrides={"lv12": "tvm"})  # doctest: +SKIP
    """

    default: str = "auto"
    rules: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    winograd: bool | float = WINOGRAD_SHARE

    @classmethod
    def of(cls, value: Any) -> Kernels:
        """``value`` (a provider name or a ``Kernels``) as a checked ``Kernels``."""
        kernels = value if isinstance(value, cls) else cls(value) if isinstance(value, str) \
            else None
        if kernels is None:
            raise BuildError(f"kernels={value!r}: a provider ({list(KERNELS)}) or hgrt.Kernels")
        for what, table in (("rules", kernels.rules), ("overrides", kernels.overrides)):
            if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
                raise BuildError(f"Kernels {what}={table!r}: a dict from "
                                 f"{'op pattern' if what == 'rules' else 'node name'} to provider")
        w = kernels.winograd
        if not isinstance(w, bool) and not (isinstance(w, int | float) and w >= 0):
            raise BuildError(f"Kernels winograd={w!r}: True (wherever it is faster), False "
                             f"(never) or the share of the model's weight bytes it may add "
                             f"(a number >= 0; default {WINOGRAD_SHARE})")
        for where, provider in kernels.choices():
            if provider not in KERNELS:
                raise BuildError(f"{where}={provider!r}: choose one of {list(KERNELS)}")
        return kernels

    def choices(self) -> list[tuple[str, str]]:
        """(where it was said, provider) for the default, each rule and each override."""
        return [("kernels", self.default),
                *((f"kernels rule {k!r}", v) for k, v in self.rules.items()),
                *((f"kernels override {k!r}", v) for k, v in self.overrides.items())]

    def choice(self, node: str, op: str) -> tuple[str, bool]:
        """The provider of ``node`` (a binding of ``op``) and whether an override named it."""
        if node in self.overrides:
            return self.overrides[node], True
        rule = match_op_rule(op, self.rules)
        return (self.default if rule is None else self.rules[rule]), False


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

    @property
    def end(self) -> relax.Var:
        return self.members[-1]

    @property
    def conv_result(self) -> relax.Var:
        """The convolution's (or dense layer's) result with its post-ops: the pool's input."""
        return self.members[-2] if self.pool is not None else self.end

    @property
    def macs(self) -> int:
        """Multiply-adds of the convolution or dense layer (without its post-ops)."""
        out = _shape(self.root.var) or ()
        return int(np.prod(out)) * (self.weight.size // max(self.weight.shape[0], 1))


class _Graph(MainReader):
    """What matching needs to know about ``main``: who reads a variable, what is a weight
    (``MainReader``), which chains claimed what, and what was copied in."""

    def __init__(self, func: relax.Function, ctx: BuildContext) -> None:
        super().__init__(func, ctx)
        self.claimed: set[relax.Var] = set()
        # tensors copied in from another device: a chain never waits for one (see _add)
        self.copied = copied_in(func)


def _ints(values: Any, n: int) -> list[int]:
    out = [int(v) for v in values]
    return out * (n // len(out)) if len(out) in (1, n // 2) else out


# ---- chain roots: the op a kernel computes -------------------------------------------------

def _fp32_out(call: relax.Call) -> bool:
    return str(call.attrs.out_dtype) in ("", "None", "void", "float32")


def _conv2d(g: _Graph, b: relax.VarBinding) -> Chain | None:
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


def _dense(g: _Graph, b: relax.VarBinding) -> Chain | None:
    x, w = b.value.args
    xs, out, wv = _shape(x), _shape(b.var), g.value(w)
    if (not _fp32_out(b.value) or not isinstance(x, relax.Var)
            or x in g.weights or xs is None or out is None or len(xs) != 2 or wv is None
            or wv.ndim != 2 or wv.dtype != np.float32):
        return None
    return Chain("dense", b, x, np.ascontiguousarray(wv.T), np.zeros(out[1], "float32"),
                 [b.var], [w], label=["dense"])


# ---- chain steps: what a kernel absorbs after its op ---------------------------------------

def _add(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
    lhs, rhs = b.value.args
    if lhs.same_as(rhs) or _shape(b.var) != _shape(c.end):
        return False
    other = rhs if lhs.same_as(c.end) else lhs
    value = g.value(other)
    if value is not None:  # a per-channel weight: into the bias, before any post-op but a
        # sum (it adds either side of a residual: split_concat puts the bias after the sum)
        bias = None if any(p[0] != "sum" for p in c.post) else per_channel(value, _shape(c.end))
        if bias is None:
            return False
        c.bias, c.label = c.bias + bias, [*c.label, "bias"]
        c.read.append(other)
    elif (isinstance(other, relax.Var) and _shape(other) == _shape(c.end) and c.residual is None
          and len(c.post) < MAX_POST_OPS and other not in g.copied):
        # (a residual copied from another device would make this kernel wait for that
        # device: the add of two devices' work stays a TVM kernel of its own, lower.py)
        c.residual, c.residual_at, c.label = other, b.var, [*c.label, "add"]
        c.post.append(("sum", 0.0, 0.0))
    else:
        return False
    c.members.append(b.var)
    return True


def _multiply(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
    """A per-channel weight times the chain's result: into the weights and the bias."""
    lhs, rhs = b.value.args
    other = rhs if lhs.same_as(c.end) else lhs
    value = g.value(other)
    if value is None or c.post or c.residual is not None or _shape(b.var) != _shape(c.end):
        return False
    scale = per_channel(value, _shape(c.end))
    if scale is None:
        return False
    c.weight = (c.weight * scale.reshape((-1,) + (1,) * (c.weight.ndim - 1))).astype("float32")
    c.bias = (c.bias * scale).astype("float32")
    c.members.append(b.var)
    c.read.append(other)
    c.label.append("scale")
    return True


def _outputs(g: _Graph, b: relax.VarBinding) -> tuple[relax.Var | None, list[relax.Var]]:
    """The variable that takes output 0 of the tuple ``b`` makes, and the unused others."""
    if not reads_only_item0(g.users, b.var):
        return None, []
    items = g.users[b.var]
    first = [u.var for u in items if u.value.index == 0]
    unused = [u.var for u in items if u.value.index != 0]
    return (first[0], unused) if len(first) == 1 else (None, [])


def _batch_norm(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
    call, a = b.value, b.value.attrs
    values = [g.value(v) for v in call.args[1:]]
    item, unused = _outputs(g, b)
    if (c.post or int(a.axis) != 1 or any(v is None for v in values) or item is None
            or getattr(a, "training", False)):
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


def _activation(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
    if len(c.post) >= MAX_POST_OPS:
        return False
    kind = "relu" if op_name(b.value) == "relax.nn.relu" else "clip"
    lo, hi = (0.0, 0.0) if kind == "relu" else (scalar(b.value.args[1]), scalar(b.value.args[2]))
    c.post.append((kind, lo, hi))
    c.members.append(b.var)
    c.label.append(kind)
    return True


def _max_pool(g: _Graph, c: Chain, b: relax.VarBinding) -> bool:
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


ROOTS: dict[str, Callable[[_Graph, relax.VarBinding], Chain | None]] = {
    "relax.nn.conv2d": _conv2d, "relax.matmul": _dense}
STEPS: dict[str, Callable[[_Graph, Chain, relax.VarBinding], bool]] = {
    "relax.add": _add, "relax.multiply": _multiply, "relax.nn.batch_norm": _batch_norm,
    "relax.nn.relu": _activation, "relax.clip": _activation, "relax.nn.max_pool2d": _max_pool}


# ---- the pass ------------------------------------------------------------------------------

def _runs_onednn(ctx: BuildContext, device: int) -> bool:
    d = ctx.devices[device]
    triple = str(d.target.attrs.get("mtriple", "")) if d.kind == "cpu" else "none"
    return d.kind == "cpu" and (not triple or triple.startswith("x86_64"))


def _provider(ctx: BuildContext, kernels: Kernels) -> Any | None:
    """The oneDNN runtime when this build uses it, else None (saying why once)."""
    asked = [(where, p) for where, p in kernels.choices() if p != "tvm"]
    if not asked:
        return None
    runtime = ctx.options.onednn
    reason = "no oneDNN runtime given" if runtime is None else runtime.unavailable_reason()
    if reason is None and not any(_runs_onednn(ctx, d.index) for d in ctx.devices):
        reason = "no device of this build is an x86-64 CPU"
    if reason is None:
        return runtime
    for where, provider in asked:
        if provider == "onednn":
            raise BuildError(f"{where}='onednn': {reason}")
    if reason not in _said:
        _said.add(reason)
        _log.warning("kernels: tvm (%s)", reason)
    ctx.log(f"kernels: tvm ({reason})")
    return None


def _check_choices(func: relax.Function, kernels: Kernels) -> None:
    """Every node an override names is a convolution or matmul of ``main``, and every rule can
    match one (a provider is chosen for those ops only)."""
    ops = {b.var.name: op_name(b.value) for b in bindings(func)}
    roots = [name for name, op in ops.items() if op in ROOTS]
    for name in kernels.overrides:
        if ops.get(name) not in ROOTS:
            parts = [r for r in roots if r.startswith(f"{name}_part")]
            what = ("is not a binding of main" if name not in ops else f"is a {ops[name]}") + (
                f" (split_concat split its convolution into {parts}: name those)" if parts else "")
            raise BuildError(f"kernels override {name!r}: {what}; providers are chosen for "
                             f"convolutions and matmuls: {roots[:20]}"
                             f"{' ...' if len(roots) > 20 else ''}")
    for rule in kernels.rules:
        if not any(match_op_rule(op, {rule: None}) for op in ROOTS):
            raise BuildError(f"kernels rule {rule!r} matches no op a provider is chosen for: "
                             f"{[op.removeprefix('relax.') for op in ROOTS]}")


def _grow(g: _Graph, chain: Chain, block: set[relax.Var]) -> Chain:
    device = g.ctx.placed.op_device.get(chain.root.var.name)
    while True:
        b = g.only_user(chain.end)
        step = None if b is None else STEPS.get(op_name(b.value))
        if (step is None or chain.pool is not None or b.var in g.claimed or b.var not in block
                or g.ctx.placed.op_device.get(b.var.name) != device or not step(g, chain, b)):
            return chain


def find_chains(g: _Graph, kernels: Kernels,
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
            if device is None or not _runs_onednn(ctx, device):
                chain = None
                why = "it is not on an x86-64 CPU" if device is not None else "it has no device"
            else:
                chain = root(g, b)
                why = ("oneDNN kernels take float32 NCHW convolutions and 2-D matmuls whose "
                       "weights are constants")
            if chain is None:
                if named and choice == "onednn":
                    raise BuildError(f"kernels override {b.var.name!r}='onednn': oneDNN cannot "
                                     f"compute this {op_name(b.value)}: {why}")
                continue
            chain.choice = choice
            chains.append(_grow(g, chain, in_block))
            g.claimed.update(chain.members)
    return chains


def make_header(kind: str, x: tuple[int, ...], out: tuple[int, ...],
                kernel: tuple[int, int] = (1, 1), strides: Any = (1, 1), padding: Any = (0,),
                dilation: Any = (1, 1), groups: int = 1,
                post: list[tuple[str, float, float]] | None = None) -> np.ndarray:
    """A blob header before packing (``pack`` fills the layout slots): ``kind`` "conv2d"
    (``x``, ``out`` NCHW; ``padding`` top, left, bottom, right) or "dense" (``x``, ``out``
    2-D); ``post``: post-ops in order, ("relu" | "clip" | "sum", alpha, beta)."""
    h = np.zeros(HEADER_INT64, "int64")
    fields = {"magic": MAGIC, "version": HEADER_VERSION, "kind": KIND[kind], "n": x[0],
              "ic": x[1], "oc": out[1], "groups": 1}
    if kind == "conv2d":
        fields.update(ih=x[2], iw=x[3], oh=out[2], ow=out[3], kh=kernel[0], kw=kernel[1],
                      groups=int(groups))
        fields.update(zip(("sh", "sw"), _ints(strides, 2), strict=True))
        fields.update(zip(("dil_h", "dil_w"), _ints(dilation, 2), strict=True))
        fields.update(zip(("pad_t", "pad_l", "pad_b", "pad_r"), _ints(padding, 4), strict=True))
    for k, (op, lo, hi) in enumerate(post or []):
        fields[f"post{k}"] = POST_OP[op]
        fields[f"post{k}_alpha"] = int(np.float64(lo).view(np.int64))
        fields[f"post{k}_beta"] = int(np.float64(hi).view(np.int64))
    for name, value in fields.items():
        h[SLOT[name]] = value
    return h


def winograd_pays(h: np.ndarray, nhwc: int) -> bool:
    """Whether the convolution of header ``h`` runs faster as Winograd F(4x4, 3x3) (the shim's
    Winograd section): a 3x3 stride-1 undilated ungrouped convolution between NHWC tensors, no
    pool, whose tiles of 4x4 output pixels are many enough and whose channels are balanced
    enough. Per tile the batched matmul does work in proportion to ``ic * oc`` (4x less than the
    direct convolution) and the transforms in proportion to ``ic + oc``: the rule asks
    ``ic * oc / (ic + oc)`` >= 12 over 36 tiles or more, >= 32 over 16-35 tiles (13x13 to 20x20
    outputs), none under 16 (a 7x7 output: the matmul reads its weights, 4x the direct ones,
    for 4 tiles). Measured in the shim against oneDNN's direct convolution, the kernel timed
    inside a 3-conv model (2 threads, AMD EPYC: AVX-512 and an AVX2 build alike), us:
    densenet121's 128 -> 32 on 56x56 976 -> 455 (balance 26; on 28x28 241 -> 114, but on 14x14
    60 -> 51 (AVX2 79 -> 66) for 4x the weights: left direct), 64 -> 16 on 28x28 68 -> 57 (AVX2
    66 -> 63), 16 -> 32 on 28x28 36 -> 40 (AVX2; balance 11), 16 -> 16 on 56x56 69 -> 90 (AVX2),
    squeezenet's 48 -> 192 on 13x13 118 -> 79, 64 -> 64 on 14x14 62 -> 41, 64 -> 32 on 14x14
    34 -> 33 (AVX2 36 -> 39), 128 -> 16 on 14x14 32 -> 39; inside whole models 512 -> 512 on
    7x7 (resnet50) 940 -> 1180 and inception's 7x7 layers 1.3-1.6x slower."""
    v = {name: int(h[SLOT[name]]) for name in HEADER_SLOTS}
    if v["kind"] != KIND["conv2d"] or (v["kh"], v["kw"], v["sh"], v["sw"], v["dil_h"],
                                       v["dil_w"], v["groups"]) != (3, 3, 1, 1, 1, 1, 1):
        return False
    has_sum = any(v[f"post{k}"] == POST_OP["sum"] for k in range(MAX_POST_OPS))
    if v["pool_kh"] or v["src_tag"] != nhwc or v["dst_tag"] != nhwc \
            or (has_sum and v["res_tag"] != nhwc):
        return False
    tiles = v["n"] * -(-v["oh"] // 4) * -(-v["ow"] // 4)
    product, total = v["ic"] * v["oc"], v["ic"] + v["oc"]  # balance: product / total
    return (tiles >= 36 and product >= 12 * total) or (tiles >= 16 and product >= 32 * total)


def winograd_growth(h: np.ndarray) -> int:
    """The bytes a convolution's weights grow by as Winograd: 6x6 numbers per filter where the
    direct convolution keeps 3x3 (the shim pads neither)."""
    return (36 - 9) * 4 * int(h[SLOT["ic"]]) * int(h[SLOT["oc"]])


def blob_bytes(params: Any) -> dict[str, int]:
    """What oneDNN's packed weights among ``params`` (``(name, array)`` pairs) take against
    plain float32 weights and biases: ``blobs``, ``packed`` bytes, ``plain`` bytes, and the
    ``winograd`` convolutions with the bytes their weights grew by (``winograd_growth``)."""
    out = {"blobs": 0, "packed": 0, "plain": 0, "winograd": 0, "winograd_growth": 0}
    for _, value in params:
        value = np.asarray(value)
        if value.dtype != np.uint8 or value.nbytes < HEADER_INT64 * 8:
            continue
        h = value[:HEADER_INT64 * 8].view(np.int64)
        if int(h[SLOT["magic"]]) != MAGIC:
            continue
        ic, oc = int(h[SLOT["ic"]]), int(h[SLOT["oc"]])
        taps = int(h[SLOT["kh"]]) * int(h[SLOT["kw"]]) if h[SLOT["kind"]] == KIND["conv2d"] \
            else 1
        out["blobs"] += 1
        out["packed"] += value.nbytes
        out["plain"] += 4 * (oc * ic // max(int(h[SLOT["groups"]]), 1) * taps + oc)
        if int(h[SLOT["algo"]]) == 1:
            out["winograd"] += 1
            out["winograd_growth"] += winograd_growth(h)
    return out


def header(chain: Chain) -> np.ndarray:
    """The blob header of ``chain`` (``make_header`` from its ops' attributes)."""
    if chain.kind == "dense":
        return make_header("dense", _shape(chain.x), _shape(chain.end), post=chain.post)
    a = chain.root.value.attrs
    h = make_header("conv2d", _shape(chain.x), _shape(chain.conv_result),
                    chain.weight.shape[2:], a.strides, a.padding, a.dilation, int(a.groups),
                    chain.post)
    if chain.pool is not None:
        names = ("kh", "kw", "sh", "sw", "pad_t", "pad_l", "pad_b", "pad_r")
        for name, value in zip(names, chain.pool, strict=True):
            h[SLOT[f"pool_{name}"]] = value
        h[SLOT["pool_oh"]], h[SLOT["pool_ow"]] = _shape(chain.end)[2:]
    return h


def _new_weight(g: _Graph, pname: str, value: np.ndarray, vdevice: Any, taken: set[str],
                takes_over: bool) -> relax.Var:
    """A new weight holding ``value``, recorded in ``ctx.weights``. It takes the graph name
    ``pname`` of the weight it replaces when ``takes_over`` (so ``set_input``/``load_params``
    of that name meet a parameter of another shape, not an unknown name), else ``pname`` +
    ``.onednn``."""
    w = g.ctx.weights
    if not (takes_over and pname in w.source):  # a name of its own
        pname = w.free_name(pname + ".onednn")
    return w.new_param(pname, value, vdevice, taken, "oneDNN")


def _blob_param(chain: Chain, blob: np.ndarray, g: _Graph, taken: set[str]) -> relax.Var:
    """The weight holding ``chain``'s packed blob, named after the first weight it read."""
    first = chain.read[0]
    members = set(chain.members)
    pname = g.weights.get(first, chain.end.name) if isinstance(first, relax.Var) \
        else chain.end.name
    only_here = all(u is not None and u.var in members for u in g.users.get(first, [None]))
    vdevice = getattr(first.ty, "vdevice", None) or chain.x.ty.vdevice
    return _new_weight(g, pname, blob, vdevice, taken, only_here)


def weight_room(g: _Graph) -> dict[int, int]:
    """Device -> the bytes of weights it may still take, for the devices a placement budget
    bounds (``Placement.budgets``: what auto placement filled with the model's weights):
    Winograd's weights, 4x the direct ones, must fit in it too."""
    ctx = g.ctx
    budgets = getattr(ctx.placement, "budgets", None) or {}
    if not budgets:
        return {}
    room = {resolve_device(k, ctx.devices, "budget"): int(v) for k, v in budgets.items()}
    for p in g.func.params[int(g.func.attrs["num_input"]):]:
        dev = ctx.device_of_vdevice(getattr(p.ty, "vdevice", None))
        value = g.value(p)
        if dev in room and value is not None:
            room[dev] -= value.nbytes
    return room


class _Emitter:
    """Packs the chains in dataflow order and makes their calls. Tensors the plan keeps NHWC
    (``channels_last``) are read and written so: the kernel's result is a new variable of
    shape N, H, W, C. ``room``: weight bytes a budgeted device may still take (``weight_room``);
    a Winograd convolution whose larger weights would not fit stays direct."""

    def __init__(self, g: _Graph, chains: list[Chain], runtime: Any, winograd: bool | float,
                 room: dict[int, int] | None = None) -> None:
        self.g, self.runtime = g, runtime
        self.winograd_bytes: list[int] = []  # per Winograd convolution: the weights' growth
        self.room = dict(room or {})
        self.over_budget: dict[int, int] = {}  # device -> convolutions kept direct for it
        self.taken = {p.name for p in g.func.params}
        convs = [c for c in chains if c.kind == "conv2d"]
        readers = {c.root.var for c in convs} | {c.residual_at for c in convs
                                                 if c.residual_at is not None}
        self.plan = channels_last.Plan(g, {c.end for c in convs}, readers, self._weight)
        self.nhwc = runtime.nhwc_tag()
        self.isa = runtime.isa()
        self.calls: dict[relax.Var, tuple[relax.Var, relax.Call]] = {}
        self.blobs: list[relax.Var] = []
        self.plain_bytes = sum(v.nbytes for p in g.func.params[int(g.func.attrs["num_input"]):]
                               if (v := g.value(p)) is not None)
        self.winograd = self._choose_winograd(convs, winograd)

    def _choose_winograd(self, convs: list[Chain], winograd: bool | float) -> set[int]:
        """The convolutions (by id) to run as Winograd, of those where it is faster
        (``winograd_pays``): all (``True``), none (``False``), or, for a share, the most output
        tiles first while the weights' growth stays within that share of the model's weight
        bytes."""
        pays = []
        for c in convs:
            h = self.header(c)
            if winograd_pays(h, self.nhwc):
                tiles = int(h[SLOT["n"]]) * -(-int(h[SLOT["oh"]]) // 4) \
                    * -(-int(h[SLOT["ow"]]) // 4)
                pays.append((c, tiles, winograd_growth(h)))
        self.winograd_candidates = [(c, growth) for c, _, growth in pays]
        if winograd is True or winograd is False:
            return {id(c) for c, _, _ in pays} if winograd else set()
        room, chosen = float(winograd) * self.plain_bytes, set()
        for c, _, growth in sorted(pays, key=lambda t: -t[1]):  # stable: model order on ties
            if growth <= room:
                chosen.add(id(c))
                room -= growth
        return chosen

    def header(self, chain: Chain) -> np.ndarray:
        """``chain``'s blob header with the layouts of its activations."""
        h = header(chain)
        for slot, v in (("src_tag", chain.x), ("res_tag", chain.residual), ("dst_tag", chain.end)):
            h[SLOT[slot]] = self._tag(v)
        return h
    def _weight(self, name: str, value: np.ndarray, vdevice: Any) -> relax.Var:
        var = _new_weight(self.g, name, value, vdevice, self.taken, False)
        self.blobs.append(var)
        return var

    def _fits(self, chain: Chain, growth: int) -> bool:
        """Whether ``growth`` more bytes of weights fit the budget of ``chain``'s device (taken
        from its room if so; a device without a budget always has room)."""
        dev = self.g.ctx.device_of_vdevice(getattr(chain.x.ty, "vdevice", None))
        if dev not in self.room:
            return True
        if growth > self.room[dev]:
            self.over_budget[dev] = self.over_budget.get(dev, 0) + 1
            return False
        self.room[dev] -= growth
        return True

    def _tag(self, v: relax.Var | None) -> int:
        return self.nhwc if v in self.plan.nhwc else 0

    def emit(self, chain: Chain) -> None:
        h = self.header(chain)
        growth = winograd_growth(h)
        winograd = id(chain) in self.winograd and self._fits(chain, growth)
        h[SLOT["algo"]] = int(winograd)
        if winograd:
            self.winograd_bytes.append(growth)
        blob = self.runtime.pack(h, chain.weight, chain.bias)
        param = _blob_param(chain, blob, self.g, self.taken)
        self.blobs.append(param)
        layouts = [self.runtime.layout_name(self._tag(v))
                   for v in (chain.x, chain.end, chain.residual) if v is not None]
        label = [("conv2d(winograd)" if winograd and op == "conv2d" else op)
                 for op in chain.label]
        attrs = {"provider": "onednn", "onednn_op": "+".join(label),
                 "onednn_isa": self.isa, "onednn_impl": self.runtime.implementation(blob),
                 "onednn_layouts": ", ".join(layouts),  # input, output[, residual]
                 "flops": str(2 * chain.macs)}  # the profiler's GFLOP/s: no weight shape here
        if chain.residual is not None and self._tag(chain.residual) == self._tag(chain.end):
            # the output (of the residual's shape, and never pooled: _add, _max_pool) may take
            # the residual's bytes where the residual dies here: oneDNN's sum post-op then adds
            # into it in place (no separate read of the residual)
            attrs["inplace"] = "2"
        func = relax.ExternFunc(FUNC_NAME[chain.kind])
        for key, value in attrs.items():
            func = func.with_attr(key, value)
        args = [v for v in (chain.x, param, chain.residual) if v is not None]
        end = chain.end
        var = type(end)(end.name, channels_last.nhwc_type(end)) if end in self.plan.nhwc else end
        self.calls[end] = (var, relax.op.call_dps_packed(func, relax.Tuple(args), var.ty))


def _rewrite(func: relax.Function, emitter: _Emitter, drop: set[relax.Var],
             ctx: BuildContext) -> relax.Function:
    """``func`` with each chain's last binding bound to its call, the rest of it dropped, the
    NHWC forms of the plan, the new weights appended to the params and the weights nothing
    reads any more removed."""
    taken = {b.var.name for b in bindings(func)} | emitter.taken
    rewriter = channels_last.Rewriter(emitter.plan, emitter.calls, taken)
    blocks = [rewriter.block(block, drop) for block in func.body.blocks]
    body = relax.SeqExpr(blocks, func.body.body)
    used = set(relax.analysis.free_vars(body))
    n_in = int(func.attrs["num_input"])
    params = list(func.params[:n_in])
    w = ctx.weights
    new_names = {w.graph_names[b.name] for b in emitter.blobs}
    for p in func.params[n_in:]:
        if p in used:
            params.append(p)
            continue
        pname = w.graph_names.pop(p.name, p.name)  # read only by claimed chains: gone
        if pname not in new_names:  # (else a new weight took over its name)
            w.source.pop(pname, None)
    return relax.Function(params + emitter.blobs, body, func.ret_ty, func.is_pure, func.attrs)


def _log_winograd(ctx: BuildContext, emitter: _Emitter, winograd: bool | float) -> None:
    """What the Winograd choice costs in bytes against the model's plain weights."""
    every = emitter.winograd_candidates
    if not every:
        return
    mib, plain = 2**20, max(emitter.plain_bytes, 1)
    took = sum(emitter.winograd_bytes)
    rule = ("every one (winograd=True)" if winograd is True else "none (winograd=False)"
            if winograd is False else f"up to {float(winograd):.0%} of them (winograd="
            f"{winograd}{', the default' if winograd == WINOGRAD_SHARE else ''})")
    ctx.log(f"oneDNN: {len(emitter.winograd_bytes)} of {len(every)} 3x3 convolutions where "
            f"Winograd F(4x4, 3x3) is faster run as Winograd, their weights "
            f"{took / mib:.1f} MiB larger: {took / plain:.0%} of the model's "
            f"{plain / mib:.1f} MiB of weights, growth allowed: {rule}; all {len(every)} would "
            f"add {sum(g for _, g in every) / mib:.1f} MiB (Kernels(winograd=True / False / a "
            f"share), --winograd)")


def claim_onednn(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Claim what oneDNN computes (see module doc); ``mod`` untouched when nothing is claimed."""
    kernels = Kernels.of(ctx.options.kernels)
    func = mod["main"]
    _check_choices(func, kernels)
    runtime = _provider(ctx, kernels)
    if runtime is None or "num_input" not in (func.attrs or {}):
        return mod
    g = _Graph(func, ctx)
    chains = find_chains(g, kernels)
    auto = [c for c in chains if c.choice == "auto"]
    macs = sum(c.macs for c in chains)  # the model's, whoever asked: auto's choice is per model
    if auto and macs < AUTO_MIN_MACS:
        ctx.log(f"kernels: tvm for {len(auto)} ops (auto: the {len(chains)} ops oneDNN could take "
                f"are {macs} multiply-adds, below {AUTO_MIN_MACS}: its per-call cost would "
                f"outweigh them)")
        g = _Graph(func, ctx)
        chains = find_chains(g, kernels, frozenset({"onednn"}))
    if not chains:
        return mod
    emitter = _Emitter(g, chains, runtime, kernels.winograd, weight_room(g))
    position = {b.var: i for i, b in enumerate(bindings(func))}
    for chain in sorted(chains, key=lambda c: position[c.end]):  # producers first
        emitter.emit(chain)
    drop = {v for c in chains for v in c.members[:-1]}
    members = {v.name for c in chains for v in c.members}
    for row in ctx.placed.report:
        if row.node in members:
            row.kernels = "onednn"
    ctx.log(f"oneDNN ({emitter.isa}) claims {len(chains)} ops, {len(emitter.plan.nhwc)} "
            f"tensors NHWC: " + ", ".join(sorted({"+".join(c.label) for c in chains})))
    _log_winograd(ctx, emitter, kernels.winograd)
    for dev, n in emitter.over_budget.items():
        ctx.log(f"oneDNN: {n} 3x3 convolutions on {ctx.devices[dev].name} kept direct: as "
                f"Winograd their weights would not fit its placement budget")
    new = mod.clone()
    new.update_func(new.get_global_var("main"), _rewrite(func, emitter, drop, ctx))
    return new
