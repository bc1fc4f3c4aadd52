"""ONNX ``LSTM``, ``GRU`` and ``RNN``: each node becomes one matrix product, the input
projection of every time step and direction (a GEMM any kernel provider can take), and one
``R.call_tir`` of a PrimFunc of its own for the recurrence (``recurrent_kernels.kernel``),
whatever its attributes, at a static sequence length.

The converter reads the node's attributes into a ``RecurrentLayer``, fills the operands the
node omits (zero bias, zero initial states, zero peepholes, every sequence at full length) and
returns the call's tuple of outputs (``Y``, ``Y_h`` and, for LSTM, ``Y_c``); the outputs a
node does not name are computed and left unused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import vector_isa
from hgrt.importer.converter import ConversionError, static_shape
from hgrt.importer.recurrent_kernels import (
    ACTIVATIONS,
    CHUNK,
    LAYER_ATTR,
    RecurrentLayer,
    kernel,
    unroll_for,
)

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"),
                       "RNN": ("Tanh",)}
# (alpha, beta) of each activation that takes them, by ONNX's defaults; consumed in order from
# activation_alpha / activation_beta by the activations that take them (as onnxruntime does)
_ALPHA_BETA = {"Affine": (1.0, 0.0), "LeakyRelu": (0.01, None), "ThresholdedRelu": (1.0, None),
               "ScaledTanh": (1.0, 1.0), "HardSigmoid": (0.2, 0.5), "Elu": (1.0, None)}
_BY_LOWER = {name.lower(): name for name in ACTIVATIONS}
DIRECTIONS = {"forward": ("forward",), "reverse": ("reverse",),
              "bidirectional": ("forward", "reverse")}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _activations(op: str, attrs: dict, dirs: int) -> tuple:
    """Each direction's activations as ``(name, alpha, beta)``."""
    names = [_text(a) for a in attrs.get("activations", ())] or list(DEFAULT_ACTIVATIONS[op]) * dirs
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    if len(names) != per_dir * dirs:
        raise ConversionError(f"'activations' has {len(names)} entries; {op} with {dirs} "
                              f"direction(s) takes {per_dir * dirs}")
    alphas, betas = list(attrs.get("activation_alpha", ())), list(attrs.get("activation_beta", ()))
    acts = []
    for name in names:
        known = _BY_LOWER.get(name.lower())
        if known is None:
            raise ConversionError(f"activation {name!r} is not one ONNX names for recurrent ops "
                                  f"({sorted(ACTIVATIONS)})")
        alpha, beta = _ALPHA_BETA.get(known, (None, None))
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        acts.append((known, float(alpha or 0.0), float(beta or 0.0)))
    return tuple(tuple(acts[d * per_dir:(d + 1) * per_dir]) for d in range(dirs))


def _layer(op: str, inputs: list, attrs: dict) -> RecurrentLayer:
    x, w = inputs[0], inputs[1]
    layout = int(attrs.get("layout", 0))
    if layout not in (0, 1):
        raise ConversionError(f"layout {layout} (ONNX knows 0 and 1)")
    xs = static_shape(x, "X")
    seq, batch = (xs[0], xs[1]) if layout == 0 else (xs[1], xs[0])
    direction = _text(attrs.get("direction", "forward"))
    if direction not in DIRECTIONS:
        raise ConversionError(f"direction {direction!r} (ONNX knows {sorted(DIRECTIONS)})")
    dirs = DIRECTIONS[direction]
    ws = static_shape(w, "W")
    hidden = int(attrs.get("hidden_size", ws[1] // GATES[op]))
    if ws != (len(dirs), GATES[op] * hidden, xs[2]):
        raise ConversionError(f"W has shape {list(ws)}, not [{len(dirs)}, {GATES[op] * hidden}, "
                              f"{xs[2]}] (directions, gates x hidden_size, input size)")
    if x.ty.dtype != "float32":
        raise ConversionError(f"X is {x.ty.dtype}; recurrent layers are imported in float32")
    clip = attrs.get("clip")
    return RecurrentLayer(op, seq, batch, xs[2], hidden, dirs, _activations(op, attrs, len(dirs)),
                          "float32", layout, None if clip is None else float(clip),
                          bool(attrs.get("input_forget", 0)),
                          bool(attrs.get("linear_before_reset", 0)))


def _operand(inputs: list, i: int, shape: tuple[int, ...], fill: float | int = 0,
             dtype: str = "float32") -> relax.Expr:
    """Input ``i`` of the node, or a constant of ``shape`` filled with ``fill`` where the node
    omits it."""
    given = inputs[i] if i < len(inputs) else None
    if given is None:
        return relax.const(np.full(shape, fill, dtype))
    got = static_shape(given, f"input {i}")
    if got != shape:
        raise ConversionError(f"input {i} has shape {list(got)}, not {list(shape)}")
    if given.ty.dtype != dtype:
        given = relax.op.astype(given, dtype)
    return given


def _emit(bb: relax.BlockBuilder, layer: RecurrentLayer, expr: relax.Expr, what: str
          ) -> relax.Var:
    """``expr`` bound under a name that says what it is of which layer (``lstm_projection``):
    the layer's call keeps the binding name it has when it is the node's only binding."""
    return bb.emit(expr, name_hint=f"{layer.op.lower()}_{what}")


def _slice(bb: relax.BlockBuilder, layer: RecurrentLayer, bias: relax.Expr, begin: int,
           end: int, what: str) -> relax.Var:
    return _emit(bb, layer, relax.op.strided_slice(bias, [1], [begin], [end]), what)


def _projection(bb: relax.BlockBuilder, layer: RecurrentLayer, x: relax.Expr, w: relax.Expr,
                bias: relax.Expr) -> relax.Var:
    """The input projection of every time step and direction, ``X W^T`` plus the biases that
    add to it (every ``Wb`` and ``Rb`` but GRU's candidate gate's ``Rb``), as one matrix
    product: ``(seq, batch, directions, gates x hidden)``, batch first under layout 1."""
    dirs, gh = len(layer.directions), GATES[layer.op] * layer.hidden
    # W (dirs, gh, input) -> (input, dirs * gh): reads weights only, folded at build
    wt = _emit(bb, layer, relax.op.permute_dims(w, [2, 0, 1]), "w_t")
    wt = _emit(bb, layer, relax.op.reshape(wt, (layer.input_size, dirs * gh)), "w_t")
    rb = _slice(bb, layer, bias, gh, 2 * gh, "rb")
    if layer.op == "GRU":  # the candidate gate's Rb stays with the kernel
        keep = np.concatenate([np.ones(2 * layer.hidden), np.zeros(layer.hidden)])
        rb = _emit(bb, layer, relax.op.multiply(rb, relax.const(keep.astype("float32"))), "rb")
    b = _emit(bb, layer, relax.op.add(_slice(bb, layer, bias, 0, gh, "wb"), rb), "bias")
    b = _emit(bb, layer, relax.op.reshape(b, (dirs * gh,)), "bias")
    xs = _emit(bb, layer, relax.op.reshape(x, (layer.seq * layer.batch, layer.input_size)),
               "x_rows")
    out = _emit(bb, layer, relax.op.matmul(xs, wt), "projection")
    out = _emit(bb, layer, relax.op.add(out, b), "projection")
    lead = (layer.seq, layer.batch) if layer.layout == 0 else (layer.batch, layer.seq)
    return _emit(bb, layer, relax.op.reshape(out, (*lead, dirs, gh)), "projection")


def _packed_r(bb: relax.BlockBuilder, r: relax.Expr, layer: RecurrentLayer) -> relax.Var:
    """R ``(dirs, gates x hidden, hidden)`` as the kernel streams it (``recurrent_kernels``'
    ``rt``): ``(dirs, chunks, hidden, gates, CHUNK)``, each chunk's columns of every gate
    contiguous row after row, zero columns padding the last chunk; reads a weight only, so
    the build folds it."""
    dirs, hid, gates = len(layer.directions), layer.hidden, GATES[layer.op]
    chunks = -(-hid // CHUNK)
    r = _emit(bb, layer, relax.op.reshape(r, (dirs, gates, hid, hid)), "r_t")  # (d, q, j, m)
    if chunks * CHUNK != hid:
        r = _emit(bb, layer, relax.op.nn.pad(r, [0, 0, 0, 0, 0, chunks * CHUNK - hid, 0, 0]),
                  "r_t")
    r = _emit(bb, layer, relax.op.reshape(r, (dirs, gates, chunks, CHUNK, hid)), "r_t")
    return _emit(bb, layer, relax.op.permute_dims(r, [0, 2, 4, 1, 3]), "r_t")


def _operands(bb: relax.BlockBuilder, layer: RecurrentLayer, inputs: list
              ) -> list[relax.Expr]:
    """The kernel's operands in its order: xp, rt[, rbh], lens, h0[, c0, p]."""
    dirs, hid, gh = len(layer.directions), layer.hidden, GATES[layer.op] * layer.hidden
    state = (dirs, layer.batch, hid) if layer.layout == 0 else (layer.batch, dirs, hid)
    bias = _operand(inputs, 3, (dirs, 2 * gh))
    args = [_projection(bb, layer, inputs[0], inputs[1], bias),
            _packed_r(bb, _operand(inputs, 2, (dirs, gh, hid)), layer)]
    if layer.op == "GRU":
        args.append(_slice(bb, layer, bias, gh + 2 * hid, 2 * gh, "rb_candidate"))
    args += [_operand(inputs, 4, (layer.batch,), layer.seq, "int32"), _operand(inputs, 5, state)]
    if layer.op == "LSTM":
        args += [_operand(inputs, 6, state), _operand(inputs, 7, (dirs, 3 * hid))]
    return args


def convert_recurrent(bb: relax.BlockBuilder, inputs: list, attrs: dict, opset: int
                      ) -> relax.Expr:
    """An ONNX LSTM, GRU or RNN node (its op in ``attrs["op_type"]``) as one call_tir."""
    op = attrs["op_type"]
    layer = _layer(op, inputs, attrs)
    dirs, dt = len(layer.directions), layer.dtype
    state = (dirs, layer.batch, layer.hidden) if layer.layout == 0 \
        else (layer.batch, dirs, layer.hidden)
    y = (layer.seq, dirs, layer.batch, layer.hidden) if layer.layout == 0 \
        else (layer.batch, layer.seq, dirs, layer.hidden)
    outs = [relax.TensorType(y, dt), relax.TensorType(state, dt)]
    if op == "LSTM":
        outs.append(relax.TensorType(state, dt))
    gv = bb.add_func(kernel(layer), f"hgrt_{op.lower()}")
    return bb.emit(relax.call_tir(gv, relax.Tuple(_operands(bb, layer, inputs)), outs))


def for_targets(mod: tvm.IRModule, targets: list) -> tvm.IRModule:
    """``mod`` with each recurrent kernel (a PrimFunc with the ``LAYER_ATTR`` its converter
    wrote) made anew for code that runs on CPUs of ``targets`` (``tvm.target.Target``), where
    their vector ISAs call for another unroll (``unroll_for``) than it was made with; its
    other attrs kept. A module with no recurrent kernel is returned as it is."""
    isas, made_anew = None, {}
    for gv, func in mod.functions.items():
        text = func.attrs.get(LAYER_ATTR) if func.attrs is not None else None
        if text is None:
            continue
        isas = isas if isas is not None else [vector_isa(t) for t in targets]
        layer = RecurrentLayer.from_json(str(text))
        unroll = unroll_for(layer, isas)
        if unroll != layer.unroll:
            made = kernel(dataclasses.replace(layer, unroll=unroll))
            for key, value in func.attrs.items():
                if key not in made.attrs:
                    made = made.with_attr(key, value)
            made_anew[gv] = made
    if not made_anew:
        return mod
    # a new module: the one handed in (a user's Relax module) stays as it was
    return tvm.IRModule({**dict(mod.functions.items()), **made_anew}, attrs=mod.attrs,
                        global_infos=mod.global_infos)


CONVERTERS = {"LSTM": convert_recurrent, "GRU": convert_recurrent, "RNN": convert_recurrent}
