"""Every user error of the command line is one line on stderr and exit status 2, through
``python -m hgrt`` (a real subprocess, as a user runs it)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest


def hgrt_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hgrt", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    import onnx

    from hgrt.testing import conv_model

    path = tmp_path_factory.mktemp("m") / "conv.onnx"
    onnx.save(conv_model(), str(path))
    return str(path)


@pytest.mark.parametrize("case", ["missing model", "bad device", "missing artifacts",
                                  "bad input file", "bad --place", "bad --kernels-rule"])
def test_user_errors_are_one_line_and_status_2(case, onnx_file, tmp_path):
    bad_npy = tmp_path / "x.npy"
    bad_npy.write_text("not numpy")
    art = str(tmp_path / "art")
    if case == "bad input file":
        assert hgrt_cli("compile", onnx_file, "--device", "cpu", "-o", art).returncode == 0
    args = {
        "missing model": ["compile", str(tmp_path / "missing.onnx"), "--device", "cpu", "-o",
                          art],
        "bad device": ["compile", onnx_file, "--device", "tpu:0", "-o", art],
        "missing artifacts": ["run", str(tmp_path / "nothing")],
        "bad input file": ["run", art, "--input", f"x={bad_npy}"],
        "bad --place": ["compile", onnx_file, "--device", "cpu", "--place", "nn.conv2d", "-o",
                        art],
        "bad --kernels-rule": ["compile", onnx_file, "--device", "cpu", "--kernels-rule",
                               "nn.conv2d=mkl", "-o", art],
    }[case]
    proc = hgrt_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hgrt {args[0]}: error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_compile_chooses_kernels_per_op(onnx_file, tmp_path):
    """--kernels-override by node (a name the model lacks: an error listing those it has),
    --kernels-rule by op; graph.json records who computes each node."""
    import json

    proc = hgrt_cli("compile", onnx_file, "--device", "cpu", "--kernels-override", "nope=tvm",
                    "-o", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "kernels override 'nope': is not a binding of main" in proc.stderr.splitlines()[-1]
    assert "convolutions, matmuls, layer norms and softmaxes: ['lv" in \
        proc.stderr.splitlines()[-1]
    providers = []
    for rule in ("matmul=tvm", "nn.conv*=tvm"):  # the model: a conv + relu, then TVM ops
        art = tmp_path / rule.partition("=")[0].replace("*", "")
        proc = hgrt_cli("compile", onnx_file, "--device", "cpu", "--kernels", "onednn",
                        "--kernels-rule", rule, "-o", str(art))
        if proc.returncode == 2 and "oneDNN" in proc.stderr:  # the extra is not installed
            pytest.skip(proc.stderr.splitlines()[-1])
        assert proc.returncode == 0, proc.stderr
        nodes = json.loads((art / "graph.json").read_text())["nodes"]
        providers.append([n["attrs"].get("provider", "tvm") for n in nodes if n["op"] == "tvm_op"])
    assert providers[0][0] == "onednn" and providers[1] == ["tvm"] * len(providers[1])


def test_python_dash_m_hgrt_runs_the_cli(onnx_file, tmp_path):
    art = str(tmp_path / "art")
    assert hgrt_cli("compile", onnx_file, "--device", "cpu", "-o", art).returncode == 0
    x = tmp_path / "x.npy"
    np.save(x, np.ones((1, 3, 8, 8), "float32"))
    proc = hgrt_cli("run", art, "--input", f"x={x}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("output 0: shape (1, 256) float32")


@pytest.mark.parametrize("args, match", [
    (["zoo", "squeezenet", "-o", "m.onnx", "--seed", "-1"], "--seed: must be at least 0, got -1"),
    (["profile", "art", "--top", "-1"], "--top: must be at least 1, got -1"),
    (["profile", "art", "--repeat", "0"], "--repeat: must be at least 1, got 0"),
    (["run", "art", "--repeat", "x"], "--repeat: expected an integer, got 'x'"),
    (["tune", "m.onnx", "--db", "d", "--trials-per-task", "0"], "must be at least 1, got 0"),
    (["rpc-server", "--max-session", "-5"], "max_session must be seconds >= 0"),
])
def test_counts_out_of_range_are_usage_errors(args, match, tmp_path):
    # --top -1 dropped the last row, --seed -1 ended in numpy's traceback
    proc = hgrt_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert match in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []
