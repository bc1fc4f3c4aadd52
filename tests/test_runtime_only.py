"""A machine whose TVM is its runtime alone (``TVM_USE_RUNTIME_LIB=1``: no compiler) loads and
runs what another built: the runtime's extras (top-k, sort) load with the first device, and a
model whose CPU kernels call them is right against onnxruntime."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import hgrt
from hgrt.corpus.postprocess import postprocess_model
from hgrt.testing import onnx_reference

RUN = """
import sys, numpy as np, tvm, hgrt
assert tvm.base._RUNTIME_ONLY
m = hgrt.load(sys.argv[1], [tvm.cpu(0)])
m.set_input(**dict(np.load(sys.argv[2])))
m.run()
np.save(sys.argv[3], m.get_output(0).numpy())
"""


def test_a_runtime_only_tvm_runs_a_saved_model_with_top_k(tmp_path):
    model, inputs = postprocess_model()
    art = hgrt.save(str(tmp_path / "art"), hgrt.build(model, ["cpu"], kernels="tvm"))
    np.savez(tmp_path / "x.npz", **inputs)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", RUN, art, str(tmp_path / "x.npz"),
                           str(tmp_path / "y.npy")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), onnx_reference(model, inputs)[0],
                               rtol=1e-5, atol=1e-6)
