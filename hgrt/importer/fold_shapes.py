"""Shape arithmetic folded to constants on the ONNX graph, before TVM sees it, as onnxruntime's
constant folding does: a ``Shape`` (``Size``) of a tensor whose shape is static, and every node
whose inputs are all constants (``Gather``, ``Concat``, ``ConstantOfShape``, ``Range``,
``Unsqueeze``, ``Slice``, ``Cast``, ``Equal``, ``Where``, ``Expand``, ``Reshape``, arithmetic
...), become ``Constant`` nodes; the nodes nobody reads any more leave. Exporters write such
chains for shapes every dimension of which is known (a channel split at ``Shape(x)[1] / 2``, a
mask of ``ConstantOfShape(Shape(ids))``), and TVM's import keeps them as run-time shapes.

Folding alternates with ONNX shape inference (a Reshape whose target became a constant has a
static shape the next round) until nothing changes. A node is evaluated by ONNX's reference
evaluator at the model's opset (``REFERENCE_OPSET``: a few at a later one, which computes them
alike); one that fails there, a random or control-flow node, one of
another domain and one whose result would exceed ``MAX_ELEMENTS`` (weights stay what they are:
``fold_weight_transforms`` handles those after import) is left alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_ELEMENTS = 1 << 16  # a folded result bigger than this stays a computation
MAX_ROUNDS = 16
# what is never folded: random, control flow and sequence ops, and what is a constant already
_NEVER = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
          "Multinomial", "Bernoulli", "If", "Loop", "Scan", "Constant", "Optional",
          "OptionalGetElement", "OptionalHasElement", "SequenceConstruct", "SequenceEmpty",
          "SequenceInsert", "SequenceAt", "SequenceErase", "SequenceLength", "SplitToSequence",
          "ConcatFromSequence"}


def _static_shapes(model: Any) -> dict[str, list[int]]:
    """Every tensor whose shape ONNX's shape inference knows in full."""
    from onnx import shape_inference

    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # an op it does not know: fold what constants alone give
        inferred = model
    g = inferred.graph
    shapes = {}
    for v in [*g.input, *g.value_info, *g.output]:
        t = v.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[v.name] = [int(d.dim_value) for d in t.shape.dim]
    return shapes


def _constants(model: Any) -> dict[str, Any]:
    """Constant tensors by name, as protos (initializers small enough to read, Constant nodes
    holding a tensor)."""
    found = {t.name: t for t in model.graph.initializer
             if int(np.prod(t.dims)) <= MAX_ELEMENTS}
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 \
                and node.attribute[0].name == "value":
            found[node.output[0]] = node.attribute[0].t
    return found


# ops whose reference implementation starts at a later opset than the ops' earlier versions
# it computes alike (for the types those allow): evaluated at that opset
REFERENCE_OPSET = {"DequantizeLinear": 19, "QuantizeLinear": 19}


def _evaluate(node: Any, values: dict[str, np.ndarray], opsets: list) -> list[np.ndarray]:
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    at_least = REFERENCE_OPSET.get(node.op_type, 0)
    opsets = [helper.make_opsetid(o.domain, max(o.version, at_least))
              if o.domain in ("", "ai.onnx") else o for o in opsets]

    names = [i for i in node.input if i]
    graph = helper.make_graph(
        [node], "fold", [helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(values[n].dtype), values[n].shape)
            for n in names],
        [helper.make_tensor_value_info(o, 0, None) for o in node.output if o])
    model = helper.make_model(graph, opset_imports=opsets)
    # T5's position buckets take the log of 0 and cast it, values that a Where then drops:
    # as in onnxruntime, no warning
    with np.errstate(all="ignore"):
        return list(ReferenceEvaluator(model).run(None, {n: values[n] for n in names}))


def _folded(node: Any, shapes: dict, values: dict, opsets: list) -> list[np.ndarray] | None:
    """The values of ``node``'s outputs when they are constants, else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER or not node.output:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        dims = np.array(shapes[node.input[0]], "int64")
        if node.op_type == "Size":
            return [np.array(int(np.prod(dims)), "int64")]
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(dims))
        return [dims[start:end]]
    if not all(i in values for i in node.input if i):
        return None
    try:
        return _evaluate(node, values, opsets)
    except Exception:  # the reference evaluator lacks it, or it is no pure function
        return None


def _sequence_length(node: Any, producer: dict, shapes: dict, values: dict
                     ) -> list[np.ndarray] | None:
    """The length of a sequence ``SplitToSequence`` made of a tensor of static shape, which
    its shape and its split's shape (or scalar value) give; else None."""
    split = producer.get(node.input[0])
    if split is None or split.op_type != "SplitToSequence":
        return None
    sizes = split.input[1] if len(split.input) > 1 else ""
    if sizes and len(shapes.get(sizes, [None, None])) == 1:  # one chunk per size given
        return [np.array(shapes[sizes][0], "int64")]
    dims = shapes.get(split.input[0])
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    if dims is None or not -len(dims) <= axis < len(dims):
        return None
    dim = dims[axis]
    if not sizes:  # chunks of one
        return [np.array(dim, "int64")]
    if sizes in values and np.ndim(values[sizes]) == 0 and int(values[sizes]) > 0:
        return [np.array(-(-dim // int(values[sizes])), "int64")]
    return None


def _fold_round(model: Any, shapes: dict, values: dict, keep: set[str]) -> bool:
    """One pass over the nodes in order, each foldable one replaced by Constant nodes (a graph
    output only where it is a sequence's length: a scalar of the shapes alone)."""
    from onnx import helper, numpy_helper

    opsets = list(model.opset_import)
    changed = False
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    del model.graph.node[:]
    for node in nodes:
        if node.op_type == "SequenceLength" and node.domain in ("", "ai.onnx"):
            outs = _sequence_length(node, producer, shapes, values)
        else:
            outs = None if any(o in keep for o in node.output) else \
                _folded(node, shapes, values, opsets)
        if outs is None or any(np.asarray(o).size > MAX_ELEMENTS for o in outs):
            model.graph.node.append(node)
            continue
        changed = True
        for name, value in zip(node.output, outs, strict=False):
            if not name:
                continue
            value = np.asarray(value)
            values[name] = value
            model.graph.node.append(helper.make_node(
                "Constant", [], [name], name=f"{node.name or node.op_type}:{name}",
                value=numpy_helper.from_array(value, name)))
    return changed


def _without_dead_nodes(model: Any) -> None:
    """The nodes whose outputs no node and no graph output reads removed (in place)."""
    needed = {o.name for o in model.graph.output}
    kept = []
    for node in reversed(list(model.graph.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
            for a in node.attribute:  # subgraphs read outer names
                for g in [a.g] if a.HasField("g") else list(a.graphs):
                    needed.update(i for n in g.node for i in n.input)
    if len(kept) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(reversed(kept))
    unread = [t for t in model.graph.initializer if t.name not in needed]
    for t in unread:
        model.graph.initializer.remove(t)
    # an initializer that old exporters also list as a graph input goes with it: else the
    # input would stay, a user input no node reads
    gone = {t.name for t in unread}
    listed = [i for i in model.graph.input if i.name in gone]
    for i in listed:
        model.graph.input.remove(i)


def fold_static_shapes(model: Any, input_shapes: dict[str, list[int]] | None = None) -> Any:
    """``model`` with its constant shape arithmetic folded (a copy; ``model`` itself when
    nothing folds). ``input_shapes`` overrides the declared shapes of inputs."""
    from onnx import numpy_helper

    folded = type(model)()
    folded.CopyFrom(model)
    for v in folded.graph.input:
        if v.name in (input_shapes or {}):
            dims = v.type.tensor_type.shape.dim
            del dims[:]
            for d in input_shapes[v.name]:
                dims.add().dim_value = int(d)
    values = {n: numpy_helper.to_array(t) for n, t in _constants(folded).items()}
    keep = {o.name for o in folded.graph.output}
    changed_at_all = False
    for _ in range(MAX_ROUNDS):
        if not _fold_round(folded, _static_shapes(folded), values, keep):
            break
        changed_at_all = True
        _without_dead_nodes(folded)
    if not changed_at_all:
        return model
    for v in folded.graph.input:  # the declared shapes stay the model's
        if v.name in (input_shapes or {}):
            original = next(i for i in model.graph.input if i.name == v.name)
            v.CopyFrom(original)
    return folded
