"""The kernels of ONNX's recurrent layers: one TIR PrimFunc per layer (every direction, every
time step inside it), written in TVMScript and specialised in Python to the layer's sizes,
activations and options.

One function per layer keeps the layer's recurrence one ``R.call_tir`` in the imported module
(a kernel provider can claim it as a whole) and its build time independent of the sequence
length: the time loop is a TIR loop, not a graph unrolled step by step. What does not depend on
the state is not in the kernel: the converter in ``recurrent.py`` computes the input projection
of every time step and direction as one matrix product (with the biases that add to it) ahead of
the call, and gives the kernel its recurrent weights packed in the order it reads them (below),
both weight-only computations that the build folds. Every product then loops over a chunk's
units innermost, along contiguous memory and without a reduction there: LLVM vectorizes that
loop (a float sum it would not reorder), about ten times faster than the dot-product order.
Packed by chunk of units, a step's pass over a chunk streams one contiguous block of the
weights instead of a few columns of every row, 4 KB apart for an LSTM of 256 units (a
bidirectional LSTM layer of 256 units, 32 steps, AMD EPYC AVX-512, 2 threads: 328 -> 230-240
us; a GRU's single row 145-154 -> 95-97 us; the LSTM on AVX2 430 -> 312-328 us).

Rows (directions times batch rows) share nothing: where there are several, each runs on a
thread of its own, whole (a bidirectional LSTM layer of 256 units, 32 steps: 394 us on two
threads, against 424 us sharing each step's units and 448 us with each direction's batch rows
in turn on its thread; ``python/bench_recurrent.py --op LSTM --directions 2``). A single row
shares each step: its hidden units in chunks (``CHUNK``), each chunk's gate products and state
update on one thread, a barrier between steps (the state is double-buffered: a step reads one
copy and writes the other). A step streams the recurrent weights, 768 KB for GRU's 256 units,
from cache: each thread streams its chunks' columns only (a GRU layer of 256 units, 32 steps:
255-264 us on one thread, 139-143 us on two, AMD EPYC AVX-512; ``python/bench_recurrent.py``).
A unit's sums run in one order whatever the thread count, so the bits do not depend on it. GRU
without ``linear_before_reset`` takes two barriers a step: its candidate's product needs every
unit's reset gate first.

Every kernel takes its operands in one form, whatever the ONNX node omitted (the converter
supplies zeros, full lengths and zero states): ``xp, rt[, rbh], lens, h0[, c0, p]`` then writes
``y, y_h[, y_c]``. ``xp`` is the input projection, ``(seq, batch, directions, gates x hidden)``
(batch first under layout 1), its biases added: every gate's ``Wb`` and ``Rb``, but for GRU's
candidate gate's ``Rb`` (``rbh``, ``(directions, hidden)``), which GRU's kernel adds, inside
the reset gate's product under ``linear_before_reset``. ``rt`` is ``R`` packed as
``(directions, chunks, hidden, gates, CHUNK)``: ``rt[d, c, m, q, jj]`` is ``R[d, q * hidden + c *
CHUNK + jj, m]``, zero past the last unit. ``h0``, ``c0`` and the outputs are in the node's
``layout`` (0: time or direction first, 1: batch first); ``lens`` is int32. A batch row past
its length leaves zeros in ``y`` and its state unchanged, and a reverse direction runs from
``lens[b] - 1`` down to 0, as ONNX says.
"""

from __future__ import annotations

import dataclasses
import json
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
# per unroll products, not once per product (``RecurrentLayer.unroll``, ``unroll_for``)
UNROLL = 4
# the unroll of an LSTM layer that runs by rows on a target with 32 vector registers of 512
# bits: the state values broadcast for 16 products stay in registers (a bidirectional layer of
# 256 units, 32 steps, AMD EPYC AVX-512: 240 against 293 us at 4; AVX2, 312 against 322 us, a
# wash; GRU by rows 224 against 190 us, single rows and RNN no gain;
# ``python/bench_recurrent.py --op LSTM --directions 2 --unroll N``)
WIDE_UNROLL = 16
LAYER_ATTR = "hgrt.recurrent_layer"  # the layer's RecurrentLayer as JSON: what for_targets reads
# hidden units a task of a kernel's parallel loop computes: two AVX-512 vectors of float32
# (fewer, shorter vectors: 1.8x slower a layer of 256 units on one thread; more: fewer tasks
# for the threads to share)
CHUNK = 32
# the time loop runs on every thread of one parallel launch (TVM's CPU codegen: the body of a
# launch point runs on each thread, a parallel loop in it shares out its iterations, a barrier
# after it waits for every thread): each step's chunks of units are shared out and a barrier
# ends the step, since the next reads every unit's state (~1.4 us a barrier on 2 threads)
LAUNCH_POINT = "pragma_parallel_launch_point"
BARRIER = "pragma_parallel_barrier_when_finish"
ONE_TASK = "hgrt.one_task"


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
    unroll: int = UNROLL  # state values per pass over the gates (``unroll_for``)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RecurrentLayer:
        fields = json.loads(text)
        fields["directions"] = tuple(fields["directions"])
        fields["activations"] = tuple(tuple(tuple(a) for a in acts)
                                      for acts in fields["activations"])
        return cls(**fields)


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
        self.chunks = -(-hidden // CHUNK)
        self.rows = dirs * batch
        self.tasks = self.rows * self.chunks
        # rows (directions x batch rows) that share nothing run in parallel whole, with no
        # barrier between their steps; a single row shares each step's chunks of units
        self.by_rows = self.rows > 1
        # one task runs on the calling thread: no launch (TVM's codegen finds no parallel loop
        # of extent 1 in it) and no barrier
        parallel = self.tasks > 1
        self.launch_point = LAUNCH_POINT if parallel else ONE_TASK
        self.barrier = BARRIER if parallel else ONE_TASK

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

    def row(self, h, st, d, b):
        """Row ``b`` of direction ``d``'s state at step ``st``, as ``m -> h[st % 2, d, b, m]``."""
        return lambda m: h[st % 2, d, b, m]

    def reset_row(self, g, h, st, d, b):
        """What GRU's candidate gate multiplies by its recurrent weights, as a row (``reset``)."""
        hid = self.layer.hidden
        return lambda m: self.reset(g[d, b, hid + m], h[st % 2, d, b, m])

    def xp_row(self, xp, d, b, st, length):
        """The input projection of step ``st``, direction ``d``, batch row ``b``: ``k -> value``."""
        return lambda k: self.xp(xp, self.time(d, st, length), b, d, k)

    # a task of the parallel loop: one chunk of hidden units of one direction and batch row
    def task_d(self, t):
        return t // (self.layer.batch * self.chunks)

    def task_b(self, t):
        return t // self.chunks % self.layer.batch

    def task_j(self, t):
        """The task's first hidden unit."""
        return t % self.chunks * CHUNK

    def task_n(self, t):
        """The task's count of hidden units (the last chunk may be short)."""
        return tirx.min(CHUNK, self.layer.hidden - self.task_j(t))

    def mac(self, acc, row, rt, d, c, m, q, jj, count: int):
        """``acc`` plus ``row(m + u) * rt[d, c, m + u, q, jj]`` (unit ``jj`` of chunk ``c``,
        gate ``q``) for ``count`` values of ``u``, summed in order (the sum stays in a register
        across them)."""
        for u in range(count):
            acc = acc + row(m + u) * rt[d, c, m + u, q, jj]
        return acc

    def rt_shape(self, gates: int) -> tuple[int, ...]:
        """``rt``'s shape: ``(directions, chunks, hidden, gates, CHUNK)``."""
        L = self.layer
        return (len(L.directions), self.chunks, L.hidden, gates, CHUNK)

    def zero(self):
        return _c(0, self.t)

    def one(self):
        return _c(1, self.t)

    def attrs(self) -> dict:
        layer = self.layer
        return {OP_ATTR: layer.op, "tirx.noalias": True, NO_GPU_SCHEDULE_ATTR: NO_GPU_REASON,
                "hgrt.recurrent_directions": ",".join(layer.directions),
                "hgrt.recurrent_hidden": layer.hidden, "hgrt.recurrent_layout": layer.layout,
                LAYER_ATTR: layer.to_json(),
                # not read by the kernel (the projection is), but it keeps the layers of a
                # stack on PrimFuncs of their own (a PrimFunc shared by calls placed on two
                # devices fails to build: assign_targets' per-target clone)
                "hgrt.recurrent_input_size": layer.input_size}


def unroll_for(layer: RecurrentLayer, isas: list) -> int:
    """The unroll of ``layer``'s products for code that runs with every vector ISA of ``isas``
    (``hgrt.devices.VectorISA``): ``WIDE_UNROLL`` for an LSTM that runs by rows where each has
    32 registers of 512 bits, else ``UNROLL``."""
    by_rows = len(layer.directions) * layer.batch > 1
    wide = bool(isas) and all(i.bits >= 512 and i.registers >= 32 for i in isas)
    return WIDE_UNROLL if layer.op == "LSTM" and by_rows and wide else UNROLL


def kernel(layer: RecurrentLayer) -> tirx.PrimFunc:
    """The PrimFunc of ``layer`` (the operands as the module docstring says)."""
    return {"LSTM": _lstm, "GRU": _gru, "RNN": _rnn}[layer.op](_Spec(layer))


def _products(s: _Spec):
    """A macro that sets, for the chunk of hidden units ``[j0, j0 + n)`` of one direction and
    batch row, ``gates`` gates from gate ``q0`` on: ``acc[d, b, q * hidden + j]`` to
    ``init(k)`` plus the product of the state ``row`` by those columns of ``rt``."""
    hid, unroll = s.layer.hidden, s.layer.unroll
    tail = hid - hid % unroll  # the first state value the unrolled products leave

    @T.macro
    def products(acc, init, row, rt, d, b, j0, n, q0, gates):
        for q, jj in T.grid(gates, n):
            acc[d, b, (q0 + q) * hid + j0 + jj] = init((q0 + q) * hid + j0 + jj)
        for m, q, jj in T.grid(hid // unroll, gates, n):
            acc[d, b, (q0 + q) * hid + j0 + jj] = s.mac(
                acc[d, b, (q0 + q) * hid + j0 + jj], row, rt, d, j0 // CHUNK, m * unroll,
                q0 + q, jj, unroll)
        for m, q, jj in T.grid(hid % unroll, gates, n):
            acc[d, b, (q0 + q) * hid + j0 + jj] = s.mac(
                acc[d, b, (q0 + q) * hid + j0 + jj], row, rt, d, j0 // CHUNK, tail + m,
                q0 + q, jj, 1)

    return products


def _time_loop(s: _Spec, first, second=None):
    """A macro that runs, at every step in order, the macro ``first`` (then ``second``) of
    ``(step, task, *bufs)`` for every task: by rows, each row's steps whole on a thread of its
    own; else in one parallel launch, a barrier after each (``_Spec``)."""
    seq, chunks, tasks = s.layer.seq, s.chunks, s.tasks

    @T.macro
    def loop(bufs):
        if s.by_rows:
            for r in T.parallel(s.rows):
                for st in range(seq):
                    for ch in range(chunks):
                        first(st, r * chunks + ch, *bufs)
                    if second is not None:
                        for ch in range(chunks):
                            second(st, r * chunks + ch, *bufs)
        else:
            with T.attr(0, s.launch_point, 1):
                for st in range(seq):
                    with T.attr(0, s.barrier, 1):
                        for t in T.parallel(tasks):
                            first(st, t, *bufs)
                    if second is not None:
                        with T.attr(0, s.barrier, 1):
                            for t in T.parallel(tasks):
                                second(st, t, *bufs)

    return loop


def _lstm(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    gh = 4 * hid  # gates i, o, f, c; peepholes i, o, f
    products, D, B, J, N = _products(s), s.task_d, s.task_b, s.task_j, s.task_n

    @T.macro
    def step(st, t, xp, rt, lens, p, y, h, c, g):
        """Task ``t``'s units at step ``st``: gates, cell, next state."""
        if st < lens[B(t)]:
            products(g, s.xp_row(xp, D(t), B(t), st, lens[B(t)]),
                     s.row(h, st, D(t), B(t)), rt, D(t), B(t), J(t), N(t), 0, 4)
            for jj in range(N(t)):
                g[D(t), B(t), J(t) + jj] = s.act(
                    0, D(t), g[D(t), B(t), J(t) + jj]
                    + p[D(t), J(t) + jj] * c[D(t), B(t), J(t) + jj])
                g[D(t), B(t), 2 * hid + J(t) + jj] = s.forget(
                    g[D(t), B(t), J(t) + jj], s.act(
                        0, D(t), g[D(t), B(t), 2 * hid + J(t) + jj]
                        + p[D(t), 2 * hid + J(t) + jj] * c[D(t), B(t), J(t) + jj]))
                g[D(t), B(t), 3 * hid + J(t) + jj] = s.act(
                    1, D(t), g[D(t), B(t), 3 * hid + J(t) + jj])
                c[D(t), B(t), J(t) + jj] = (
                    g[D(t), B(t), 2 * hid + J(t) + jj] * c[D(t), B(t), J(t) + jj]
                    + g[D(t), B(t), J(t) + jj] * g[D(t), B(t), 3 * hid + J(t) + jj])
                g[D(t), B(t), hid + J(t) + jj] = s.act(
                    0, D(t), g[D(t), B(t), hid + J(t) + jj]
                    + p[D(t), hid + J(t) + jj] * c[D(t), B(t), J(t) + jj])
                h[1 - st % 2, D(t), B(t), J(t) + jj] = (
                    g[D(t), B(t), hid + J(t) + jj]
                    * s.act(2, D(t), c[D(t), B(t), J(t) + jj], False))
                T.buffer_store(y, h[1 - st % 2, D(t), B(t), J(t) + jj],
                               s.y(s.time(D(t), st, lens[B(t)]), D(t), B(t), J(t) + jj))
        else:
            for jj in range(N(t)):
                h[1 - st % 2, D(t), B(t), J(t) + jj] = h[st % 2, D(t), B(t), J(t) + jj]

    time_loop = _time_loop(s, step)

    @T.prim_func(private=True, s_tir=True)
    def lstm(xp: T.Buffer(s.xp_shape(gh), dt), rt: T.Buffer(s.rt_shape(4), dt),
             lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
             c0: T.Buffer(s.state_shape, dt), p: T.Buffer((dirs, 3 * hid), dt),
             y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt),
             yc: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((2, dirs, batch, hid), dt)
        c = T.alloc_buffer((dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, gh), dt)
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d, b, j in T.grid(dirs, batch, hid):
            h[0, d, b, j] = s.load_state(h0, d, b, j)
            c[d, b, j] = s.load_state(c0, d, b, j)
        time_loop((xp, rt, lens, p, y, h, c, g))
        for d, b, j in T.grid(dirs, batch, hid):
            T.buffer_store(yh, h[seq % 2, d, b, j], s.state(d, b, j))
            T.buffer_store(yc, c[d, b, j], s.state(d, b, j))

    return lstm


def _gru_steps(s: _Spec):
    """GRU's steps as macros: ``gates`` (z and r; with ``linear_before_reset`` the rest of the
    step too) and ``candidate`` (without it, once every unit's reset gate is there)."""
    L = s.layer
    hid, lbr = L.hidden, L.linear_before_reset
    products, D, B, J, N = _products(s), s.task_d, s.task_b, s.task_j, s.task_n

    @T.macro
    def update(st, t, xp, rt, rbh, lens, y, h, g, a):
        """The candidate gate (its recurrent part from the state after the reset gate unless
        ``linear_before_reset``, which has it in ``a`` already) and the next state."""
        if not lbr:
            products(a, lambda k: s.zero(), s.reset_row(g, h, st, D(t), B(t)), rt, D(t), B(t),
                     J(t), N(t), 2, 1)
        for jj in range(N(t)):
            g[D(t), B(t), 2 * hid + J(t) + jj] = s.act(1, D(t), s.xp_row(
                xp, D(t), B(t), st, lens[B(t)])(2 * hid + J(t) + jj) + s.candidate(
                g[D(t), B(t), hid + J(t) + jj], a[D(t), B(t), 2 * hid + J(t) + jj],
                rbh[D(t), J(t) + jj]))
            h[1 - st % 2, D(t), B(t), J(t) + jj] = (
                (s.one() - g[D(t), B(t), J(t) + jj]) * g[D(t), B(t), 2 * hid + J(t) + jj]
                + g[D(t), B(t), J(t) + jj] * h[st % 2, D(t), B(t), J(t) + jj])
            T.buffer_store(y, h[1 - st % 2, D(t), B(t), J(t) + jj],
                           s.y(s.time(D(t), st, lens[B(t)]), D(t), B(t), J(t) + jj))

    @T.macro
    def gates(st, t, xp, rt, rbh, lens, y, h, g, a):
        """Task ``t``'s gates z and r at step ``st`` (and with ``linear_before_reset`` the
        candidate's recurrent product, reset after it, and the next state)."""
        if st < lens[B(t)]:
            products(g, s.xp_row(xp, D(t), B(t), st, lens[B(t)]),
                     s.row(h, st, D(t), B(t)), rt, D(t), B(t), J(t), N(t), 0, 2)
            if lbr:
                products(a, lambda k: s.zero(), s.row(h, st, D(t), B(t)), rt,
                         D(t), B(t), J(t), N(t), 2, 1)
            for q, jj in T.grid(2, N(t)):
                g[D(t), B(t), q * hid + J(t) + jj] = s.act(
                    0, D(t), g[D(t), B(t), q * hid + J(t) + jj])
            if lbr:
                update(st, t, xp, rt, rbh, lens, y, h, g, a)
        elif lbr:
            for jj in range(N(t)):
                h[1 - st % 2, D(t), B(t), J(t) + jj] = h[st % 2, D(t), B(t), J(t) + jj]

    @T.macro
    def candidate(st, t, xp, rt, rbh, lens, y, h, g, a):
        """Without ``linear_before_reset``: task ``t``'s candidate and next state, once every
        unit's reset gate is there."""
        if st < lens[B(t)]:
            update(st, t, xp, rt, rbh, lens, y, h, g, a)
        else:
            for jj in range(N(t)):
                h[1 - st % 2, D(t), B(t), J(t) + jj] = h[st % 2, D(t), B(t), J(t) + jj]

    return gates, candidate


def _gru(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    gh = 3 * hid  # gates z, r, h
    gates, candidate = _gru_steps(s)
    # (without linear_before_reset the candidate's product needs every unit's reset gate)
    time_loop = _time_loop(s, gates, None if L.linear_before_reset else candidate)

    @T.prim_func(private=True, s_tir=True)
    def gru(xp: T.Buffer(s.xp_shape(gh), dt), rt: T.Buffer(s.rt_shape(3), dt),
            rbh: T.Buffer((dirs, hid), dt), lens: T.Buffer((batch,), "int32"),
            h0: T.Buffer(s.state_shape, dt), y: T.Buffer(s.y_shape, dt),
            yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((2, dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, gh), dt)
        a = T.alloc_buffer((dirs, batch, gh), dt)  # the recurrent part of the candidate gate
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d, b, j in T.grid(dirs, batch, hid):
            h[0, d, b, j] = s.load_state(h0, d, b, j)
        time_loop((xp, rt, rbh, lens, y, h, g, a))
        for d, b, j in T.grid(dirs, batch, hid):
            T.buffer_store(yh, h[seq % 2, d, b, j], s.state(d, b, j))

    return gru


def _rnn(s: _Spec) -> tirx.PrimFunc:
    L, dt = s.layer, s.layer.dtype
    seq, batch, hid, dirs = L.seq, L.batch, L.hidden, len(L.directions)
    products, D, B, J, N = _products(s), s.task_d, s.task_b, s.task_j, s.task_n

    @T.macro
    def step(st, t, xp, rt, lens, y, h, g):
        """Task ``t``'s units at step ``st``."""
        if st < lens[B(t)]:
            products(g, s.xp_row(xp, D(t), B(t), st, lens[B(t)]),
                     s.row(h, st, D(t), B(t)), rt, D(t), B(t), J(t), N(t), 0, 1)
            for jj in range(N(t)):
                h[1 - st % 2, D(t), B(t), J(t) + jj] = s.act(0, D(t), g[D(t), B(t), J(t) + jj])
                T.buffer_store(y, h[1 - st % 2, D(t), B(t), J(t) + jj],
                               s.y(s.time(D(t), st, lens[B(t)]), D(t), B(t), J(t) + jj))
        else:
            for jj in range(N(t)):
                h[1 - st % 2, D(t), B(t), J(t) + jj] = h[st % 2, D(t), B(t), J(t) + jj]

    time_loop = _time_loop(s, step)

    @T.prim_func(private=True, s_tir=True)
    def rnn(xp: T.Buffer(s.xp_shape(hid), dt), rt: T.Buffer(s.rt_shape(1), dt),
            lens: T.Buffer((batch,), "int32"), h0: T.Buffer(s.state_shape, dt),
            y: T.Buffer(s.y_shape, dt), yh: T.Buffer(s.state_shape, dt)):
        T.func_attr(s.attrs())
        h = T.alloc_buffer((2, dirs, batch, hid), dt)
        g = T.alloc_buffer((dirs, batch, hid), dt)
        for i0, i1, i2, i3 in T.grid(*s.y_shape):
            y[i0, i1, i2, i3] = s.zero()
        for d, b, j in T.grid(dirs, batch, hid):
            h[0, d, b, j] = s.load_state(h0, d, b, j)
        time_loop((xp, rt, lens, y, h, g))
        for d, b, j in T.grid(dirs, batch, hid):
            T.buffer_store(yh, h[seq % 2, d, b, j], s.state(d, b, j))

    return rnn
