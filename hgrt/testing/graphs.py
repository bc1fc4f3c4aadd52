"""For the runtime alone: TVM-built elementwise kernels (``elementwise_lib``) and a graph-JSON
builder (``GraphBuilder``) on vectors of ``N`` floats.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import tvm

N = 16  # the vector length of elementwise_lib's kernels and GraphBuilder's default shape


def add_one_chain(n: int, steps: int) -> GraphBuilder:
    """x -> ``steps`` add_one kernels on (n,) float32 tensors, alternating two storages."""
    g = GraphBuilder(shape=(n,))
    a = g.input("x", sid=0)
    for i in range(steps):
        a = g.op("add_one", [a], sids=[1 + i % 2])
    g.output(a)
    return g


@functools.cache
def elementwise_lib(n: int = N, dtype: str = "float32") -> tvm.runtime.Module:
    """A library with add_one, add, mul, twice_out (a+1, a*2) and add_one_2d (on (4, n/4))."""
    from tvm import te

    one, two = tvm.tirx.const(1, dtype), tvm.tirx.const(2, dtype)
    a = te.placeholder((n,), dtype, name="a")
    b = te.placeholder((n,), dtype, name="b")
    funcs = {
        "add_one": [a, te.compute((n,), lambda i: a[i] + one, name="o")],
        "add": [a, b, te.compute((n,), lambda i: a[i] + b[i], name="o")],
        "mul": [a, b, te.compute((n,), lambda i: a[i] * b[i], name="o")],
        "twice_out": [a, te.compute((n,), lambda i: a[i] + one, name="o1"),
                      te.compute((n,), lambda i: a[i] * two, name="o2")],
    }
    a2 = te.placeholder((4, n // 4), dtype, name="a2")
    funcs["add_one_2d"] = [a2, te.compute((4, n // 4), lambda i, j: a2[i, j] + one)]
    mod = tvm.IRModule({name: te.create_prim_func(args).with_attr("global_symbol", name)
                        for name, args in funcs.items()})
    return tvm.tirx.build(mod, target="llvm")


class GraphBuilder:
    """Builds classic graph JSON by hand: ``x = g.input("x", dev=0); y = g.op("add_one", [x], 1)``.

    Entries are referred to as (node_id, index). By default every entry has its own storage id.
    """

    def __init__(self, shape=(N,), dtype="float32"):
        self.shape, self.dtype = tuple(shape), dtype
        self.nodes, self.shapes, self.dtypes, self.devs, self.sids = [], [], [], [], []
        self.arg_nodes, self.heads, self.params = [], [], []

    def _add(self, node, n_out, dev, sids, shapes):
        nid = len(self.nodes)
        self.nodes.append(node)
        for k in range(n_out):
            self.shapes.append(list(shapes[k] if shapes else self.shape))
            self.dtypes.append(self.dtype)
            self.devs.append(dev)
            self.sids.append(sids[k] if sids else len(self.sids))
        return [(nid, k) for k in range(n_out)]

    def input(self, name, dev=0, sid=None, shape=None, param=False):
        self.arg_nodes.append(len(self.nodes))
        if param:
            self.params.append(name)
        return self._add({"op": "null", "name": name, "inputs": []}, 1, dev,
                         [sid] if sid is not None else None, [shape] if shape else None)[0]

    def op(self, func, inputs, dev=0, num_outputs=1, sids=None, name=None, flatten=False,
           shapes=None):
        node = {"op": "tvm_op", "name": name or f"{func}_{len(self.nodes)}",
                "inputs": [[nid, k, 0] for nid, k in inputs],
                "attrs": {"func_name": func, "num_inputs": str(len(inputs)),
                          "num_outputs": str(num_outputs), "flatten_data": "1" if flatten else "0"}}
        outs = self._add(node, num_outputs, dev, sids, shapes)
        return outs[0] if num_outputs == 1 else outs

    def copy(self, x, dev, sid=None):
        return self.op("__copy", [x], dev, sids=[sid] if sid is not None else None,
                       name=f"copy_{len(self.nodes)}", shapes=[self.shapes[self._eid(x)]])

    def _eid(self, ref):
        nid, k = ref
        return sum(int(n.get("attrs", {}).get("num_outputs", 1)) for n in self.nodes[:nid]) + k

    def output(self, *refs):
        self.heads.extend([[nid, k, 0] for nid, k in refs])

    def doc(self, device_column=True, pools=False):
        row_ptr = [0]
        for n in self.nodes:
            row_ptr.append(row_ptr[-1] + int(n.get("attrs", {}).get("num_outputs", 1)))
        attrs = {"shape": ["list_shape", self.shapes], "dltype": ["list_str", self.dtypes],
                 "storage_id": ["list_int", self.sids]}
        if device_column:
            attrs["device_index"] = ["list_int", self.devs]
        doc = {"nodes": self.nodes, "arg_nodes": self.arg_nodes, "node_row_ptr": row_ptr,
               "heads": self.heads, "attrs": attrs, "hgrt": {"version": 1, "params": self.params}}
        if pools:
            doc["hgrt"].update(self._pool_plan())
        return json.loads(json.dumps(doc))

    def json(self, **kw):
        return json.dumps(self.doc(**kw))

    def _pool_plan(self):
        """Pack storage ids into one arena per device, in order (no reuse across sids)."""
        size, dev_of = {}, {}
        for eid, sid in enumerate(self.sids):
            nbytes = int(np.prod(self.shapes[eid])) * np.dtype(self.dtype).itemsize
            size[sid] = max(size.get(sid, 0), nbytes)
            dev_of[sid] = self.devs[eid]
        n_dev = max(self.devs) + 1
        pool, offsets = [0] * n_dev, [0] * (max(self.sids) + 1)
        for sid in sorted(size):
            offsets[sid] = pool[dev_of[sid]]
            pool[dev_of[sid]] += (size[sid] + 63) // 64 * 64
        return {"pool_bytes": pool, "storage_offset": offsets}
