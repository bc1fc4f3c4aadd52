"""Single-op models (a convolution + bias + ReLU, a dense layer + bias) built for cuda:0 with
TVM's kernels and with cuBLAS/cuDNN (kernels="cudalibs"), for ``python/gpu_ops.py`` to time on
a GPU machine: where a library call pays. Runs here (TVM's compiler); the folder it writes
(weights as shapes only: the GPU machine makes seeded ones) travels there.

    python python/gpu_ops_prepare.py [DIR]        # default .gpu0/ops
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.artifacts import iter_params

RNG = np.random.default_rng(3)


def _model(nodes, x_shape, y_shape, weights, name):
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def conv(c: int, o: int, h: int, k: int, p: int, g: int, s: int = 1):
    w = (RNG.normal(0, 1, (o, c // g, k, k)) / np.sqrt(c // g * k * k)).astype("float32")
    oh = (h + 2 * p - k) // s + 1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[p] * 4, group=g,
                              strides=[s, s]),
             helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, [1, c, h, h], [1, o, oh, oh],
                   {"w": w, "b": RNG.normal(0, 0.1, o).astype("float32")}, "conv")
    return model, {"x": RNG.normal(size=(1, c, h, h)).astype("float32")}, \
        o * oh * oh * (c // g) * k * k


def dense(m: int, k: int, n: int):
    w = (RNG.normal(0, 1, (k, n)) / np.sqrt(k)).astype("float32")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["c"]),
             helper.make_node("Add", ["c", "b"], ["y"])]
    model = _model(nodes, [m, k], [m, n], {"w": w, "b": RNG.normal(0, 0.1, n).astype("float32")},
                   "dense")
    return model, {"x": RNG.normal(size=(m, k)).astype("float32")}, m * k * n


CASES = {
    "conv64_16_1x1_55": (conv, (64, 16, 55, 1, 0, 1)),
    "conv16_64_3x3_55": (conv, (16, 64, 55, 3, 1, 1)),
    "conv64_64_3x3_56": (conv, (64, 64, 56, 3, 1, 1)),
    "conv256_64_1x1_56": (conv, (256, 64, 56, 1, 0, 1)),
    "conv128_128_3x3_28": (conv, (128, 128, 28, 3, 1, 1)),
    "conv256_256_3x3_14": (conv, (256, 256, 14, 3, 1, 1)),
    "conv512_512_3x3_7": (conv, (512, 512, 7, 3, 1, 1)),
    "conv3_64_7x7_224_s2": (conv, (3, 64, 224, 7, 3, 1, 2)),
    "dw96_3x3_112": (conv, (96, 96, 112, 3, 1, 96)),
    "dw576_3x3_14": (conv, (576, 576, 14, 3, 1, 576)),
    "conv96_24_1x1_56": (conv, (96, 24, 56, 1, 0, 1)),
    "conv1024_256_1x1_14": (conv, (1024, 256, 14, 1, 0, 1)),
    "dense128_768_768": (dense, (128, 768, 768)),
    "dense128_768_3072": (dense, (128, 768, 3072)),
    "dense197_768_2304": (dense, (197, 768, 2304)),
    "dense1_2048_1000": (dense, (1, 2048, 1000)),
    "dense64_256_256": (dense, (64, 256, 256)),
    "dense128_3072_768": (dense, (128, 3072, 768)),
}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else ".gpu0/ops"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    index = []
    for name, (make, args) in CASES.items():
        model, inputs, macs = make(*args)
        np.savez(f"{out}/{name}.inputs.npz", **inputs)
        for kernels in ("tvm", "cudalibs"):
            res = hgrt.build(model, ["cuda:0", "cpu:0"],
                             hgrt.Placement(preferred="cuda:0", fallback="cpu:0"),
                             cuda_arch="sm_90", kernels=kernels)
            d = f"{out}/{name}.{kernels}"
            hgrt.save(d, res)
            shapes = {n: [list(np.asarray(v).shape), str(np.asarray(v).dtype)]
                      for n, v in iter_params(f"{d}/params.bin")}
            with open(f"{d}/shapes.json", "w") as f:
                json.dump(shapes, f)
            os.remove(f"{d}/params.bin")  # the GPU machine makes seeded weights of these shapes
            index.append({"case": name, "build": kernels, "dir": d, "macs": macs})
        print(name, macs, flush=True)
    with open(f"{out}/index.json", "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
