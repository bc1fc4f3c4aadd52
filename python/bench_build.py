"""Build time: hgrt.build vs tvm.compile with the same fusion pipeline, per light zoo model.

    python python/bench_build.py [model ...]

Both start from the same imported Relax module (import time excluded from neither: hgrt.build
imports the ONNX model itself, so tvm.compile's figure includes the same import).
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import sys
import time
import warnings

import tvm
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.zoo import LIGHT_MODELS, light_model


def tvm_compile_seconds(model) -> float:
    start = time.perf_counter()
    mod, _ = import_model(model)
    target = tvm.target.Target("llvm")
    tvm.compile(mod, target, relax_pipeline=relax.get_default_pipeline(target))
    return time.perf_counter() - start


def hgrt_build_seconds(model) -> float:
    start = time.perf_counter()
    hgrt.build(model, ["cpu:0"])
    return time.perf_counter() - start


def main(models: list[str]) -> None:
    print(f"{'model':14} {'hgrt s':>8} {'tvm.compile s':>14} {'ratio':>6}")
    for name in models:
        model = light_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_tvm = tvm_compile_seconds(model)
            t_hgrt = hgrt_build_seconds(model)
        print(f"{name:14} {t_hgrt:8.2f} {t_tvm:14.2f} {t_hgrt / t_tvm:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(LIGHT_MODELS))
