"""The kernels of ONNX's recurrent layers: one TIR PrimFunc per layer (every direction, every
time step inside it), written in TVMScript and specialised in Python to the layer's sizes,
activations and options.

One function per layer keeps the layer one ``R.call_tir`` in the imported module (a kernel
provider can claim it as a whole) and its build time independent of the sequence length: the
time loop is a TIR loop, not a graph unrolled step by step. Each kernel first copies its
weights transposed (gates last), so that every product loops over the gates innermost, along
contiguous memory and without a reduction there: LLVM vectorizes that loop (a float sum it
would not reorder), about ten times faster than the dot-product order.

Every kernel takes its operands in one form, whatever the ONNX node omitted (the converter in
``recurrent.py`` supplies zeros, full lengths and zero states):
``x, w, r, bias, lens, h0[, c0, p]`` then writes ``y, y_h[, y_c]``. ``x``, ``h0``, ``c0`` and
the outputs are in the node's ``layout`` (0: time or direction first, 1: batch first); ``lens``
is int32. A batch row past its length leaves zeros in ``y`` and its state unchanged, and a
reverse direction runs from ``lens[b] - 1`` down to 0, as ONNX says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from hgrt.relay_passes.util.relax_util import NO_GPU_SCHEDULE_ATTR

# the recurrent op of each kernel, an attr of its PrimFunc: what a kernel provider looks for
OP_ATTR = "hgrt.recurrent_op"
# the time loop around the gate products is no root block, which dlight needs: placement keeps
# these kernels on a CPU
NO_GPU_REASON = "hand-written recurrent kernel: no GPU schedule"


@dataclass(frozen=True)
class RecurrentLayer:
    """What a kernel is specialised to: the ONNX op, sizes, dtype, options, and each
    direction's activations (``(name, alpha, beta)``, ONNX names)."""

    op: str  # "LSTM", "GRU" or "RNN"
    seq: int
    batch: int
    input_size: int
    hidden: int
    directions: tuple[str, ...]  # ("forward",), ("reverse",), ("forward", "reverse")
    activations: tuple[tuple[tuple[str, float, float], ...], ...]  # per direction
    dtype: str = "float32"
    layout: int = 0
    clip: float | None = None
    input_forget: bool = False
    linear_before_reset: bool = False


def _c(value: float, dtype: str) -> tirx.PrimExpr:
    return tirx.const(value, dtype)


# the activation functions ONNX names for recurrent ops: (x, alpha, beta, dtype) -> expression
ACTIVATIONS: dict[str, Callable[..., tirx.PrimExpr]] = {
    "Sigmoid": lambda x, a, b, t: tirx.sigmoid(x),
    "Tanh": lambda x, a, b, t: tirx.tanh(x),
    "Relu": lambda x, a, b, t: tirx.max(x, _c(0, t)),
    "Affine": lambda x, a, b, t: _c(a, t) * x + _c(b, t),
    "LeakyRelu": lambda x, a, b, t: tirx.Select(x >= _c(0, t), x, _c(a, t) * x),
    "ThresholdedRelu": lambda x, a, b, t: tirx.Select(x > _c(a, t), x, _c(0, t)),
    "ScaledTanh": lambda x, a, b, t: _c(a, t) * tirx.tanh(_c(b, t) * x),
    "HardSigmoid": lambda x, a, b, t: tirx.max(_c(0, t), tirx.min(_c(1, t),
                                                                  _c(a, t) * x + _c(b, t))),
    "Elu": lambda x, a, b, t: tirx.Select(x >= _c(0, t), x, _c(a, t) * (tirx.exp(x) - _c(1, t))),
    "Softsign": lambda x, a, b, t: x / (_c(1, t) + tirx.abs(x)),
    "Softplus": lambda x, a, b, t: tirx.log(tirx.exp(x) + _c(1, t)),
}


class _Spec:
    """The index forms and per-direction choices a kernel body asks for, as Python callables
    that TVMScript evaluates while it parses the body."""

    def __init__(self, layer: RecurrentLayer) -> None:
        self.layer = layer
        self.t = layer.dtype
        seq, batch, dirs, hidden = layer.seq, layer.batch, len(layer.directions), layer.hidden
        first = layer.layout == 0
        self.x_shape = (seq, batch, layer.input_size) if first else (batch, seq, layer.input_size)
        self.y_shape = (seq, dirs, batch, hidden) if first else (batch, seq, dirs, hidden)
        self.state_shape = (dirs, batch, hidden) if first else (batch, dirs, hidden)

    def x(self, buf, t, b, i):
        return buf[t, b, i] if self.layer.layout == 0 else buf[b, t, i]

    def y(self, t, d, b, j) -> list:
        return [t, d, b, j] if self.layer.layout == 0 else [b, t, d, j]

    def state(self, d, b, j) -> list:
        return [d, b, j] if self.layer.layout == 0 else [b, d, j]

    def load_state(self, buf, d, b, j):
        return buf[d, b, j] if self.layer.layout == 0 else buf[b, d, j]

    def time(self, d, s, length):
        """The time step that step ``s`` of direction ``d`` reads and writes."""
        rev = [name == "reverse" for name in self.layer.directions]
        if all(rev) or not any(rev):
            return length - 1 - s if rev[0] else s
        return tirx.Select(d == rev.index(True), length - 1 - s, s)

    def act(self, k, d, v, clipped: bool = True):
        """Activation ``k`` of direction ``d`` applied to ``v``, clipped first when the layer
        clips (a gate's input; LSTM's output activation of the cell state is not clipped, as
        onnxruntime does)."""
        if self.layer.clip is not None and clipped:
            v = tirx.max(_c(-self.layer.clip, self.t), tirx.min(_c(self.layer.clip, self.t), v))
        exprs = [ACTIVATIONS[name](v, a, b, self.t) for name, a, b in
                 (acts[k] for acts in self.layer.activations)]
        if all(str(e) == str(exprs[0]) for e in exprs):
            return exprs[0]
        return tirx.Select(d == 0, exprs[0], exprs[1])

    def forget(self, input_gate, forget_gate):
        """LSTM's forget gate: coupled to the input gate (``1 - i``) under ``input_forget``."""
        return self.one() - input_gate if self.layer.input_forget else forget_gate

    def reset(self, reset_gate, h):
        """What GRU's candidate gate multiplies by its recurrent weights: the state after the
        reset gate, unless the reset applies after that product (``linear_before_reset``)."""
        return h if self.layer.linear_before_reset else reset_gate * h

    def candidate(self, reset_gate, recurrent, recurrent_bias):
        """The recurrent term of GRU's candidate gate, its bias included."""
        if self.layer.linear_before_reset:
            return reset_gate * (recurrent + recurrent_bias)
        return recurrent + recurrent_bias

    def zero(self):
        return _c(0, self.t)

    def one(self):
        return _c(1, self.t)

    def attrs(self) -> dict:
        layer = self.layer
        return {OP_ATTR: layer.op, "tirx.noalias": True, NO_GPU_SCHEDULE_ATTR: NO_GPU_REASON,
                "hgrt.recurrent_directions": ",".join(layer.directions),
                "hgrt.recurrent_hidden": layer.hidden, "hgrt.recurrent_layout": layer.layout}


def kernel(layer: RecurrentLayer) -> tirx.PrimFunc:
    """The PrimFunc of ``layer`` (the operands as the module docstring says)."""
    return {"LSTM": _lstm, "GRU": _gru, "RNN": _rnn}[layer.op](_Spec(layer))


def _lstm(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, isz, hid, dirs = L.seq, L.batch, L.input_size, L.hidden, len(L.directions)
    gh = 4 * hid  # gates i, o, f, c; peepholes i, o, f

    @T.prim_func(private=True, s_tir=True)
    def lstm(x: T.Buffer(s.x_shape, dt), w: T.Buffer((dirs, gh, isz), dt),
             r: T.Buffer((dirs, gh, hid), dt), bias: T.Buffer((dirs, 2 * gh), dt),
             lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
             c0: T.Buffer(s.state_shape, dt), p: T.Buffer((dirs, 3 * hid), dt),
             y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt),
             yc: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((batch, hid), dt)
        c = T.alloc_buffer((batch, hid), dt)
        g = T.alloc_buffer((batch, gh), dt)
        wt = T.alloc_buffer((dirs, isz, gh), dt)
        rt = T.alloc_buffer((dirs, hid, gh), dt)
        for d, k, i in T.grid(dirs, gh, isz):
            wt[d, i, k] = w[d, k, i]
        for d, k, m in T.grid(dirs, gh, hid):
            rt[d, m, k] = r[d, k, m]
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in range(dirs):
            for b, j in T.grid(batch, hid):
                h[b, j] = s.load_state(h0, d, b, j)
                c[b, j] = s.load_state(c0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(gh):
                            g[b, k] = bias[d, k] + bias[d, gh + k]
                        for i, k in T.grid(isz, gh):
                            g[b, k] = g[b, k] + s.x(x, s.time(d, st, lens[b]), b, i) * wt[d, i, k]
                        for m, k in T.grid(hid, gh):
                            g[b, k] = g[b, k] + h[b, m] * rt[d, m, k]
                        for j in range(hid):
                            g[b, j] = s.act(0, d, g[b, j] + p[d, j] * c[b, j])
                            g[b, 2 * hid + j] = s.forget(
                                g[b, j], s.act(0, d, g[b, 2 * hid + j] + p[d, 2 * hid + j]
                                               * c[b, j]))
                            g[b, 3 * hid + j] = s.act(1, d, g[b, 3 * hid + j])
                            c[b, j] = g[b, 2 * hid + j] * c[b, j] + g[b, j] * g[b, 3 * hid + j]
                            g[b, hid + j] = s.act(0, d, g[b, hid + j] + p[d, hid + j] * c[b, j])
                            h[b, j] = g[b, hid + j] * s.act(2, d, c[b, j], False)
                            T.buffer_store(y, h[b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[b, j], s.state(d, b, j))
                T.buffer_store(yc, c[b, j], s.state(d, b, j))

    return lstm


def _gru(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, isz, hid, dirs = L.seq, L.batch, L.input_size, L.hidden, len(L.directions)
    gh = 3 * hid  # gates z, r, h

    @T.prim_func(private=True, s_tir=True)
    def gru(x: T.Buffer(s.x_shape, dt), w: T.Buffer((dirs, gh, isz), dt),
            r: T.Buffer((dirs, gh, hid), dt), bias: T.Buffer((dirs, 2 * gh), dt),
            lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
            y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((batch, hid), dt)
        g = T.alloc_buffer((batch, gh), dt)
        a = T.alloc_buffer((batch, hid), dt)  # the recurrent part of the candidate gate
        wt = T.alloc_buffer((dirs, isz, gh), dt)
        rt = T.alloc_buffer((dirs, hid, gh), dt)
        for d, k, i in T.grid(dirs, gh, isz):
            wt[d, i, k] = w[d, k, i]
        for d, k, m in T.grid(dirs, gh, hid):
            rt[d, m, k] = r[d, k, m]
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in range(dirs):
            for b, j in T.grid(batch, hid):
                h[b, j] = s.load_state(h0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(gh):
                            g[b, k] = bias[d, k]
                        for i, k in T.grid(isz, gh):
                            g[b, k] = g[b, k] + s.x(x, s.time(d, st, lens[b]), b, i) * wt[d, i, k]
                        for m, k in T.grid(hid, 2 * hid):
                            g[b, k] = g[b, k] + h[b, m] * rt[d, m, k]
                        for k in range(2 * hid):
                            g[b, k] = s.act(0, d, g[b, k] + bias[d, gh + k])
                        for j in range(hid):
                            a[b, j] = s.zero()
                        for m, j in T.grid(hid, hid):
                            a[b, j] = a[b, j] + s.reset(g[b, hid + m], h[b, m]) * rt[
                                d, m, 2 * hid + j]
                        for j in range(hid):
                            g[b, 2 * hid + j] = s.act(1, d, g[b, 2 * hid + j] + s.candidate(
                                g[b, hid + j], a[b, j], bias[d, gh + 2 * hid + j]))
                        for j in range(hid):
                            h[b, j] = (s.one() - g[b, j]) * g[b, 2 * hid + j] + g[b, j] * h[b, j]
                            T.buffer_store(y, h[b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[b, j], s.state(d, b, j))

    return gru


def _rnn(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, isz, hid, dirs = L.seq, L.batch, L.input_size, L.hidden, len(L.directions)

    @T.prim_func(private=True, s_tir=True)
    def rnn(x: T.Buffer(s.x_shape, dt), w: T.Buffer((dirs, hid, isz), dt),
            r: T.Buffer((dirs, hid, hid), dt), bias: T.Buffer((dirs, 2 * hid), dt),
            lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
            y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((batch, hid), dt)
        g = T.alloc_buffer((batch, hid), dt)
        wt = T.alloc_buffer((dirs, isz, hid), dt)
        rt = T.alloc_buffer((dirs, hid, hid), dt)
        for d, k, i in T.grid(dirs, hid, isz):
            wt[d, i, k] = w[d, k, i]
        for d, k, m in T.grid(dirs, hid, hid):
            rt[d, m, k] = r[d, k, m]
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in range(dirs):
            for b, j in T.grid(batch, hid):
                h[b, j] = s.load_state(h0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(hid):
                            g[b, k] = bias[d, k] + bias[d, hid + k]
                        for i, k in T.grid(isz, hid):
                            g[b, k] = g[b, k] + s.x(x, s.time(d, st, lens[b]), b, i) * wt[d, i, k]
                        for m, k in T.grid(hid, hid):
                            g[b, k] = g[b, k] + h[b, m] * rt[d, m, k]
                        for j in range(hid):
                            h[b, j] = s.act(0, d, g[b, j])
                            T.buffer_store(y, h[b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[b, j], s.state(d, b, j))

    return rnn
