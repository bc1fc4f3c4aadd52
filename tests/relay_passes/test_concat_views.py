"""concat_views: concatenations whose pieces their kernels write in place (``__concat``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.graph import CONCAT_FUNC
from hgrt.lifetimes import runs
from hgrt.testing import build_and_compare, onnx_inputs, run_hgrt

TOL = {"rtol": 1e-4, "atol": 1e-4}


def dense_block_onnx(ch: int = 16, hw: int = 8):
    """A DenseNet-like block: a = conv(x); b = conv(relu(a)); s1 = concat(a, b);
    c = conv(relu(s1)); s2 = concat(s1, c); outputs y = conv(relu(s2)) and s2 (so that s2's
    concat stays a kernel of its own: read twice, it fuses into neither reader)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def conv(src: str, cin: int, out: str) -> None:
        w = f"w_{out}"
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((ch, cin, 3, 3)) / np.sqrt(9 * cin)).astype("float32"), w))
        nodes.append(helper.make_node("Conv", [src, w], [out], pads=[1, 1, 1, 1]))

    def relu(src: str) -> str:
        nodes.append(helper.make_node("Relu", [src], [f"r_{src}"]))
        return f"r_{src}"

    conv("x", ch, "a")
    conv(relu("a"), ch, "b")
    nodes.append(helper.make_node("Concat", ["a", "b"], ["s1"], axis=1))
    conv(relu("s1"), 2 * ch, "c")
    nodes.append(helper.make_node("Concat", ["s1", "c"], ["s2"], axis=1))
    conv(relu("s2"), 3 * ch, "y")
    graph = helper.make_graph(
        nodes, "dense_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, ch, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("s2", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _concats(res):
    g = res.graph
    return [nid for nid, n in enumerate(g.nodes) if n.func_name == CONCAT_FUNC]


def test_a_chain_of_concats_is_one_buffer_its_kernels_write_in_place():
    res = build_and_compare(dense_block_onnx(), **TOL)
    g = res.graph
    s1, s2 = _concats(res)
    assert not [n for n in g.nodes if n.func_name and "concatenate" in n.func_name]
    offsets, roots = g.entry_offsets(), g.alias_roots()
    piece = 16 * 8 * 8 * 4  # bytes of one 16-channel piece
    a, b = (g.entry_id(*i[:2]) for i in g.nodes[s1].inputs)
    s1_out, c = (g.entry_id(*i[:2]) for i in g.nodes[s2].inputs)
    out = g.entry_id(s2)
    assert [offsets[e] for e in (a, b, s1_out, c, out)] == [0, piece, 0, 2 * piece, 0]
    assert {roots[e] for e in (a, b, s1_out, c, out)} == {out}
    assert len({g.storage_ids[e] for e in (a, b, s1_out, c, out)}) == 1
    # the kernels of a, b and c write into the output's bytes: no step reads and rewrites them
    assert sum(n.op == "tvm_op" and n.func_name not in (CONCAT_FUNC, "__nop")
               for n in g.nodes) == 4 + 3  # the convs, the relus


def test_pieces_made_on_another_device_and_several_streams_stay_exact():
    """b and c computed on cpu:1 arrive by copies that write into the concat's bytes; with two
    streams per device the run equals the sequential one bitwise, run after run."""
    model = dense_block_onnx()
    placement = hgrt.Placement(overrides={}, rules={}, fallback="cpu:0")
    base = hgrt.build(model, ["cpu:0", "cpu:1"], placement, kernels="tvm",
                      streams={"single_stream": True})
    names = [r.node for r in base.placement_report if r.op == "relax.nn.conv2d"]
    placement = hgrt.Placement(overrides={names[1]: "cpu:1", names[2]: "cpu:1"},
                               fallback="cpu:0")
    inputs = onnx_inputs(model)
    seq = hgrt.build(model, ["cpu:0", "cpu:1"], placement, kernels="tvm",
                     streams={"single_stream": True})
    par = hgrt.build(model, ["cpu:0", "cpu:1"], placement, kernels="tvm",
                     streams={"per_device": 2, "memory_slack": None})
    for res in (seq, par):
        g = res.graph
        copies = [g.entry_id(nid) for nid, n in enumerate(g.nodes) if n.func_name == "__copy"]
        pieces = {g.entry_id(*i[:2]) for nid in _concats(res) for i in g.nodes[nid].inputs}
        assert len(_concats(res)) == 2 and len(pieces & set(copies)) == 2
    assert len({s for s in par.graph.streams if s >= 0}) > 2 and any(par.graph.waits)
    want = run_hgrt(seq, inputs)
    np.testing.assert_allclose(want[0], run_hgrt(base, inputs)[0], **TOL)
    m = hgrt.create(par.graph_json, par.lib, [tvm.cpu(0), tvm.cpu(1)])
    m.load_params(par.params)
    m.set_input("x", inputs["x"])
    for _ in range(30):
        m.run()
        for k, w in enumerate(want):
            np.testing.assert_array_equal(m.get_output(k).numpy(), w)


def test_a_fused_concat_of_concats_stays_a_kernel():
    """s = concat(c, concat(a, b)): TVM fuses both concats into one kernel whose inputs come
    in another order (a, b, c) than its output lays them out (c, a, b); it is no view."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    for out in "abc":
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((16, 16, 3, 3)) / 12).astype("float32"), f"w_{out}"))
        nodes.append(helper.make_node("Conv", ["x", f"w_{out}"], [out], pads=[1, 1, 1, 1]))
    nodes += [helper.make_node("Concat", ["a", "b"], ["t"], axis=1),
              helper.make_node("Concat", ["c", "t"], ["s"], axis=1)]
    graph = helper.make_graph(
        nodes, "concat_of_concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 4, 4])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)], inits)
    res = build_and_compare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
                            **TOL)
    fused = [n.func_name for n in res.graph.nodes if "concatenate" in (n.func_name or "")]
    assert not _concats(res) and len(fused) == 1 and fused[0].startswith("fused_")


def _doc():
    res = hgrt.build(dense_block_onnx(), ["cpu"], kernels="tvm")
    return res, json.loads(res.graph_json)


def test_a_loaded_concat_view_is_checked():
    res, doc = _doc()
    g = res.graph
    s1, s2 = _concats(res)
    sids = doc["attrs"]["storage_id"][1]

    bad = json.loads(res.graph_json)  # a piece kept in a storage of its own
    b = g.entry_id(*g.nodes[s1].inputs[1][:2])
    bad["attrs"]["storage_id"][1][b] = max(sids) + 1
    bad["hgrt"]["storage_offset"].append(0)
    with pytest.raises(hgrt.GraphError, match=r"piece output 0 of node .* has another storage"):
        hgrt.Graph.from_json(bad)

    bad = json.loads(res.graph_json)  # the model's input as a piece: nothing writes it there
    bad["nodes"][s1]["inputs"][0] = [0, 0, 0]
    with pytest.raises(hgrt.GraphError, match=r"is an input, a weight or a view"):
        hgrt.Graph.from_json(bad)

    bad = json.loads(res.graph_json)  # a scalar "concat": no axis to lay pieces along
    bad["attrs"]["shape"][1] = [[] if eid in (b, g.entry_id(s1)) else shp
                                for eid, shp in enumerate(bad["attrs"]["shape"][1])]
    bad["nodes"][s1]["inputs"] = bad["nodes"][s1]["inputs"][1:]
    bad["nodes"][s1]["attrs"]["num_inputs"] = "1"
    with pytest.raises(hgrt.GraphError, match=r"laid one after another do not make \(\)"):
        hgrt.Graph.from_json(bad)

    assert doc["hgrt"]["version"] == 2  # an older hgrt refuses the format, not a kernel name
    assert json.loads(hgrt.build(dense_block_onnx(), ["cpu"], kernels="tvm",
                                 streams={"single_stream": True}).graph_json)["hgrt"]["version"] \
        == 2

    bad = json.loads(res.graph_json)  # one tensor a piece of two concats
    bad["nodes"][s2]["inputs"].append(bad["nodes"][s1]["inputs"][0])
    bad["nodes"][s2]["attrs"]["num_inputs"] = str(len(bad["nodes"][s2]["inputs"]))
    with pytest.raises(hgrt.GraphError, match=r"laid one after another do not make|view twice"):
        hgrt.Graph.from_json(bad)


def test_a_reader_of_a_concat_view_must_wait_for_every_piece():
    """Conv b on a stream of its own: the relu reading s1 (a view: the concat runs nothing)
    must wait for b's kernel, not only for a's on its own stream; without that wait the graph
    is refused as a race."""
    res, doc = _doc()
    g = res.graph
    s1 = _concats(res)[0]
    conv_b = g.nodes[s1].inputs[1][0]
    relu_a = g.nodes[conv_b].inputs[0][0]
    s1_entry = g.entry_id(s1)
    relu_s1 = next(nid for nid, n in enumerate(g.nodes)
                   if any(g.entry_id(*i[:2]) == s1_entry for i in n.inputs) and n.op == "tvm_op"
                   and n.func_name != CONCAT_FUNC)
    doc["hgrt"]["streams"] = [(1 if nid == conv_b else 0) if runs(n) else -1
                              for nid, n in enumerate(g.nodes)]
    doc["hgrt"]["waits"] = [[] for _ in g.nodes]
    doc["hgrt"]["waits"][conv_b] = [relu_a]
    doc["hgrt"]["waits"][relu_s1] = [conv_b]
    hgrt.Graph.from_json(doc)  # ordered: accepted
    doc["hgrt"]["waits"][relu_s1] = []
    with pytest.raises(hgrt.GraphError, match=rf"node {relu_s1} .* reads the output of node "
                                              rf"{conv_b} .* with no event between them"):
        hgrt.Graph.from_json(doc)


def test_inspect_counts_and_draws_concat_views(tmp_path):
    from hgrt.inspect import format_summary, inspect_artifacts

    res = hgrt.build(dense_block_onnx(), ["cpu"], kernels="tvm")
    hgrt.save(str(tmp_path / "art"), res)
    summary, files = inspect_artifacts(str(tmp_path / "art"))
    assert summary["concat_views"] == 2
    assert "concats written in place by their pieces' kernels: 2" in format_summary(summary)
    assert summary["kernels_per_device"] == {"cpu:0": 7}  # the convs, the relus: no concat
    assert any(f.endswith(".png") for f in files)
