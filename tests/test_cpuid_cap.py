"""python/cpuid_cap.py: the benchmarks' CPUID cap that makes onnxruntime run AVX2 kernels on an
AVX-512 host, by CPUID faulting or by a patched copy of onnxruntime. Each check runs in a fresh
interpreter (the cap acts when onnxruntime loads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from hgrt.devices import cpu_flags

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX512F = 1 << 16  # CPUID leaf 7 EBX

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif("avx512f" not in cpu_flags(), reason="needs an AVX-512 host")
needs_faulting = pytest.mark.skipif(
    "cpuid_fault" not in cpu_flags(),
    reason="needs CPUID faulting (cpuid_fault in /proc/cpuinfo)")

# one 3x3 convolution through onnxruntime, optionally under the cap; prints JSON
SCRIPT = r"""
import json, sys, threading
import numpy as np
sys.path.insert(0, sys.argv[1])
import cpuid_cap
how = {"none": None, "auto": {}, "patch": {"patch": True}}[sys.argv[2]]
said = "avx512" if how is None else cpuid_cap.cap_onnxruntime("avx2", "avx512", **how)
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 96, 3, 3)).astype(np.float32)
x = rng.standard_normal((1, 96, 20, 20)).astype(np.float32)
g = helper.make_graph(
    [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4)], "conv",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    [numpy_helper.from_array(w, "w")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
so = ort.SessionOptions()
so.intra_op_num_threads = 1
y = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
    None, {"x": x})[0]
np.save(sys.argv[3], y)
lib = cpuid_cap._library()
seen = []
t = threading.Thread(target=lambda: seen.append(lib.cpuid_leaf7_ebx()))
t.start()
t.join()
print(json.dumps({"said": said, "main": lib.cpuid_leaf7_ebx(), "thread": seen[0],
                  "hits": lib.cpuid_trap_hits(), "ort": ort.__file__}), flush=True)
if sys.argv[4:] == ["trap"]:  # a SIGTRAP that is not a patched instruction's
    import os, signal
    os.kill(os.getpid(), signal.SIGTRAP)
"""


def _conv(tmp_path, how: str, *then: str, status: int = 0) -> tuple[dict, np.ndarray]:
    out = tmp_path / f"y_{how}.npy"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.path.join(CHECKOUT, "python"), how, str(out), *then],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HGRT_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == status, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), np.load(out)


@needs_faulting
def test_onnxruntime_under_the_cap_runs_other_kernels_and_the_cap_is_lifted(tmp_path):
    plain, y_host = _conv(tmp_path, "none")
    capped, y_avx2 = _conv(tmp_path, "auto")
    assert capped["said"] == "avx2 (CPUID capped)"
    # after loading onnxruntime, CPUID reports AVX-512 again, to this thread and to new ones
    assert capped["main"] & AVX512F and capped["thread"] & AVX512F
    assert plain["main"] & AVX512F
    # MLAS picked its AVX2 kernels: same convolution within rounding, not the same bits
    np.testing.assert_allclose(y_avx2, y_host, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(y_avx2, y_host)


# patches and loads a copy of onnxruntime: a benchmark tool, checked with -m slow
@pytest.mark.slow
def test_a_patched_onnxruntime_runs_avx2_kernels_and_nothing_else_is_capped(tmp_path):
    plain, y_host = _conv(tmp_path, "none")
    capped, y_avx2 = _conv(tmp_path, "patch")
    assert capped["said"] == "avx2 (CPUID capped, patched)"
    # imported from the patched copy in the cache, whose CPUID instructions trapped
    assert capped["ort"].startswith(str(tmp_path / "cache")) and capped["hits"] > 0
    # MLAS picked its AVX2 kernels: same convolution within rounding, not the same bits
    np.testing.assert_allclose(y_avx2, y_host, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(y_avx2, y_host)
    # the copy is made once: a second process reuses it; a SIGTRAP of its own (not from a
    # patched instruction) still ends the process, as it would without the handler
    (sites,) = (tmp_path / "cache").glob("onnxruntime-cpuid-*/sites.json")
    made = sites.stat().st_mtime_ns
    again, y_again = _conv(tmp_path, "patch", "trap", status=-signal.SIGTRAP)
    assert sites.stat().st_mtime_ns == made and np.array_equal(y_again, y_avx2)
    assert again["ort"] == capped["ort"] and again["hits"] > 0


def test_the_cap_says_why_not_where_it_cannot_act():
    sys.path.insert(0, os.path.join(CHECKOUT, "python"))
    try:
        import cpuid_cap
    finally:
        sys.path.pop(0)
    assert cpuid_cap.cap_onnxruntime("avx512", "avx512") == "avx512"
    assert cpuid_cap.cap_onnxruntime("sse", "avx512") == "avx512 (no CPUID cap for sse)"
    import onnxruntime  # noqa: F401  (loaded already: too late to cap)

    assert cpuid_cap.cap_onnxruntime("avx2", "avx512") == (
        "avx512 (onnxruntime was loaded before the CPUID cap)")
