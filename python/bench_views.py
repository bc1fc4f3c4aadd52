"""A corpus model built twice by default, with and without oneDNN's matmul reading and writing
through strided views (``HGRT_ONEDNN_VIEWS=0`` at build: the transposes around attention's
products stay kernels of their own), the two timed in turns in one process (median of the
rounds' medians of 3 runs), each build's transpose kernels counted.

    python python/bench_views.py vit swin --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import hgrt.spin  # noqa: F401  (before TVM loads)


def main() -> None:
    import onnx
    import tvm
    from bench_common import machine

    import hgrt
    from hgrt.corpus import seeded_inputs, spec
    from hgrt.corpus.generate import real_path
    from hgrt.corpus.specs import inputs_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="corpus models (their dynamo export, real size)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    print(machine())
    for name in args.models:
        model = onnx.load(real_path(name, "dynamo"))
        inputs = seeded_inputs(inputs_of(spec(name), "real", 1))
        mods, transposes = {}, {}
        for label, flag in (("views", "1"), ("no views", "0")):
            os.environ["HGRT_ONEDNN_VIEWS"] = flag
            res = hgrt.build(model, ["cpu"])
            transposes[label] = sum("transpose" in (n.func_name or "") for n in res.graph.nodes)
            m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
            m.load_params(res.params)
            m.set_input(**inputs)
            m.run()
            mods[label] = m
        os.environ.pop("HGRT_ONEDNN_VIEWS")
        samples: dict[str, list[float]] = {k: [] for k in mods}
        for _ in range(args.rounds):
            for label, m in mods.items():
                runs = []
                for _ in range(3):
                    t = time.perf_counter()
                    m.run()
                    runs.append(time.perf_counter() - t)
                samples[label].append(statistics.median(runs) * 1e3)
        print(name, ", ".join(f"{k}: {statistics.median(v):.1f} ms ({transposes[k]} transpose "
                              f"kernels)" for k, v in samples.items()))


if __name__ == "__main__":
    main()
