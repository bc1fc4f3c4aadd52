"""A corpus model built and loaded twice, with and without one of oneDNN's switches, the two
timed in turns in one process (median of the rounds' medians of 3 runs), the kernels the
switch reaches counted in each, their outputs compared.

    python python/bench_views.py vit swin --rounds 5
    python python/bench_views.py gpt2 distilbert --switch row-chunks \
        --target 'cpu=llvm -mcpu=haswell'

The switches: ``views`` (``HGRT_ONEDNN_VIEWS=0`` at build: the transposes around attention's
products stay kernels of their own; counted: transpose kernels); ``row-chunks``
(``HGRT_ONEDNN_ROW_CHUNK=0`` as the module first runs: a dense layer's rows all at once where
the AVX2 kernel would take them 64 at a time; counted: dense layers in chunks, whose
``onednn_impl`` says ``rows_of_64`` where the build's oneDNN runs AVX2); ``own-gelu``
(``HGRT_ONEDNN_OWN_GELU=0`` at build and first run: GELU's tanh form as a kernel's last post-op
is oneDNN's eltwise post-op rather than hgrt's pass over the result; counted: the kernels whose
``onednn_impl`` ends ``hgrt_gelu_tanh``); ``split`` (``HGRT_ONEDNN_SPLIT=0`` at build: an NHWC
split on channels is a TVM kernel rather than ``hgrt.onednn.split``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import hgrt.spin  # noqa: F401  (before TVM loads)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# switch -> (its environment variable, what is counted, the count of a node)
SWITCHES = {
    "views": ("HGRT_ONEDNN_VIEWS", "transpose kernels",
              lambda n: "transpose" in (n.func_name or "")),
    "row-chunks": ("HGRT_ONEDNN_ROW_CHUNK", "dense layers in row chunks",
                   lambda n: "rows_of_" in n.attrs.get("onednn_impl", "")),
    "own-gelu": ("HGRT_ONEDNN_OWN_GELU", "kernels with hgrt's tanh GELU",
                 lambda n: "hgrt_gelu_tanh" in n.attrs.get("onednn_impl", "")),
    "split": ("HGRT_ONEDNN_SPLIT", "oneDNN splits",
              lambda n: n.func_name == "hgrt.onednn.split"),
}


def _module(model, target, inputs, flag: str, var: str):
    """Build, create and run once with ``var`` = ``flag`` (a build switch is read as the model
    builds, a kernel switch as each kernel first runs); the module and its build."""
    import tvm

    import hgrt

    os.environ[var] = flag
    try:
        res = hgrt.build(model, ["cpu"], target=target)
        m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
        m.load_params(res.params)
        m.set_input(**inputs)
        m.run()
    finally:
        os.environ.pop(var)
    return m, res


def main() -> None:
    import numpy as np
    import onnx
    from bench_common import cap_onednn_isa, machine

    from hgrt.cli import parse_targets
    from hgrt.corpus import seeded_inputs, spec
    from hgrt.corpus.generate import real_path
    from hgrt.corpus.specs import inputs_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="corpus models (their dynamo export, real size)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--switch", choices=sorted(SWITCHES), default="views")
    p.add_argument("--target", action="append", metavar="KIND=TARGET",
                   help="build the CPU for another target, e.g. 'cpu=llvm -mcpu=haswell' (an "
                        "AVX2 build; oneDNN capped to its ISA)")
    args = p.parse_args()
    target = parse_targets(args.target) if args.target else None
    cap_onednn_isa(target)
    var, counted, counts = SWITCHES[args.switch]
    warnings.simplefilter("ignore")
    print(machine(), f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(host)')}")
    for name in args.models:
        model = onnx.load(real_path(name, "dynamo"))
        inputs = seeded_inputs(inputs_of(spec(name), "real", 1))
        mods, count = {}, {}
        for label, flag in (("on", "1"), ("off", "0")):
            mods[label], res = _module(model, target, inputs, flag, var)
            count[label] = sum(map(counts, res.graph.nodes))
        outs = [m.get_output(0).numpy() for m in mods.values()]
        diff = float(np.abs(outs[0] - outs[1]).max() / max(np.abs(outs[1]).max(), 1e-30))
        samples: dict[str, list[float]] = {k: [] for k in mods}
        for _ in range(args.rounds):
            for label, m in mods.items():
                runs = []
                for _ in range(3):
                    t = time.perf_counter()
                    m.run()
                    runs.append(time.perf_counter() - t)
                samples[label].append(statistics.median(runs) * 1e3)
        print(name, ", ".join(f"{args.switch} {k}: {statistics.median(v):.2f} ms (min "
                              f"{min(v):.2f}; {count[k]} {counted})" for k, v in samples.items()),
              f"; max rel diff {diff:.1e}")


if __name__ == "__main__":
    main()
