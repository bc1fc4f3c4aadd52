"""What ``kernels="auto"`` gives oneDNN, per op by modelled time with the switches between the
thread pools counted (providers/onednn/auto_choice.py): decisions read off the build, no timing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import auto_choice, rows
from hgrt.providers.onednn import claim_onednn as claim
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import assert_close_to, onnx_inputs, reference, run_hgrt

REASON = onednn.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
# the cost model reads the target's vector ISA and cores: a fixed one, whatever the host
TARGET = {"cpu": "llvm -mcpu=haswell -num-cores=2"}


def dense_stack(rows: int, width: int, layers: int, between: str) -> object:
    """``layers`` x (MatMul by a width x width weight + bias, then ``between``: "softmax_rows"
    (a softmax over the rows axis: a TVM kernel on its pool, oneDNN's row kernels reduce the
    last axis only), "layer_norm" (over the last axis: TVM's or oneDNN's), "transpose" (a pair:
    small layout kernels) or "relu") on a 1 x rows x width input, as an ONNX model."""
    rng = np.random.default_rng(0)
    inits, nodes, cur = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32")
        inits += [numpy_helper.from_array(w, f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype("float32"), f"b{i}")]
        nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        if between == "layer_norm":
            inits += [numpy_helper.from_array(np.ones(width, "float32"), f"g{i}"),
                      numpy_helper.from_array(np.zeros(width, "float32"), f"z{i}")]
            nodes.append(helper.make_node("LayerNormalization", [f"a{i}", f"g{i}", f"z{i}"],
                                          [f"o{i}"], axis=-1))
        elif between == "softmax_rows":
            nodes.append(helper.make_node("Softmax", [f"a{i}"], [f"o{i}"], axis=1))
        elif between == "transpose":
            nodes += [helper.make_node("Transpose", [f"a{i}"], [f"t{i}"], perm=[0, 2, 1]),
                      helper.make_node("Transpose", [f"t{i}"], [f"o{i}"], perm=[0, 2, 1])]
        else:
            nodes.append(helper.make_node("Relu", [f"a{i}"], [f"o{i}"]))
        cur = f"o{i}"
    graph = helper.make_graph(
        nodes, "dense_stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, rows, width])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, rows, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onednn_denses(model) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto", target=TARGET)
    return sum(n.func_name == claim.FUNC_NAME["dense"] for n in res.graph.nodes)


AVX512 = {"cpu": "llvm -mcpu=skylake-avx512 -num-cores=2"}


def test_a_transformer_s_dense_layers_stay_tvm_s_where_its_tile_is_as_fast():
    """128 rows (register tiles of several rows), a softmax over the rows after each, AVX-512:
    oneDNN's kernel saves nothing to pay for the two switches between thread pools around it;
    the placement report says so. On AVX2 (TVM's kernel ``TVM_DENSE_BY_ISA`` times oneDNN's,
    built for its 2 cores: 0.2 ms a layer saved in the model) it does not pay for them either;
    8 layers in a row, with nothing between them, pay for the two switches around them all."""
    model = dense_stack(128, 768, 4, "softmax_rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto", target=AVX512)
    assert sum(n.func_name == claim.FUNC_NAME["dense"] for n in res.graph.nodes) == 0
    why = [r.kernels_why for r in res.placement_report if r.op == "relax.matmul"]
    assert len(why) == 4 and all(w.startswith("TVM faster: dense") and "thread pools" in w
                                 for w in why), why
    assert onednn_denses(model) == 0
    assert onednn_denses(dense_stack(128, 768, 8, "relu")) == 8


def test_dense_layers_go_to_onednn_where_tvm_s_tile_holds_one_row():
    """1009 rows (a prime: TVM's tiles of 2 rows and a part-filled last one, on AVX2
    ``TVM_DENSE_BY_ISA`` times oneDNN's time): milliseconds saved a layer on 2 AVX2 cores
    outweigh two switches."""
    assert onednn_denses(dense_stack(1009, 768, 2, "softmax_rows")) == 2


def test_a_small_saving_does_not_pay_for_two_switches():
    """49 rows of 192 x 192: 1.8M multiply-adds a layer save tens of microseconds, less than
    the switches into oneDNN and back around each softmax."""
    assert onednn_denses(dense_stack(49, 192, 12, "softmax_rows")) == 0


def test_a_vector_times_a_weight_stays_tvm_s():
    """An unrolled RNN's steps, (1, 256) x (256, 256) + bias and an elementwise op, 8 times,
    on AVX2: a single row streams its weight on either side (no ISA factor), and a oneDNN
    call costs ``ONEDNN_CALL_US`` of its own, more than TVM's serial kernel on one core loses:
    all TVM's (with oneDNN's they ran 2.6x slower in a 62-step RNN)."""
    assert auto_choice.ONEDNN_CALL_US > 0
    assert onednn_denses(dense_stack(1, 256, 8, "relu")) == 0
    # wider single rows, (1, 1280) x (1280, 1280): their multiply-adds on both cores pay
    assert onednn_denses(dense_stack(1, 1280, 2, "relu")) == 2


def test_layer_norms_between_dense_layers_join_them_on_onednn():
    """The same layers with a layer norm over the last axis between them: oneDNN's row kernel
    takes it, and the whole stack is one run of oneDNN kernels, no switch inside; the numbers
    are onnxruntime's."""
    model = dense_stack(49, 192, 12, "layer_norm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto", target=TARGET)
    funcs = [n.func_name for n in res.graph.nodes]
    assert funcs.count(claim.FUNC_NAME["dense"]) == 12
    assert funcs.count(rows.FUNC_NAME["layer_norm"]) == 12
    why = [r.kernels_why for r in res.placement_report if r.op == "relax.nn.layer_norm"]
    assert len(why) == 12 and all("among oneDNN kernels" in w for w in why), why
    x = onnx_inputs(model)
    assert_close_to(run_hgrt(res, x), reference(model, x))


def test_small_kernels_between_dense_layers_cost_no_switch():
    """The same layers with a ReLU (a post-op) or a transpose pair (small layout kernels that
    run on the calling thread) between them: one run of oneDNN kernels, no switch inside."""
    assert onednn_denses(dense_stack(49, 192, 12, "relu")) == 12
    assert onednn_denses(dense_stack(49, 192, 12, "transpose")) == 12


def test_the_switch_cost_decides_between_them(monkeypatch):
    """With switches free the 49-row layers between softmaxes go to oneDNN after all."""
    monkeypatch.setattr(auto_choice, "SWITCH_US", 0.0)
    assert onednn_denses(dense_stack(49, 192, 12, "softmax_rows")) == 12


def test_a_mixed_build_equals_onnxruntime(monkeypatch):
    """Dense layers on oneDNN between softmaxes on TVM (switches free): the numbers are
    onnxruntime's."""
    monkeypatch.setattr(auto_choice, "SWITCH_US", 0.0)
    model = dense_stack(49, 192, 3, "softmax_rows")
    x = onnx_inputs(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto", target=TARGET)
    assert sum(n.func_name == claim.FUNC_NAME["dense"] for n in res.graph.nodes) == 3
    assert_close_to(run_hgrt(res, x), reference(model, x))


def test_a_run_of_dense_layers_goes_to_onednn_on_avx2_and_stays_tvm_s_on_avx512():
    """12 dense layers of 128 rows joined by ReLUs (one run of oneDNN kernels, two switches):
    on AVX2 TVM's kernel takes ``TVM_DENSE_BY_ISA`` times oneDNN's, which pays for the
    switches; on AVX-512 the two are as fast, and TVM keeps them."""
    model = dense_stack(128, 768, 12, "relu")
    assert auto_choice.TVM_DENSE_BY_ISA["avx2"] > 1
    assert onednn_denses(model) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto", target=AVX512)
    assert sum(n.func_name == claim.FUNC_NAME["dense"] for n in res.graph.nodes) == 0
