"""The kernels of ONNX's recurrent layers: one TIR PrimFunc per layer (every direction, every
time step inside it), written in TVMScript and specialised in Python to the layer's sizes,
activations and options.

One function per layer keeps the layer's recurrence one ``R.call_tir`` in the imported module
(a kernel provider can claim it as a whole) and its build time independent of the sequence
length: the time loop is a TIR loop, not a graph unrolled step by step. What does not depend on
the state is not in the kernel: the converter in ``recurrent.py`` computes the input projection
of every time step and direction as one matrix product (with the biases that add to it) ahead of
the call, and gives the kernel its recurrent weights transposed (gates last), both weight-only
computations that the build folds. Every product then loops over the gates innermost, along
contiguous memory and without a reduction there: LLVM vectorizes that loop (a float sum it
would not reorder), about ten times faster than the dot-product order. Directions run in
parallel, each on state buffers of its own.

Every kernel takes its operands in one form, whatever the ONNX node omitted (the converter
supplies zeros, full lengths and zero states): ``xp, rt[, rbh], lens, h0[, c0, p]`` then writes
``y, y_h[, y_c]``. ``xp`` is the input projection, ``(seq, batch, directions, gates x hidden)``
(batch first under layout 1), its biases added: every gate's ``Wb`` and ``Rb``, but for GRU's
candidate gate's ``Rb`` (``rbh``, ``(directions, hidden)``), which GRU's kernel adds, inside
the reset gate's product under ``linear_before_reset``. ``rt`` is ``R`` transposed, ``(directions,
hidden, gates x hidden)``. ``h0``, ``c0`` and the outputs are in the node's ``layout`` (0: time
or direction first, 1: batch first); ``lens`` is int32. A batch row past its length leaves
zeros in ``y`` and its state unchanged, and a reverse direction runs from ``lens[b] - 1`` down
to 0, as ONNX says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from hgrt.relay_passes.inner.cpu_schedule_math import libm_only, vector_sigmoid, vector_tanh
from hgrt.relay_passes.util.relax_util import NO_GPU_SCHEDULE_ATTR

# the recurrent op of each kernel, an attr of its PrimFunc: what a kernel provider looks for
OP_ATTR = "hgrt.recurrent_op"
# the time loop around the gate products is no root block, which dlight needs: placement keeps
# these kernels on a CPU
NO_GPU_REASON = "hand-written recurrent kernel: no GPU schedule"
# state values each pass over the gates adds: a gate's partial sum is loaded and stored once
# per UNROLL products, not once per product
UNROLL = 4


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


def _sigmoid(x: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    return vector_sigmoid(x) if _vector_math(dtype) else tirx.sigmoid(x)


def _tanh(x: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    return vector_tanh(x) if _vector_math(dtype) else tirx.tanh(x)


def _vector_math(dtype: str) -> bool:
    """float32 gates as vectorizable arithmetic (``cpu_schedule_math``): libm's sigmoid and
    tanh are one call per value, LLVM vectorizes no loop around them (a GRU of 256 units,
    32 steps: 344 us a layer, AMD EPYC); ``HGRT_LIBM=1`` keeps libm."""
    return dtype == "float32" and not libm_only()


# the activation functions ONNX names for recurrent ops: (x, alpha, beta, dtype) -> expression
ACTIVATIONS: dict[str, Callable[..., tirx.PrimExpr]] = {
    "Sigmoid": lambda x, a, b, t: _sigmoid(x, t),
    "Tanh": lambda x, a, b, t: _tanh(x, t),
    "Relu": lambda x, a, b, t: tirx.max(x, _c(0, t)),
    "Affine": lambda x, a, b, t: _c(a, t) * x + _c(b, t),
    "LeakyRelu": lambda x, a, b, t: tirx.Select(x >= _c(0, t), x, _c(a, t) * x),
    "ThresholdedRelu": lambda x, a, b, t: tirx.Select(x > _c(a, t), x, _c(0, t)),
    "ScaledTanh": lambda x, a, b, t: _c(a, t) * _tanh(_c(b, t) * x, t),
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
        self.y_shape = (seq, dirs, batch, hidden) if first else (batch, seq, dirs, hidden)
        self.state_shape = (dirs, batch, hidden) if first else (batch, dirs, hidden)

    def xp_shape(self, gates_hidden: int) -> tuple[int, ...]:
        """The input projection's shape: per time step, batch row and direction, every gate."""
        L, dirs = self.layer, len(self.layer.directions)
        return (L.seq, L.batch, dirs, gates_hidden) if L.layout == 0 \
            else (L.batch, L.seq, dirs, gates_hidden)

    def xp(self, buf, t, b, d, k):
        return buf[t, b, d, k] if self.layer.layout == 0 else buf[b, t, d, k]

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

    def row(self, h, d, b):
        """Row ``b`` of direction ``d``'s state, as ``m -> h[d, b, m]``."""
        return lambda m: h[d, b, m]

    def reset_row(self, g, h, d, b):
        """What GRU's candidate gate multiplies by its recurrent weights, as a row (``reset``)."""
        hid = self.layer.hidden
        return lambda m: self.reset(g[d, b, hid + m], h[d, b, m])

    def mac(self, acc, row, rt, d, m, k, count: int = UNROLL):
        """``acc`` plus ``row(m + u) * rt[d, m + u, k]`` for ``count`` values of ``u``, summed in
        order (the sum stays in a register across them)."""
        for u in range(count):
            acc = acc + row(m + u) * rt[d, m + u, k]
        return acc

    def zero(self):
        return _c(0, self.t)

    def one(self):
        return _c(1, self.t)

    def attrs(self) -> dict:
        layer = self.layer
        return {OP_ATTR: layer.op, "tirx.noalias": True, NO_GPU_SCHEDULE_ATTR: NO_GPU_REASON,
                "hgrt.recurrent_directions": ",".join(layer.directions),
                "hgrt.recurrent_hidden": layer.hidden, "hgrt.recurrent_layout": layer.layout,
                # not read by the kernel (the projection is), but it keeps the layers of a
                # stack on PrimFuncs of their own (a PrimFunc shared by calls placed on two
                # devices fails to build: assign_targets' per-target clone)
                "hgrt.recurrent_input_size": layer.input_size}


def kernel(layer: RecurrentLayer) -> tirx.PrimFunc:
    """The PrimFunc of ``layer`` (the operands as the module docstring says)."""
    return {"LSTM": _lstm, "GRU": _gru, "RNN": _rnn}[layer.op](_Spec(layer))


def _lstm(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    tail = hid - hid % UNROLL  # the first state value the unrolled products leave
    gh = 4 * hid  # gates i, o, f, c; peepholes i, o, f

    @T.prim_func(private=True, s_tir=True)
    def lstm(xp: T.Buffer(s.xp_shape(gh), dt), rt: T.Buffer((dirs, hid, gh), dt),
             lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
             c0: T.Buffer(s.state_shape, dt), p: T.Buffer((dirs, 3 * hid), dt),
             y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt),
             yc: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((dirs, batch, hid), dt)
        c = T.alloc_buffer((dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, gh), dt)
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in T.parallel(dirs):
            for b, j in T.grid(batch, hid):
                h[d, b, j] = s.load_state(h0, d, b, j)
                c[d, b, j] = s.load_state(c0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(gh):
                            g[d, b, k] = s.xp(xp, s.time(d, st, lens[b]), b, d, k)
                        for m, k in T.grid(hid // UNROLL, gh):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, m * UNROLL, k)
                        for m, k in T.grid(hid % UNROLL, gh):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, tail + m, k, 1)
                        for j in range(hid):
                            g[d, b, j] = s.act(0, d, g[d, b, j] + p[d, j] * c[d, b, j])
                            g[d, b, 2 * hid + j] = s.forget(
                                g[d, b, j], s.act(0, d, g[d, b, 2 * hid + j] + p[d, 2 * hid + j]
                                                  * c[d, b, j]))
                            g[d, b, 3 * hid + j] = s.act(1, d, g[d, b, 3 * hid + j])
                            c[d, b, j] = (g[d, b, 2 * hid + j] * c[d, b, j]
                                          + g[d, b, j] * g[d, b, 3 * hid + j])
                            g[d, b, hid + j] = s.act(0, d, g[d, b, hid + j]
                                                     + p[d, hid + j] * c[d, b, j])
                            h[d, b, j] = g[d, b, hid + j] * s.act(2, d, c[d, b, j], False)
                            T.buffer_store(y, h[d, b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[d, b, j], s.state(d, b, j))
                T.buffer_store(yc, c[d, b, j], s.state(d, b, j))

    return lstm


def _gru(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    tail = hid - hid % UNROLL  # the first state value the unrolled products leave
    gh = 3 * hid  # gates z, r, h

    @T.prim_func(private=True, s_tir=True)
    def gru(xp: T.Buffer(s.xp_shape(gh), dt), rt: T.Buffer((dirs, hid, gh), dt),
            rbh: T.Buffer((dirs, hid), dt), lens: T.Buffer((batch,), "int32"),
            h0: T.Buffer(s.state_shape, dt), y: T.Buffer(s.y_shape, dt),
            yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, gh), dt)
        a = T.alloc_buffer((dirs, batch, hid), dt)  # the recurrent part of the candidate gate
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in T.parallel(dirs):
            for b, j in T.grid(batch, hid):
                h[d, b, j] = s.load_state(h0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(gh):
                            g[d, b, k] = s.xp(xp, s.time(d, st, lens[b]), b, d, k)
                        for m, k in T.grid(hid // UNROLL, 2 * hid):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, m * UNROLL, k)
                        for m, k in T.grid(hid % UNROLL, 2 * hid):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, tail + m, k, 1)
                        for k in range(2 * hid):
                            g[d, b, k] = s.act(0, d, g[d, b, k])
                        for j in range(hid):
                            a[d, b, j] = s.zero()
                        for m, j in T.grid(hid // UNROLL, hid):
                            a[d, b, j] = s.mac(a[d, b, j], s.reset_row(g, h, d, b), rt, d,
                                               m * UNROLL, 2 * hid + j)
                        for m, j in T.grid(hid % UNROLL, hid):
                            a[d, b, j] = s.mac(a[d, b, j], s.reset_row(g, h, d, b), rt, d,
                                               tail + m, 2 * hid + j, 1)
                        for j in range(hid):
                            g[d, b, 2 * hid + j] = s.act(1, d, g[d, b, 2 * hid + j] + s.candidate(
                                g[d, b, hid + j], a[d, b, j], rbh[d, j]))
                        for j in range(hid):
                            h[d, b, j] = ((s.one() - g[d, b, j]) * g[d, b, 2 * hid + j]
                                          + g[d, b, j] * h[d, b, j])
                            T.buffer_store(y, h[d, b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[d, b, j], s.state(d, b, j))

    return gru


def _rnn(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    tail = hid - hid % UNROLL  # the first state value the unrolled products leave

    @T.prim_func(private=True, s_tir=True)
    def rnn(xp: T.Buffer(s.xp_shape(hid), dt), rt: T.Buffer((dirs, hid, hid), dt),
            lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
            y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, hid), dt)
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d in T.parallel(dirs):
            for b, j in T.grid(batch, hid):
                h[d, b, j] = s.load_state(h0, d, b, j)
            for st in range(seq):
                for b in range(batch):
                    if st < lens[b]:
                        for k in range(hid):
                            g[d, b, k] = s.xp(xp, s.time(d, st, lens[b]), b, d, k)
                        for m, k in T.grid(hid // UNROLL, hid):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, m * UNROLL, k)
                        for m, k in T.grid(hid % UNROLL, hid):
                            g[d, b, k] = s.mac(g[d, b, k], s.row(h, d, b), rt, d, tail + m, k, 1)
                        for j in range(hid):
                            h[d, b, j] = s.act(0, d, g[d, b, j])
                            T.buffer_store(y, h[d, b, j], s.y(s.time(d, st, lens[b]), d, b, j))
            for b, j in T.grid(batch, hid):
                T.buffer_store(yh, h[d, b, j], s.state(d, b, j))

    return rnn
