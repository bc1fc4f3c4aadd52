"""The profiler covers every node, counts copy bytes exactly, and writes a valid Chrome trace."""

import json

import numpy as np

import hgrt
from hgrt.testing import GraphBuilder, N


def two_device_graph():
    g = GraphBuilder()
    x = g.input("x", dev=0)
    a = g.op("add_one", [x], dev=0)
    b = g.copy(a, dev=1)
    c = g.op("add", [b, b], dev=1)
    d = g.copy(c, dev=0)
    g.output(g.op("mul", [d, x], dev=0), c)
    return g


def test_profile_rows_cover_every_step_and_copy_bytes_add_up(lib, two_cpus, tmp_path):
    g = two_device_graph()
    m = hgrt.create(g.json(pools=True), lib, two_cpus)
    m.set_input("x", np.ones(N, "float32"))
    rep = m.profile(repeat=5)
    op_nodes = [i for i, n in enumerate(g.nodes) if n["op"] == "tvm_op"]
    assert sorted(op.node_id for op in rep.ops) == op_nodes
    assert all(op.median_us > 0 for op in rep.ops)
    copy_nodes = [i for i, n in enumerate(g.nodes) if n["op"] == "tvm_op"
                  and n["attrs"]["func_name"] == "__copy"]
    assert sum(rep.copy_bytes().values()) == len(copy_nodes) * N * 4
    assert rep.copy_bytes() == {"cpu:0 -> cpu:1": N * 4, "cpu:1 -> cpu:0": N * 4}
    assert {d: n for d, (n, _) in rep.by_device().items()} == {"cpu:0": 3, "cpu:1": 2}
    by_op = rep.by_op()
    assert by_op["copy"][0] == len(copy_nodes)
    assert sum(n for n, _ in by_op.values()) == len(op_nodes)
    assert abs(sum(us for _, us in by_op.values()) - rep.op_sum_us) < 1e-6
    table = rep.table()
    assert "mul" in table and "cpu:1" in table and "copies: 2 per run" in table
    assert "by op:" in table
    assert rep.run_wall_us > 0

    trace = json.loads(open(rep.save_chrome_trace(str(tmp_path / "t.json"))).read())
    begins = [e for e in trace["traceEvents"] if e["ph"] == "B"]
    ends = [e for e in trace["traceEvents"] if e["ph"] == "E"]
    assert len(begins) == len(ends) == len(op_nodes)
    for b, e in zip(begins, ends, strict=True):
        assert b["name"] == e["name"] and b["tid"] == e["tid"] and b["ts"] <= e["ts"]
    # profiling does not change results
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), np.full(N, 4.0))
