"""FLOPs of an ONNX model's convolutions and matrix products, and the least time they take at a
given peak: the floor under any kernel library's latency on a machine.

    python python/model_flops.py squeezenet resnet50 --peak 267   # GFLOP/s (AVX2, 2 threads)
    python python/model_flops.py model.onnx --peak 493

A model is a path to an .onnx file or the name of a light zoo model (random weights). Shapes
come from one onnxruntime run with every intermediate tensor made an output (batch 1);
FLOPs count 2 per multiply-add: Conv = 2 x output elements x (input channels / groups) x
kernel area, Gemm / MatMul = 2 x output elements x the reduction length. Peaks measured on
the machine: ``cc -O3 -funroll-loops -mavx2 -mfma -fopenmp python/fma_peak.c -o /tmp/fma_peak
&& /tmp/fma_peak`` (add ``-mavx512f`` for the AVX-512 figure).
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def _load(name: str):
    import onnx

    if os.path.exists(name):
        return onnx.load(name)
    from hgrt.zoo import light_model

    return light_model(name)


def model_flops(model) -> float:
    """2 x multiply-adds of the model's Conv, Gemm and MatMul nodes at batch 1."""
    import onnx
    import onnxruntime as ort

    model = onnx.ModelProto.FromString(model.SerializeToString())  # outputs are added below
    g = model.graph
    inits = {t.name: list(t.dims) for t in g.initializer}
    names = [o for n in g.node for o in n.output if o]
    del g.output[:]
    for name in names:
        g.output.append(onnx.helper.make_empty_tensor_value_info(name))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
             for i in sess.get_inputs()}
    shapes = {k: list(v.shape) for k, v in zip(names, sess.run(names, feeds), strict=True)}
    shapes.update(inits)
    shapes.update({k: list(v.shape) for k, v in feeds.items()})
    total = 0.0
    for node in g.node:
        if node.op_type == "Conv":
            weight = shapes[node.input[1]]
            total += 2.0 * np.prod(shapes[node.output[0]]) * np.prod(weight[1:])
        elif node.op_type in ("Gemm", "MatMul"):
            a = shapes[node.input[0]]
            trans_a = any(at.name == "transA" and at.i for at in node.attribute)
            total += 2.0 * np.prod(shapes[node.output[0]]) * (a[0] if trans_a else a[-1])
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="paths of .onnx files or light zoo model names")
    p.add_argument("--peak", type=float, action="append",
                   help="GFLOP/s to give the floor at (repeat; default 267 and 493, this "
                        "host's AVX2 and AVX-512 FMA peaks on 2 threads)")
    args = p.parse_args()
    peaks = args.peak or [267.0, 493.0]
    for name in args.models:
        flops = model_flops(_load(name))
        floors = ", ".join(f"{flops / (peak * 1e9) * 1e3:.2f} ms at {peak:g} GFLOP/s"
                           for peak in peaks)
        print(f"{name}: {flops / 1e9:.3f} GFLOP; {floors}")


if __name__ == "__main__":
    main()
