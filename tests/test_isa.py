"""The CPU a build is for: the vector ISA of a target (``vector_isa``), the host's target when
/proc/cpuinfo and LLVM disagree (``host_target``, emulated hosts), TVM's classic option strings
(``as_target``), what ``hgrt compile`` says it built for, and a tuning database of another
CPU named by the user (an error, not a silent fallback)."""

from __future__ import annotations

import platform
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
import hgrt.devices
from hgrt.cli import isa_lines, main, parse_targets
from hgrt.devices import as_target, host_target, vector_isa
from hgrt.errors import BuildError, DeviceError

on_x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                            reason="emulates x86-64 hosts through LLVM's CPU features")
X86 = "x86_64-linux-gnu"


def _x86(mcpu: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mtriple": X86, "mcpu": mcpu})


# ---- vector_isa ------------------------------------------------------------------------------

@pytest.mark.parametrize("mcpu, name, bits, registers", [
    ("haswell", "avx2", 256, 16), ("znver3", "avx2", 256, 16),
    ("skylake-avx512", "avx512", 512, 32), ("rocketlake", "avx512", 512, 32),
    ("sandybridge", "avx", 256, 16), ("x86-64", "sse", 128, 16),
])
def test_vector_isa_of_an_x86_cpu(mcpu, name, bits, registers):
    isa = vector_isa(_x86(mcpu))
    assert (isa.name, isa.bits, isa.registers) == (name, bits, registers)
    assert isa.lanes() == bits // 32 and isa.lanes(16) == bits // 16


@on_x86
def test_plain_llvm_is_generic_x86_64():
    assert vector_isa(tvm.target.Target("llvm")).name == "sse"


def test_an_arm_board_is_neon():
    isa = vector_isa(as_target("raspberry-pi/4b-aarch64"))
    assert (isa.name, isa.bits, isa.registers) == ("neon", 128, 32)
    assert vector_isa(as_target("llvm -mtriple=aarch64-linux-gnu")).name == "neon"


# ---- host_target on emulated hosts -----------------------------------------------------------

SSE4_FLAGS = {"ssse3", "sse4_1", "sse4_2", "popcnt"}
AVX2_FLAGS = SSE4_FLAGS | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe"}
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


def _host(monkeypatch, llvm_cpu: str, flags: set[str]) -> tvm.target.Target:
    monkeypatch.setattr(tvm.target.codegen, "llvm_get_system_cpu", lambda: llvm_cpu)
    monkeypatch.setattr(hgrt.devices.host_cpu, "cpu_flags", lambda: set(flags))
    return host_target(2)


@on_x86
@pytest.mark.parametrize("llvm_cpu, flags, mcpu, isa", [
    ("znver3", AVX2_FLAGS, "znver3", "avx2"),  # AVX2-only host LLVM names: its name kept
    ("skylake-avx512", AVX2_FLAGS, "haswell", "avx2"),  # a VM hides AVX-512: not promised
    ("generic", AVX2_FLAGS, "haswell", "avx2"),  # LLVM cannot name it: the flags can
    ("generic", SSE4_FLAGS | {"avx"}, "sandybridge", "avx"),
    ("skylake-avx512", AVX512_FLAGS, "skylake-avx512", "avx512"),
    # every extension counts, not the widest only: its code would die of SIGILL
    ("skylake-avx512", AVX512_FLAGS - {"avx512cd"}, "haswell", "avx2"),
    ("znver4", AVX512_FLAGS, "skylake-avx512", "avx512"),  # no avx512_bf16, _vnni, ...
    ("znver3", set(), "znver3", "avx2"),  # no /proc/cpuinfo: LLVM is believed
])
def test_host_target_follows_the_flags(monkeypatch, llvm_cpu, flags, mcpu, isa):
    t = _host(monkeypatch, llvm_cpu, flags)
    assert str(t.attrs["mcpu"]) == mcpu and int(t.attrs["num-cores"]) == 2
    assert vector_isa(t).name == isa


# ---- classic option strings ------------------------------------------------------------------

@pytest.mark.parametrize("spec, attrs", [
    ("llvm -mcpu=haswell -num-cores=2", {"mcpu": "haswell", "num-cores": 2}),
    ("llvm -mcpu=haswell -mattr=+avx2,+fma", {"mcpu": "haswell", "mattr": ["+avx2", "+fma"]}),
    ("llvm  -mcpu='skylake-avx512'  ", {"mcpu": "skylake-avx512"}),
    ("llvm -mtriple=aarch64-linux-gnu -mattr=+neon", {"mtriple": "aarch64-linux-gnu",
                                                      "mattr": ["+neon"]}),
    ("llvm -mcpu=haswell -fast-math", {"fast-math": True}),  # a bare flag: true
    ("llvm -fast-math=false -opt-level=2", {"fast-math": False, "opt-level": 2}),
    ("cuda -arch=sm_80 -max_threads_per_block=512", {"arch": "sm_80",
                                                     "max_threads_per_block": 512}),
    ("raspberry-pi/4b-aarch64 -num-cores=2", {"mcpu": "cortex-a72", "num-cores": 2}),
])
def test_option_strings_become_targets(spec, attrs):
    t = as_target(spec)
    assert t.kind.name == ("cuda" if spec.startswith("cuda") else "llvm")
    for key, value in attrs.items():
        got = t.attrs[key]
        got = [str(x) for x in got] if isinstance(value, list) else type(value)(got)
        assert got == value, (key, got, value)


@pytest.mark.parametrize("spec, match", [
    ("llvm -mcpu", r"'llvm -mcpu': -mcpu needs a value \(-mcpu=...\)"),
    ("llvm -mcpu=", r"'-mcpu=' is not an option; expected -key=value"),
    ("llvm mcpu=haswell", r"'mcpu=haswell' is not an option"),
    ("llvm -mcpus=haswell", r"llvm option '-mcpus' not found; did you mean '-mcpu'"),
    ("llvm -num-cores=two", r"-num-cores=two: expected an integer"),
    ("llvm -fast-math=maybe", r"-fast-math=maybe: expected true or false"),
    ("lvm -mcpu=haswell", r"target kind 'lvm' not found; did you mean 'llvm'"),
    ("llvm -mcpu='haswell", r"No closing quotation"),
])
def test_malformed_option_strings_name_the_bad_part(spec, match):
    with pytest.raises(DeviceError, match=match):
        as_target(spec, "--target cpu")


@pytest.mark.parametrize("spec, match", [
    ("llvm -mcpu=haswel", r"mcpu 'haswel' not found; did you mean 'haswell'"),
    ('{"kind": "llvm", "mcpu": "znver9"}', r"mcpu 'znver9' not found; did you mean 'znver"),
    ("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a7x",
     r"mcpu 'cortex-a7x' not found; did you mean 'cortex-a78'.* for aarch64-linux-gnu"),
    ('{"kind": "cuda", "arch": "sm_80", "host": {"kind": "llvm", "mcpu": "haswel"}}',
     r"mcpu 'haswel' not found"),  # a GPU's host too
])
def test_an_mcpu_llvm_does_not_know_is_refused(spec, match):
    # LLVM only logs a line and builds for a generic CPU (slow code) when it meets one
    with pytest.raises(DeviceError, match=match):
        as_target(spec, "--target cpu")


def test_known_mcpus_of_every_architecture_pass():
    for spec in ("llvm -mcpu=haswell", "raspberry-pi/4b-aarch64", "llvm -mcpu=x86-64-v3",
                 "llvm -mtriple=riscv64-linux-gnu -mcpu=sifive-u74", "llvm",
                 "llvm -mtriple=aarch64-linux-gnu -mcpu=apple-m1"):  # an alias LLVM takes
        assert as_target(spec).kind.name == "llvm"
    assert as_target("apple/m1-gpu").kind.name == "metal"  # a tag whose host is an alias


@pytest.mark.parametrize("targets, match", [
    ({"cpu:1": "llvm -mcpu=haswell"}, r"targets are given for \['cpu:1'\], but the devices are "
                                      r"\['cpu:0'\]"),
    ({"cuda": "cuda -arch=sm_80"}, r"targets are given for \['cuda'\]"),
])
def test_a_target_for_a_device_not_in_the_list_is_refused(targets, match):
    # it was ignored: the device built for the default target, silently
    with pytest.raises(DeviceError, match=match):
        hgrt.devices.parse_devices(["cpu:0"], targets=targets)
    devs = hgrt.devices.parse_devices(["cpu:0", "cpu:1"], targets={"cpu:1": "llvm -mcpu=haswell"})
    assert devs[1].target.attrs["mcpu"] == "haswell" != devs[0].target.attrs["mcpu"]
    # with GPUs only, a CPU target is their host's
    arm = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a78"}
    (gpu,) = hgrt.devices.parse_devices(["cuda"], targets={"cpu": arm, "cuda": "cuda -arch=sm_87"})
    assert gpu.target.host.attrs["mcpu"] == "cortex-a78"


def test_the_cli_spelling_of_targets():
    assert parse_targets(["cpu=llvm -mcpu=haswell"]) == {"cpu": "llvm -mcpu=haswell"}
    assert parse_targets(["llvm -mcpu=haswell"]) == {"cpu": "llvm -mcpu=haswell"}
    assert parse_targets(['cpu:1={"kind": "llvm", "mcpu": "znver3"}']) == {
        "cpu:1": '{"kind": "llvm", "mcpu": "znver3"}'}
    assert parse_targets(None) is None
    with pytest.raises(DeviceError, match="-mcpu needs a value"):
        parse_targets(["cpu=llvm -mcpu"])
    with pytest.raises(DeviceError, match="unknown kind 'tpu'"):
        parse_targets(["tpu=llvm -mcpu=haswell"])


def test_compile_says_the_vector_isa_of_each_cpu():
    result = SimpleNamespace(targets={
        "cpu:0": str(as_target("llvm -mcpu=haswell -num-cores=2")),
        "cpu:1": str(as_target("llvm -mtriple=aarch64-linux-gnu")),
        "cuda:0": str(tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm"))})
    assert isa_lines(result) == [
        "cpu:0: llvm mcpu=haswell, vector ISA avx2 (256-bit, 16 registers), 2 cores",
        "cpu:1: llvm mtriple=aarch64-linux-gnu, vector ISA neon (128-bit, 32 registers), "
        "1 core (no -num-cores in its target: TVM's kernels run serial)"]


# ---- a tuning database of another CPU --------------------------------------------------------

@I.ir_module
class MatmulRelu:
    @R.function
    def main(x: R.Tensor((16, 32), "float32"), w: R.Tensor((32, 32), "float32")):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, w))
            R.output(y)
        return y


TUNED_FOR = "llvm -mcpu=haswell -num-cores=2"


@pytest.fixture(scope="module")
def haswell_db(tmp_path_factory):
    """A database with one record per kernel of MatmulRelu for haswell (an empty trace: no
    search, the records only need their target)."""
    from tvm.s_tir import meta_schedule as ms

    from hgrt.relay_passes.inner.tuning_db import bare_func, functions_for, open_database
    from hgrt.tune import fuse_for_tuning

    db_dir = str(tmp_path_factory.mktemp("haswell_db"))
    target = as_target(TUNED_FOR)
    db = open_database(db_dir)
    for func in functions_for(fuse_for_tuning(MatmulRelu, [target]), target).values():
        task = tvm.IRModule({"main": bare_func(func)})
        db.commit_tuning_record(ms.database.TuningRecord(
            tvm.s_tir.Schedule(task).trace, db.commit_workload(task), [1e-3], target,
            ms.arg_info.ArgInfo.from_prim_func(func)))
    return db_dir


def test_a_named_database_of_another_cpu_is_an_error(haswell_db):
    with pytest.raises(BuildError, match=r"tuned for \['llvm -mcpu=haswell'\], but this build "
                                         r"is for 'llvm -mcpu=znver3'"):
        hgrt.build(MatmulRelu, ["cpu"], target={"cpu": "llvm -mcpu=znver3"},
                   tuning_db=haswell_db)
    # the database's own CPU: its records are read, nothing refused
    res = hgrt.build(MatmulRelu, ["cpu"], target={"cpu": "llvm -mcpu=haswell"},
                     tuning_db=haswell_db, kernels="tvm")
    assert res.tuning.ignored_records == 0


def test_apply_database_without_explicit_still_warns(haswell_db):
    from hgrt.relay_passes.inner.tuning_db import apply_database
    from hgrt.tune import fuse_for_tuning

    mod = fuse_for_tuning(MatmulRelu, [as_target("llvm -mcpu=znver3")])
    with pytest.warns(UserWarning, match=r"records for other targets \(\['llvm -mcpu=haswell'\]"):
        new, report = apply_database(mod, haswell_db)
    assert new is mod and report.tuned == {} and report.ignored_records > 0
    with pytest.raises(BuildError, match="tuned for"):
        apply_database(mod, haswell_db, explicit=True)


def test_cli_tuning_db_of_another_cpu_is_one_line(haswell_db, tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((32, 32), "float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])], initializer=[w])
    model = str(tmp_path / "mm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    code = main(["compile", model, "--device", "cpu", "--target", "cpu=llvm -mcpu=znver3",
                 "--tuning-db", haswell_db, "--kernels", "tvm", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("hgrt compile: error: ")
    assert "was tuned for ['llvm -mcpu=haswell']" in err
    assert "--target 'cpu=llvm -mcpu=haswell'" in err


# ---- what an artifact needs of the CPU that runs it ------------------------------------------

@on_x86
def test_a_build_records_what_its_kernels_need_and_create_checks_it(monkeypatch):
    """A build for extensions this CPU lacks died of SIGILL in run() (an fp16 model built for
    sapphirerapids on an AVX-512 host without avx512_fp16): create() refuses it, naming the
    device and the extensions, before anything runs."""
    import json

    from hgrt.testing import conv_model

    built = hgrt.build(conv_model(), ["cpu:0", "cpu:1"],
                       target={"cpu": {"kind": "llvm", "mcpu": "haswell"}})
    needs = json.loads(built.graph_json)["hgrt"]["cpu_needs"]
    assert needs[0]["arch"] == "x86_64" and {"avx2", "fma"} <= set(needs[0]["features"])
    assert "avx512f" not in needs[0]["features"]
    hgrt.create(built.graph_json, built.lib, [tvm.cpu(0), tvm.cpu(1)])  # fits: haswell flags
    monkeypatch.setattr(hgrt.devices.host_cpu, "cpu_flags", lambda: AVX2_FLAGS - {"fma"})
    with pytest.raises(DeviceError, match=r"cpu:0: the library was built for fma, which this "
                                          r"CPU lacks"):
        hgrt.create(built.graph_json, built.lib, [tvm.cpu(0), tvm.cpu(1)])
    monkeypatch.setenv("HGRT_CPU_CHECK", "0")  # the user's word against the check
    hgrt.create(built.graph_json, built.lib, [tvm.cpu(0), tvm.cpu(1)])
    monkeypatch.delenv("HGRT_CPU_CHECK")
    # no /proc/cpuinfo: trusted
    monkeypatch.setattr(hgrt.devices.host_cpu, "cpu_flags", lambda: set())
    hgrt.create(built.graph_json, built.lib, [tvm.cpu(0), tvm.cpu(1)])
    doc = json.loads(built.graph_json)  # an extension this hgrt has no flag name for
    doc["hgrt"]["cpu_needs"][1]["features"].append("avx10.1")
    monkeypatch.setattr(hgrt.devices.host_cpu, "cpu_flags", lambda: AVX2_FLAGS)
    with pytest.raises(DeviceError, match=r"cpu:1: the library was built for avx10.1"):
        hgrt.create(json.dumps(doc), built.lib, [tvm.cpu(0), tvm.cpu(1)])  # was a KeyError


@pytest.mark.parametrize("needs, match", [
    ([{"arch": "x86_64"}], r"cpu_needs\[0\] must be null or"),
    ([{"arch": "x86_64", "features": [1]}], r"cpu_needs\[0\]"),
    ("avx2", "cpu_needs must list, per device"),
])
def test_bad_cpu_needs_are_graph_errors(needs, match):
    import json

    from hgrt.graph import Graph
    from hgrt.testing import GraphBuilder

    g = GraphBuilder()
    g.output(g.op("add_one", [g.input("x")]))
    doc = g.doc()
    doc.setdefault("hgrt", {})["cpu_needs"] = needs
    with pytest.raises(hgrt.GraphError, match=match):
        Graph.from_json(json.dumps(doc))
