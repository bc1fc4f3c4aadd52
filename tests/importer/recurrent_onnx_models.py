"""Small ONNX graphs of one recurrent node (LSTM, GRU, RNN) made with ``onnx.helper``, with
seeded weights whose outputs stay away from saturation."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
SIZES = {"seq": 5, "batch": 3, "input": 4, "hidden": 6}


def recurrent_model(op: str, direction: str = "forward", *, bias: bool = True,
                    initial: bool = False, peepholes: bool = False, lens: bool = False,
                    layout: int = 0, outputs: tuple[str, ...] | None = None, before: bool = False,
                    opset: int = 14, hidden: int = SIZES["hidden"], batch: int = SIZES["batch"],
                    **attrs):
    """A graph of one ``op`` node (``before``: an element-wise Mul on X ahead of it, so that
    two devices can share the graph); the optional inputs as initializers or graph inputs
    (initial states and sequence lengths are inputs); ``hidden`` units (the recurrent weights
    scaled so that a gate's input keeps its spread), ``batch`` rows."""
    seq, isz, hid = SIZES["seq"], SIZES["input"], hidden
    dirs, gates = 2 if direction == "bidirectional" else 1, GATES[op]
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array((rng.standard_normal((dirs, gates * hid, isz)) * 0.6)
                                     .astype("float32"), "W"),
             numpy_helper.from_array((rng.standard_normal((dirs, gates * hid, hid))
                                      * (0.4 * np.sqrt(SIZES["hidden"] / hid))).astype("float32"),
                                     "R")]
    names = ["X", "W", "R", "B" if bias else "", "seq_lens" if lens else ""]
    if bias:
        inits.append(numpy_helper.from_array((rng.standard_normal((dirs, 2 * gates * hid))
                                              * 0.5).astype("float32"), "B"))
    x_shape = [seq, batch, isz] if layout == 0 else [batch, seq, isz]
    state = [dirs, batch, hid] if layout == 0 else [batch, dirs, hid]
    inputs = [helper.make_tensor_value_info("X_in" if before else "X", TensorProto.FLOAT,
                                            x_shape)]
    if lens:
        inputs.append(helper.make_tensor_value_info("seq_lens", TensorProto.INT32, [batch]))
    states = ["initial_h"] + (["initial_c"] if op == "LSTM" else [])
    if initial:
        names += states
        inputs += [helper.make_tensor_value_info(s, TensorProto.FLOAT, state) for s in states]
    if peepholes:
        names += [""] * (7 - len(names)) + ["P"]
        inits.append(numpy_helper.from_array((rng.standard_normal((dirs, 3 * hid)) * 0.5)
                                             .astype("float32"), "P"))
    while names and names[-1] == "":
        names.pop()
    all_outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    outs = list(outputs) if outputs is not None else all_outs
    node_outs = [o if o in outs else "" for o in all_outs]
    while node_outs[-1] == "":
        node_outs.pop()
    nodes = [helper.make_node("Mul", ["X_in", "scale"], ["X"])] if before else []
    if before:
        inits.append(numpy_helper.from_array(np.array(1.5, "float32"), "scale"))
    layout_attr = {"layout": layout} if layout else {}
    nodes.append(helper.make_node(op, names, node_outs, hidden_size=hid, direction=direction,
                                  **layout_attr, **attrs))
    graph = helper.make_graph(nodes, op.lower(), inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                               for o in outs], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def recurrent_inputs(model, seed: int = 1) -> dict[str, np.ndarray]:
    """Standard-normal inputs; sequence lengths from 1 to the full length."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT32:
            out[i.name] = np.resize(np.array([SIZES["seq"], 2, 1, 4], "int32"), shape)
        else:
            out[i.name] = rng.standard_normal(shape).astype("float32")
    return out


def stacked_lstm(seq: int, hidden: int, layers: int, batch: int = 2, isz: int = 16):
    """``layers`` bidirectional LSTMs in a row, as torch exports ``nn.LSTM(num_layers=...,
    bidirectional=True)``: each layer's Y (seq, 2, batch, hidden) reshaped to the next X."""
    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "X"
    for k in range(layers):
        width = isz if k == 0 else 2 * hidden
        for name, shape in (("W", (2, 4 * hidden, width)), ("R", (2, 4 * hidden, hidden)),
                            ("B", (2, 8 * hidden))):
            scale = 1 / np.sqrt(shape[-1])
            inits.append(numpy_helper.from_array(
                (rng.uniform(-1, 1, shape) * scale).astype("float32"), f"{name}{k}"))
        nodes.append(helper.make_node("LSTM", [x, f"W{k}", f"R{k}", f"B{k}"], [f"Y{k}"],
                                      hidden_size=hidden, direction="bidirectional"))
        nodes.append(helper.make_node("Transpose", [f"Y{k}"], [f"T{k}"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"T{k}", "shape"], [f"X{k + 1}"]))
        x = f"X{k + 1}"
    inits.append(numpy_helper.from_array(np.array([seq, batch, 2 * hidden], "int64"), "shape"))
    graph = helper.make_graph(
        nodes, "stacked", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                         [seq, batch, isz])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
