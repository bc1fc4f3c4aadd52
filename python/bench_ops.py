"""One op alone as an hgrt build, timed: a dense layer ``MxKxN`` (``(1, M, K) x (K, N)`` plus a
bias) or a depthwise convolution ``dw:CxHxKxS`` (C channels, an H x H plane, a K x K window,
stride S, plus a bias and SiLU), built with the kernels and target asked for, each checked
against numpy or onnxruntime. ``run()`` best of 7 blocks after 3 warm-up runs.

    python python/bench_ops.py 197x768x3072 196x768x3072              # TVM's kernels, this host
    python python/bench_ops.py 197x768x768 --kernels onednn
    python python/bench_ops.py 195x768x3072 --target 'cpu=llvm -mcpu=haswell'
    python python/bench_ops.py dw:144x56x3x1 dw:1152x7x5x1
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import hgrt.spin  # noqa: F401  (before TVM loads)

os.environ.setdefault("TVM_NUM_THREADS", "2")  # the pool's size, set before it starts


def _dense(m: int, k: int, n: int, rng):
    from onnx import helper, numpy_helper

    w, b = (rng.standard_normal((k, n)) * 0.05).astype("float32"), \
        (rng.standard_normal(n) * 0.05).astype("float32")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y"])]
    x = rng.standard_normal((1, m, k)).astype("float32")
    return nodes, x, [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")], \
        lambda: x[0] @ w + b, 2 * m * k * n


def _depthwise(c: int, h: int, k: int, s: int, rng):
    from onnx import helper, numpy_helper

    w = (rng.standard_normal((c, 1, k, k)) * 0.2).astype("float32")
    b = (rng.standard_normal(c) * 0.1).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=c, kernel_shape=[k, k],
                              pads=[k // 2] * 4, strides=[s, s]),
             helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    x = rng.standard_normal((1, c, h, h)).astype("float32")
    out = (h - 1) // s + 1
    return nodes, x, [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")], \
        None, 2 * c * out * out * k * k


def main() -> None:
    import numpy as np
    import onnxruntime
    import tvm
    from bench_common import machine
    from onnx import TensorProto, helper

    import hgrt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ops", nargs="+", help="MxKxN (dense) or dw:CxHxKxS (depthwise)")
    p.add_argument("--kernels", default="tvm", help="hgrt.build's kernels (default tvm)")
    p.add_argument("--target", help="KIND=TARGET, as hgrt compile --target takes it")
    args = p.parse_args()
    target = dict([args.target.split("=", 1)]) if args.target else None
    print(machine())
    print(f"kernels {args.kernels}, target {target or 'this host'}")
    for spec in args.ops:
        rng = np.random.default_rng(0)
        dims = [int(v) for v in spec.removeprefix("dw:").split("x")]
        nodes, x, inits, want, flops = (_depthwise if spec.startswith("dw:") else _dense)(
            *dims, rng)
        graph = helper.make_graph(nodes, "op", [helper.make_tensor_value_info(
            "x", TensorProto.FLOAT, list(x.shape))], [helper.make_tensor_value_info(
                "y", TensorProto.FLOAT, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = hgrt.build(model, ["cpu"], kernels=args.kernels, target=target)
        m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
        m.load_params(res.params)
        m.set_input("x", x)
        for _ in range(3):
            m.run()
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(10):
                m.run()
            best = min(best, (time.perf_counter() - t) / 10)
        ref = want() if want is not None else onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        err = float(np.abs(m.get_output(0).numpy().reshape(ref.shape) - ref).max())
        print(f"{spec}: {best * 1e3:.3f} ms, {flops / best / 1e9:.0f} GFLOP/s, "
              f"max abs diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
