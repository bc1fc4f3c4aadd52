"""Where a GPU is among the devices, the graph's steps launch GPU work first and wait for GPU
results last (``overlap_order``): a CPU op that reads nothing of the GPU's runs before the copy
that waits for the GPU, not after it. Without a GPU the written order stays. Build level: CUDA
code generation needs no GPU."""

from __future__ import annotations

import warnings

import numpy as np
import tvm
from tvm import relax

import hgrt
from hgrt.graph import COPY_FUNC

RULES = {"exp": "cuda:0", "tanh": "cpu:0", "topk": "cpu:0", "add": "cuda:0"}


def model(tanh_of: str = "s", rejoin: bool = False) -> tvm.IRModule:
    """x -> exp -> exp -> topk, and a tanh written after them (of s: it reads nothing of the
    exps; of "y": of their result). ``rejoin``: the tanh's result is added to the exps' on the
    GPU (no topk)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    s = relax.Var("s", relax.TensorType((4, 64), "float32"))
    with bb.function("main", [x, s]):
        with bb.dataflow():
            y = bb.emit(relax.op.exp(bb.emit(relax.op.exp(x))))
            top = None if rejoin else bb.emit(relax.TupleGetItem(relax.op.topk(y, 3, axis=-1), 0))
            side = bb.emit(relax.op.tanh(y if tanh_of == "y" else s))
            out = bb.emit_output(relax.op.add(y, side) if rejoin else relax.Tuple([top, side]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 2)
    return mod


def build(devices, mod: tvm.IRModule | None = None):
    rules = {k: v.replace("cuda:0", devices[1]) for k, v in RULES.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model() if mod is None else mod, devices, hgrt.Placement(rules=rules),
                          kernels="tvm", cuda_arch="sm_90")


def positions(graph) -> dict[str, int]:
    """First node position of: the tanh kernel, the copy back from device 1, the topk."""
    out = {}
    for nid, node in enumerate(graph.nodes):
        if node.op != "tvm_op":
            continue
        dev = graph.entry_device(graph.entry_id(nid))
        src = graph.entry_device(graph.entry_id(*node.inputs[0][:2])) if node.inputs else dev
        if node.func_name == COPY_FUNC and src == 1 and dev == 0:
            out.setdefault("copy back", nid)
        elif "tanh" in node.func_name:
            out.setdefault("tanh", nid)
        elif "topk" in node.func_name:
            out.setdefault("topk", nid)
    return out


def test_a_cpu_op_that_reads_nothing_of_the_gpu_runs_before_the_copy_that_waits_for_it():
    result = build(["cpu:0", "cuda:0"])
    at = positions(result.graph)
    assert set(at) == {"copy back", "tanh", "topk"}, at
    assert at["tanh"] < at["copy back"] < at["topk"], at


def test_without_a_gpu_the_written_order_stays_and_both_orders_compute_the_same():
    result = build(["cpu:0", "cpu:1"])
    at = positions(result.graph)
    assert at["copy back"] < at["topk"] < at["tanh"], at  # as written
    x = np.random.default_rng(0).standard_normal((4, 64)).astype("float32")
    module = hgrt.create(result.graph_json, result.lib, [tvm.cpu(0), tvm.cpu(1)])
    module.load_params(result.params)
    module.set_input("x", x)
    module.set_input("s", -x)
    module.run()
    want = np.sort(np.exp(np.exp(x)), axis=-1)[:, ::-1][:, :3]
    np.testing.assert_allclose(module.get_output(0).numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(module.get_output(1).numpy(), np.tanh(-x), rtol=1e-5)
