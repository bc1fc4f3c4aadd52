"""A small classifier with its post-processing in the graph, on static shapes: a conv backbone,
scores, then ops that have no CUDA kernel in hgrt's GPU build (``TopK``, ``CumSum``) and a
``Gather`` of the winners' rows, as detection and ranking heads export them.

    x (1, 3, 32, 32) -> Conv 3x3 -> Relu -> MaxPool -> Conv 3x3 -> Relu -> GlobalAveragePool
      -> Flatten -> Gemm (CLASSES scores) -> Softmax -> TopK (K) -> top_scores, top_classes
      top_scores -> CumSum -> top_cumulative;  top_classes -> Gather(table) -> top_rows

Seeded random weights (numpy, nothing downloaded); the scores are rescaled so that their
standard deviation is ``LOGITS_STD`` on the seeded input: the top K are far enough apart that
float rounding cannot reorder them, and their probabilities are not all one class's.

>>> model, inputs = postprocess_model()
>>> [o.name for o in model.graph.output]
['top_scores', 'top_classes', 'top_cumulative', 'top_rows']
"""

from __future__ import annotations

from typing import Any

import numpy as np

CLASSES = 100
K = 5
ROW = 8  # the width of the table's rows gathered for the winners
LOGITS_STD = 3.0
INPUT_SHAPE = (1, 3, 32, 32)
# size -> (input height and width, the two convolutions' channels): "tiny" for tests, "real" a
# backbone whose work pays for a GPU (the second convolution: 0.46 G multiply-adds)
SIZES = {"tiny": (32, 16, 32), "real": (224, 32, 128)}


def _graph(weights: dict[str, np.ndarray], outputs: list[str], hw: int = INPUT_SHAPE[2]) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("TopK", ["probs", "k"], ["top_scores", "top_classes"], axis=-1),
        helper.make_node("CumSum", ["top_scores", "axis"], ["top_cumulative"]),
        helper.make_node("Gather", ["table", "top_classes"], ["top_rows"], axis=0),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in weights.items()]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, hw, hw])
    outs = [helper.make_empty_tensor_value_info(n) for n in outputs]
    graph = helper.make_graph(nodes, "postprocess", [x], outs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def postprocess_model(seed: int = 0, size: str = "tiny") -> tuple[Any, dict[str, np.ndarray]]:
    """The ONNX ModelProto and its seeded input ``{"x": ...}`` (standard normal); ``size``
    one of ``SIZES``."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(seed)

    def he(*shape: int) -> np.ndarray:  # keeps activations at unit scale through the relus
        fan_in = int(np.prod(shape[1:]))
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype("float32")

    hw, c1, c2 = SIZES[size]
    weights = {"w1": he(c1, 3, 3, 3), "b1": np.zeros(c1, "float32"),
               "w2": he(c2, c1, 3, 3), "b2": np.zeros(c2, "float32"),
               "wf": he(CLASSES, c2), "bf": np.zeros(CLASSES, "float32"),
               "k": np.array([K], "int64"), "axis": np.array(1, "int64"),
               "table": rng.standard_normal((CLASSES, ROW)).astype("float32")}
    inputs = {"x": np.random.default_rng(seed + 1).standard_normal((1, 3, hw, hw))
              .astype("float32")}
    logits = ReferenceEvaluator(_graph(weights, ["logits"], hw)).run(["logits"], inputs)[0]
    scale = LOGITS_STD / max(float(np.std(logits)), 1e-6)
    weights["wf"] = (weights["wf"] * scale).astype("float32")
    weights["bf"] = (rng.standard_normal(CLASSES) * 0.1 * LOGITS_STD).astype("float32")
    outputs = ["top_scores", "top_classes", "top_cumulative", "top_rows"]
    return _graph(weights, outputs, hw), inputs
