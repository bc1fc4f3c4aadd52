"""The ONNX backend test cases of the onnx wheel (``onnx/backend/test/data/``): their names,
models, inputs and expected outputs, and ``check_case``, which builds one with hgrt and compares.
"""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

import hgrt
from hgrt.testing.builds import alternating, input_names, run_hgrt

CASE_DIRS = ("pytorch-converted", "pytorch-operator", "simple")


@dataclass
class OnnxCase:
    """One backend test case: its model file and test_data_set_0's inputs / expected outputs."""

    name: str
    model_path: str
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def _onnx_data() -> str:
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


def _read_pb(path: str) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def onnx_case_names() -> list[str]:
    """Every backend case of ``CASE_DIRS`` as ``"<dir>/<case>"``, sorted per directory."""
    names = []
    for d in CASE_DIRS:
        for path in sorted(glob.glob(os.path.join(_onnx_data(), d, "*", "model.onnx"))):
            names.append(f"{d}/{os.path.basename(os.path.dirname(path))}")
    return names


def load_case(name: str) -> OnnxCase:
    """The backend case ``name`` (e.g. ``"pytorch-converted/test_Conv2d"``)."""
    root = os.path.join(_onnx_data(), name)
    data = os.path.join(root, "test_data_set_0")

    def arrays(kind: str) -> list[np.ndarray]:
        paths = glob.glob(os.path.join(data, f"{kind}_*.pb"))
        return [_read_pb(p) for p in sorted(paths, key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]

    return OnnxCase(name, os.path.join(root, "model.onnx"), arrays("input"), arrays("output"))


def case_inputs(case: OnnxCase) -> dict[str, np.ndarray]:
    """The case's input arrays keyed by hgrt input name (initializers listed as inputs dropped)."""
    import onnx

    graph = onnx.load(case.model_path).graph
    inits = {t.name for t in graph.initializer}
    given = [a for i, a in zip(graph.input, case.inputs, strict=False) if i.name not in inits]
    return dict(zip(input_names(case.model_path), given, strict=True))


def check_case(case: OnnxCase, placement: str, form: str = "onnx") -> None:
    """Build ``case`` (placement ``"single"``: all on cpu:0, or ``"alternating"``: ops alternate
    between cpu:0 and cpu:1), run it and compare with the expected outputs. ``form``:
    ``"onnx"`` builds the file; ``"relax"`` the Relax module TVM's ``from_onnx`` makes of it
    with the weights bound as constants (as a TVM user hands it over)."""
    model: Any = case.model_path
    if form == "relax":
        import onnx
        from tvm.relax.frontend.onnx import from_onnx

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = from_onnx(onnx.load(case.model_path), sanitize_input_names=False)
        except Exception as e:
            raise hgrt.BuildError(f"the ONNX frontend cannot import this model: {e}") from e
    if placement == "single":
        res = hgrt.build(model, ["cpu:0"])
    else:
        res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    inputs = case_inputs(case)
    if form == "relax":
        main = model["main"]
        inputs = dict(zip([p.name for p in main.params[:int(main.attrs["num_input"])]],
                          inputs.values(), strict=True))
    got = run_hgrt(res, inputs)
    assert len(got) == len(case.outputs)
    for g, want in zip(got, case.outputs, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4)
