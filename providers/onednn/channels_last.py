"""channels_last: oneDNN kernels hand each other NHWC tensors, and so do the ops between them.

oneDNN's fp32 convolutions run fastest on channels-last activations (its brgemm kernels pick
NHWC themselves on AVX2 and AVX-512), while a model's ops read and write NCHW. A reorder around
every convolution cost more than the convolutions' own gap to onnxruntime (squeezenet: 26
convolutions 2.2 ms alone, 3.8 ms with their reorders, AVX-512, 2 threads), and squeezenet,
inception and densenet put a concat or a pool between most convolutions. So
``claim_onednn`` asks this module which tensors of ``main`` are NHWC:

- the result of an op that has an NHWC form, when its tensor inputs are NHWC: concat on
  channels and max/avg pooling (oneDNN's primitives: TVM's NHWC forms measured 2-3x slower),
  batch norm, arithmetic with a per-channel weight, of two NHWC tensors, or with a computed
  (N, C, 1, 1) tensor (a squeeze-excite gate: its bytes are the N,1,1,C one, a view), unary
  element-wise ops, dropout (no kernel), a split on channels (every part NHWC); a mean over
  H and W reads NHWC and gives its plain result; a transpose to N,H,W,C is a view of the
  NHWC bytes, and one back to N,C,H,W of a plain N,H,W,C tensor an NHWC-held tensor (no
  kernel either way) where a reader takes NHWC;
- the result of a claimed convolution that a claimed convolution or such an op reads (else the
  kernel writes NCHW itself);
- the result of an op that the ONNX importer spells as several (``Composite``): ONNX's LRN
  (square, expand, avg_pool3d, squeeze, scale, add, power, divide: 8 TVM kernels' worth, 30 %
  of inception_v1 beside oneDNN's convolutions) and ShuffleNet's channel shuffle (reshape,
  transpose, reshape), each one oneDNN primitive on NHWC when its input is NHWC.

Where an NHWC tensor meets another reader (a TVM op without an NHWC form, a copy to another
device, the function's result) one reorder (``hgrt.onednn.to_nchw``) turns it back to NCHW: a
node of its own, so the profiler shows it and the memory planner sizes it. An op with an NHWC
form keeps it whatever reads it: the reorder after it is no bigger than the one before it
would be. Tensors leaving a dataflow block stay NCHW.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import relax, tirx

from hgrt.graph_format import PROVIDER_WHY
from hgrt.providers.onednn import PROVIDER
from hgrt.relay_passes.util.relax_util import bindings, op_name, per_channel, reads_only_item0
from hgrt.relay_passes.util.relax_util import float32_shape as _shape

ONEDNN_PREFIX = PROVIDER.func_prefix  # what its kernels' graph nodes call

UNARY = frozenset({"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh",
                   "relax.nn.silu", "relax.nn.gelu", "relax.exp", "relax.sqrt", "relax.abs",
                   "relax.negative"})
BINARY = frozenset({"relax.add", "relax.multiply", "relax.subtract", "relax.divide",
                    "relax.maximum", "relax.minimum"})
POOLS = frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d"})

Builder = Callable[["Rewriter"], relax.Expr]
# why the ops between oneDNN kernels are oneDNN's too (the graph node's provider_why)
NHWC_WHY = "channels last: between oneDNN kernels its tensors stay NHWC"
# NHWC concat on channels: oneDNN's primitive (TVM's concat picks an operand per element)
CONCAT = relax.ExternFunc(ONEDNN_PREFIX + "concat").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "concat").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
# NHWC pooling: oneDNN's (TVM's NHWC pools measured 3x its NCHW ones); attributes in a weight
POOL = relax.ExternFunc(ONEDNN_PREFIX + "pool").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "pool").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
POOL_ATTRS = ("algorithm", "kh", "kw", "sh", "sw", "pad_t", "pad_l", "pad_b", "pad_r", "dil_h",
              "dil_w")  # algorithm: 0 max, 1 average counting the pad, 2 average without it
# ONNX's LRN across channels, attributes (size, alpha, beta, bias) in a float32 weight
LRN = relax.ExternFunc(ONEDNN_PREFIX + "lrn").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "lrn").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
# NHWC split on channels: per pixel, runs of channels copied on oneDNN's OpenMP team
SPLIT = relax.ExternFunc(ONEDNN_PREFIX + "split").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "split").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
# channel shuffle: channels seen as groups x C/groups and transposed; groups in an int64 weight
SHUFFLE = relax.ExternFunc(ONEDNN_PREFIX + "shuffle").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "shuffle").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
# a squeeze-excite gate: NHWC x times a computed N x C tensor, oneDNN's binary multiply (a TVM
# kernel there ran on one thread: efficientnet's 16 took 0.62 ms, EPYC AVX-512, 2 threads)
GATE = relax.ExternFunc(ONEDNN_PREFIX + "gate").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "gate").with_attr("onednn_layouts", "acdb") \
    .with_attr(PROVIDER_WHY, NHWC_WHY)
# NHWC -> NCHW: oneDNN's reorder, a kernel of its own (TVM's transpose fused into the next op
# made inception's LRN 3x slower)
TO_NCHW = relax.ExternFunc(ONEDNN_PREFIX + "to_nchw").with_attr("provider", "onednn") \
    .with_attr("onednn_op", "reorder").with_attr("onednn_layouts", "acdb, plain") \
    .with_attr(PROVIDER_WHY, "channels last: a oneDNN kernel's NHWC result back to NCHW")


def pool_window(a: Any) -> list[int] | None:
    """A 2-D pool's window as POOL_ATTRS has it after the algorithm: kernel h, w, strides h, w,
    pads top, left, bottom, right, dilations h, w (None: not a 2-D window)."""
    pads = [int(v) for v in a.padding]
    pads = pads * 2 if len(pads) == 2 else pads
    window = [*(int(v) for v in a.pool_size), *(int(v) for v in a.strides), *pads,
              *(int(v) for v in a.dilation)]
    return window if len(window) == len(POOL_ATTRS) - 1 else None


def nhwc_type(var: relax.Var) -> relax.TensorType:
    n, c, h, w = _shape(var)
    return relax.TensorType((n, h, w, c), "float32", var.ty.vdevice)


class Composite:
    """One op that the importer wrote as several bindings: ``members`` (read only by the next,
    in order) end in ``end``; ``x`` is its input; ``func`` and ``attrs`` its oneDNN kernel."""

    def __init__(self, end: relax.Var, x: relax.Var, members: list[relax.Var],
                 func: relax.ExternFunc, attrs: np.ndarray) -> None:
        self.end, self.x, self.members, self.func, self.attrs = end, x, members, func, attrs

    def build(self, rw: Rewriter) -> relax.Expr:
        label = str(self.func.global_symbol).rsplit(".", 1)[-1]
        params = rw.weight((self.end, label), f"{self.end.name}.{label}", self.attrs,
                           self.x.ty.vdevice)
        return relax.op.call_dps_packed(self.func, relax.Tuple([rw.new[self.x], params]),
                                        nhwc_type(self.end))


def find_composites(g: Any) -> dict[relax.Var, Composite]:
    """The composites of ``main`` (see module doc) by their last variable."""
    defs = {b.var: b.value for b in bindings(g.func)}

    def inner(var: Any, op: str, reader: relax.Var) -> relax.Call | None:
        """The call of ``op`` bound to ``var`` when ``reader`` alone reads it."""
        value = defs.get(var) if isinstance(var, relax.DataflowVar) else None
        user = g.only_user(var) if value is not None else None
        ok = isinstance(value, relax.Call) and op_name(value) == op and user is not None \
            and user.var.same_as(reader) and _shape(var) is not None
        return value if ok else None

    def scalar(call: relax.Call) -> tuple[relax.Var, float] | None:
        """(the variable, the constant) of ``var * c``, ``var + c`` (either order), ``var ** c``
        (the caller checks the order)."""
        for a, b in (call.args, call.args[::-1]):
            c = g.value(b)
            if isinstance(a, relax.Var) and c is not None and c.size == 1:
                return a, float(c.reshape(()))
        return None

    found: dict[relax.Var, Composite] = {}
    for end, value in defs.items():
        if not isinstance(end, relax.DataflowVar) or not isinstance(value, relax.Call):
            continue
        comp = None
        if op_name(value) == "relax.divide":
            comp = _lrn(end, value, inner, scalar)
        elif op_name(value) == "relax.reshape":
            comp = _shuffle(end, value, inner)
        if comp is not None and _shape(comp.x) is not None and len(_shape(comp.x)) == 4:
            found[end] = comp
    return found


def _lrn(end: relax.Var, divide: relax.Call, inner: Callable, scalar: Callable
         ) -> Composite | None:
    """``x / (bias + alpha * avg_pool3d(expand(x * x), (size, 1, 1)))^beta``, the window
    centred (odd size), counting the pad: ONNX's LRN as TVM's importer writes it."""
    x, var = divide.args
    members, calls, consts, reader = [], [], [], end
    for op in ("relax.power", "relax.add", "relax.multiply",  # ^beta, + bias, * alpha
               "relax.squeeze", "relax.nn.avg_pool3d", "relax.expand_dims", "relax.multiply"):
        call = inner(var, op, reader)
        if call is None:
            return None
        members.append(var)
        if len(consts) < 3:  # (the variable, the constant)
            found = scalar(call)
            if found is None or (op == "relax.power" and not call.args[0].same_as(found[0])):
                return None
            reader, (var, c) = var, found
            consts.append(c)
        else:
            calls.append(call)
            reader, var = var, call.args[0]
    beta, bias, alpha = consts
    squeeze, pool, expand, square = calls
    a = pool.attrs
    size = int(a.pool_size[0])
    fits = (var.same_as(x) and all(a.same_as(x) for a in square.args)
            and _shape(end) == _shape(x) and squeeze.attrs.axis is not None
            and [int(v) for v in squeeze.attrs.axis] == [1]
            and [int(v) for v in expand.attrs.axis] == [1]
            and [int(v) for v in a.pool_size] == [size, 1, 1] and size % 2 == 1
            and [int(v) for v in a.strides] == [1, 1, 1]
            and [int(v) for v in a.dilation] == [1, 1, 1]
            and [int(v) for v in a.padding] == [size // 2, 0, 0, size // 2, 0, 0]
            and bool(a.count_include_pad) and not bool(a.ceil_mode)
            and str(a.layout) == "NCDHW")
    if not fits:
        return None
    # alpha scales the window's mean (sum / size): ONNX's alpha, and oneDNN's
    return Composite(end, x, members[::-1], LRN, np.array([size, alpha, beta, bias], "float32"))


def _shuffle(end: relax.Var, reshape: relax.Call, inner: Callable) -> Composite | None:
    """``reshape(transpose(reshape(x, (N, g, C/g, H, W)), (0, 2, 1, 3, 4)), x.shape)``."""
    t = reshape.args[0]
    perm = inner(t, "relax.permute_dims", end)
    r = perm.args[0] if perm is not None else None
    split = inner(r, "relax.reshape", t)
    if split is None or perm.attrs.axes is None \
            or [int(v) for v in perm.attrs.axes] != [0, 2, 1, 3, 4]:
        return None
    x = split.args[0]
    shape, parts = _shape(x), _shape(r)
    if shape is None or len(shape) != 4 or _shape(end) != shape or len(parts) != 5 \
            or parts[0] != shape[0] or parts[1] * parts[2] != shape[1] or parts[3:] != shape[2:]:
        return None
    return Composite(end, x, [r, t], SHUFFLE, np.array([parts[1]], "int64"))


class Plan:
    """Which variables of ``main`` hold NHWC tensors (``nhwc``), and how each TVM op that makes
    or reads one is rewritten (``forms``: binding variable -> builder of its new value)."""

    def __init__(self, g: Any, chain_ends: set[relax.Var], nhwc_readers: set[relax.Var],
                 new_weight: Callable[[str, np.ndarray, Any], relax.Var]) -> None:
        """``g``: claim_onednn's graph of ``main`` (users, weights, values); ``chain_ends``:
        results of claimed convolutions; ``nhwc_readers``: bindings of claimed chains that can
        read an NHWC input or residual; ``new_weight(name, value, vdevice)``: a new weight."""
        self.g, self.new_weight = g, new_weight
        self.nhwc_readers = nhwc_readers
        self.nhwc: set[relax.Var] = set()
        self.forms: dict[relax.Var, tuple[Builder, bool]] = {}  # var -> (builder, makes NHWC)
        self.tuples: set[relax.Var] = set()  # tuple results (batch norm, dropout) with item 0 NHWC
        self.splits: set[relax.Var] = set()  # of them, those whose every item is NHWC (split)
        self.composites = find_composites(g)
        self._member_of = {m: c for c in self.composites.values() for m in c.members}
        self.dropped: set[relax.Var] = set()  # members of composites run as one kernel
        for block in g.func.body.blocks:
            for b in block.bindings:
                self._forward(b, chain_ends)
        # A convolution whose result no reader takes NHWC writes NCHW itself. An op with an NHWC
        # form keeps it whatever reads it: the reorder after it is no bigger than before it.
        takes = set(nhwc_readers) | set(self.forms) | self.dropped
        for v in chain_ends & self.nhwc:
            if not any(u is not None and u.var in takes for u in g.users.get(v, [None])):
                self.nhwc.discard(v)

    def _item0(self, tup: relax.Var) -> relax.Var | None:
        items = [u.var for u in self.g.users.get(tup, []) if u is not None
                 and isinstance(u.value, relax.TupleGetItem) and u.value.index == 0]
        return items[0] if len(items) == 1 else None

    def _forward(self, b: relax.VarBinding, chain_ends: set[relax.Var]) -> None:
        v, value = b.var, b.value
        fits = isinstance(v, relax.DataflowVar)
        comp = self._member_of.get(v) or self.composites.get(v)
        if comp is not None and comp.x in self.nhwc:  # (else its bindings go on as they are)
            if v.same_as(comp.end):
                self.forms[v] = (comp.build, True)
                self.nhwc.add(v)
            else:
                self.dropped.add(v)
            return
        if v in chain_ends:
            if fits and _shape(v) is not None and len(_shape(v)) == 4:
                self.nhwc.add(v)
            return
        if isinstance(value, relax.TupleGetItem):
            tup = value.tuple_value
            index = value.index
            if tup in self.tuples and (index != 0 or fits):  # item 0 NHWC, the others as they were
                nhwc = index == 0 or tup in self.splits
                self.forms[v] = (lambda rw, t=tup, i=index: rw.item(t, i), nhwc)
                if nhwc:
                    self.nhwc.add(v)
            return
        if not fits or not isinstance(value, relax.Call):
            return
        form = self._form(value, b)
        if form is None:
            return
        makes = form[1]
        if makes == "tuple" and not isinstance(self._item0(v), relax.DataflowVar):
            return
        if makes == "split":  # every item read in the dataflow block, by item
            if not all(u is not None and isinstance(u.value, relax.TupleGetItem)
                       and isinstance(u.var, relax.DataflowVar)
                       for u in self.g.users.get(v, [None])):
                return
            self.splits.add(v)
        self.forms[v] = form
        if makes in ("tuple", "split"):
            self.tuples.add(v)
        elif makes:
            self.nhwc.add(v)

    def _form(self, call: relax.Call, b: relax.VarBinding) -> tuple[Builder, Any] | None:
        name = op_name(call)
        args = list(call.args)
        x = args[0] if args else None
        if name == "relax.concat":
            fields = list(getattr(x, "fields", []))
            axis = int(call.attrs.axis)
            if not fields or any(f not in self.nhwc for f in fields) or axis not in (1, -3):
                return None
            return (lambda rw: relax.op.call_dps_packed(
                CONCAT, relax.Tuple([rw.new[f] for f in fields]), nhwc_type(b.var))), True
        if name == "relax.permute_dims":
            return self._permute(call, x, b.var)
        if x not in self.nhwc:
            return self._binary(call, args) if name in BINARY else None
        a = call.attrs
        if name in POOLS and str(a.layout) == "NCHW" and str(a.out_layout or "NCHW") == "NCHW":
            return self._pool(name, a, x, b.var)
        if name in UNARY:
            return (lambda rw: relax.Call(call.op, [rw.new[x], *args[1:]], call.attrs)), True
        if name in BINARY:
            return self._binary(call, args)
        if name == "relax.nn.batch_norm" and int(a.axis) in (1, -3):
            return (lambda rw: relax.op.nn.batch_norm(
                rw.new[x], *args[1:], axis=3, epsilon=float(a.epsilon), center=bool(a.center),
                scale=bool(a.scale), momentum=float(a.momentum),
                training=bool(getattr(a, "training", False)))), "tuple"
        if name == "relax.split" and int(a.axis) in (1, -3) and len(_shape(x)) == 4:
            # on channels: per pixel, runs of channels copied (SPLIT). ShuffleNetV2's halves
            # between its units: split NCHW, each unit's concat, shuffle and split were one TVM
            # kernel between oneDNN's convolutions (3.0-3.1 -> 2.7 ms NHWC, EPYC AVX-512, 2
            # threads); then the split a TVM kernel, switching thread pools twice
            parts, (n, c, h, w) = a.indices_or_sections, _shape(x)
            cuts = [c * k // int(parts) for k in range(1, int(parts))] if isinstance(
                parts, tirx.IntImm) else [min(max(int(i), 0), c) for i in parts]
            widths = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, c], strict=True)]
            if min(widths) < 1 or os.environ.get("HGRT_ONEDNN_SPLIT") == "0":
                # (an empty part; or the TVM kernel, to time the difference)
                return (lambda rw: relax.op.split(rw.new[x], parts, axis=3)), "split"
            types = [relax.TensorType((n, h, w, k), "float32", x.ty.vdevice) for k in widths]
            return (lambda rw: relax.op.call_dps_packed(SPLIT, relax.Tuple([rw.new[x]]), types)
                    ), "split"
        if name == "relax.nn.dropout" and reads_only_item0(self.g.users, b.var):
            # inference: item 0 is x itself, no kernel
            return (lambda rw: rw.new[x]), "tuple"
        if name == "relax.mean":
            return self._mean(call, x)
        return None

    def _permute(self, call: relax.Call, x: relax.Expr, out: relax.Var
                 ) -> tuple[Builder, bool] | None:
        """The transposes between NCHW and NHWC that a model writes around its channels-last
        ops (ConvNeXt's blocks: a depthwise convolution, then layer norm and dense layers on
        N,H,W,C, then back to add the residual): to NHWC of an NHWC-held tensor is its bytes,
        a view; to NCHW of a plain N,H,W,C tensor is an NHWC-held one, no kernel, where a
        reader takes it so (a claimed convolution, or arithmetic with an NHWC tensor)."""
        axes = [int(a) for a in call.attrs.axes] if call.attrs.axes is not None else None
        if not isinstance(x, relax.Var) or _shape(x) is None or len(_shape(x)) != 4:
            return None
        if axes == [0, 2, 3, 1] and x in self.nhwc:
            return (lambda rw: relax.op.reshape(rw.new[x], _shape(out))), False
        if axes != [0, 3, 1, 2] or x in self.nhwc or self.g.value(x) is not None:
            return None
        for u in self.g.users.get(out, []):
            if u is None:
                continue
            if u.var in self.nhwc_readers:
                return (lambda rw: x), True
            if op_name(u.value) in BINARY and len(u.value.args) == 2 and any(
                    a in self.nhwc and _shape(a) == _shape(out) for a in u.value.args):
                return (lambda rw: x), True
        return None

    def _binary(self, call: relax.Call, args: list[relax.Expr]) -> tuple[Builder, bool] | None:
        """``a op b`` of two NHWC tensors of one shape, of one and a per-channel weight (or a
        scalar: the weight becomes a new one of shape (C,)), or of one and a computed (N or 1,
        C, 1, 1) tensor (``_gate``)."""
        ours = [a for a in args if a in self.nhwc]
        if not ours or len(args) != 2:
            return None
        if len(ours) == 2 and _shape(args[0]) == _shape(args[1]):
            return (lambda rw: relax.Call(call.op, [rw.new[a] for a in args], call.attrs)), True
        big = max(ours, key=lambda a: int(np.prod(_shape(a))))
        other = args[1] if args[0].same_as(big) else args[0]
        gate = self._gate(other, _shape(big))
        if gate is not None:
            def read_gate(rw: Rewriter) -> relax.Expr:  # N,C bytes as the N,1,1,C view
                src = rw.new[other] if other in self.nhwc else other
                view = rw.emit(relax.op.reshape(src, (gate[0], 1, 1, gate[1])),
                               f"{other.name}_nhwc")
                if op_name(call) == "relax.multiply":  # oneDNN's, on its own threads
                    x = rw.new[big]
                    return relax.op.call_dps_packed(GATE, relax.Tuple([x, view]), x.ty)
                return relax.Call(call.op, [rw.new[big] if a.same_as(big) else view
                                            for a in args], call.attrs)
            return read_gate, True
        if len(ours) == 2:
            return None
        value = self.g.value(other)
        scale = None if value is None else per_channel(value, _shape(ours[0]))
        if scale is None:
            return None

        def build(rw: Rewriter) -> relax.Expr:  # a scalar broadcasts as it is
            name = self.g.weights.get(other, "w") if isinstance(other, relax.Var) else "w"
            o = rw.weight((other, "nhwc"), f"{name}.nhwc", scale,
                          other.ty.vdevice) if value.size != 1 else other
            operands = [rw.new[a] if a in self.nhwc else o for a in args]
            return relax.Call(call.op, operands, call.attrs)
        return build, True

    def _gate(self, other: relax.Expr, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(N or 1, C) where ``other`` is a computed (N or 1, C, 1, 1) tensor beside an NHWC
        tensor of ``shape`` (a squeeze-excite gate, EfficientNet's and MobileNetV3's): its
        bytes are the N,1,1,C tensor that broadcasts over NHWC, a reshape away (a view), so the
        NHWC side needs no reorder to NCHW and back."""
        s = _shape(other) if isinstance(other, relax.Var) else None
        if s is None or self.g.value(other) is not None or len(s) != 4 or len(shape) != 4 \
                or s[0] not in (1, shape[0]) or s[1] != shape[1] or s[2:] != (1, 1):
            return None
        return s[0], s[1]

    def _pool(self, name: str, a: Any, x: relax.Var, out: relax.Var
              ) -> tuple[Builder, bool] | None:
        """oneDNN's pooling; its attributes (POOL_ATTRS) a new int64 weight."""
        include_pad = name.endswith("avg_pool2d") and bool(a.count_include_pad)
        if include_pad and bool(a.ceil_mode):  # windows past the pad: counted unlike TVM
            return None
        algo = 0 if name.endswith("max_pool2d") else 1 if include_pad else 2
        window = pool_window(a)
        if window is None:
            return None
        attrs = np.array([algo, *window], "int64")

        def build(rw: Rewriter) -> relax.Expr:
            return rw.pool(x, (out, "pool"), f"{out.name}.pool", attrs, nhwc_type(out))
        return build, True

    def _mean(self, call: relax.Call, x: relax.Var) -> tuple[Builder, bool] | None:
        axes = sorted(int(v) % 4 for v in call.attrs.axis) if call.attrs.axis is not None else []
        if axes != [2, 3]:
            return None
        keep = bool(call.attrs.keepdims)
        n, c, h, w = _shape(x)
        shape = (n, c, 1, 1) if keep else (n, c)
        # oneDNN's average pool over the whole H x W: its N,1,1,C result is the plain N,C,1,1
        # (or N,C) tensor byte for byte, a reshape away (squeezenet's 13x13x1000 mean: 43 us
        # as a TVM kernel after oneDNN's convolution, 18 us in onnxruntime)
        attrs = np.array([1, h, w, 1, 1, 0, 0, 0, 0, 1, 1], "int64")

        def build(rw: Rewriter) -> relax.Expr:
            pooled = rw.pool(x, (x, "mean"), f"{x.name}.mean", attrs,
                             relax.TensorType((n, 1, 1, c), "float32", x.ty.vdevice))
            return relax.op.reshape(rw.emit(pooled, "mean_nhwc"), shape)
        return build, False


class Rewriter:
    """Rewrites the bindings of ``main`` by a Plan: NHWC forms, chains' calls, and a reorder
    to NCHW before the first other reader of an NHWC tensor."""

    def __init__(self, plan: Plan, calls: dict[relax.Var, tuple[relax.Var, relax.Call]],
                 taken: set[str]) -> None:
        self.plan, self.calls, self.taken = plan, calls, taken
        self.new: dict[relax.Var, relax.Var] = {}  # NHWC variable (or tuple) of an old one
        self.plain: dict[relax.Var, relax.Var] = {}  # its NCHW copy, made at the first reader
        self.weights: dict[tuple[relax.Expr, str], relax.Var] = {}
        self.out: list[relax.Binding] = []
        self.dataflow = True
        self._bb = relax.BlockBuilder()
        # the model's bindings that became oneDNN's NHWC kernels (concat, split, pool, ...), and
        # the members of the composites that run as one (the placement report says so)
        self.onednn_ops: set[str] = {v.name for v in plan.dropped}

    def _name(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def emit(self, expr: relax.Expr, base: str) -> relax.Var:
        """Bind ``expr`` (its type inferred) to a new variable, before the current binding."""
        expr = self._bb.normalize(expr)
        cls = relax.DataflowVar if self.dataflow else relax.Var
        var = cls(self._name(base), expr.ty)
        self.out.append(relax.VarBinding(var, expr))
        return var

    def weight(self, key: tuple[relax.Expr, str], name: str, value: np.ndarray,
               vdevice: Any) -> relax.Var:
        """A new weight ``name`` holding ``value``, made once per ``key``."""
        if key not in self.weights:
            self.weights[key] = self.plan.new_weight(name, value, vdevice)
        return self.weights[key]

    def pool(self, x: relax.Var, key: tuple[relax.Expr, str], name: str, attrs: np.ndarray,
             out: relax.TensorType) -> relax.Expr:
        """oneDNN's pool of the NHWC form of ``x``; ``attrs`` (POOL_ATTRS) a new weight."""
        params = self.weight(key, name, attrs, x.ty.vdevice)
        return relax.op.call_dps_packed(POOL, relax.Tuple([self.new[x], params]), out)

    def item(self, tup: relax.Var, index: int) -> relax.Expr | None:
        """Item ``index`` of the rewritten tuple ``tup`` (a dropout's item 0 is its input)."""
        new = self.new[tup]
        if isinstance(new.ty, relax.TupleType):
            return relax.TupleGetItem(new, index)
        return new if index == 0 else None  # a dropout's unused mask: not made

    def _read(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` with each NHWC variable it reads replaced by its NCHW copy."""
        if isinstance(expr, relax.Var):
            if expr not in self.plan.nhwc:
                return expr
            if expr not in self.plain:
                n, c, h, w = _shape(expr)
                if h == 1 and w == 1:  # N,1,1,C is N,C,1,1 byte for byte: a view, no reorder
                    nchw = relax.op.reshape(self.new[expr], (n, c, h, w))
                else:
                    nchw = relax.op.call_dps_packed(TO_NCHW, relax.Tuple([self.new[expr]]),
                                                    expr.ty)
                self.plain[expr] = self.emit(nchw, f"{expr.name}_nchw")
            return self.plain[expr]
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._read(f) for f in expr.fields])
        if isinstance(expr, relax.TupleGetItem):
            return relax.TupleGetItem(self._read(expr.tuple_value), expr.index)
        if isinstance(expr, relax.Call):
            return relax.Call(expr.op, [self._read(a) for a in expr.args], expr.attrs,
                              expr.ty_args)
        return expr

    def binding(self, b: relax.VarBinding) -> None:
        v = b.var
        if v in self.calls:  # a claimed chain: NHWC in where the plan says so, else NCHW
            var, call = self.calls[v]
            func, args = call.args
            args = relax.Tuple([self.new[a] if a in self.plan.nhwc else self._read(a)
                                for a in args.fields])
            self.out.append(relax.VarBinding(var, relax.Call(call.op, [func, args], call.attrs,
                                                             call.ty_args)))
            if v in self.plan.nhwc:
                self.new[v] = var
            return
        form = self.plan.forms.get(v)
        if form is None:
            self.out.append(relax.VarBinding(v, self._read(b.value)))
            return
        value = form[0](self)
        if value is None or isinstance(value, relax.Var):  # no binding: dropout's
            if value is not None:
                self.new[v] = value
            return
        value = self._bb.normalize(value)
        callee = value.args[0] if isinstance(value, relax.Call) and value.args else None
        if isinstance(callee, relax.ExternFunc) and callee.attrs.get(PROVIDER_WHY) == NHWC_WHY:
            self.onednn_ops.add(v.name)
        if v in self.plan.nhwc or v in self.plan.tuples:
            new = type(v)(v.name, value.ty)
            self.new[v] = new
            self.out.append(relax.VarBinding(new, value))
        else:
            self.out.append(relax.VarBinding(v, value))

    def block(self, block: relax.BindingBlock, drop: set[relax.Var]) -> relax.BindingBlock:
        self.out, self.dataflow = [], isinstance(block, relax.DataflowBlock)
        for b in block.bindings:
            if b.var not in drop and b.var not in self.plan.dropped:
                self.binding(b)
        return type(block)(self.out)
