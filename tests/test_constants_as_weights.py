"""A weight reaches the passes the same way whatever holds it in the model: an ONNX initializer,
an ONNX ``Constant`` node, or a constant bound in a Relax module (TVM's ``from_onnx`` without
``keep_params_in_input``). Same kernels, providers and oneDNN ops per node, bitwise equal
outputs, and equal to onnxruntime on the original file."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

import hgrt
from hgrt.frontend import import_model, is_weight
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import assert_close_to, reference, run_hgrt, zoo_input, zoo_model

KERNELS = ["tvm"] + (["auto"] if onednn.unavailable_reason() is None else [])


def constant_nodes(model, which):
    """A copy of ``model`` whose initializers for which ``which(tensor)`` holds are ``Constant``
    nodes instead, as some exporters write biases."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    moved = [t for t in graph.initializer if which(t)]
    for t in reversed(moved):
        graph.node.insert(0, helper.make_node("Constant", [], [t.name], value=t))
        graph.initializer.remove(t)
    return out


def bound_in_relax(model):
    from tvm.relax.frontend.onnx import from_onnx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_onnx(model, sanitize_input_names=False)


def kernel_signature(res) -> list[tuple[str, str, str]]:
    """Per kernel node in order: what it computes, its provider, its oneDNN op (names of
    weights aside)."""
    nodes = json.loads(res.graph_json)["nodes"]
    return [(n["attrs"]["func_name"] if n["attrs"].get("provider") else "tvm",
             n["attrs"].get("provider", "tvm"), n["attrs"].get("onednn_op", ""))
            for n in nodes if n["op"] == "tvm_op"]


@pytest.fixture(scope="module")
def squeezenet():
    model = zoo_model("squeezenet")
    biases = sorted(t.name for t in model.graph.initializer if len(t.dims) == 1)
    half = set(biases[::2])  # 13 of the 26 conv biases as Constant nodes
    forms = {"initializers": model,
             "constant nodes": constant_nodes(model, lambda t: t.name in half),
             "relax constants": bound_in_relax(model)}
    return model, forms


@pytest.mark.parametrize("kernels", KERNELS)
def test_every_form_builds_the_same_graph_and_numbers(squeezenet, kernels):
    model, forms = squeezenet
    x = zoo_input(model)
    built = {name: hgrt.build(m, ["cpu"], kernels=kernels) for name, m in forms.items()}
    want_sig = kernel_signature(built["initializers"])
    outs = {name: run_hgrt(res, x) for name, res in built.items()}
    for name, res in built.items():
        assert kernel_signature(res) == want_sig, name
        assert sum(v.nbytes for v in res.params.values()) == \
            sum(v.nbytes for v in built["initializers"].params.values()), name
        np.testing.assert_array_equal(outs[name][0], outs["initializers"][0], err_msg=name)
    assert_close_to(outs["initializers"], reference(model, x))
    if kernels == "auto":  # every bias a post-op of its convolution: no add kernels between
        ops = [s[2] for s in want_sig if s[1] == "onednn"]
        assert sum(op.startswith("conv2d") for op in ops) >= 26
        assert not any("add" in s[0] for s in want_sig if s[1] == "tvm")


def test_a_constant_node_weight_is_a_param_and_a_shape_stays_a_constant(squeezenet):
    model, forms = squeezenet
    mod, weights = import_model(forms["constant nodes"])
    want, _ = import_model(model)
    assert sorted(weights) == sorted(p.name for p in want["main"].params[1:])
    assert is_weight((64,), "float32") and is_weight((128,), "int64")
    assert not is_weight((4,), "int64") and not is_weight((), "float32")
