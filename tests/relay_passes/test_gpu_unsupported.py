"""Ops without a CUDA kernel in hgrt's GPU build (``GPU_UNSUPPORTED_OPS``) go to a CPU without
being asked, with a copy between; forced onto the GPU, their build fails as the reason says.
Build level: CUDA code generation needs no GPU."""

from __future__ import annotations

import warnings

import pytest
import tvm
from tvm import relax

import hgrt
from hgrt.graph import COPY_FUNC
from hgrt.relay_passes.place_devices import GPU_UNSUPPORTED_OPS

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


def build(model, placement):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, DEVICES, placement, kernels="tvm")


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
