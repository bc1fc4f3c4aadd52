"""The default CPU schedule of transformers' kernels: N-D and batched matrix products (a weight,
two activations, a transposed operand, broadcast batch dims, a ragged last column tile),
LayerNorm and Softmax. Each gets its rule (``ScheduleReport.rules``), not the fallback, and
gives onnxruntime's numbers built with TVM kernels on one CPU and split over cpu:0 / cpu:1,
for this host and for an AVX2 target."""

import warnings

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.relay_passes.inner.cpu_schedule import schedule_cpu_functions
from hgrt.relay_passes.inner.cpu_schedule_conv import PEEL_HINT
from hgrt.relay_passes.inner.prepack_weights import pack_columns
from hgrt.testing import fused_module, matmul_module, onnx_reference, run_hgrt

RNG = np.random.default_rng(7)
HASWELL = {"cpu": {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}}
SPLIT = {"rules": {"matmul": "cpu:1", "nn.*": "cpu:1"}}


def _model(nodes, inputs: dict, weights: dict | None = None):
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape)
                     for n, a in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, n) for n, w in (weights or {}).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _x(*shape):
    return RNG.standard_normal(shape).astype("float32")


def _linear_gelu(n: int):
    """(2, 24, 64) x (64, n) weight, + bias, GELU: a transformer's MLP."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Gelu", ["a"], ["y"])]
    return _model(nodes, {"x": _x(2, 24, 64)}, {"w": _x(64, n), "b": _x(n)})


def _attention():
    """softmax(Q K^T + mask) V with K transposed in the graph, V broadcast over the batch."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Add", ["s", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    return _model(nodes, {"q": _x(2, 3, 32, 16), "k": _x(2, 3, 48, 16),
                          "mask": _x(1, 1, 32, 48), "v": _x(3, 48, 40)})


def _ragged_rows():
    """Rows no register tile divides: (1, 197, 64) x (64, 256) + bias, GELU (ViT's 197, a
    prime), and (2, 3, 37, 48) x (3, 48, 64) (attention's xV over 37 rows)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Gelu", ["a"], ["g"]),
             helper.make_node("MatMul", ["p", "v"], ["pv"]),
             helper.make_node("Reshape", ["g", "flat"], ["g1"]),
             helper.make_node("Reshape", ["pv", "flat"], ["pv1"]),
             helper.make_node("Concat", ["g1", "pv1"], ["y"], axis=1)]
    return _model(nodes, {"x": _x(1, 197, 64), "p": _x(2, 3, 37, 48), "v": _x(3, 48, 64)},
                  {"w": _x(64, 256), "b": _x(256), "flat": np.array([1, -1], "int64")})


def _layer_norm():
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
             helper.make_node("Neg", ["n"], ["y"])]  # (on cpu:0 when split)
    return _model(nodes, {"x": _x(3, 17, 96)}, {"g": _x(96), "b": _x(96)})


def _softmax_ragged():
    """Softmax over rows of 49 (swin's windows: no whole vectors of 8 or 16 lanes) + a mask
    of -100 on most entries (exp's results below float32's normal range)."""
    mask = np.where(RNG.random((1, 49, 49)) < 0.6, -100.0, 0.0).astype("float32")
    nodes = [helper.make_node("Add", ["x", "mask"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    return _model(nodes, {"x": _x(6, 49, 49), "mask": mask})


MODELS = {"linear_ragged": lambda: _linear_gelu(200), "linear": lambda: _linear_gelu(128),
          "ragged_rows": _ragged_rows,
          "attention": _attention, "layer_norm": _layer_norm, "softmax_ragged": _softmax_ragged}
# the rule each kernel of a model's op kind must get
RULES = {"matmul": "matmul", "softmax": "rows", "layer_norm": "rows"}


def _inputs(model) -> dict:
    return {i.name: _x(*[d.dim_value for d in i.type.tensor_type.shape.dim])
            for i in model.graph.input}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_kernel_gets_its_rule_not_the_fallback(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = fused_module(MODELS[name]())
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    _, report = schedule_cpu_functions(mod, target)
    assert report.skipped == {}
    checked = 0
    for func, rules in report.rules.items():
        for op, rule in RULES.items():
            if op in func:
                assert rule in rules, (func, rules)
                assert "reduction" not in rules, (func, rules)
                checked += 1
    assert checked >= (2 if name == "attention" else 1), report.rules


@pytest.mark.parametrize("mcpu", ["haswell", "skylake-avx512"])
def test_a_row_of_no_whole_vectors_runs_whole_registers_and_a_peeled_tail(mcpu):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = fused_module(_softmax_ragged())
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    new, report = schedule_cpu_functions(mod, target)
    (name,) = [f for f in report.rules if "softmax" in f]
    assert "rows" in report.rules[name]
    script = new[name].script()
    assert PEEL_HINT in script and "T.vectorized(16)" in script  # 49 = 3 x 16 + 1
    # its max and sum: the 48 values of whole vectors through 16 partial results, the last apart
    assert "T_softmax_maxelem_rf" in script and "T_softmax_expsum_rf" in script
    assert "T_softmax_maxelem_tail" in script


@pytest.mark.parametrize("mcpu, rows", [("haswell", 2), ("skylake-avx512", 6)])
def test_rows_no_tile_divides_get_tiles_of_the_most_rows_that_fit(mcpu, rows):
    """197 and 37 rows, primes: a tile of the most rows that fit the registers with a row of
    B and a broadcast value (4 vectors a row: 2 on AVX2's 16 registers, 6 on AVX-512's 32),
    not of one row; 196 keeps a divisor near the limit; 195 on AVX2 gets ragged tiles of 2
    rows, not tiles of 3 x 4 registers (which spill)."""
    from hgrt.devices import vector_isa
    from hgrt.relay_passes.inner.cpu_schedule_matmul import tile_rows

    isa = vector_isa(tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2}))
    assert tile_rows(197, 256, isa) == tile_rows(37, 64, isa) == rows
    assert tile_rows(196, 256, isa) == (2 if rows == 2 else 4)
    assert tile_rows(195, 256, isa) == (2 if rows == 2 else 5)


def test_rows_no_tile_divides_run_full_tiles_and_a_peeled_last_one():
    """The kernels of ``_ragged_rows`` (built for this host): tiles of ``tile_rows`` rows
    under a partition hint, which lowering uses to peel the part-filled last tile off."""
    from hgrt.devices import host_target, vector_isa
    from hgrt.relay_passes.inner.cpu_schedule_matmul import tile_rows

    rows = tile_rows(197, 256, vector_isa(host_target(2)))
    assert rows >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = fused_module(_ragged_rows())
    new, report = schedule_cpu_functions(mod, host_target(2))
    names = [f for f in report.rules if "matmul" in f]
    assert len(names) == 2 and all("matmul" in report.rules[n] for n in names)
    for name in names:
        script = new[name].script()
        assert PEEL_HINT in script and f"T.unroll({rows})" in script, name


@pytest.mark.parametrize("target", [None, HASWELL], ids=["host", "avx2"])
@pytest.mark.parametrize("placement", ["single", "split"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_match_onnxruntime(name, placement, target):
    model = MODELS[name]()
    x = _inputs(model)
    devices, rules = (["cpu:0"], None) if placement == "single" else (["cpu:0", "cpu:1"], SPLIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, devices, rules, kernels="tvm", target=target)
    if placement == "split":
        assert {r.device for r in res.placement_report} == {"cpu:0", "cpu:1"}
    got = run_hgrt(res, x)[0]
    np.testing.assert_allclose(got, onnx_reference(model, x)[0], rtol=2e-5, atol=2e-5)


def test_a_ragged_weight_is_packed_padded_to_whole_tiles():
    """GPT-2's head has 50257 columns, which no vector divides: its weight is packed into
    whole column tiles, the last one zero-padded, and the padding never reaches the output."""
    model = _linear_gelu(200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm")
    packed = [v.shape for k, v in res.params.items() if "_col" in k]
    assert len(packed) == 1
    tiles, k, vf = packed[0]
    assert k == 64 and tiles * vf > 200 > (tiles - 1) * vf
    w = _x(5, 200)
    p = pack_columns(w, 64)
    assert p.shape == (4, 5, 64) and not p[3, :, 8:].any()
    np.testing.assert_array_equal(p[3, :, :8], w[:, 192:])


@pytest.mark.parametrize("n", [16, 13])
def test_a_vector_times_a_matrix_builds_and_is_numpy_s(n):
    """(8,) @ (8, n): one vector of outputs, no loop outside it to parallelize (the schedule
    puts a unit loop there)."""
    mod = matmul_module((8,), (8, n))
    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal(8).astype("float32"),
         "b": rng.standard_normal((8, n)).astype("float32")}
    got = run_hgrt(hgrt.build(mod, ["cpu"], kernels="tvm"), x)[0]
    np.testing.assert_allclose(got, x["a"] @ x["b"], rtol=1e-5, atol=1e-5)
