"""Ops without a CUDA kernel in hgrt's GPU build (``GPU_UNSUPPORTED_OPS``, and the importer's
recurrent kernels, whose PrimFuncs say no GPU can schedule them) go to a CPU without being
asked, with a copy between; forced onto the GPU, their build fails as the reason says.
Build level: CUDA code generation needs no GPU."""

from __future__ import annotations

import logging
import warnings

import onnx
import pytest
import tvm
from tvm import relax

import hgrt
from hgrt.corpus import entry
from hgrt.graph import COPY_FUNC
from hgrt.importer.recurrent_kernels import NO_GPU_REASON
from hgrt.relay_passes.place_devices import GPU_UNSUPPORTED_OPS
from hgrt.testing import build_and_compare

DEVICES = ["cpu:0", "cuda:0"]


def relax_model(op) -> tvm.IRModule:
    """x (2, 16) -> exp -> ``op`` -> exp: the op between two ops any device runs."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = op(bb.emit(relax.op.exp(x)))
            out = bb.emit_output(relax.op.exp(bb.emit(y)))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    return mod


OPS = {"relax.topk": lambda y: relax.TupleGetItem(relax.op.topk(y, 4, axis=-1), 0),
       "relax.cumsum": lambda y: relax.op.cumsum(y, axis=1)}


def build(model, placement, devices=DEVICES):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, devices, placement, kernels="tvm", cuda_arch="sm_90")


@pytest.mark.parametrize("op", sorted(OPS))
def test_forced_onto_the_gpu_the_build_fails(op):
    model = relax_model(OPS[op])
    with pytest.raises(hgrt.BuildError):
        build(model, hgrt.Placement(rules={op: "cuda:0", "exp": "cuda:0"}))


@pytest.mark.parametrize("placement", [hgrt.Placement(preferred="cuda:0"),
                                       hgrt.Placement(auto=True),
                                       hgrt.Placement(rules={"*": "cuda:0"})],
                         ids=["preferred", "auto", "pattern"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_they_go_to_the_cpu_with_a_copy(op, placement):
    res = build(relax_model(OPS[op]), placement)
    rows = [r for r in res.placement_report if r.op == op]
    assert rows and all(r.device == "cpu:0" for r in rows)
    if placement.auto:  # tiny ops: no copy pays here, the whole model stays on the CPU
        assert "cuda:0 cannot compile it" in rows[0].reason
        return
    assert GPU_UNSUPPORTED_OPS[op] in rows[0].reason
    assert {r.device for r in res.placement_report} == set(DEVICES)
    assert any(n.func_name == COPY_FUNC for n in res.graph.nodes)


def test_an_exact_rule_still_places_the_op_where_it_says():
    """A rule naming the op is the user's word: the build then fails, naming the binding."""
    with pytest.raises(hgrt.BuildError, match="topk"):
        build(relax_model(OPS["relax.topk"]), hgrt.Placement(rules={"topk": "cuda:0"}))


# the tiny corpus files: two recurrent layers each, every layer one call_tir of its own kernel
RECURRENT = ("gru.dynamo", "lstm.dynamo")


def recurrent_model(name: str) -> onnx.ModelProto:
    return onnx.load(entry(name).path)


def recurrent_rows(res):
    return [r for r in res.placement_report if r.op == "relax.call_tir"]


@pytest.mark.parametrize("placement", [hgrt.Placement(preferred="cuda:0", fallback="cpu:0"),
                                       hgrt.Placement(rules={"*": "cuda:0"})],
                         ids=["preferred", "pattern"])
@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_layers_go_to_the_cpu_the_rest_to_the_gpu(name, placement):
    res = build(recurrent_model(name), placement, ["cuda:0", "cpu:0"])
    rows = recurrent_rows(res)
    assert len(rows) == 2 and all(r.device == "cpu:0" for r in rows)
    assert all(f"cuda:0: {NO_GPU_REASON}" in r.reason for r in rows)
    assert {r.device for r in res.placement_report if r not in rows} == {"cuda:0"}
    assert any(n.func_name == COPY_FUNC for n in res.graph.nodes)


@pytest.mark.parametrize("name", RECURRENT)
def test_auto_keeps_a_tiny_recurrent_model_whole_on_the_cpu(name, caplog):
    """The recurrent layers can only run on cpu:0; the other ops take microseconds on either
    device, less than the copies to and from cuda:0 (5 us each without a GPU to measure), so
    the plan of every op on cpu:0 beats both the split and cuda:0 with the layers on cpu:0."""
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        res = build(recurrent_model(name), hgrt.Placement(auto=True))
    rows = recurrent_rows(res)
    assert len(rows) == 2 and all("cuda:0 cannot compile it" in r.reason for r in rows)
    assert {r.device for r in res.placement_report} == {"cpu:0"}
    assert "cuda:0 only (+2 ops it cannot run)" in caplog.text
    assert "-> cpu:0 only" in caplog.text


@pytest.mark.parametrize("placement", [hgrt.Placement(rules={"call_tir": "cuda:0"}),
                                       hgrt.Placement(overrides={"lv1": "cuda:0"})],
                         ids=["exact-rule", "override"])
def test_a_recurrent_layer_forced_onto_the_gpu_fails_saying_why(placement):
    with pytest.raises(hgrt.BuildError, match="'lv1' \\(hgrt_lstm\\) on cuda:0: "
                                              f"{NO_GPU_REASON}"):
        build(recurrent_model("lstm.dynamo"), placement)


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_layers_on_cpu0_the_rest_on_cpu1_match_onnxruntime(name):
    pytest.importorskip("onnxruntime")
    placement = hgrt.Placement(rules={"call_tir": "cpu:0", "*": "cpu:1"})
    res = build_and_compare(recurrent_model(name), ["cpu:0", "cpu:1"], placement)
    rows = recurrent_rows(res)
    assert len(rows) == 2 and all(r.device == "cpu:0" for r in rows)
    assert {r.device for r in res.placement_report if r not in rows} == {"cpu:1"}
