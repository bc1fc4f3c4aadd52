"""Graph JSON validation: every defect is a GraphError that names its place."""

import copy
import json

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.graph import Graph
from hgrt.testing import GraphBuilder, N


def base_doc():
    g = GraphBuilder()
    x = g.input("x", dev=0)
    a = g.op("add_one", [x], dev=0, name="first")
    b = g.copy(a, dev=1)
    g.output(g.op("add", [b, b], dev=1, name="last"))
    return g.doc(pools=True)


def mutate(fn):
    doc = base_doc()
    fn(doc)
    return doc


BAD = {
    "missing nodes": (lambda d: d.pop("nodes"), "missing key 'nodes'"),
    "missing attrs column": (lambda d: d["attrs"].pop("dltype"), "missing column 'dltype'"),
    "input to missing node": (lambda d: d["nodes"][1]["inputs"].__setitem__(0, [9, 0, 0]),
                              "node 1 'first': input refers to node 9, which does not exist"),
    "not topological": (lambda d: d["nodes"][1]["inputs"].__setitem__(0, [3, 0, 0]),
                        "node 1 'first': input refers to node 3, which comes later"),
    "short column": (lambda d: d["attrs"]["storage_id"][1].pop(),
                     "column 'storage_id' has 3 values but the graph has 4 entries"),
    "bad op": (lambda d: d["nodes"][1].__setitem__("op", "relu"),
               "node 1 'first': op 'relu' is not one of"),
    "storage on two devices": (lambda d: d["attrs"]["storage_id"][1].__setitem__(2, 0),
                               "storage id 0 is used on device 0 .* and on device 1"),
    "row_ptr length": (lambda d: d["node_row_ptr"].pop(), "node_row_ptr has 4 values"),
    "bad dtype": (lambda d: d["attrs"]["dltype"][1].__setitem__(0, "floaty"),
                  "entry 0: unknown dtype 'floaty'"),
    "num_inputs mismatch": (lambda d: d["nodes"][3]["attrs"].__setitem__("num_inputs", "3"),
                            "node 3 'last': num_inputs = 3"),
    "num_inputs not a string": (lambda d: d["nodes"][3]["attrs"].__setitem__("num_inputs", 2),
                                "node 3 'last': attrs.num_inputs = 2 must be a string"),
    "flatten_data not 0/1": (lambda d: d["nodes"][3]["attrs"].__setitem__("flatten_data", "2"),
                             "node 3 'last': attrs.flatten_data = '2' must be a string"),
    "negative num_outputs": (lambda d: d["nodes"][3]["attrs"].__setitem__("num_outputs", "-1"),
                             "attrs.num_outputs = '-1'"),
    "head out of range": (lambda d: d["heads"].append([3, 1, 0]), r"heads: \[3, 1\]"),
    "arg node is an op": (lambda d: d["arg_nodes"].append(1), "arg_nodes: node 1 'first' is a"),
    "pool too small": (lambda d: d["hgrt"]["pool_bytes"].__setitem__(1, 64),
                       "past the 64-byte pool of device 1"),
    "future version": (lambda d: d["hgrt"].__setitem__("version", 99), "format version 99"),
    "negative shape": (lambda d: d["attrs"]["shape"][1].__setitem__(0, [-1]),
                       "'shape', entry 0"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_graph_json_raises_named_error(name):
    fn, pattern = BAD[name]
    with pytest.raises(hgrt.GraphError, match=pattern):
        Graph.from_json(json.dumps(mutate(fn)))


def test_unknown_list_int_column_is_tolerated_and_kept():
    doc = base_doc()
    doc["attrs"]["my_annotation"] = ["list_int", [7, 7, 7, 7]]
    g = Graph.from_json(json.dumps(doc))
    assert g.extra_columns == {"my_annotation": [7, 7, 7, 7]}
    assert json.loads(g.to_json())["attrs"]["my_annotation"] == ["list_int", [7, 7, 7, 7]]


def test_round_trip_is_stable():
    g = Graph.from_json(json.dumps(base_doc()))
    assert Graph.from_json(g.to_json()).to_json() == g.to_json()


def test_not_json():
    with pytest.raises(hgrt.GraphError, match="does not parse"):
        Graph.from_json("{nodes:")


def test_device_index_outside_device_list(lib):
    with pytest.raises(hgrt.GraphError, match="device_index 1 is outside the device list"):
        hgrt.create(json.dumps(base_doc()), lib, [tvm.cpu(0)])


def test_unknown_function_names_it_and_where_it_looked(lib, two_cpus):
    doc = mutate(lambda d: d["nodes"][3]["attrs"].__setitem__("func_name", "fused_gelu"))
    with pytest.raises(hgrt.GraphError,
                       match=r"node 3 'last'.*'fused_gelu' is not in the library \(looked in "
                             r"module 'llvm'"):
        hgrt.create(json.dumps(doc), lib, two_cpus)


def test_bad_devices(lib):
    with pytest.raises(hgrt.DeviceError, match="empty"):
        hgrt.create(json.dumps(base_doc()), lib, [])
    with pytest.raises(hgrt.DeviceError, match=r"devices\[1\]"):
        hgrt.create(json.dumps(base_doc()), lib, [tvm.cpu(0), "cpu"])


class TestInputErrors:
    @pytest.fixture
    def m(self, lib, two_cpus):
        return hgrt.create(json.dumps(base_doc()), lib, two_cpus)

    def test_unknown_name_lists_known(self, m):
        with pytest.raises(hgrt.InputError, match=r"'y' not found; known: \['x'\]"):
            m.set_input("y", np.zeros(N, "float32"))

    def test_shape(self, m):
        with pytest.raises(hgrt.InputError, match=r"expected shape \(16,\), got \(3,\)"):
            m.set_input("x", np.zeros(3, "float32"))

    def test_dtype(self, m):
        with pytest.raises(hgrt.InputError, match="expected dtype float32, got float64"):
            m.set_input("x", np.zeros(N))
        with pytest.raises(hgrt.InputError, match="expected dtype float32, got int32"):
            m.set_input("x", tvm.runtime.tensor(np.zeros(N, "int32")))

    def test_index(self, m):
        with pytest.raises(hgrt.InputError, match="input index 5 out of range"):
            m.set_input(5, np.zeros(N, "float32"))
        with pytest.raises(hgrt.InputError, match="output index 1 out of range"):
            m.get_output(1)

    def test_out_mismatch(self, m):
        with pytest.raises(hgrt.InputError, match="out is"):
            m.get_output(0, tvm.runtime.empty((3,), "float32"))

    def test_params(self, m):
        with pytest.raises(hgrt.ParamError, match="'w' not found"):
            m.load_params({"w": np.zeros(N, "float32")})
        with pytest.raises(hgrt.ParamError, match="save_param_dict format"):
            m.load_params(b"garbage")
        m.load_params({"w": np.zeros(N, "float32")}, strict=False)  # ignored, as TVM did


def test_graph_object_is_not_mutated_by_create(lib, two_cpus):
    doc = base_doc()
    before = copy.deepcopy(doc)
    hgrt.create(doc, lib, two_cpus)
    assert doc == before


def test_storage_reused_while_live_is_refused():
    g = GraphBuilder()
    x = g.input("x", sid=0)
    a = g.op("add_one", [x], sids=[1])
    b = g.op("add_one", [a], sids=[1])  # writes storage 1 while reading it: overlap
    g.output(b)
    with pytest.raises(hgrt.GraphError, match="entries 1 and 2 on device 0 share storage 1"):
        Graph.from_json(g.json())


def test_input_storage_is_never_reused():
    g = GraphBuilder()
    x = g.input("x", sid=0)
    a = g.op("add_one", [x], sids=[1])
    b = g.op("add_one", [a], sids=[0])  # x is dead after node 1, but inputs live forever
    g.output(b)
    with pytest.raises(hgrt.GraphError, match="share storage 0"):
        Graph.from_json(g.json())


def test_arena_overlap_is_refused():
    doc = base_doc()
    doc["hgrt"]["storage_offset"][1] = 0  # entry 1 overlaps the input x at [0, 64)
    with pytest.raises(hgrt.GraphError, match="entries 0 and 1 on device 0 share pool bytes"):
        Graph.from_json(json.dumps(doc))


def test_impossible_allocation_is_a_device_error(lib):
    doc = base_doc()
    doc["hgrt"]["pool_bytes"][0] = 1 << 50  # a petabyte
    with pytest.raises(hgrt.DeviceError, match="cannot allocate 1125899906842624 bytes for the "
                                               "pool of device 0 on cpu:0"):
        hgrt.create(json.dumps(doc), lib, [tvm.cpu(0), tvm.cpu(1)])


def test_device_names_must_cover_the_device_index():
    """hgrt inspect ended in an IndexError on such a file, which from_json accepted."""
    g = GraphBuilder()
    x = g.input("x")
    g.output(g.op("add_one", [g.op("add_one", [x])], dev=1))
    doc = g.doc()
    doc.setdefault("hgrt", {})["devices"] = ["cpu:0"]
    with pytest.raises(hgrt.GraphError, match=r"devices names 1 devices \(\['cpu:0'\]\), but "
                                         r"device_index uses 2"):
        Graph.from_json(json.dumps(doc))


def test_a_graph_file_that_is_not_text_is_a_graph_error(tmp_path):
    """hgrt run / inspect and Host.add ended in a raw UnicodeDecodeError."""
    from hgrt import artifacts

    (tmp_path / "graph.json").write_bytes(b'{"nodes": [\xff\xfe]}')
    (tmp_path / "lib.so").write_bytes(b"")
    (tmp_path / "params.bin").write_bytes(b"")
    with pytest.raises(hgrt.GraphError, match=r"graph.json: not a graph JSON \(not UTF-8 text: "
                                              r"byte 11 is 0xff\)"):
        artifacts.read(str(tmp_path))
