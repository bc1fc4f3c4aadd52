"""Placement: auto vs the convolution rule vs one device, on the light zoo models.

Each model is built for cpu:0 + cpu:1 three ways (everything on cpu:0; convolutions on cpu:1;
``Placement(auto=True)``, and auto under a weight budget of half the model on cpu:0) and run
with ``hgrt.create``; printed: copies per run, run() median, memory per device. Auto should
never be slower than the better of one device and the conv rule by more than noise, with
fewer copies than the conv rule.

    python python/bench_placement.py [--models squeezenet resnet50 ...] [--markdown F]
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
from bench_common import light, median_time, table

import hgrt
from hgrt.devices import runtime_device

MODELS = ("squeezenet", "resnet50", "inception_v1", "densenet121")


def placements(model) -> dict[str, hgrt.Placement]:
    weights = sum(np.asarray(v).nbytes for v in _weights(model))
    return {
        "one device": hgrt.Placement(),
        "conv rule": hgrt.Placement(rules={"nn.conv2d": "cpu:1"}, fallback="cpu:0"),
        "auto": hgrt.Placement(auto=True),
        "auto, half the weights fit cpu:0": hgrt.Placement(
            auto=True, budgets={"cpu:0": weights // 2}),
    }


def _weights(model):
    from hgrt.frontend import import_model

    return import_model(model, None, None)[1].values()


def bench(name: str, repeat: int) -> list[str]:
    mdl = light(name)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = placements(mdl.model)
    for label, placement in plans.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = hgrt.build(mdl.model, ["cpu:0", "cpu:1"], placement)
        m = hgrt.create(res.graph, res.lib, [runtime_device("cpu:0"), runtime_device("cpu:1")])
        m.load_params(res.params)
        m.set_input(**mdl.inputs)
        t = median_time(m.run, repeat)
        copies = sum(1 for n in res.graph.nodes if n.func_name == "__copy")
        mem = " / ".join(f"{d.planned_bytes / 2**20:.1f}" for d in res.memory_report)
        rows.append(f"| {name} | {label} | {copies} | {t * 1e3:.2f} | {mem} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--markdown", help="write the table into this markdown file")
    args = ap.parse_args()
    head = ["| model | placement | copies | run() ms | MiB cpu:0 / cpu:1 |",
            "|---|---|---|---|---|"]
    table(args.markdown, "bench_placement", f"python python/bench_placement.py --repeat "
          f"{args.repeat} --models {' '.join(args.models)}", head,
          lambda: [r for name in args.models for r in bench(name, args.repeat)])


if __name__ == "__main__":
    main()
