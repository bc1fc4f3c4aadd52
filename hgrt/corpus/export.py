"""Exporting corpus models to ONNX as users do: ``torch.onnx.export`` with both exporters (the
dynamo one, torch's default, and ``dynamo=False`` at opset 17), and
``onnxruntime.quantization.quantize_static`` (QDQ, per channel) calibrated on random data.

Needs the ``corpus`` extra. Exports are deterministic (seeded weights and inputs), so the set of
op types a config gives is a property of the config.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import warnings

import numpy as np

from hgrt.corpus.builders import CorpusError, build, check_informative, example_inputs, torch_args
from hgrt.corpus.specs import BY_NAME, EXPORTERS, TORCHSCRIPT_OPSET, Spec, inputs_of


def op_types(model) -> list[str]:
    """The sorted set of op types (``domain::Op`` outside the default domain) of an ONNX model,
    functions' bodies included."""
    import onnx

    proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    stack, seen = nodes, set()
    while stack:
        node = stack.pop()
        seen.add(node.op_type if node.domain in ("", "ai.onnx") else
                 f"{node.domain}::{node.op_type}")
        for attr in node.attribute:
            for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                stack.extend(g.node)
    return sorted(seen)


def export_torch(spec: Spec, size: str, exporter: str, path: str, batch: int = 1) -> str:
    """Write ``spec`` at ``size`` to ``path`` with ``exporter`` ("dynamo" or "torchscript"),
    its inputs of ``batch`` samples (shapes are static: each batch is a file of its own)."""
    import torch

    if exporter not in EXPORTERS:
        raise CorpusError(f"exporter {exporter!r}: one of {list(EXPORTERS)}")
    model = build(spec, size)
    check_informative(model, spec, size)
    args = torch_args(spec, size, batch=batch)
    names = [n for n, *_ in inputs_of(spec, size)]
    kwargs = {"input_names": names, "output_names": ["logits"]}
    if exporter == "dynamo":
        kwargs.update(dynamo=True, external_data=False)
    else:
        kwargs.update(dynamo=False, opset_version=TORCHSCRIPT_OPSET)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, path, **kwargs)
    return path


def quantize(spec: Spec, size: str, float_path: str, path: str, batches: int = 8,
             batch: int = 1) -> str:
    """``float_path`` (the torchscript export of ``spec.quantize``) as int8 QDQ, per channel,
    calibrated on ``batches`` random inputs of ``batch`` samples."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    base = BY_NAME[spec.quantize]

    class RandomReader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([example_inputs(base, size, seed=200 + i, batch=batch)
                               for i in range(batches)])

        def get_next(self):
            return next(self.feeds, None)

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        quantize_static(float_path, path, RandomReader(), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    return path


def export(name: str, size: str, exporter: str, path: str, batch: int = 1) -> str:
    """Write corpus model ``name`` at ``size`` ("tiny" or "real") with inputs of ``batch``
    samples, exported by ``exporter``, to ``path``; an int8 model is quantized from its base's
    ``torchscript`` export."""
    spec = BY_NAME[name]
    if not spec.quantize:
        return export_torch(spec, size, exporter, path, batch)
    with tempfile.TemporaryDirectory() as tmp:
        float_path = os.path.join(tmp, "float.onnx")
        export_torch(BY_NAME[spec.quantize], size, exporter, float_path, batch)
        return quantize(spec, size, float_path, path, batch=batch)


def describe(path: str) -> dict:
    """What the manifest says of an exported file: its inputs (name, shape, dtype), outputs,
    opset, op types and size."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}

    def value(v) -> dict:
        t = v.type.tensor_type
        return {"name": v.name, "shape": [d.dim_value for d in t.shape.dim],
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name}

    opset = max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
                default=0)
    return {"inputs": [value(v) for v in proto.graph.input if v.name not in inits],
            "outputs": [value(v) for v in proto.graph.output], "opset": opset,
            "op_types": op_types(proto), "bytes": os.path.getsize(path),
            "nodes": len(proto.graph.node)}


def max_abs(a: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x))) for x in a)
