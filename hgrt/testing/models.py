"""Models to test with: random weights that keep outputs informative (``calibrated`` scales a
model's last layer so that its logits have a standard deviation of a few units; ``zoo_model``:
a calibrated zoo model, ``zoo_input`` its input) and a small conv model (``conv_model``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hgrt.testing.builds import onnx_inputs
from hgrt.testing.oracle import onnx_proto, onnx_reference

# ops whose output scales by s when their data input does (s > 0), so the logits stay a fixed
# multiple of the last weighted layer's output
_HOMOGENEOUS = {"Relu", "GlobalAveragePool", "AveragePool", "MaxPool", "GlobalMaxPool",
                "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Dropout", "Identity", "Transpose"}
_SOFTMAX = {"Softmax", "LogSoftmax"}
LOGITS_STD = 3.0


def _last_layer(proto) -> tuple[str, list[str]]:
    """(the logits tensor, the initializers that scale it linearly): the softmax's input (or
    the graph output when there is none), and the weight and bias of the weighted layer it
    comes from through ops that commute with a positive scale."""
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}

    def weight(name: str) -> str | None:  # the initializer behind a reshaped/transposed weight
        while name not in inits:
            node = producer.get(name)
            if node is None or node.op_type not in ("Reshape", "Transpose", "Identity",
                                                    "Flatten", "Unsqueeze", "Squeeze"):
                return None
            name = node.input[0]
        return name

    head = producer.get(graph.output[0].name)
    logits = head.input[0] if head is not None and head.op_type in _SOFTMAX else \
        graph.output[0].name
    cur, scaled = logits, []
    while (node := producer.get(cur)) is not None:
        params = [w for w in map(weight, node.input[1:3]) if w is not None]
        if node.op_type in _HOMOGENEOUS:
            cur = node.input[0]
        elif node.op_type in ("Conv", "Gemm", "BatchNormalization") and weight(node.input[1]):
            return logits, scaled + params
        elif node.op_type == "MatMul" and weight(node.input[1]):
            return logits, scaled + params[:1]
        elif node.op_type == "Add" and (bias := weight(node.input[1]) or weight(node.input[0])):
            scaled.append(bias)
            cur = node.input[0] if bias == weight(node.input[1]) else node.input[1]
        else:
            break
    raise ValueError(f"no weighted layer found that scales the logits '{logits}' linearly "
                     f"(stopped at {node.op_type if node is not None else 'a graph input'} "
                     f"'{cur}')")


def calibrated(model: Any, inputs: dict[str, np.ndarray] | None = None,
               std: float = LOGITS_STD):
    """A copy of the ONNX ``model`` whose last weighted layer is scaled so that its logits (the
    input of the final softmax, or the output where there is none) have standard deviation
    ``std`` on ``inputs`` (default ``onnx_inputs``). Random weights otherwise give logits of
    hundreds, and a softmax of them is one-hot: a comparison of such outputs sees only the
    winning class."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.ModelProto()
    proto.CopyFrom(onnx_proto(model))
    inputs = onnx_inputs(proto) if inputs is None else inputs
    logits, names = _last_layer(proto)
    now = float(np.std(onnx_reference(proto, inputs, [logits])[0]))
    if not np.isfinite(now) or now == 0:
        raise ValueError(f"logits '{logits}' have standard deviation {now}: cannot calibrate")
    scale = std / now
    for t in proto.graph.initializer:
        if t.name in names:
            value = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((value * scale).astype(value.dtype), t.name))
    return proto


def zoo_model(name: str, seed: int = 0):
    """``hgrt.zoo.light_model(name, seed)`` calibrated (``calibrated``) on ``zoo_input``."""
    from hgrt.zoo import light_model

    model = light_model(name, seed=seed)
    return calibrated(model, zoo_input(model, seed + 1))


def zoo_input(model, seed: int = 1) -> dict[str, np.ndarray]:
    """The zoo's seeded inputs for ``model`` (``hgrt.zoo.light_input``)."""
    from hgrt.zoo import light_input

    return light_input(model, seed=seed)


def conv_model(seed: int = 0):
    """x → Conv(w, b) → Relu → Flatten → Add(f, s) → Mul(g, s) → Add(h, f): a weight (s) used by
    two ops. An ONNX ModelProto, input ``x`` of shape (1, 3, 8, 8)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n)
             for n, s in (("w", (4, 3, 3, 3)), ("b", (4,)), ("s", (1, 256)))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Add", ["f", "s"], ["g"]),
             helper.make_node("Mul", ["g", "s"], ["h"]),
             helper.make_node("Add", ["h", "f"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def matmul_module(a_shape: tuple[int, ...], b_shape: tuple[int, ...]):
    """A Relax module whose ``main`` is ``a @ b``, both inputs (``num_input`` 2), float32."""
    from tvm import relax

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "float32"))
    b = relax.Var("b", relax.TensorType(b_shape, "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 2)
    return mod
