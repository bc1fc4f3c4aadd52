"""Import-time rewrites: ONNX Sum/Mean/Max/Min made pairwise, weight-only computations folded,
batch_norm fused into its convolution. Reference: onnx's own ReferenceEvaluator."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tvm import relax

import hgrt
from hgrt.compiler import lower_model
from hgrt.frontend import import_model
from hgrt.relay_passes.util.relax_util import op_name
from hgrt.testing import onnx_inputs, run_hgrt


def _model(nodes, inputs, output, inits=(), opset=13):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _run(model, feeds, devices=("cpu",), placement=None):
    res = hgrt.build(model, list(devices), placement)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(i) for i in range(len(devices))])
    m.load_params(res.params)
    m.set_input(**feeds)
    m.run()
    return m.get_output(0).numpy(), res


def _ops(mod) -> str:
    return mod["main"].script()


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_reductions_become_pairwise_and_match_onnx(op):
    shapes = [("a", [2, 3, 4]), ("b", [3, 4]), ("c", [2, 1, 4])]  # multidirectional broadcast
    model = _model([helper.make_node(op, ["a", "b", "c"], ["y"])], shapes, ("y", [2, 3, 4]))
    mod, _ = import_model(model)
    assert "R.stack" not in _ops(mod)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype("float32") for n, s in shapes}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got, _ = _run(model, feeds, ("cpu:0", "cpu:1"), hgrt.Placement(rules={"add": "cpu:1"}))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_weight_only_computation_is_done_at_build_time():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype("float32")  # Gemm transB: y = x @ w.T + b
    b = rng.standard_normal(16).astype("float32")
    model = _model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                   [("x", [4, 8])], ("y", [4, 16]), inits=[("w", w), ("b", b)])
    mod, weights = import_model(model)
    assert "permute_dims" not in _ops(mod) and "transpose" not in _ops(mod)
    assert "w" not in weights  # only the transpose read it: replaced by its result
    assert any(v.shape == (8, 16) and np.array_equal(v, w.T) for v in weights.values())
    x = rng.standard_normal((4, 8)).astype("float32")
    got, res = _run(model, {"x": x})
    np.testing.assert_allclose(got, x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert not any(v.shape == (16, 8) for v in res.params.values())


def test_folding_keeps_the_models_own_functions_and_may_call_them():
    # Clip (ReLU6) imports as a function of the module; here it runs on the activation and on
    # a weight (folded), next to a Gemm whose weight transpose is folded too
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 8)).astype("float32") * 4
    lo, hi = np.array(0, "float32"), np.array(6, "float32")
    model = _model([helper.make_node("Clip", ["w", "lo", "hi"], ["wc"]),
                    helper.make_node("Gemm", ["x", "wc"], ["g"], transB=1),
                    helper.make_node("Clip", ["g", "lo", "hi"], ["y"])],
                   [("x", [4, 8])], ("y", [4, 6]), inits=[("w", w), ("lo", lo), ("hi", hi)])
    mod, weights = import_model(model)
    assert "w" not in weights
    x = rng.standard_normal((4, 8)).astype("float32")
    got, _ = _run(model, {"x": x})
    np.testing.assert_allclose(got, np.clip(x @ np.clip(w, 0, 6).T, 0, 6), rtol=1e-5, atol=1e-5)


def test_nothing_to_fold_leaves_weights_alone():
    w = np.ones((4, 4), "float32")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 4])],
                   ("y", [2, 4]), inits=[("w", w)])
    mod, weights = import_model(model)
    assert list(weights) == ["w"] and weights["w"] is not None
    assert [gv.name_hint for gv in mod.get_global_vars()] == ["main"]


def test_batch_norm_fuses_into_its_convolution():
    rng = np.random.default_rng(2)
    c = 8
    inits = [("w", rng.standard_normal((c, 3, 3, 3)).astype("float32") / 5),
             ("s", rng.uniform(0.5, 1.5, c).astype("float32")),
             ("bias", rng.standard_normal(c).astype("float32")),
             ("mean", rng.standard_normal(c).astype("float32")),
             ("var", rng.uniform(0.5, 1.5, c).astype("float32"))]
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node("BatchNormalization", ["c", "s", "bias", "mean", "var"],
                                     ["bn"]),
                    helper.make_node("Relu", ["bn"], ["y"])],
                   [("x", [1, 3, 10, 10])], ("y", [1, c, 10, 10]), inits=inits)
    mod, _ = lower_model(model)
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1 and "conv2d" in kernels[0] and "relu" in kernels[0], kernels
    x = rng.standard_normal((1, 3, 10, 10)).astype("float32")
    conv = ReferenceEvaluator(_model(model.graph.node[:1], [("x", [1, 3, 10, 10])],
                                     ("c", [1, c, 10, 10]), inits=inits[:1]))
    v = {k: a.reshape(-1, 1, 1) for k, a in inits[1:]}
    bn = (conv.run(None, {"x": x})[0] - v["mean"]) / np.sqrt(v["var"] + 1e-5) * v["s"] + v["bias"]
    want = np.maximum(bn, 0)
    got, _ = _run(model, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_inference_dropouts_pass_their_input_through():
    """x -> Conv -> Dropout -> Relu -> y: the dropout is no kernel (nor fused into one), and
    the result equals the Relax VM's (which runs it)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype("float32"), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Dropout", ["c"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    graph = helper.make_graph(
        nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mod, _ = import_model(model)
    assert "relax.nn.dropout" not in str(mod["main"].script())
    res = _against_onnx(model)
    assert not [n for n in res.graph.nodes if "dropout" in (n.func_name or "")]


def _against_onnx(model):
    """hgrt's build of ``model`` against ONNX's reference evaluator (the Relax VM would run the
    rewritten import too); the build result."""
    inputs = onnx_inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="tvm")
    want = ReferenceEvaluator(model).run(None, inputs)
    for got, w in zip(run_hgrt(res, inputs), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    return res


def _pool_conv_concat_relu(concat_out: bool):
    """x -> [AveragePool 3x3/2, Conv 3x3/2] -> Concat -> Relu -> y (ShuffleNet's stride-2
    unit); with ``concat_out`` the concat is an output too."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype("float32"), "w")
    nodes = [helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["p", "c"], ["cat"], axis=1),
             helper.make_node("Relu", ["cat"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if concat_out:
        outputs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "unit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        outputs, [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("concat_out", [False, True])
def test_a_relu_of_a_concat_goes_to_its_parts(concat_out):
    """relu(concat(pool, conv)) is concat(relu(pool), relu(conv)): each relu fuses into its
    part's kernel and the concat is written in place by them; not where the concat is read
    elsewhere (an output too)."""
    res = _against_onnx(_pool_conv_concat_relu(concat_out))
    funcs = [n.func_name for n in res.graph.nodes if n.op == "tvm_op"]
    if concat_out:  # the relu reads the whole concat (a view still: both parts are kernels')
        assert "__concat" in funcs and [f for f in funcs if "relu" in f] == ["relu_llvm"]
    else:
        assert "__concat" in funcs and len(funcs) == 3  # pool+relu, conv+relu, the view
        assert all("relu" in f for f in funcs if f != "__concat")


def test_a_clip_of_a_concat_keeps_its_bounds():
    """R.clip's bounds are scalars, not operands: clip(concat(x + y, x * y), 0, 6) becomes the
    concat of the clipped parts, the same numbers."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    y = relax.Var("y", relax.TensorType((1, 4), "float32"))
    with bb.function("main", [x, y], attrs={"num_input": 2}):
        with bb.dataflow():
            parts = [bb.emit(relax.op.add(x, y)), bb.emit(relax.op.multiply(x, y))]
            cat = bb.emit(relax.op.concat(parts, axis=1))
            out = bb.emit_output(bb.emit(relax.op.clip(cat, 0.0, 6.0)))
        bb.emit_func_output(out)
    mod, _ = import_model(bb.finalize())
    assert [op_name(b.value) for b in mod["main"].body.blocks[0].bindings].count(
        "relax.clip") == 2
    xv, yv = (np.linspace(-3, 3, 4, dtype="float32").reshape(1, 4) * k for k in (1, 2))
    res = hgrt.build(bb.finalize(), ["cpu"], params={}, kernels="tvm")
    got = run_hgrt(res, {"x": xv, "y": yv})[0]
    np.testing.assert_allclose(got, np.clip(np.concatenate([xv + yv, xv * yv], 1), 0, 6))


@pytest.mark.parametrize("op, ref", [("Sum", lambda r, x: r + x + r),
                                     ("Mean", lambda r, x: (r + x + r) / 3),
                                     ("Max", lambda r, x: np.maximum(r, x))])
def test_stacked_reductions_take_names_of_their_own(op, ref):
    """Their pairwise ops were emitted as the builder's default "lv", the ONNX import's first
    name: place_devices then refused "binding name 'lv' appears twice in main"."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node(op, ["r", "x", "r"], ["y"])],
        "stacked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = np.random.default_rng(0).standard_normal((1, 4, 2, 2)).astype("float32")
    got = run_hgrt(hgrt.build(model, ["cpu:0", "cpu:1"]), {"x": x})[0]
    np.testing.assert_allclose(got, ref(np.maximum(x, 0), x), rtol=1e-6, atol=1e-6)
