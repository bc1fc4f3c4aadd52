"""The cuBLAS/cuDNN provider at build level (no GPU needed): what it claims on a CUDA device and
with which attributes, the weights it folds, the names its shim parses, the errors of a kernel
given wrong tensors; with a GPU, its kernels against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.errors import BuildError, GraphError
from hgrt.providers.cudalibs import kernels as runtime
from hgrt.providers.cudalibs import names
from hgrt.testing import zoo_model

CUDA = ["cuda:0", "cpu:0"]
ON_CUDA = hgrt.Placement(preferred="cuda:0", fallback="cpu:0")
needs_shim = pytest.mark.skipif(runtime.unavailable_reason() is not None,
                                reason=str(runtime.unavailable_reason()))
has_gpu = tvm.cuda(0).exist


def _conv_bn_residual() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """a = conv(x) + b1; y = relu(batch_norm(conv(x)) + a): two convolutions for cuDNN, the
    second with a folded batch norm, a residual and a ReLU."""
    rng = np.random.default_rng(7)
    w = {"w1": rng.normal(0, 0.3, (16, 8, 3, 3)), "b1": rng.normal(0, 0.3, 16),
         "w2": rng.normal(0, 0.3, (16, 8, 3, 3)), "gamma": rng.uniform(0.5, 1.5, 16),
         "beta": rng.normal(0, 0.3, 16), "mean": rng.normal(0, 0.3, 16),
         "var": rng.uniform(0.5, 1.5, 16)}
    w = {k: v.astype("float32") for k, v in w.items()}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"],
                              epsilon=1e-5),
             helper.make_node("Add", ["n", "a"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "conv_bn_residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, w


def _kernel_nodes(res: hgrt.BuildResult) -> list:
    return [n for n in res.graph.nodes if (n.func_name or "").startswith("hgrt.cudalibs.")]


def _param(res: hgrt.BuildResult, node, i: int) -> np.ndarray:
    src = res.graph.nodes[node.inputs[i][0]]
    assert src.op == "null", f"input {i} of {node.name} is not a weight"
    return res.params[src.name]


@needs_shim
def test_convolutions_with_a_folded_batch_norm_residual_and_relu_are_claimed():
    model, w = _conv_bn_residual()
    res = hgrt.build(model, CUDA, ON_CUDA, cuda_arch="sm_90", kernels="cudalibs")
    nodes = _kernel_nodes(res)
    labels = sorted(n.attrs["cudalibs_op"] for n in nodes)
    # whichever convolution comes first takes the other's result as its residual
    assert labels in (["conv2d+bias", "conv2d+scale+bias+add+relu"],
                      ["conv2d+bias+add+relu", "conv2d+scale+bias"]), labels
    assert all(n.attrs["provider"] == "cudalibs" for n in nodes)
    bn = next(n for n in nodes if "scale" in n.attrs["cudalibs_op"])
    plain = next(n for n in nodes if n is not bn)
    # the batch norm folded at build: (x, W * scale, shift[, residual])
    scale = w["gamma"] / np.sqrt(w["var"] + 1e-5)
    np.testing.assert_allclose(_param(res, bn, 1), w["w2"] * scale[:, None, None, None],
                               rtol=1e-6)
    np.testing.assert_allclose(_param(res, bn, 2), w["beta"] - w["mean"] * scale,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_param(res, plain, 1), w["w1"])
    np.testing.assert_array_equal(_param(res, plain, 2), w["b1"])
    last, first = (bn, plain) if "add" in bn.attrs["cudalibs_op"] else (plain, bn)
    assert last.func_name == "hgrt.cudalibs.conv2d_s1x1_p1x1_d1x1_g1_res_relu"
    assert first.func_name == "hgrt.cudalibs.conv2d_s1x1_p1x1_d1x1_g1"
    assert last.inputs[3][0] == res.graph.nodes.index(first)  # the residual
    assert not any(n.func_name == "__copy" for n in res.graph.nodes)
    rows = {r.node: r.kernels for r in res.placement_report}
    assert "cudalibs" in rows.values()


@needs_shim
def test_the_cpu_and_tvm_choices_leave_the_ops_alone():
    model, _ = _conv_bn_residual()
    assert not _kernel_nodes(hgrt.build(model, CUDA, ON_CUDA, cuda_arch="sm_90", kernels="tvm"))
    assert not _kernel_nodes(hgrt.build(model, ["cpu:0"], kernels="cudalibs"))
    rule = hgrt.Kernels("cudalibs", rules={"nn.conv2d": "tvm"})
    assert not _kernel_nodes(hgrt.build(model, CUDA, ON_CUDA, cuda_arch="sm_90", kernels=rule))


def test_an_override_on_a_cpu_op_is_refused_by_name():
    model, _ = _conv_bn_residual()
    with pytest.raises(BuildError, match="'cudalibs'.*not on a CUDA device"):
        res = hgrt.build(model, ["cpu:0"], kernels="tvm")
        conv = next(r.node for r in res.placement_report if r.op.endswith("conv2d"))
        hgrt.build(model, ["cpu:0"], kernels=hgrt.Kernels("tvm", overrides={conv: "cudalibs"}))


@needs_shim
def test_resnet50_on_cuda_all_asked_and_where_it_pays():
    res = hgrt.build(zoo_model("resnet50"), CUDA, ON_CUDA, cuda_arch="sm_90", kernels="cudalibs")
    labels = [n.attrs["cudalibs_op"] for n in _kernel_nodes(res)]
    assert len([x for x in labels if x.startswith("conv2d")]) == 53
    assert labels.count("conv2d+scale+bias+add+relu") == 16  # the residual blocks' ends
    assert any(x.startswith("dense+bias") for x in labels)
    # auto: the 3x3 convolutions of 128 channels or more (a reduction of 1152 or more); the
    # 1x1 ones, the 64-channel 3x3 ones, the stem and the 2048 -> 1000 dense layer stay TVM's
    auto = hgrt.build(zoo_model("resnet50"), CUDA, ON_CUDA, cuda_arch="sm_90")
    claimed = _kernel_nodes(auto)
    assert len(claimed) == 4 + 6 + 3, [n.func_name for n in claimed]  # stages 2, 3 and 4
    assert all("_p1x1_" in n.func_name for n in claimed)


def test_auto_pays_by_shape():
    from hgrt.providers.cudalibs.claim_cudalibs import AUTO_MIN_REDUCTION

    model, _ = _conv_bn_residual()  # 8 -> 16 channels, 3x3: a reduction of 72
    res = hgrt.build(model, CUDA, ON_CUDA, cuda_arch="sm_90")
    assert AUTO_MIN_REDUCTION > 72 and not _kernel_nodes(res)


@needs_shim
@pytest.mark.parametrize("name", [
    names.conv2d_name((2, 2), (3, 3), (1, 1), 1, residual=True, act="relu"),
    names.conv2d_name((1, 1), (1, 1), (2, 2), 32, act="clip", clip_hi=6.0),
    names.dense_name(True, "relu"), names.matmul_name(True)])
def test_the_shim_reads_what_the_name_says(name):
    got = runtime.parse(name)
    for kind in ("conv2d", "dense", "matmul"):
        if f".{kind}" in name:
            assert got.startswith(kind)
    assert ("residual=1" in got) == ("_res" in name)
    assert ("trans_b=1" in got) == ("_tb" in name)
    if "clip" in name:
        assert "act=clip clip_hi=6" in got and "dilation=2x2 groups=32" in got
    if "s2x2" in name:
        assert "stride=2x2 pad=3x3" in got and "act=relu" in got


@needs_shim
def test_a_kernel_refuses_wrong_tensors_with_their_name():
    with pytest.raises(GraphError, match="unknown attribute 'q7'"):
        runtime.kernel_function("hgrt.cudalibs.conv2d_q7")
    f = runtime.kernel_function(names.dense_name(True))
    cpu = [tvm.runtime.tensor(np.zeros(s, "float32")) for s in ((4, 8), (8, 3), (3,), (4, 3))]
    with pytest.raises(Exception, match="not on a CUDA device"):
        f(*cpu)
    with pytest.raises(Exception, match="4 arguments, expected"):
        runtime.kernel_function(names.dense_name(False))(*cpu)


@pytest.mark.skipif(not has_gpu, reason="no CUDA GPU here")
@needs_shim
def test_claimed_kernels_run_right_on_a_gpu():
    from hgrt.testing import onnx_reference

    model, _ = _conv_bn_residual()
    x = np.random.default_rng(1).normal(size=(1, 8, 16, 16)).astype("float32")
    want = onnx_reference(model, {"x": x})[0]
    res = hgrt.build(model, CUDA, ON_CUDA)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cuda(0), tvm.cpu(0)], params=res.params)
    m.set_input(x=x)
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), want, rtol=1e-4, atol=1e-4)
