"""SHA-256 of each zoo model's graph JSON and outputs, for checking that a change which should not
alter what hgrt builds did not: run it before and after, and compare.

    python python/graph_hashes.py [--kernels auto tvm] [--models squeezenet ...] > hashes.txt
"""

from __future__ import annotations

import argparse
import hashlib
import warnings

import numpy as np

import hgrt
from hgrt.testing import alternating, run_hgrt, zoo_input, zoo_model
from hgrt.zoo import LIGHT_MODELS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[m for m in LIGHT_MODELS
                                                    if m not in ("vgg19", "bvlc_alexnet",
                                                                 "zfnet512")])
    ap.add_argument("--kernels", nargs="+", default=["auto", "tvm"])
    args = ap.parse_args()
    for name in args.models:
        model = zoo_model(name)
        x = zoo_input(model)
        for kernels in args.kernels:
            for split in (False, True):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = hgrt.build(model, ["cpu:0", "cpu:1"] if split else ["cpu"],
                                     alternating(model) if split else None, kernels=kernels)
                graph = hashlib.sha256(res.graph_json.encode()).hexdigest()[:16]
                outs = hashlib.sha256(b"".join(np.ascontiguousarray(o).tobytes()
                                               for o in run_hgrt(res, x))).hexdigest()[:16]
                print(f"{name:14} {kernels:5} {'split' if split else 'one  '} graph {graph} "
                      f"outputs {outs}", flush=True)


if __name__ == "__main__":
    main()
