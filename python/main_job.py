"""The main job: compile a real ONNX model from the onnx wheel, run it split across two devices.

light squeezenet (its ConstantOfShape weights replaced by seeded random ones, the last layer
scaled so that the softmax is not one-hot) is compiled with convolutions on device 1 and
everything else on device 0, run with hgrt on cpu:0 + cpu:1 (or cpu + cuda when a GPU exists),
and compared with onnxruntime running the same ONNX model (ONNX's reference evaluator where
onnxruntime is not installed).

    python python/main_job.py [--out out/]
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import argparse
import time
from collections import Counter

import numpy as np
import tvm

import hgrt
from hgrt.testing import assert_close_to, one_hot_rows, onnx_reference, zoo_input, zoo_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/squeezenet")
    args = ap.parse_args()

    gpu = tvm.cuda(0).exist
    names = ["cpu:0", "cuda:0"] if gpu else ["cpu:0", "cpu:1"]
    devices = [tvm.cpu(0), tvm.cuda(0)] if gpu else [tvm.cpu(0), tvm.cpu(1)]
    model = zoo_model("squeezenet")
    t0 = time.perf_counter()
    res = hgrt.build(model, names, hgrt.Placement(rules={"nn.conv2d": names[1]},
                                                   fallback=names[0]))
    print(f"built light squeezenet for {names} in {time.perf_counter() - t0:.1f} s")
    per_dev = Counter(row.device for row in res.placement_report)
    print("where each op ran:", dict(per_dev))
    for row in res.placement_report[:8]:
        print(f"  {row.node:<12} {row.op:<22} -> {row.device:<7} ({row.reason})")
    print(f"  ... {len(res.placement_report)} ops in all")
    hgrt.save(args.out, res)

    m = hgrt.load(args.out, devices)
    inputs = zoo_input(model)
    m.set_input(**inputs)
    m.run()
    got = m.get_output(0).numpy()
    want = onnx_reference(model, inputs)[0]
    oracle = "onnxruntime" if _has_onnxruntime() else "ONNX's reference evaluator"
    copies = sum(1 for n in res.graph.nodes if n.func_name == "__copy")
    print(f"graph: {copies} __copy nodes; memory per device: "
          + ", ".join(f"{names[i]} {d.planned_bytes} B (lower bound {d.lower_bound} B)"
                      for i, d in enumerate(res.memory_report)))
    err = float(np.max(np.abs(got - want)))
    top = np.sort(want.reshape(-1))[::-1][:3]
    print(f"output {got.shape}: top-3 probabilities {', '.join(f'{p:.4f}' for p in top)} "
          f"(one-hot rows: {one_hot_rows(want)}); max |hgrt - {oracle}| = {err:.3g} "
          f"({err / float(np.max(np.abs(want))):.2g} of the largest)")
    assert_close_to([got], [want])
    print(f"OK: hgrt on {[str(d) for d in devices]} matches {oracle} on the ONNX file")
    print(f"run(): {m.benchmark(repeat=5, number=1)}")


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
