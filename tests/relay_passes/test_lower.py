"""The lowering passes: targets per device, one library, CUDA at build level (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import tirx

import hgrt
from hgrt.compiler import lower_model
from hgrt.errors import BuildError
from hgrt.graph import COPY_FUNC
from hgrt.relay_passes import BuildContext, Placement, parse_devices, place_devices
from hgrt.testing import load_case, run_hgrt

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
    res = hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(rules={"nn.conv2d": "cuda"}))
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
    got = run_hgrt(res, {"input_0": case.inputs[0]}, [tvm.cpu(0), tvm.cuda(0)])
    np.testing.assert_allclose(got[0], case.outputs[0], rtol=1e-3, atol=1e-4)


def test_unscheduled_gpu_function_is_a_build_error(monkeypatch):
    import tvm.s_tir.dlight as dl

    monkeypatch.setattr(dl, "ApplyDefaultSchedule", lambda *rules: (lambda mod: mod))
    case = load_case(CONV)
    with pytest.raises(BuildError,
                       match="'schedule_gpu' failed after .*unscheduled by dlight: .*conv"):
        hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(rules={"nn.conv2d": "cuda"}))


def test_cuda_arch_can_be_overridden():
    devs = parse_devices(["cpu", "cuda:0"], cuda_arch="sm_86")
    assert devs[1].target.attrs["arch"] == "sm_86"
    assert devs[1].target.host is not None
    case = load_case(CONV)
    res = hgrt.build(case.model_path, ["cpu", "cuda"], hgrt.Placement(preferred="cuda"),
                     cuda_arch="sm_90")
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
