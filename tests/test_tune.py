"""MetaSchedule tuning into a JSON database, building with it, resuming it (a few trials)."""

import json
import os

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
from hgrt.devices import host_target
from hgrt.errors import BuildError
from hgrt.relay_passes.inner.cpu_schedule import schedule_cpu_functions
from hgrt.relay_passes.inner.tuning_db import (
    TuningProgress,
    apply_database,
    bare_func,
    kernel_key,
    module_targets,
)
from hgrt.testing import run_lowered_vm
from hgrt.tune import (
    fuse_for_tuning,
    provider_calls,
    tune,
    tuning_tasks,
    verify_in_model,
    verify_whole_runs,
)

TARGET = host_target()


@I.ir_module
class TwoKernels:
    @R.function
    def main(x: R.Tensor((32, 64), "float32"), w: R.Tensor((64, 64), "float32"),
             b: R.Tensor((64,), "float32")):
        with R.dataflow():
            y = R.nn.relu(R.matmul(x, w))
            z = R.add(R.matmul(y, w), b)
            R.output(z)
        return z


def _records(db_dir):
    with open(os.path.join(db_dir, "database_tuning_record.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Tune 2 trials per task, then resume to 3: the second run adds, it does not restart."""
    db_dir = str(tmp_path_factory.mktemp("tuning"))
    mod = fuse_for_tuning(TwoKernels)
    lines = []
    # the builder's processes make their temporary directories here (test_tune_leaves_no_...)
    scratch = str(tmp_path_factory.mktemp("scratch"))
    old_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    try:
        # verify=False: which kernels win inside the model depends on timing; the verification
        # has its own test below
        first = tune(TwoKernels, db_dir, trials_per_task=2, log=lines.append, verify=False)[0]
        after_first = _records(db_dir)
        resumed = tune(mod, db_dir, trials_per_task=3, log=lines.append)[0]
    finally:
        if old_tmpdir is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old_tmpdir
    TUNE_SCRATCH.append(scratch)
    return mod, db_dir, first, after_first, resumed, lines


TUNE_SCRATCH: list[str] = []


def test_tune_leaves_no_temporary_directory_behind(tuned):
    # one was left per task: the default schedule's build (tune.record_default)
    left = os.listdir(TUNE_SCRATCH[0])
    assert left == [], f"tune left {left} in its temporary directory"


def test_a_damaged_database_is_a_build_error_naming_it(tuned, tmp_path):
    _, db_dir, *_ = tuned
    bad = tmp_path / "db"
    bad.mkdir()
    for name in ("database_workload.json", "database_tuning_record.json"):
        with open(os.path.join(db_dir, name)) as f:
            (bad / name).write_text(f.read())
    with open(bad / "database_tuning_record.json", "a") as f:
        f.write("garbage{\n")  # a record cut by a crash, say
    with pytest.raises(BuildError, match=r"tuning database .*db'.* do not read as MetaSchedule"):
        hgrt.build(TwoKernels, ["cpu"], tuning_db=str(bad))
    (bad / "database_tuning_record.json").write_text("")
    (bad / "database_workload.json").write_text('["x", 1]\n')  # parses, but not a workload
    with pytest.raises(BuildError, match="do not read as MetaSchedule records"):
        hgrt.build(TwoKernels, ["cpu"], tuning_db=str(bad))
    with pytest.raises(BuildError, match="is a file; a database is a directory"):
        hgrt.build(TwoKernels, ["cpu"], tuning_db=str(bad / "database_workload.json"))


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"k": "many"}'])
def test_a_damaged_progress_file_is_refused_not_read_as_empty(tmp_path, text):
    (tmp_path / TuningProgress.FILE).write_text(text)
    with pytest.raises(BuildError, match=f"{TuningProgress.FILE} is damaged"):
        TuningProgress(str(tmp_path))
    (tmp_path / TuningProgress.FILE).unlink()
    assert TuningProgress(str(tmp_path)).asked_by_key == {}  # none yet: nothing tuned


def test_tasks_are_the_fused_kernels():
    mod = fuse_for_tuning(TwoKernels)
    assert [str(t) for t in module_targets(mod)] == [str(TARGET)]
    names = sorted(t.task_name for t in tuning_tasks(mod, TARGET))
    assert names == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]


def test_a_kernel_on_two_devices_of_one_target_is_one_task():
    split = hgrt.Placement(rules={"relax.matmul": "cpu:1"})
    mod = fuse_for_tuning(TwoKernels, ["cpu:0", "cpu:1"], split)
    assert len(module_targets(mod)) == 1
    # the matmuls run on cpu:1, the relu / add on cpu:0: fusion stops at the device boundary
    names = sorted(t.task_name for t in tuning_tasks(mod, TARGET))
    assert names == ["add_llvm", "matmul_llvm", "relu_llvm"]


def test_tune_writes_a_json_database_and_reports_progress(tuned):
    _, db_dir, first, after_first, _, lines = tuned
    assert first.tasks == 2
    assert sorted(first.trials) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
    assert len(after_first) >= 2
    assert all(v > 0 for v in first.best.values())
    assert any(line.startswith("task 1/2") and "best" in line for line in lines)
    assert os.path.exists(os.path.join(db_dir, "database_workload.json"))


def test_resumed_tune_adds_to_the_database(tuned):
    _, db_dir, _, after_first, resumed, _ = tuned
    records = _records(db_dir)
    assert len(records) > len(after_first)
    assert records[:len(after_first)] == after_first  # what the first run found is kept
    # a third run with the same budget has nothing left to do
    again = tune(TwoKernels, db_dir, trials_per_task=3, log=None, verify=False)[0]
    assert sorted(again.skipped) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
    assert len(_records(db_dir)) == len(records)


def test_apply_database_schedules_the_tuned_kernels(tuned):
    mod, db_dir, *_ = tuned
    new, report = apply_database(mod, db_dir)
    assert sorted(report.tuned) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
    assert report.fallback == []
    for name in report.tuned:
        assert bool(new[name].attrs["tirx.is_scheduled"])
        assert not tvm_ffi.structural_equal(new[name], mod[name])
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in [(32, 64), (64, 64), (64,)]]
    ref = run_lowered_vm(mod, args, TARGET)
    out = run_lowered_vm(schedule_cpu_functions(new, TARGET)[0], args, TARGET)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _inputs():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((32, 64)).astype("float32"),
            "w": rng.standard_normal((64, 64)).astype("float32"),
            "b": rng.standard_normal(64).astype("float32")}


def _run(result, inputs):
    m = hgrt.create(result.graph_json, result.lib, [tvm.cpu(i) for i in range(len(
        result.devices))])
    m.load_params(result.params)
    m.set_input(**inputs)
    m.run()
    return m.get_output(0).numpy()


@pytest.mark.parametrize("devices", [["cpu"], ["cpu:0", "cpu:1"]])
def test_build_with_the_database_uses_the_tuned_kernels(tuned, devices):
    *_, db_dir = tuned[:2]
    placement = hgrt.Placement(rules={"relax.nn.relu": "cpu:1"}) if len(devices) > 1 else None
    tuned_build = hgrt.build(TwoKernels, devices, placement, tuning_db=db_dir)
    default_build = hgrt.build(TwoKernels, devices, placement)
    assert default_build.tuning is None
    report = tuned_build.tuning
    # matmul+add stays whole on cpu:0 in both placements: tuned, so applied
    assert "fused_matmul_llvm_add_llvm" in report.tuned
    if len(devices) == 1:
        assert sorted(report.tuned) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
    else:  # relu moved to cpu:1, so matmul and relu are two kernels nobody tuned
        assert report.fallback and "fused_matmul_llvm_relu_llvm" not in report.tuned
    inputs = _inputs()
    np.testing.assert_allclose(_run(tuned_build, inputs), _run(default_build, inputs),
                               rtol=1e-4, atol=1e-4)


def test_tuned_kernel_is_the_best_schedule_of_the_database(tuned):
    from tvm.s_tir import meta_schedule as ms

    mod, db_dir, *_ = tuned
    new, report = apply_database(mod, db_dir)
    db = ms.database.JSONDatabase(work_dir=db_dir, module_equality="structural")
    records = db.get_all_tuning_records()
    for name in report.tuned:
        bare = bare_func(mod[name])
        mine = [r for r in records
                if tvm_ffi.structural_equal(bare_func(r.workload.mod["main"]), bare)]
        assert mine, name
        best = min(mine, key=lambda r: sum(float(x) for x in r.run_secs) / len(r.run_secs))
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": bare}))
        best.trace.apply_to_schedule(sch, remove_postproc=False)
        assert tvm_ffi.structural_equal(sch.mod["main"].body, new[name].body), name
        # what build does next (the default schedule) leaves a tuned kernel alone
        assert tvm_ffi.structural_equal(schedule_cpu_functions(new)[0][name], new[name]), name


def test_the_default_schedule_is_a_record_of_every_task(tuned):
    _, db_dir, first, *_ = tuned
    with open(os.path.join(db_dir, "hgrt_progress.json")) as f:
        progress = json.load(f)
    timed = [k for k, v in progress.items() if k.endswith("|default_ns") and v > 0]
    assert len(timed) == first.tasks


def test_database_for_another_target_is_ignored_with_a_warning(tuned):
    _, db_dir, *_ = tuned
    other = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2})
    mod = fuse_for_tuning(TwoKernels, [other])
    with pytest.warns(UserWarning, match="other targets"):
        new, report = apply_database(mod, db_dir)
    assert report.tuned == {} and report.ignored_records > 0
    assert sorted(report.fallback) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
    assert new is mod


def test_missing_database_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="hgrt tune"):
        hgrt.build(TwoKernels, ["cpu"], tuning_db=str(tmp_path / "nothing"))


def test_a_kernel_slower_in_the_model_keeps_the_default_schedule(tuned, monkeypatch):
    mod, db_dir, *_ = tuned
    progress = TuningProgress(db_dir)
    saved = progress.default_wins()
    name = "fused_matmul_llvm_add_llvm"
    # the kernels kept make whole runs faster (the whole-run verdict: the next test)
    monkeypatch.setattr(hgrt.tune, "whole_runs", lambda a, b, repeat: (1.0, 0.5))
    try:
        times = verify_in_model(TwoKernels, db_dir, log=None)
        assert sorted(times) == ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
        assert all(d > 0 and t > 0 for d, t in times.values())
        slower = {n for n, (d, t) in times.items() if t > d * 1.02}
        assert set(apply_database(mod, db_dir)[1].default_faster) == slower
        # as if the verification had found the tuned matmul+add slower in the model
        progress.set_default_wins({kernel_key(mod[name], mod[name].attrs["target"])})
        new, report = apply_database(mod, db_dir)
        assert name in report.fallback and report.default_faster == [name]
        assert "default schedule ran faster in the model" in report.summary()
        assert "tirx.is_scheduled" not in (new[name].attrs or {})  # left to the default pass
        _, everything = apply_database(mod, db_dir, use_verdicts=False)
        assert name in everything.tuned
    finally:
        progress.set_default_wins(saved)


@pytest.mark.parametrize("tuned_s, keeps", [(0.99, False), (0.9, True)])
def test_tuned_kernels_that_do_not_speed_up_whole_runs_keep_the_default(tuned, monkeypatch,
                                                                       tuned_s, keeps):
    """The profiled verdicts keep one tuned kernel (the other's default won); whole runs of the
    tuned build decide: 1 % faster than the default build (within the 2 % margin) and both keep
    the default, saying so; 10 % faster and the tuned one stays. A verdict on a kernel of
    another model sharing the database stays either way."""
    mod, db_dir, *_ = tuned
    progress = TuningProgress(db_dir)
    saved = progress.default_wins()
    timed: list = []

    def whole_runs(a, b, repeat):
        timed.append((a, b))
        return 1.0, tuned_s

    monkeypatch.setattr(hgrt.tune, "whole_runs", whole_runs)
    lines: list[str] = []
    try:
        loser = "fused_matmul_llvm_add_llvm"
        other_model = "llvm/another/()/|123"
        progress.set_default_wins({kernel_key(mod[loser], mod[loser].attrs["target"]),
                                   other_model})
        assert verify_whole_runs(TwoKernels, db_dir, log=lines.append) is keeps
        assert len(timed) == 1 and timed[0][0] is not timed[0][1]
        report = apply_database(mod, db_dir)[1]
        both = ["fused_matmul_llvm_add_llvm", "fused_matmul_llvm_relu_llvm"]
        assert sorted(report.default_faster) == ([loser] if keeps else both)
        assert sorted(report.tuned) == (["fused_matmul_llvm_relu_llvm"] if keeps else [])
        assert other_model in TuningProgress(db_dir).default_wins()
        assert ("every kernel keeps the default schedule" in lines[-1]) is not keeps
    finally:
        progress.set_default_wins(saved)


def _conv_exp():
    """x → Conv + bias → Relu → Exp: oneDNN can take the conv and relu, not the exp."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(16).astype("float32"), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Exp", ["r"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 9, 9])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "conv_exp", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _needs_onednn():
    from hgrt.providers.onednn import kernels as onednn

    if onednn.unavailable_reason():
        pytest.skip(f"oneDNN unavailable: {onednn.unavailable_reason()}")


def test_what_onednn_computes_is_not_tuned():
    """Tuning follows the kernel provider of the build: a conv that oneDNN computes is no task
    (it would be tuned for nothing), the same conv left to TVM is."""
    _needs_onednn()
    model = _conv_exp()
    with_tvm = fuse_for_tuning(model, kernels="tvm")
    with_onednn = fuse_for_tuning(model, kernels="onednn")
    assert provider_calls(with_tvm) == 0 and provider_calls(with_onednn) >= 1
    tvm_tasks = [t.task_name for t in tuning_tasks(with_tvm, TARGET)]
    onednn_tasks = [t.task_name for t in tuning_tasks(with_onednn, TARGET)]
    assert any("conv2d" in n for n in tvm_tasks), tvm_tasks
    assert onednn_tasks and not any("conv2d" in n for n in onednn_tasks), onednn_tasks
    assert any("exp" in n for n in onednn_tasks), onednn_tasks


def test_tune_with_onednn_kernels_tunes_and_verifies_the_rest(tmp_path):
    _needs_onednn()
    model, lines = _conv_exp(), []
    summary = tune(model, str(tmp_path), trials_per_task=1, kernels="onednn",
                   log=lines.append)[0]
    assert summary.tasks == len(tuning_tasks(fuse_for_tuning(model, kernels="onednn"), TARGET))
    assert not any("conv2d" in n for n in summary.trials), summary.trials
    assert any("go to kernel providers and are not tuned" in line for line in lines), lines
    assert any(line.startswith("verify in the model") for line in lines), lines
    # the database builds a oneDNN model: its TVM kernels tuned, its conv still oneDNN's
    # (tuning_verdicts=False: whether a ~1 us exp tuned beats its default in the model is
    # timing; verify_in_model's own test covers the verdicts)
    res = hgrt.build(model, ["cpu"], kernels="onednn", tuning_db=str(tmp_path),
                     tuning_verdicts=False)
    assert res.tuning.tuned and not any("conv2d" in n for n in res.tuning.tuned)
    assert any((n.func_name or "").startswith("hgrt.onednn.") for n in res.graph.nodes)
    x = np.random.default_rng(3).standard_normal((1, 8, 9, 9)).astype("float32")
    ref = hgrt.build(model, ["cpu"], kernels="tvm")
    np.testing.assert_allclose(_run(res, {"x": x}), _run(ref, {"x": x}), rtol=1e-4, atol=1e-4)
