"""The command-line flow a user follows: hgrt zoo → hgrt tune → hgrt compile --tuning-db → run."""

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hgrt.cli import main


def _matmul_model(path: str) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((64, 32)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])],
        initializer=[numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return w


# a real tuning run end to end through the CLI; tests/test_tune.py keeps tuning in the default run
@pytest.mark.slow
def test_tune_compile_run(tmp_path, capsys):
    model = str(tmp_path / "mm.onnx")
    w = _matmul_model(model)
    db = str(tmp_path / "db")
    assert main(["tune", model, "--device", "cpu", "--db", db, "--trials-per-task", "2",
                 "--cost-model", "random", "--kernels", "tvm"]) == 0
    out = capsys.readouterr().out
    assert "task 1/1" in out and "default schedule" in out and "--tuning-db" in out
    assert "--kernels tvm --tuning-db" in out  # the build it tells of uses the same kernels
    assert os.path.exists(os.path.join(db, "database_tuning_record.json"))

    # again: nothing left to do, nothing measured
    records = open(os.path.join(db, "database_tuning_record.json")).read()
    assert main(["tune", model, "--device", "cpu", "--db", db, "--trials-per-task", "2",
                 "--kernels", "tvm"]) == 0
    assert "done before" in capsys.readouterr().out
    # the default provider (auto) leaves this small matmul to TVM too: the same task, done;
    # the build it tells of needs no --kernels (compile's default is the same)
    assert main(["tune", model, "--device", "cpu", "--db", db, "--trials-per-task", "2"]) == 0
    out = capsys.readouterr().out
    assert "done before" in out and "--kernels" not in out.split("build with")[-1]
    assert open(os.path.join(db, "database_tuning_record.json")).read() == records

    art = str(tmp_path / "out")
    assert main(["compile", model, "--device", "cpu", "--tuning-db", db, "-o", art,
                 "--kernels", "tvm"]) == 0  # the tuned conv, not oneDNN's
    out = capsys.readouterr().out
    assert "target" in out and "num-cores" in out
    # the tune verified the tuned kernel inside the model: it is applied, or kept out for a
    # reason the build states (which one wins depends on timing)
    assert ("tuned 1 of 1 kernels" in out) != (
        "tuned 0 of 1 kernels" in out and "default schedule ran faster in the model" in out)
    x = np.random.default_rng(1).standard_normal((16, 64)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    assert main(["run", art, "--input", f"x={tmp_path / 'x.npy'}", "--save-output",
                 str(tmp_path / "y.npz")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["arr_0"], np.maximum(x @ w, 0),
                               rtol=1e-5, atol=1e-5)


def test_tune_refuses_a_bad_budget(tmp_path, capsys):
    model = str(tmp_path / "mm.onnx")
    _matmul_model(model)
    with pytest.raises(SystemExit) as e:  # a usage error, as argparse makes them
        main(["tune", model, "--device", "cpu", "--db", str(tmp_path / "db"),
              "--trials-per-task", "0"])
    assert e.value.code == 2
    assert "--trials-per-task: must be at least 1, got 0" in capsys.readouterr().err


def test_zoo_writes_a_runnable_model(tmp_path, capsys):
    path = str(tmp_path / "sq.onnx")
    assert main(["zoo", "squeezenet", "-o", path, "--input", str(tmp_path / "x.npy")]) == 0
    model = onnx.load(path)
    assert not [n for n in model.graph.node if n.op_type == "ConstantOfShape"]
    assert np.load(tmp_path / "x.npy").shape == (1, 3, 224, 224)
    capsys.readouterr()
    assert main(["zoo", "nosuchnet", "-o", path]) == 2  # names what exists
    err = capsys.readouterr().err
    assert "'nosuchnet' not found" in err and "squeezenet" in err


def test_compile_with_a_missing_database_names_it(tmp_path, capsys):
    model = str(tmp_path / "mm.onnx")
    _matmul_model(model)
    rc = main(["compile", model, "--device", "cpu", "--tuning-db", str(tmp_path / "nope"),
               "-o", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope" in err and "hgrt tune" in err
    assert not json.dumps(err).count("Traceback")
