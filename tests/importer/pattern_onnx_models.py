"""Small ONNX graphs of the activation and normalisation subgraphs that exporters write, made
with ``onnx.helper``: each takes ``x`` (2, 4, 8), adds a weight (an op before the pattern, so
that two devices can share the graph), computes the pattern and scales the result.

Constants are written as torch's exporters write them: ``"node"`` as ``Constant`` nodes of
rank 0 (``torch.onnx.export(dynamo=False)``), ``"init"`` as initializers (the dynamo
exporter), each read where it is used."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper, numpy_helper

SHAPE = (2, 4, 8)
SQRT2 = math.sqrt(2.0)
SQRT_2_PI = math.sqrt(2.0 / math.pi)


class Graph:
    """A graph under construction: ``op`` adds a node and names its output, ``c`` a constant
    in the chosen style."""

    def __init__(self, constants: str = "node", opset: int = 17) -> None:
        self.nodes: list = []
        self.inits: list = []
        self.constants, self.opset = constants, opset
        rng = np.random.default_rng(3)
        self.weight("shift", rng.uniform(-0.5, 0.5, SHAPE[-1:]))
        self.x = self.op("Add", "x_in", "shift")

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def weight(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def c(self, value, dtype=np.float32) -> str:
        name = f"k{len(self.nodes)}_{len(self.inits)}"
        tensor = numpy_helper.from_array(np.asarray(value, dtype), name)
        if self.constants == "node":
            self.nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        else:
            self.inits.append(tensor)
        return name

    def axes(self, *axes: int, **attrs) -> tuple[list[str], dict]:
        """Inputs and attributes of a ReduceMean over ``axes`` (an input from opset 18)."""
        if self.opset >= 18:
            return [self.c(list(axes), np.int64)], attrs
        return [], {"axes": list(axes), **attrs}

    def model(self, y: str):
        out = self.op("Mul", y, self.c(1.5))
        graph = helper.make_graph(
            self.nodes, "pattern",
            [helper.make_tensor_value_info("x_in", TensorProto.FLOAT, SHAPE)],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, SHAPE)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])


def clip(constants="node", opset=17, lo=0.0, hi=6.0):
    """ONNX Clip with constant bounds (ReLU6 as torch exports it: bounds as inputs from
    opset 11, attributes before)."""
    g = Graph(constants, opset)
    if opset < 11:
        return g.model(g.op("Clip", g.x, min=lo, max=hi))
    return g.model(g.op("Clip", g.x, g.c(lo), g.c(hi)))


def silu(constants="node", sigmoid_first=False, read_twice=False):
    """``x * sigmoid(x)`` (``sigmoid_first``: ``sigmoid(x) * x``); ``read_twice``: the sigmoid
    is also added to the result."""
    g = Graph(constants)
    s = g.op("Sigmoid", g.x)
    y = g.op("Mul", s, g.x) if sigmoid_first else g.op("Mul", g.x, s)
    return g.model(g.op("Add", y, s) if read_twice else y)


def hardswish(form="onnx", constants="node", six=6.0):
    """HardSwish as ``form``: ``onnx`` the op (opset 14), ``hardsigmoid`` ``x * HardSigmoid(x)``
    (torch before opset 14), ``relu6`` ``x * relu6(x + 3) / 6`` (written out, as MobileNetV3
    code does), ``relu6_scaled`` ``x * (relu6(x + 3) * (1/6))``; ``six`` the divisor."""
    g = Graph(constants, 14 if form in ("onnx", "hardsigmoid") else 17)
    if form == "onnx":
        return g.model(g.op("HardSwish", g.x))
    if form == "hardsigmoid":
        return g.model(g.op("Mul", g.x, g.op("HardSigmoid", g.x, alpha=1 / six, beta=0.5)))
    r6 = g.op("Clip", g.op("Add", g.x, g.c(3.0)), g.c(0.0), g.c(6.0))
    if form == "relu6":
        return g.model(g.op("Div", g.op("Mul", g.x, r6), g.c(six)))
    return g.model(g.op("Mul", g.x, g.op("Mul", r6, g.c(1 / six))))


def gelu_erf(form="torch", constants="node", sqrt2=SQRT2):
    """The erf GELU: ``torch`` ``(x * (erf(x / sqrt2) + 1)) * 0.5`` (nn.GELU through
    torch.onnx.export), ``dynamo`` ``0.5 * (x * (erf(x / sqrt2) + 1))`` (onnxscript's
    decomposition), ``transformers`` ``x * 0.5 * (1 + erf(x * (1 / sqrt2)))``; ``onnx`` the Gelu
    op (opset 20)."""
    if form == "onnx":
        g = Graph(constants, 20)
        return g.model(g.op("Gelu", g.x))
    g = Graph(constants)
    if form == "transformers":
        half = g.op("Mul", g.x, g.c(0.5))
        e = g.op("Erf", g.op("Mul", g.x, g.c(1 / sqrt2)))
        return g.model(g.op("Mul", half, g.op("Add", g.c(1.0), e)))
    inner = g.op("Mul", g.x, g.op("Add", g.op("Erf", g.op("Div", g.x, g.c(sqrt2))), g.c(1.0)))
    if form == "dynamo":
        return g.model(g.op("Mul", g.c(0.5), inner))
    return g.model(g.op("Mul", inner, g.c(0.5)))


def gelu_tanh(form="pow", constants="node", cubic=0.044715):
    """The tanh GELU ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``: ``pow`` with
    ``Pow(x, 3)`` (transformers' NewGELU, GPT-2), ``cube`` with ``x * x * x``; ``onnx`` the Gelu
    op (opset 20, approximate tanh)."""
    if form == "onnx":
        g = Graph(constants, 20)
        return g.model(g.op("Gelu", g.x, approximate="tanh"))
    g = Graph(constants)
    x3 = g.op("Pow", g.x, g.c(3.0)) if form == "pow" \
        else g.op("Mul", g.op("Mul", g.x, g.x), g.x)
    inner = g.op("Mul", g.c(SQRT_2_PI), g.op("Add", g.x, g.op("Mul", g.c(cubic), x3)))
    half = g.op("Mul", g.c(0.5), g.x)
    return g.model(g.op("Mul", half, g.op("Add", g.c(1.0), g.op("Tanh", inner))))


def layer_norm(form="div", constants="node", opset=17, eps=1e-5, axis=-1, affine=True,
               twice=False):
    """A LayerNorm over the last axis written out: ``div`` ``(x - mean) / sqrt(var + eps)``
    (torch before LayerNormalization, and transformers' own LayerNorm classes), ``rsqrt``
    ``(x - mean) * (1 / sqrt(var + eps))`` with the variance as ``d * d``, ``twice`` the
    difference computed twice (as Python code that writes ``x - u`` twice exports);
    ``onnx`` the LayerNormalization op; ``affine``: times gamma plus beta (weights)."""
    rng = np.random.default_rng(5)
    g = Graph(constants, opset)
    gamma = g.weight("gamma", rng.uniform(0.5, 1.5, SHAPE[-1:]))
    beta = g.weight("beta", rng.uniform(-0.5, 0.5, SHAPE[-1:]))
    if form == "onnx":
        return g.model(g.op("LayerNormalization", g.x, gamma, beta, axis=axis, epsilon=eps))
    ins, attrs = g.axes(axis, keepdims=1)
    mean = g.op("ReduceMean", g.x, *ins, **attrs)
    d = g.op("Sub", g.x, mean)
    sq = g.op("Mul", d, d) if form == "rsqrt" else g.op("Pow", d, g.c(2.0))
    ins, attrs = g.axes(axis, keepdims=1)
    var = g.op("ReduceMean", sq, *ins, **attrs)
    std = g.op("Sqrt", g.op("Add", var, g.c(eps)))
    d2 = g.op("Sub", g.x, mean) if twice else d
    y = g.op("Mul", d2, g.op("Reciprocal", std)) if form == "rsqrt" else g.op("Div", d2, std)
    if affine:
        y = g.op("Add", g.op("Mul", y, gamma), beta)
    return g.model(y)


def softmax(opset=13):
    g = Graph("node", opset)
    return g.model(g.op("Softmax", g.x, axis=-1 if opset >= 13 else 2))
