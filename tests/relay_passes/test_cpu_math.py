"""exp, erf, tanh and sigmoid of float32 CPU kernels as vectorizable arithmetic
(``inner/cpu_schedule_math.py``): against float64 numpy on a dense grid, random points and
special values, vectorized for this host and for AVX2; and models of Softmax, GELU (erf and
tanh forms), SiLU, Sigmoid and Tanh built with TVM kernels, on one CPU and split over cpu:0 /
cpu:1, against onnxruntime."""

import math
import warnings

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import te

import hgrt
from hgrt.relay_passes.inner.cpu_schedule import schedule_cpu_functions
from hgrt.relay_passes.inner.cpu_schedule_math import (
    vector_erf,
    vector_exp,
    vector_sigmoid,
    vector_tanh,
)
from hgrt.testing import assert_close_to, fused_module, onnx_reference, run_hgrt

HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38, -1e-30, 1e-8,
                    88.72, 88.73, -87.33, -103.9, -104.5, 0.625, -0.625, 3.99, 4.01, 9.0,
                    -9.0, 20.0, 1e30, -1e30], np.float32)
FUNCS = {"exp": (vector_exp, np.exp), "tanh": (vector_tanh, np.tanh),
         "erf": (vector_erf, np.vectorize(math.erf, otypes=[np.float64])),
         "sigmoid": (vector_sigmoid, lambda v: 1.0 / (1.0 + np.exp(-v)))}


def _vectorized(f, target) -> tvm.runtime.Module:
    x = te.placeholder((te.var("n"),), "float32", name="x")
    y = te.compute(x.shape, lambda i: f(x[i]), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]).with_attr("global_symbol", "main"))
    _, lanes = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(lanes)
    return tvm.tirx.build(sch.mod, target=tvm.target.Target(target))


def _points() -> np.ndarray:
    grid = np.arange(-100.0, 100.0, 2.0 ** -8).astype(np.float32)
    rng = np.random.default_rng(0)
    rand = np.concatenate([rng.standard_normal(200_000) * 4, rng.uniform(-100, 100, 200_000)])
    xs = np.concatenate([SPECIAL, grid, rand.astype(np.float32)])
    return np.concatenate([xs, np.zeros(-len(xs) % 16, np.float32)])


@pytest.mark.parametrize("target", ["llvm", HASWELL], ids=["host", "avx2"])
@pytest.mark.parametrize("name", sorted(FUNCS))
def test_within_a_few_ulp_of_float64_and_libm_at_special_values(name, target):
    f, ref = FUNCS[name]
    xs = _points()
    out = tvm.runtime.empty(xs.shape, "float32", tvm.cpu())
    _vectorized(f, target)["main"](tvm.runtime.tensor(xs, tvm.cpu()), out)
    got = out.numpy().astype(np.float64)
    with np.errstate(all="ignore"):
        want = ref(xs.astype(np.float64))
        want32 = want.astype(np.float32).astype(np.float64)
    normal = np.isfinite(want32) & (np.abs(want32) >= np.finfo(np.float32).tiny)
    rel = np.abs(got[normal] - want[normal]) / np.abs(want[normal])
    assert rel.max() <= 5e-7, (name, rel.max(), xs[normal][np.argmax(rel)])
    tiny = np.isfinite(want32) & ~normal  # denormal results: absolute precision
    assert np.abs(got[tiny] - want[tiny]).max(initial=0.0) <= 1e-37
    # inf, nan and saturated values exactly as numpy's float32 results
    s_got, s_want = got[:len(SPECIAL)], want32[:len(SPECIAL)]
    assert np.array_equal(np.isnan(s_got), np.isnan(s_want)), name
    denormal = (s_want != 0) & (np.abs(s_want) < np.finfo(np.float32).tiny)
    exact = (np.isinf(s_want) | (np.abs(SPECIAL) >= 20.0) & (name != "exp")) & ~denormal
    assert np.array_equal(s_got[exact], s_want[exact]), (name, SPECIAL[exact], s_got[exact])


def test_exp_gives_no_denormal_result():
    """Below float32's smallest normal result exp is 0 (a denormal result costs an x86 core a
    microcode assist per element); above it, within 5e-7 of float64 as everywhere."""
    xs = np.concatenate([np.linspace(-120.0, -80.0, 4096), [-87.34, -87.33, -87.3]]).astype(
        np.float32)
    xs = np.concatenate([xs, np.zeros(-len(xs) % 16, np.float32)])
    out = tvm.runtime.empty(xs.shape, "float32", tvm.cpu())
    _vectorized(vector_exp, "llvm")["main"](tvm.runtime.tensor(xs, tvm.cpu()), out)
    got = out.numpy()
    tiny = np.finfo(np.float32).tiny
    assert not np.any((got != 0) & (np.abs(got) < tiny))
    assert np.all(got[xs < -87.34] == 0) and np.all(got[xs > -87.33] >= tiny)


def _activations():
    """Softmax, GELU (the op, its tanh form, and the erf subgraph exporters write), SiLU,
    Sigmoid and Tanh of one input, each its own output."""
    n = helper.make_node
    nodes = [n("Softmax", ["x"], ["softmax"], axis=-1),
             n("Gelu", ["x"], ["gelu"]),
             n("Gelu", ["x"], ["gelu_tanh"], approximate="tanh"),
             n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["silu"]),
             n("Sigmoid", ["x"], ["sigmoid"]), n("Tanh", ["x"], ["tanh"]),
             n("Div", ["x", "sqrt2"], ["d"]), n("Erf", ["d"], ["e"]),
             n("Add", ["e", "one"], ["e1"]), n("Mul", ["x", "e1"], ["xe"]),
             n("Mul", ["xe", "half"], ["gelu_erf"])]
    outs = ["softmax", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "gelu_erf"]
    consts = [helper.make_tensor(k, TensorProto.FLOAT, [], [v])
              for k, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 72])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _x():
    x = np.random.default_rng(3).standard_normal((2, 16, 72)).astype("float32") * 3
    x[0, 0, :8] = [-30.0, 30.0, -12.0, 12.0, 0.0, 1e-6, -88.0, 80.0]  # tails and saturation
    return x


@pytest.mark.parametrize("target", [None, {"cpu": HASWELL}], ids=["host", "avx2"])
@pytest.mark.parametrize("placement", ["single", "split"])
def test_activation_models_match_onnxruntime(placement, target):
    model, x = _activations(), {"x": _x()}
    devices, rules = ((["cpu:0"], None) if placement == "single" else
                      (["cpu:0", "cpu:1"], {"rules": {"nn.*": "cpu:1"}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, devices, rules, kernels="tvm", target=target)
    if placement == "split":
        assert {r.device for r in res.placement_report} == {"cpu:0", "cpu:1"}
    got, want = run_hgrt(res, x), onnx_reference(model, x)
    assert_close_to(got, want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _calls(mod: tvm.IRModule) -> str:
    return "".join(f.script() for f in mod.functions.values()
                   if isinstance(f, tvm.tirx.PrimFunc))


def test_kernels_call_no_libm_unless_asked(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = fused_module(_activations())
        _, report = schedule_cpu_functions(mod, tvm.target.Target(HASWELL))
        monkeypatch.setenv("HGRT_LIBM", "1")
        libm, _ = fused_module(_activations())
    text = _calls(mod)
    assert not any(f"T.{op}(" in text for op in ("exp", "erf", "tanh", "sigmoid")), text
    assert all(f"T.{op}(" in _calls(libm) for op in ("exp", "erf", "tanh", "sigmoid"))
    softmax = [k for k in report.rules if "softmax" in k]
    assert softmax and all("rows" in report.rules[k] for k in softmax), report.rules


def test_a_gpu_kernel_keeps_cuda_math_whatever_device_comes_first():
    """An op whose inferred type lost its vdevice (a sigmoid of a mean, as in a squeeze-excite
    block) on a GPU, in a build whose first device is a CPU: its CUDA kernel calls CUDA's
    ``expf``, not the CPU's polynomial (which made such kernels slower on the GPU), whatever the
    order of the device list."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 4, 4), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8, 1, 1), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, w))
            s = bb.emit(relax.op.sigmoid(bb.emit(relax.op.mean(c, axis=[2, 3], keepdims=True))))
            out = bb.emit_output(relax.op.multiply(c, s))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    for devices in (["cpu:0", "cuda:0"], ["cuda:0", "cpu:0"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = hgrt.build(mod, devices, hgrt.Placement(preferred="cuda:0"), kernels="tvm",
                                cuda_arch="sm_90", params={"w": np.ones((8, 8, 1, 1), "float32")})
        source = "".join(m.inspect_source() for m in result.lib.imports if m.kind == "cuda")
        assert "expf(" in source, devices
        # the Cephes exp polynomial's first coefficient (1.987569e-04) as CUDA codegen writes it
        assert "0x1.a0d2ce" not in source, devices
