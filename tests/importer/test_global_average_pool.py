"""An average pool whose one window covers its whole input (ONNX ``AveragePool`` with a kernel
larger than the input and ``ceil_mode``, as transformers' EfficientNet writes its last pool, or
a kernel the input's size) imports as a mean over the spatial axes
(``hgrt.importer.patterns.global_average_pool``) and runs as onnxruntime runs the file; a pool
with a smaller window, or with padding, stays an average pool."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.relay_passes.util.relax_util import bindings, op_name
from hgrt.testing import assert_close_to, onnx_inputs, reference, run_hgrt

SHAPE = (1, 4, 7, 7)


def average_pool(kernel: int, stride: int = 1, pad: int = 0, ceil_mode: int = 0,
                 count_include_pad: int = 0):
    """``x`` (1, 4, 7, 7) plus a weight (an op before the pool), then ONNX ``AveragePool``
    with a square ``kernel``, ``stride`` and ``pad`` on every side."""
    rnd = math.ceil if ceil_mode else math.floor
    side = rnd((SHAPE[2] + 2 * pad - kernel) / stride) + 1
    shift = numpy_helper.from_array(
        np.random.default_rng(3).uniform(-0.5, 0.5, SHAPE[1:2] + (1, 1)).astype("float32"),
        "shift")
    nodes = [helper.make_node("Add", ["x", "shift"], ["t"]),
             helper.make_node("AveragePool", ["t"], ["y"], kernel_shape=[kernel, kernel],
                              strides=[stride, stride], pads=[pad] * 4, ceil_mode=ceil_mode,
                              count_include_pad=count_include_pad)]
    graph = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE[:2] + (side, side))],
        [shift])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# (case, model): one window over the whole input
GLOBAL = [
    ("kernel_1280_ceil_mode", lambda: average_pool(1280, 1280, ceil_mode=1,
                                                   count_include_pad=1)),
    ("kernel_7_exact", lambda: average_pool(7)),
]

# (case, model): an output of one element per channel too, but not the mean of the input
NEAR_MISSES = [
    ("kernel_3_stride_1", lambda: average_pool(3)),
    ("kernel_3_stride_5", lambda: average_pool(3, 5)),  # one 3x3 window
    ("padding_1_count_include_pad", lambda: average_pool(9, pad=1, count_include_pad=1)),
]


def _ops(mod: tvm.IRModule) -> Counter:
    return Counter(op_name(b.value) for b in bindings(mod["main"]))


def _runs_as_onnxruntime(model) -> None:
    res = hgrt.build(model, ["cpu:0"], kernels="tvm")
    inputs = onnx_inputs(model)
    assert_close_to(run_hgrt(res, inputs), reference(model, inputs), rtol=1e-5,
                    atol_of_max=1e-6)


@pytest.mark.parametrize("case,make", GLOBAL, ids=[c[0] for c in GLOBAL])
def test_whole_input_window_imports_as_mean(case, make):
    ops = _ops(import_model(make())[0])
    assert ops["relax.mean"] == 1 and ops["relax.nn.avg_pool2d"] == 0, ops
    _runs_as_onnxruntime(make())


@pytest.mark.parametrize("case,make", NEAR_MISSES, ids=[c[0] for c in NEAR_MISSES])
def test_smaller_or_padded_window_stays_a_pool(case, make):
    ops = _ops(import_model(make())[0])
    assert ops["relax.nn.avg_pool2d"] == 1 and ops["relax.mean"] == 0, ops
    _runs_as_onnxruntime(make())


# (pool, input shape, layout, pool_size, ceil_mode, the axes of the mean)
RELAX = [
    (relax.op.nn.avg_pool2d, (1, 7, 5, 3), "NHWC", [1280, 1280], True, [1, 2]),
    (relax.op.nn.avg_pool1d, (1, 3, 7), "NCW", [7], False, [2]),
    (relax.op.nn.avg_pool3d, (1, 4, 5, 6, 3), "NDHWC", [5, 6, 7], True, [1, 2, 3]),
]


@pytest.mark.parametrize("pool,shape,layout,size,ceil,axes", RELAX,
                         ids=[f"{c[0].__name__}_{c[2]}" for c in RELAX])
def test_other_layouts_and_ranks_as_relax(pool, shape, layout, size, ceil, axes):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(pool(x, size, size, [0] * 2 * len(size), ceil_mode=ceil,
                                    count_include_pad=True, layout=layout))
        bb.emit_func_output(y)
    mod = bb.get()
    got = [b.value for b in bindings(import_model(mod, {})[0]["main"])]
    assert [op_name(c) for c in got] == ["relax.mean"], got
    assert [int(a) for a in got[0].attrs.axis] == axes and bool(got[0].attrs.keepdims)
    inputs = {"x": np.random.default_rng(0).standard_normal(shape).astype("float32")}
    assert_close_to(run_hgrt(hgrt.build(mod, ["cpu:0"], kernels="tvm"), inputs),
                    reference(mod, inputs), rtol=1e-5, atol_of_max=1e-6)
