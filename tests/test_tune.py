"""MetaSchedule tuning into a JSON database, applying it, resuming it (a handful of trials)."""

import json
import os

import numpy as np
import pytest
import tvm
import tvm_ffi
from kernel_testing import run_relax_vm
from tvm.script import ir as I
from tvm.script import relax as R

from hgrt.relay_passes.schedule_cpu import default_cpu_schedule
from hgrt.tune import apply_database, fuse_for_tuning, tune, tuning_tasks

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


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
    first = tune(mod, TARGET, db_dir, trials_per_task=2, log=lines.append)[0]
    after_first = _records(db_dir)
    resumed = tune(mod, TARGET, db_dir, trials_per_task=3, log=lines.append)[0]
    return mod, db_dir, first, after_first, resumed, lines


def test_tasks_are_the_fused_kernels():
    mod = fuse_for_tuning(TwoKernels)
    names = sorted(t.task_name for t in tuning_tasks(mod, TARGET))
    assert names == ["fused_matmul_add", "fused_matmul_relu"]


def test_tune_writes_a_json_database_and_reports_progress(tuned):
    _, db_dir, first, after_first, _, lines = tuned
    assert first.tasks == 2 and sorted(first.trials) == ["fused_matmul_add", "fused_matmul_relu"]
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
    again = tune(fuse_for_tuning(TwoKernels), TARGET, db_dir, trials_per_task=3, log=None)[0]
    assert sorted(again.skipped) == ["fused_matmul_add", "fused_matmul_relu"]
    assert len(_records(db_dir)) == len(records)


def test_apply_database_schedules_the_tuned_kernels(tuned):
    mod, db_dir, *_ = tuned
    new, report = apply_database(mod, TARGET, db_dir)
    assert sorted(report.tuned) == ["fused_matmul_add", "fused_matmul_relu"]
    assert report.fallback == []
    for name in report.tuned:
        assert bool(new[name].attrs["tirx.is_scheduled"])
        assert not tvm_ffi.structural_equal(new[name], mod[name])
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in [(32, 64), (64, 64), (64,)]]
    ref = run_relax_vm(mod, TARGET, args)
    out = run_relax_vm(default_cpu_schedule(new, TARGET), TARGET, args)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_database_for_another_target_is_ignored_with_a_warning(tuned):
    mod, db_dir, *_ = tuned
    other = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2})
    with pytest.warns(UserWarning, match="other targets"):
        new, report = apply_database(mod, other, db_dir)
    assert report.tuned == [] and report.ignored_records > 0
    assert new is mod
