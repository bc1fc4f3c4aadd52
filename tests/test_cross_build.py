"""Building for another machine: devices that carry a foreign target (TVM tags, JSON targets),
a library cross-linked by the compiler its triple names, an artifact directory that a failed save
never half-writes, and `hgrt compile --target/--cc`. (Running on an emulated aarch64 board:
tests/rpc/test_board_aarch64.py, slow.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import onnx
import pytest
import tvm

import hgrt
from hgrt import artifacts
from hgrt.devices import (
    as_target,
    device_spec,
    kind_targets,
    machine_arch,
    parse_devices,
    target_triple,
)
from hgrt.errors import BuildError, DeviceError
from hgrt.rpc.session import _target_hint, library_machine
from hgrt.testing import conv_model

PI = "raspberry-pi/4b-aarch64"
ARM_JSON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 2}'
has_cross_gxx = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                                   reason="no aarch64-linux-gnu-g++ (apt-get install "
                                          "g++-aarch64-linux-gnu)")


@pytest.mark.parametrize("target", [PI, "arm/rasp4b64", ARM_JSON, tvm.target.Target(PI),
                                    {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}])
def test_two_devices_of_a_foreign_cpu(target):
    devs = parse_devices(["cpu:0", "cpu:1"], targets={"cpu": target})
    assert [d.name for d in devs] == ["cpu:0", "cpu:1"]
    assert all(target_triple(d.target) == "aarch64-linux-gnu" for d in devs)
    assert all(d.target.host is None for d in devs)  # a CPU tag's own host is dropped


def test_devices_given_as_targets_take_free_ids():
    assert [d.name for d in parse_devices([PI, PI])] == ["cpu:0", "cpu:1"]
    assert [d.name for d in parse_devices([PI, "cpu:0"], targets=PI)] == ["cpu:1", "cpu:0"]
    devs = parse_devices([device_spec("cpu:1", PI), device_spec("cpu:0", ARM_JSON)])
    assert [(d.name, d.index) for d in devs] == [("cpu:1", 0), ("cpu:0", 1)]
    with pytest.raises(DeviceError, match="repeats"):
        parse_devices(["cpu:0", "cpu:0"], targets={"cpu": PI})


def test_one_device_gets_its_own_target_and_architectures_are_not_mixed():
    devs = parse_devices(["cpu:0", "cpu:1"], targets={"cpu": ARM_JSON, "cpu:1": PI})
    assert "cortex-a72" in str(devs[1].target) and "cortex-a72" not in str(devs[0].target)
    with pytest.raises(DeviceError, match=r"several architectures .*'cpu:1': 'aarch64'"):
        parse_devices(["cpu:0", "cpu:1"], targets={"cpu:1": PI})


def test_gpu_and_cpu_of_one_board_share_its_triple():
    devs = parse_devices(["cpu", "cuda"], targets={"cuda": "nvidia/jetson-orin-nano"})
    assert [target_triple(d.target) for d in devs] == ["aarch64-linux-gnu"] * 2
    devs = parse_devices(["cpu", "cuda"], targets={"cpu": PI})  # cuda's host: the cpu target
    assert target_triple(devs[1].target) == "aarch64-linux-gnu"
    assert set(kind_targets(PI)) == {"cpu"}


def test_classic_option_strings_are_translated():
    # TVM 0.27's Target() takes no options; the strings users bring from older TVM still work
    t = as_target("llvm -mtriple=aarch64-linux-gnu -mattr=+neon -num-cores=4")
    assert target_triple(t) == "aarch64-linux-gnu"
    assert list(t.attrs["mattr"]) == ["+neon"] and int(t.attrs["num-cores"]) == 4
    devs = parse_devices(["cpu:0", "cpu:1"], targets={"cpu": "llvm -mtriple=aarch64-linux-gnu"})
    assert all(target_triple(d.target) == "aarch64-linux-gnu" for d in devs)


@pytest.mark.parametrize("spec, match", [
    ("llvm -mcpu", r"'llvm -mcpu': -mcpu needs a value"),
    ("llvm -mtripel=aarch64-linux-gnu", r"option '-mtripel' not found; did you mean '-mtriple'"),
    ("raspbery-pi/4b", "did you mean 'raspberry-pi/4b-aarch64'"),
    ('{"kind": "llvm",', "not valid JSON"),
])
def test_bad_targets_say_what_to_give(spec, match):
    with pytest.raises(DeviceError, match=match):
        as_target(spec)


def test_machine_names():
    assert [machine_arch(m) for m in ("arm64", "aarch64-unknown-linux-gnu", "armv8l", "amd64",
                                      "x86_64-conda-linux-gnu")] == \
        ["aarch64", "aarch64", "arm", "x86_64", "x86_64"]
    assert artifacts.cross_compiler_name("aarch64-unknown-linux-gnu") == "aarch64-linux-gnu-g++"
    assert artifacts.cross_compiler_name("armv8l-linux-gnueabihf") == "arm-linux-gnueabihf-g++"


@pytest.mark.parametrize("machine, triple", [("aarch64", "aarch64-linux-gnu"),
                                             ("armv7l", "armv7l-linux-gnueabihf")])
def test_upload_hint_names_a_target_tvm_027_takes(machine, triple):
    hint = _target_hint({"machine": machine, "system": "Linux"})
    assert "-mtriple=" not in hint
    spec = hint[hint.index("--target 'cpu=") + len("--target 'cpu="):hint.index("'` (or")]
    assert target_triple(as_target(spec)) == triple


@pytest.fixture(scope="module")
def arm_build():
    return hgrt.build(conv_model(), ["cpu:0", "cpu:1"], target={"cpu": PI},
                      placement=hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))


def test_save_without_the_cross_compiler_names_it_and_writes_nothing(arm_build, tmp_path,
                                                                     monkeypatch):
    out = tmp_path / "art"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BuildError, match=r"needs the cross compiler 'aarch64-linux-gnu-g\+\+', "
                                         r"which is not installed \(Debian/Ubuntu: apt-get "
                                         r"install g\+\+-aarch64-linux-gnu\)"):
        hgrt.save(str(out), arm_build)
    assert os.listdir(tmp_path) == []
    with pytest.raises(BuildError, match="'no-such-g\\+\\+' given to link lib.so is not on PATH"):
        hgrt.save(str(out), arm_build, cc="no-such-g++")


def test_a_failed_save_leaves_the_old_artifacts(tmp_path):
    res = hgrt.build(conv_model(), ["cpu"])
    out = str(tmp_path / "art")
    hgrt.save(out, res)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    with pytest.raises(BuildError, match="linking lib.so for x86_64.* failed"):
        hgrt.save(out, res, cc="false")  # a "compiler" that always fails
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["art"]  # no temporary directory left


@has_cross_gxx
def test_save_links_for_the_triple(arm_build, tmp_path):
    out = hgrt.save(str(tmp_path / "art"), arm_build)
    assert library_machine(os.path.join(out, "lib.so")) == "aarch64"
    assert artifacts.library_triple(arm_build.lib) == "aarch64-linux-gnu"


@has_cross_gxx
def test_cli_compile_for_a_board(tmp_path):
    onnx.save(conv_model(), str(tmp_path / "m.onnx"))
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "hgrt", "compile", str(tmp_path / "m.onnx"),
                           "--device", "cpu:0", "--device", "cpu:1", "--target", f"cpu={PI}",
                           "--cc", "aarch64-linux-gnu-g++", "-o", out],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert library_machine(os.path.join(out, "lib.so")) == "aarch64"
    # a classic TVM option string is translated: the same board by its triple
    out2 = str(tmp_path / "out2")
    proc = subprocess.run([sys.executable, "-m", "hgrt", "compile", str(tmp_path / "m.onnx"),
                           "--device", "cpu", "--target", "cpu=llvm -mtriple=aarch64-linux-gnu",
                           "-o", out2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert library_machine(os.path.join(out2, "lib.so")) == "aarch64"
    assert "cpu:0: llvm mtriple=aarch64-linux-gnu, vector ISA neon" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "hgrt", "compile", str(tmp_path / "m.onnx"),
                          "--device", "cpu", "--target", "cpu=llvm -mcpu", "-o", out],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "error: --target cpu 'llvm -mcpu': -mcpu needs a value" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_device_lists_of_the_wrong_type_are_device_errors():
    from hgrt.testing import conv_model

    for devices in (5, None):
        with pytest.raises(hgrt.DeviceError, match="devices must be a name"):
            hgrt.build(conv_model(), devices)
    with pytest.raises(hgrt.DeviceError, match="cuda_arch 'junk'"):
        hgrt.build(conv_model(), ["cpu", "cuda"], cuda_arch="junk")


@has_cross_gxx
def test_a_board_s_artifacts_loaded_here_say_so_before_loading_the_library(arm_build, tmp_path):
    """dlopen of an aarch64 lib.so said 'cannot open shared object file: No such file'."""
    out = hgrt.save(str(tmp_path / "art"), arm_build)
    with pytest.raises(DeviceError, match=r"cpu:0: the library was built for aarch64, this "
                                          r"machine is x86_64: run it on such a board through "
                                          r"RPC"):
        hgrt.load(out)
    with pytest.raises(DeviceError, match=r"the library was built for aarch64"):
        hgrt.Host(["cpu:0", "cpu:1"]).add("arm", out)  # it loaded the library first
