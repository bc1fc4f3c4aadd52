"""ONNX LSTM, GRU and RNN as hgrt imports them (one call_tir per layer), against onnxruntime
on graphs of one node, per attribute, on one device and split over cpu:0 / cpu:1; and the ONNX
node test cases of the three ops (their inputs and numpy reference outputs)."""

from __future__ import annotations

import functools
import importlib
import time

import numpy as np
import pytest
import tvm
from recurrent_onnx_models import recurrent_inputs, recurrent_model, stacked_lstm

import hgrt
from hgrt.frontend import import_model
from hgrt.testing import alternating, input_names, onnx_reference, run_hgrt


def _check(model, split: bool = False, inputs=None):
    inputs = recurrent_inputs(model) if inputs is None else inputs
    want = onnx_reference(model, inputs)
    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model)) if split \
        else hgrt.build(model, ["cpu:0"])
    got = run_hgrt(res, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert np.abs(w).max() > 0.05  # an informative output, not all zeros
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    return res


@pytest.mark.slow  # the node cases below run every direction of every op by default
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_directions(op, direction):
    _check(recurrent_model(op, direction))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_split_over_two_devices(op):
    """The Mul before the layer on cpu:0, the layer on cpu:1: its operands are copied."""
    model = recurrent_model(op, "bidirectional", before=True, initial=True)
    assert set(alternating(model).overrides.values()) == {"cpu:0", "cpu:1"}
    _check(model, split=True)


SLOW = pytest.mark.slow
ATTRIBUTES = [
    ("LSTM", {"clip": 0.7}),
    pytest.param("GRU", {"clip": 0.5, "direction": "bidirectional"}, marks=SLOW),
    pytest.param("RNN", {"clip": 0.4}, marks=SLOW),
    ("LSTM", {"peepholes": True, "initial": True, "direction": "bidirectional"}),
    ("LSTM", {"input_forget": 1}),
    ("GRU", {"linear_before_reset": 1, "initial": True}),
    pytest.param("GRU", {"linear_before_reset": 1, "direction": "bidirectional"}, marks=SLOW),
    ("LSTM", {"lens": True, "direction": "bidirectional"}),
    ("GRU", {"linear_before_reset": 1, "lens": True, "initial": True,
             "direction": "bidirectional"}),
    pytest.param("GRU", {"lens": True, "direction": "reverse"}, marks=SLOW),
    pytest.param("RNN", {"lens": True, "initial": True, "direction": "bidirectional"},
                 marks=SLOW),
    ("LSTM", {"bias": False, "outputs": ("Y_h",)}),
    pytest.param("LSTM", {"outputs": ("Y", "Y_c")}, marks=SLOW),
    pytest.param("GRU", {"bias": False, "outputs": ("Y",)}, marks=SLOW),
    pytest.param("RNN", {"activations": ["LeakyRelu"], "activation_alpha": [0.2]}, marks=SLOW),
    ("RNN", {"activations": ["Relu", "Affine"], "activation_alpha": [0.5],
             "activation_beta": [0.1], "direction": "bidirectional"}),
    ("GRU", {"activations": ["HardSigmoid", "Softsign", "Sigmoid", "ThresholdedRelu"],
             "activation_alpha": [0.3, 0.1], "activation_beta": [0.4],
             "direction": "bidirectional"}),
    ("LSTM", {"activations": ["HardSigmoid", "ScaledTanh", "Elu"],
              "activation_alpha": [0.3, 0.9, 0.8], "activation_beta": [0.4, 1.2]}),
    pytest.param("LSTM", {"activations": ["Sigmoid", "Softplus", "Tanh", "Sigmoid", "Tanh",
                                          "Softsign"], "direction": "bidirectional"},
                 marks=SLOW),
]


def _id(param) -> str:
    op, attrs = param.values if hasattr(param, "values") else param
    return f"{op}-{'-'.join(sorted(attrs))}"


@pytest.mark.parametrize("op, attrs", ATTRIBUTES, ids=[_id(p) for p in ATTRIBUTES])
def test_attribute(op, attrs):
    _check(recurrent_model(op, **attrs))


@pytest.mark.parametrize("op, direction, batch, attrs", [
    ("GRU", "forward", 1, {}),
    pytest.param("GRU", "reverse", 1, {"linear_before_reset": 1}, marks=SLOW),
    pytest.param("LSTM", "forward", 1, {"peepholes": True}, marks=SLOW),
    ("RNN", "bidirectional", 3, {})])
def test_threads_give_one_thread_s_bits(op, direction, batch, attrs):
    """40 hidden units. One row (a direction of a batch row): each step's units in two tasks,
    the second short, on two threads with a barrier between steps, the sequence shorter than
    the layer (the state carried); several rows: each on a thread of its own, whole. Right
    against onnxruntime, and the same bits on 1 and 2 threads (each unit's sums in one order;
    a step that read a state other threads had not finished would differ)."""
    model = recurrent_model(op, direction, lens=True, initial=True, hidden=40, batch=batch,
                            **attrs)
    inputs = recurrent_inputs(model)
    if batch == 1:
        inputs["seq_lens"] = np.array([3], "int32")
    res = _check(model, inputs=inputs)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    got = {}
    for threads in (1, 2):
        m.configure_calls(callers=1, threads_per_call=threads)
        got[threads] = [np.array(o) for o in m(**inputs)]
    for one, two in zip(got[1], got[2], strict=True):
        assert np.array_equal(one, two)


def _transposed(arrays, perms):
    return [np.transpose(a, p) for a, p in zip(arrays, perms, strict=True)]


@pytest.mark.parametrize("op, direction", [("LSTM", "bidirectional"),
                                           pytest.param("GRU", "forward", marks=SLOW),
                                           pytest.param("RNN", "reverse", marks=SLOW)])
def test_batch_first_layout(op, direction):
    """layout 1 (onnxruntime runs layout 0 only): the oracle is onnxruntime on the same layer in
    layout 0, its inputs and outputs transposed."""
    model = recurrent_model(op, direction, layout=1, initial=True)
    inputs = recurrent_inputs(model)
    time_first = recurrent_model(op, direction, initial=True)
    swap = {"X": (1, 0, 2), "initial_h": (1, 0, 2), "initial_c": (1, 0, 2)}
    want = onnx_reference(time_first, {k: np.transpose(v, swap[k]) for k, v in inputs.items()})
    want = _transposed(want, [(2, 0, 1, 3)] + [(1, 0, 2)] * (len(want) - 1))
    got = run_hgrt(hgrt.build(model, ["cpu:0"]), inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_layer_is_one_call_whatever_its_length():
    """One call_tir per layer, its PrimFunc saying which op it is, and the same module at 8 and
    at 256 steps but for the sizes."""
    from hgrt.relay_passes.util.relax_util import CALL_TIR, bindings, op_name

    def calls(seq):
        mod, _ = import_model(stacked_lstm(seq=seq, hidden=8, layers=2))
        found = [b.value for b in bindings(mod["main"]) if op_name(b.value) == CALL_TIR]
        return mod, found, len(list(bindings(mod["main"])))

    mod, short, n_short = calls(8)
    _, long, n_long = calls(256)
    assert len(short) == len(long) == 2 and n_short == n_long
    assert [str(mod[c.args[0]].attrs["hgrt.recurrent_op"]) for c in short] == ["LSTM", "LSTM"]


def _unrolls(model, target: str) -> list[int]:
    """The unroll of each recurrent kernel of ``model`` lowered for a CPU of ``target``."""
    from hgrt.compiler import lower_model
    from hgrt.devices import as_target
    from hgrt.importer.recurrent_kernels import LAYER_ATTR, RecurrentLayer

    mod, _ = lower_model(model, [as_target(target)])
    return [RecurrentLayer.from_json(str(f.attrs[LAYER_ATTR])).unroll
            for f in mod.functions.values() if f.attrs is not None and LAYER_ATTR in f.attrs]


def test_the_unroll_follows_the_build_s_cpu():
    """An LSTM that runs by rows gets 16 products a pass where the build's CPU has 32 vector
    registers of 512 bits, 4 on AVX2's 16 (16 spills there), on an aarch64 board, and for
    GRU, RNN and a single row; the module handed in keeps its kernels."""
    from hgrt.devices import as_target
    from hgrt.importer.recurrent import for_targets

    by_rows = recurrent_model("LSTM", "bidirectional", hidden=40)
    avx512, avx2 = "llvm -mcpu=skylake-avx512 -num-cores=2", "llvm -mcpu=haswell -num-cores=2"
    assert _unrolls(by_rows, avx512) == [16]
    assert _unrolls(by_rows, avx2) == [4]
    assert _unrolls(by_rows, "llvm -mtriple=aarch64-linux-gnu -mattr=+neon") == [4]
    assert _unrolls(recurrent_model("LSTM", "forward", batch=1), avx512) == [4]
    assert _unrolls(recurrent_model("GRU", "bidirectional"), avx512) == [4]
    mod, _ = import_model(by_rows)
    wide = for_targets(mod, [as_target(avx512)])
    assert wide is not mod and [gv.name_hint for gv in wide.functions] == \
        [gv.name_hint for gv in mod.functions]
    assert for_targets(mod, [as_target(avx2)]) is mod
    # a build over two CPUs gets the unroll that suits both
    assert for_targets(mod, [as_target(avx512), as_target(avx2)]) is mod


@pytest.mark.parametrize("op, hidden", [("LSTM", 40), ("LSTM", 256), ("GRU", 20)])
def test_every_unroll_computes_the_same_layer(op, hidden):
    """The kernel at 16 products a pass (40 units: two passes and a tail of 8) against the
    same layer at 4, built for this host: the sums run in one order, so they agree to
    rounding whatever the unroll (the builds above run the target's unroll against
    onnxruntime)."""
    import dataclasses

    from hgrt.devices import host_target
    from hgrt.importer.recurrent_kernels import RecurrentLayer, kernel

    acts = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh")}[op]
    layer = RecurrentLayer(op, 6, 2, 8, hidden, ("forward", "reverse"),
                           (tuple((a, 0.0, 0.0) for a in acts),) * 2)
    rng = np.random.default_rng(3)
    outs = {}
    for unroll in (4, 16):
        func = kernel(dataclasses.replace(layer, unroll=unroll)).with_attr("global_symbol", "f")
        run = tvm.compile(tvm.IRModule({"f": func}), target=host_target(2))["f"]
        rng = np.random.default_rng(3)
        args = [np.full([int(d) for d in b.shape], 6, "int32") if str(b.dtype) == "int32" else
                (rng.standard_normal([int(d) for d in b.shape]) * 0.3).astype("float32")
                for b in func.params]
        tensors = [tvm.runtime.tensor(a) for a in args]
        run(*tensors)
        outs[unroll] = [t.numpy() for t in tensors[-(3 if op == "LSTM" else 2):]]
    for four, sixteen in zip(outs[4], outs[16], strict=True):
        assert np.abs(four).max() > 0.05
        np.testing.assert_allclose(sixteen, four, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_the_input_projection_is_one_matrix_product_ahead_of_the_layer(op):
    """Every time step's and direction's X W^T (biases added) is one matmul before the call;
    the weight transposes are folded at build, so a run is that product and the recurrence."""
    res = hgrt.build(recurrent_model(op, "bidirectional", lens=True), ["cpu:0"], kernels="tvm")
    kernels = [n.func_name for n in res.graph.nodes if n.func_name not in (None, "__nop")]
    assert len(kernels) == 2 and "matmul" in kernels[0], kernels
    assert kernels[1] == f"hgrt_{op.lower()}"


# ---- the ONNX node test cases -------------------------------------------------------------------

@functools.cache
def _node_cases(op: str) -> dict:
    """The node test cases of ``op`` from the onnx package's case code (the wheel ships the
    code, not the data): each export function called with its ``expect`` collecting the node,
    inputs and reference outputs, made into a model as ONNX's own ``expect`` makes it."""
    from onnx.backend.test.case import node

    module = importlib.import_module(f"onnx.backend.test.case.node.{op.lower()}")
    cases = {}

    def collect(node_op, inputs, outputs, name, **kwargs):
        cases[name] = (node_op, inputs, outputs, kwargs)

    original, module.expect = module.expect, collect
    try:
        cls = getattr(module, op)
        for name in sorted(dir(cls)):
            if name.startswith("export_"):
                getattr(cls, name)()
    finally:
        module.expect = original
    return {name: _case_model(node, *case) for name, case in cases.items()}


def _case_model(node, node_op, inputs, outputs, kwargs):
    import onnx

    present_in = [x for x in node_op.input if x]
    present_out = [x for x in node_op.output if x]
    graph = onnx.helper.make_graph(
        [node_op], "case",
        [node._extract_value_info(a, n) for a, n in zip(inputs, present_in, strict=False)],
        [node._extract_value_info(a, n) for a, n in zip(outputs, present_out, strict=False)])
    opset = kwargs.get("opset_imports") or [onnx.helper.make_operatorsetid(
        "", onnx.defs.get_schema(node_op.op_type).since_version)]
    return onnx.helper.make_model(graph, opset_imports=opset), inputs, outputs


NODE_CASES = [(op, name) for op in ("LSTM", "GRU", "RNN") for name in sorted(_node_cases(op))]


def test_every_op_has_its_node_cases():
    ops = [op for op, _ in NODE_CASES]
    assert {op: ops.count(op) for op in set(ops)} == {"LSTM": 6, "GRU": 6, "RNN": 6}


@pytest.mark.parametrize("op, name", NODE_CASES)
def test_onnx_node_case(op, name):
    model, inputs, outputs = _node_cases(op)[name]
    got = run_hgrt(hgrt.build(model, ["cpu:0"]),
                   dict(zip(input_names(model), inputs, strict=True)))
    assert len(got) == len(outputs)
    for g, want in zip(got, outputs, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-6)


def test_build_time_of_a_long_stacked_lstm():
    """Two stacked bidirectional layers of 32 steps, 64 hidden: the time loop is a TIR loop, so
    the build takes seconds (an LSTMCell unrolled over 32 steps: 965 nodes, 14.7 s)."""
    model = stacked_lstm(seq=32, hidden=64, layers=2)
    inputs = recurrent_inputs(model)
    t0 = time.perf_counter()
    res = hgrt.build(model, ["cpu:0"])
    seconds = time.perf_counter() - t0
    got = run_hgrt(res, inputs)
    np.testing.assert_allclose(got[0], onnx_reference(model, inputs)[0], rtol=1e-4, atol=1e-5)
    assert seconds < 8, seconds
