"""slice_views: copy kernels that read one aligned range of their input become ``__slice`` views."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.graph import SLICE_FUNC
from hgrt.lifetimes import ALIGN, runs
from hgrt.testing import build_and_compare, onnx_inputs, run_hgrt
from hgrt.testing.builds import alternating, fused_module
from hgrt.testing.oracle import onnx_reference, run_lowered_vm

TOL = {"rtol": 1e-4, "atol": 1e-5}


def unrolled_rnn_onnx(steps: int = 6, hidden: int = 64, axis: int = 0, head_slice: bool = False):
    """An RNN as an exporter unrolls it: p = x @ W + b for every step at once, then per step
    h = tanh(slice(p, t) + h @ R) (the slice fuses into no kernel: the matmul leads its
    group). ``axis`` 2: the slices take half of every row's units instead, tiled over steps.
    ``head_slice``: also the input's first step, sliced, as a graph output."""
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(hidden)
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) * scale)
                                     .astype("float32"), n) for n in ("W", "R")]
    inits.append(numpy_helper.from_array(rng.standard_normal(hidden).astype("float32") * 0.1,
                                         "b"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["p"])]
    h = "h0"
    outs = []
    for t in range(steps):
        if axis == 0:
            starts, ends = [t], [t + 1]
        else:
            starts, ends = [(t % 2) * hidden // 2], [(t % 2 + 1) * hidden // 2]
        for k, v in (("s", starts), ("e", ends), ("a", [axis])):
            inits.append(numpy_helper.from_array(np.array(v, dtype=np.int64), f"{k}{t}"))
        nodes.append(helper.make_node("Slice", ["p", f"s{t}", f"e{t}", f"a{t}"], [f"p{t}"]))
        if axis != 0:  # (steps, 1, hidden / 2) -> one step's row, (1, 1, hidden / 2) x 2
            nodes.append(helper.make_node("Concat", [f"p{t}", f"p{t}"], [f"q{t}"], axis=2))
            inits.append(numpy_helper.from_array(np.array([t], dtype=np.int64), f"i{t}"))
            nodes.append(helper.make_node("Gather", [f"q{t}", f"i{t}"], [f"g{t}"], axis=0))
            src = f"g{t}"
        else:
            src = f"p{t}"
        nodes += [helper.make_node("MatMul", [h, "R"], [f"hr{t}"]),
                  helper.make_node("Add", [f"hr{t}", src], [f"z{t}"]),
                  helper.make_node("Tanh", [f"z{t}"], [f"h{t + 1}"])]
        h = f"h{t + 1}"
        outs.append(h)
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=0))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if head_slice:
        inits += [numpy_helper.from_array(np.array(v, dtype=np.int64), k)
                  for k, v in (("hs", [0]), ("he", [1]), ("ha", [0]))]
        nodes.append(helper.make_node("Slice", ["x", "hs", "he", "ha"], ["x0"]))
        outputs.append(helper.make_tensor_value_info("x0", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "unrolled_rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, hidden]),
         helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, 1, hidden])],
        outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _slices(res) -> list[int]:
    return [nid for nid, n in enumerate(res.graph.nodes) if n.func_name == SLICE_FUNC]


def _slice_kernels(res) -> int:
    """Slice kernels of their own (TVM fuses the first step's into its matmul's kernel)."""
    return sum(1 for n in res.graph.nodes if runs(n) and n.func_name.startswith("strided_slice"))


@pytest.mark.parametrize("kernels", ["tvm", "auto"])
def test_each_step_reads_its_slice_in_place(kernels):
    res = build_and_compare(unrolled_rnn_onnx(), kernels=kernels, **TOL)
    g = res.graph
    views = _slices(res)
    assert len(views) == 5 and _slice_kernels(res) == 0
    src = {g.alias_roots()[g.entry_id(v)] for v in views}
    assert len(src) == 1  # every step's slice lies in p's bytes ...
    step = 64 * 4
    assert sorted(g.entry_offsets()[g.entry_id(v)] for v in views) == \
        [t * step for t in range(1, 6)]  # ... one row of 64 floats after another
    assert sorted(g.nodes[v].byte_offset for v in views) == [t * step for t in range(1, 6)]
    # p's storage lives until the last step has read its slice
    (root,) = src
    last_reader = max(nid for nid, n in enumerate(g.nodes) if runs(n) and any(
        g.alias_roots()[g.entry_id(*i[:2])] == root for i in n.inputs))
    assert last_reader > max(views)
    assert json.loads(res.graph_json)["hgrt"]["version"] == 3


def test_only_slices_at_aligned_offsets_are_views():
    """24 floats a step: step t starts at 96 t bytes, a multiple of 64 for even t only (step
    0's slice is fused into its matmul's kernel)."""
    res = build_and_compare(unrolled_rnn_onnx(hidden=24), kernels="tvm", **TOL)
    offsets = sorted(res.graph.nodes[v].byte_offset for v in _slices(res))
    assert offsets == [192, 384] and all(o % ALIGN == 0 for o in offsets)
    assert _slice_kernels(res) == 3


def test_a_slice_of_every_row_is_no_view():
    """Half of each row's units: not one run of bytes."""
    res = build_and_compare(unrolled_rnn_onnx(axis=2), kernels="tvm", **TOL)
    assert not _slices(res)


def test_an_output_sliced_from_an_input_stays_a_kernel():
    """x[0:1] as a graph output: a view would follow the next set_input."""
    model = unrolled_rnn_onnx(head_slice=True)
    res = build_and_compare(model, kernels="tvm", **TOL)
    g = res.graph
    out = g.heads[1][0]
    assert runs(g.nodes[out]) and len(_slices(res)) == 5
    inputs = onnx_inputs(model)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    for k, v in inputs.items():
        m.set_input(k, v)
    m.run()
    first = m.get_output(1).numpy().copy()
    m.set_input("x", inputs["x"] + 1)
    np.testing.assert_array_equal(m.get_output(1).numpy(), first)


def test_views_across_two_devices_and_streams_stay_exact():
    model = unrolled_rnn_onnx()
    inputs = onnx_inputs(model)
    build_and_compare(model, ("cpu:0", "cpu:1"), alternating(model), **TOL)
    seq = hgrt.build(model, ["cpu"], kernels="tvm", streams={"single_stream": True})
    par = hgrt.build(model, ["cpu"], kernels="tvm",
                     streams={"per_device": 2, "memory_slack": None})
    assert len(_slices(par)) == 5
    want = run_hgrt(seq, inputs)
    m = hgrt.create(par.graph_json, par.lib, [tvm.cpu(0)])
    m.load_params(par.params)
    for k, v in inputs.items():
        m.set_input(k, v)
    for _ in range(20):
        m.run()
        np.testing.assert_array_equal(m.get_output(0).numpy(), want[0])


def test_the_relax_vm_lowering_keeps_its_slice_kernels():
    """lower_model's module (run on the Relax VM, which passes TVM's kernels no tensor at a
    byte offset) calls the slice kernels as before."""
    model = unrolled_rnn_onnx()
    mod, weights = fused_module(model)
    inputs = onnx_inputs(model)
    got = run_lowered_vm(mod, [*inputs.values(), *weights])
    np.testing.assert_allclose(got[0], onnx_reference(model, inputs)[0], **TOL)
    assert sum("strided_slice" in gv.name_hint for gv in mod.functions) >= 6


def test_a_loaded_slice_view_is_checked():
    res = hgrt.build(unrolled_rnn_onnx(), ["cpu"], kernels="tvm")
    v = _slices(res)[1]

    def refused(edit, match):
        doc = json.loads(res.graph_json)
        edit(doc["nodes"][v]["attrs"], doc)
        with pytest.raises(hgrt.GraphError, match=match):
            hgrt.Graph.from_json(doc)

    hgrt.Graph.from_json(json.loads(res.graph_json))
    refused(lambda a, d: a.__setitem__("byte_offset", "4"), r"byte_offset 4 is not a multiple")
    refused(lambda a, d: a.__setitem__("byte_offset", str(64 * 4 * 6)), r"lie outside its input")
    refused(lambda a, d: a.pop("byte_offset"), r"__slice without attrs.byte_offset")
    refused(lambda a, d: a.__setitem__("byte_offset", "-64"), r"byte_offset")
    refused(lambda a, d: d["hgrt"].__setitem__("version", 2), r"format version 2 has no __slice")


def test_inspect_counts_slice_views(tmp_path):
    from hgrt.inspect import format_summary, inspect_artifacts

    hgrt.save(str(tmp_path / "art"), hgrt.build(unrolled_rnn_onnx(), ["cpu"], kernels="tvm"))
    summary, _ = inspect_artifacts(str(tmp_path / "art"))
    assert summary["slice_views"] == 5
    assert "slices read in place (views of a range of their input): 5" in format_summary(summary)
