"""The lowering passes: targets per device, one library, CUDA at build level (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import tirx

import hgrt
from hgrt.compiler import lower_model
from hgrt.devices import parse_devices
from hgrt.errors import BuildError
from hgrt.graph import COPY_FUNC
from hgrt.relay_passes import BuildContext, Placement, place_devices
from hgrt.testing import case_inputs, load_case, run_hgrt

CONV = "pytorch-converted/test_Conv2d"


def test_every_primfunc_has_the_target_of_its_device():
    case = load_case(CONV)
    mod, _ = lower_model(case.model_path, ["cpu", "cuda"], Placement(rules={"nn.conv2d": "cuda"}),
                         schedule=True)
    kinds = {gv.name_hint: f.attrs["target"].kind.name for gv, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    assert "cuda" in kinds.values() and "llvm" in kinds.values()
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and f.attrs["target"].kind.name == "cuda":
            assert bool(f.attrs.get("tirx.is_scheduled", False)), gv.name_hint
            assert f.attrs["target"].attrs["arch"] == "sm_80"


def test_cuda_build_imports_a_cuda_module_and_copies_at_boundaries():
    case = load_case(CONV)
    # kernels="tvm": TVM's own CUDA kernels (cuBLAS/cuDNN would take the convolution)
    res = hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(rules={"nn.conv2d": "cuda"}),
                     kernels="tvm")
    assert res.lib.kind == "llvm"
    assert [m.kind for m in res.lib.imports_] == ["cuda"]
    assert "__global__" in res.lib.imports_[0].inspect_source()
    g = res.graph
    conv = [i for i, r in enumerate(res.placement_report) if r.op == "relax.nn.conv2d"]
    assert conv
    for nid, node in enumerate(g.nodes):
        if node.op != "tvm_op":
            continue
        out_dev = g.device_index[g.entry_id(nid)]
        in_devs = {g.device_index[g.entry_id(s, i)] for s, i, _ in node.inputs}
        if node.func_name == COPY_FUNC:
            assert in_devs != {out_dev}
        else:
            assert in_devs <= {out_dev}, f"{g.describe_node(nid)} reads another device"
    cuda_kernels = [n for i, n in enumerate(g.nodes) if n.op == "tvm_op"
                    and n.func_name != COPY_FUNC and g.device_index[g.entry_id(i)] == 1]
    assert cuda_kernels and any("conv" in n.func_name for n in cuda_kernels)
    assert any(n.func_name == COPY_FUNC for n in g.nodes)
    if not tvm.cuda(0).exist:
        pytest.skip("no GPU: CUDA execution not checked")
    got = run_hgrt(res, case_inputs(case), [tvm.cpu(0), tvm.cuda(0)])
    np.testing.assert_allclose(got[0], case.outputs[0], rtol=1e-3, atol=1e-4)


def test_unscheduled_gpu_function_is_a_build_error(monkeypatch):
    import tvm.s_tir.dlight as dl

    monkeypatch.setattr(dl, "ApplyDefaultSchedule", lambda *rules: (lambda mod: mod))
    case = load_case(CONV)
    with pytest.raises(BuildError,
                       match="'schedule_gpu' failed after .*unscheduled by dlight: .*conv"):
        hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(rules={"nn.conv2d": "cuda"}),
                   kernels="tvm")


def test_cuda_arch_can_be_overridden():
    devs = parse_devices(["cpu", "cuda:0"], cuda_arch="sm_86")
    assert devs[1].target.attrs["arch"] == "sm_86"
    assert devs[1].target.host is not None
    case = load_case(CONV)
    res = hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(preferred="cuda"),
                     cuda_arch="sm_90", kernels="tvm")
    assert {r.device for r in res.placement_report} == {"cuda:0"}
    assert [m.kind for m in res.lib.imports_] == ["cuda"]


def test_gpu_unsupported_op_falls_back():
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((8,), "float32")):
            with R.dataflow():
                a = R.exp(x)
                b = R.nonzero(a)
                R.output(b)
            return b

    mod = Mod
    ctx = BuildContext(devices=parse_devices(["cpu", "cuda"]), placement=Placement(
        preferred="cuda", fallback="cpu"))
    place_devices(mod, ctx)
    rows = {r.op: r for r in ctx.placed.report}
    assert rows["relax.exp"].device == "cuda:0"
    assert rows["relax.nonzero"].device == "cpu:0"
    assert rows["relax.nonzero"].reason.startswith("fallback (cuda:0:")


def _two_branches():
    """x -> (matmul, relu) x2 per branch; the branches joined by an add (the join)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for br in "ab":
        prev = "x"
        for i in range(2):
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((32, 32)) / 6).astype("float32"), f"{br}w{i}"))
            nodes += [helper.make_node("MatMul", [prev, f"{br}w{i}"], [f"{br}m{i}"]),
                      helper.make_node("Relu", [f"{br}m{i}"], [f"{br}{i}"])]
            prev = f"{br}{i}"
    nodes.append(helper.make_node("Add", ["a1", "b1"], ["y"]))
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model, rng.standard_normal((8, 32)).astype("float32")


@pytest.mark.parametrize("kernels", ["tvm", "onednn"])
def test_the_join_of_two_devices_is_a_kernel_of_its_own(kernels):
    """The add of branch a (cpu:0) and branch b (copied from cpu:1) is not fused into branch
    a's last kernel (nor taken as a oneDNN residual): that kernel would wait for cpu:1 and the
    devices could not overlap. Same numbers as the VM."""
    from hgrt.providers.onednn import kernels as onednn
    from hgrt.testing import reference

    if kernels == "onednn" and onednn.unavailable_reason():
        pytest.skip(onednn.unavailable_reason())
    model, x = _two_branches()
    from hgrt.frontend import import_model
    from hgrt.relay_passes.util.relax_util import bindings, op_name

    mod, _ = import_model(model, None, None)
    on_b = []
    for b in bindings(mod["main"]):  # every op that depends on a "bw" weight, not the add
        names = {v.name for v in relax_free_vars(b.value)}
        if op_name(b.value) != "relax.add" and (names & {"bw0", "bw1"} or names & set(on_b)):
            on_b.append(b.var.name)
    split = hgrt.Placement(overrides=dict.fromkeys(on_b, "cpu:1"))
    res = hgrt.build(model, ["cpu:0", "cpu:1"], split, kernels=kernels)
    g = res.graph
    copies = {nid for nid, n in enumerate(g.nodes) if n.op == "tvm_op"
              and n.func_name == COPY_FUNC}
    assert copies
    readers = [nid for nid, n in enumerate(g.nodes) if n.op == "tvm_op"
               and any(s in copies for s, _, _ in n.inputs) and nid not in copies]
    # whatever reads the copy back from cpu:1 is the lone add, not a matmul with it fused in
    back = [nid for nid in readers if g.device_index[g.entry_id(nid)] == 0]
    assert back and all("matmul" not in g.nodes[nid].func_name
                        and "dense" not in g.nodes[nid].func_name for nid in back), \
        [g.nodes[nid].func_name for nid in back]
    got = run_hgrt(res, {"x": x})[0]
    np.testing.assert_allclose(got, reference(model, [x])[0], rtol=1e-5, atol=1e-5)


def relax_free_vars(expr):
    from tvm import relax

    return relax.analysis.free_vars(expr)


def _cumsums():
    """x → CumSum(axis 1) → Relu → CumSum(axis 1, exclusive, reverse): two scans of one shape."""
    from onnx import TensorProto, helper

    axis = helper.make_tensor("axis", TensorProto.INT64, [], [1])
    nodes = [helper.make_node("CumSum", ["x", "axis"], ["c0"]),
             helper.make_node("Relu", ["c0"], ["r"]),
             helper.make_node("CumSum", ["r", "axis"], ["y"], exclusive=1, reverse=1)]
    graph = helper.make_graph(
        nodes, "cumsums", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, 3])], [axis])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("placement", ["single", "alternating"])
def test_a_cumsum_lowers_to_a_kernel(placement):
    """LegalizeOps has no rule for scans (RoBERTa's position ids are a cumsum of the mask):
    they reach the graph as kernels, on each device where they are placed."""
    from hgrt.testing import alternating, build_and_compare

    model = _cumsums()
    if placement == "single":
        build_and_compare(model)
    else:
        build_and_compare(model, ["cpu:0", "cpu:1"], alternating(model))
