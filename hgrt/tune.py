"""``hgrt.tune``: MetaSchedule tuning of a model's fused kernels into a JSON database, and
``apply_database``: the tuned schedules put back into a fused module before it is built.

>>> tune("model.onnx", "tuning/", trials_per_task=16, devices=["cpu:0", "cpu:1"],
...      placement=hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))  # doctest: +SKIP
task 1/18 fused_conv2d_add_relu (weight 1): 16 trials (16 in db), best 0.412 ms
>>> res = hgrt.build("model.onnx", ["cpu:0", "cpu:1"], placement,
...                  tuning_db="tuning/")  # doctest: +SKIP
>>> print(res.tuning.summary())  # doctest: +SKIP
tuned 18 of 38 kernels from tuning/; 20 fall back to the default schedule (...)

A task is one distinct fused PrimFunc (structural hash) for one target: a function placed on two
devices of two targets is tuned once per target. Records are matched by that hash and by the
target (kind, mcpu, mattr, arch): a database tuned for another CPU is ignored with a warning.
Tuning is resumable: a task that already has ``trials_per_task`` measured records in the
database is skipped, one with fewer gets only the missing trials, and every record is appended
to the same JSON files (MetaSchedule writes a task's records when its round finishes).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx

from hgrt.errors import BuildError

__all__ = ["ApplyReport", "TuneSummary", "apply_database", "fuse_for_tuning", "tune",
           "tuning_tasks", "verify_in_model"]

# registered in each builder worker by _builder_initializer: tvm.build without the
# `import tvm.s_tir.tensor_intrin` of MetaSchedule's default_build (~46 s per worker here)
BUILD_FUNC = "hgrt.tune.build_without_tensor_intrin"


def _builder_initializer() -> None:
    import tvm_ffi

    def build(mod, target, _params):
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        return tvm_build(mod, target=target)

    tvm_ffi.register_global_func(BUILD_FUNC, build, override=True)


def fuse_for_tuning(model: Any, devices: Any = "cpu", placement: Any = None,
                    params: dict[str, Any] | None = None, *,
                    input_shapes: dict[str, Any] | None = None) -> tvm.IRModule:
    """A model (ONNX path / ModelProto, Relax IRModule) → the placed, fused module ``build``
    schedules (``hgrt.compiler.lower_model``): same passes, same devices and placement, so the
    functions, their structural hashes and targets are the ones ``build`` looks up.
    A module that is already fused is returned as it is."""
    from hgrt.compiler import lower_model

    if isinstance(model, tvm.IRModule) and _is_fused(model):
        return model
    return lower_model(model, devices, placement, params, input_shapes=input_shapes)[0]


def _is_fused(mod: tvm.IRModule) -> bool:
    return any(isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())


def module_targets(mod: tvm.IRModule) -> list[tvm.target.Target]:
    """The distinct targets (by ``_target_key``) of the PrimFuncs of a fused module."""
    seen: dict[tuple, tvm.target.Target] = {}
    for _, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and f.attrs is not None and "target" in f.attrs:
            seen.setdefault(_target_key(f.attrs["target"]), f.attrs["target"])
    return list(seen.values())


def _target_key(target: tvm.target.Target) -> tuple:
    """What must agree for a record to apply: the code it was timed as (not the core count)."""
    a = target.attrs
    mattr = tuple(sorted(str(x) for x in a["mattr"])) if "mattr" in a else ()
    return (target.kind.name, str(a.get("mcpu", "")) if "mcpu" in a else "", mattr,
            str(a["arch"]) if "arch" in a else "")


def _func_target(func: tirx.PrimFunc, default: tvm.target.Target) -> tvm.target.Target:
    return func.attrs["target"] if func.attrs is not None and "target" in func.attrs else default


def _functions_for(mod: tvm.IRModule, target: tvm.target.Target) -> dict[str, tirx.PrimFunc]:
    """PrimFuncs that run on ``target`` (their ``target`` attr, or none), attr stripped."""
    key = _target_key(target)
    out = {}
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and _target_key(_func_target(f, target)) == key:
            out[gv.name_hint] = f.without_attr("target") if "target" in (f.attrs or {}) else f
    return out


def _bare(func: tirx.PrimFunc) -> tirx.PrimFunc:
    for attr in ("global_symbol", "target", "tirx.noalias"):
        if func.attrs is not None and attr in func.attrs:
            func = func.without_attr(attr)
    return func


def tuning_tasks(mod: tvm.IRModule, target: tvm.target.Target | str) -> list:
    """MetaSchedule tasks (``ExtractedTask``) of the fused ``mod`` for the kernels on ``target``.

    ``ms.relax_integration.extract_tasks`` dedups by structural hash and weights each task by
    its number of call sites; functions placed on another target are left out.
    """
    from tvm.s_tir import meta_schedule as ms

    target = tvm.target.Target(target)
    mine = _functions_for(mod, target)
    stripped = mod.clone()
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and "target" in (f.attrs or {}):
            stripped.update_func(gv, f.without_attr("target"))
    tasks = ms.relax_integration.extract_tasks(stripped, target)
    keep = []
    for t in tasks:
        body = t.dispatched[0]["main"]
        if t.task_name in mine or any(
                tvm_ffi.structural_equal(_bare(body), _bare(f)) for f in mine.values()):
            keep.append(t)
    return keep


@dataclass
class TuneSummary:
    """What ``tune`` did: per task name, trials measured now and the best time (seconds)."""

    db_dir: str
    target: str
    tasks: int = 0
    skipped: list[str] = field(default_factory=list)  # already had enough trials
    trials: dict[str, int] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _database(db_dir: str):
    from tvm.s_tir import meta_schedule as ms

    os.makedirs(db_dir, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=db_dir, module_equality="structural")


def _records(db, task_mod: tvm.IRModule, target: tvm.target.Target) -> list:
    if not db.has_workload(task_mod):
        return []
    key = _target_key(target)
    recs = db.get_top_k(db.commit_workload(task_mod), 1 << 30)
    return [r for r in recs if _target_key(r.target) == key]


def _record_default(db, task_mod: tvm.IRModule, target: tvm.target.Target, builder, runner,
                    log: Callable[[str], None]) -> float | None:
    """Build and time hgrt's default schedule of the task with MetaSchedule's own builder and
    runner, and commit it as a tuning record; its mean seconds, or None when it cannot be
    scheduled, built or run."""
    from tvm.s_tir import meta_schedule as ms

    from hgrt.relay_passes.schedule_cpu import default_schedule_trace

    func = task_mod["main"]
    trace = default_schedule_trace(func, target)
    if trace is None:
        return None
    sch = tvm.s_tir.Schedule(task_mod)
    trace.apply_to_schedule(sch, remove_postproc=False)
    built = builder.build([ms.builder.BuilderInput(sch.mod, target)])[0]
    if built.error_msg:
        log(f"  the default schedule does not build: {built.error_msg.splitlines()[0][:160]}")
        return None
    args_info = ms.arg_info.ArgInfo.from_prim_func(func)
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    res = runner.run([ms.runner.RunnerInput(built.artifact_path, device,
                                            args_info)])[0].result()
    if res.error_msg or not res.run_secs:
        return None
    secs = [float(x) for x in res.run_secs]
    db.commit_tuning_record(ms.database.TuningRecord(
        trace, db.commit_workload(task_mod), secs, target, args_info))
    return sum(secs) / len(secs)


class _Progress:
    """``hgrt_progress.json`` in the database: per (target, workload hash), the trials a
    finished tune of that task asked for."""

    FILE = "hgrt_progress.json"

    def __init__(self, db_dir: str) -> None:
        self.path = os.path.join(db_dir, self.FILE)
        try:
            with open(self.path) as f:
                self.asked_by_key: dict[str, int] = json.load(f)
        except (OSError, ValueError):
            self.asked_by_key = {}

    @staticmethod
    def _key(task_mod: tvm.IRModule, target: tvm.target.Target, what: str) -> str:
        return (f"{'/'.join(map(str, _target_key(target)))}|"
                f"{tvm_ffi.structural_hash(task_mod)}|{what}")

    def asked(self, task_mod: tvm.IRModule, target: tvm.target.Target,
              what: str = "trials") -> int:
        return int(self.asked_by_key.get(self._key(task_mod, target, what), 0))

    def record(self, task_mod: tvm.IRModule, target: tvm.target.Target, trials: int,
               what: str = "trials") -> None:
        key = self._key(task_mod, target, what)
        self.asked_by_key[key] = max(trials, self.asked_by_key.get(key, 0))
        self._save()

    def default_wins(self) -> set[str]:
        """Kernels (``kernel_key``) whose tuned schedule ran slower in the model than the
        default one when ``verify_in_model`` last ran."""
        return {k.rsplit("|", 1)[0] for k, v in self.asked_by_key.items()
                if k.endswith("|default_wins") and v}

    def set_default_wins(self, keys: set[str], scope: set[str] | None = None) -> None:
        """Record ``keys`` as the kernels whose default schedule wins, replacing the verdicts
        on the kernels of ``scope`` (default: all; several models may share a database)."""
        self.asked_by_key = {k: v for k, v in self.asked_by_key.items()
                             if not k.endswith("|default_wins") or (
                                 scope is not None and k.rsplit("|", 1)[0] not in scope)}
        self.asked_by_key.update({f"{k}|default_wins": 1 for k in keys})
        self._save()

    def _save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.asked_by_key, f, indent=0, sort_keys=True)
        os.replace(tmp, self.path)


def kernel_key(func: tirx.PrimFunc, target: tvm.target.Target) -> str:
    """A kernel of a fused module: its target (``_target_key``) and its structural hash."""
    return f"{'/'.join(map(str, _target_key(target)))}|{tvm_ffi.structural_hash(_bare(func))}"


def _best(records: list) -> float | None:
    times = [sum(float(x) for x in r.run_secs) / len(r.run_secs) for r in records
             if r.run_secs]
    return min(times) if times else None


def tune(model: Any, db_dir: str, trials_per_task: int = 16, *, devices: Any = "cpu",
         placement: Any = None, params: dict[str, Any] | None = None,
         input_shapes: dict[str, Any] | None = None, trials_per_round: int = 16,
         population_size: int = 128, builder_timeout_sec: float = 60.0,
         max_workers: int | None = None, seed: int = 0, cost_model: str = "auto",
         verify: bool = True, log: Callable[[str], None] | None = print) -> list[TuneSummary]:
    """Tune every distinct kernel of ``model`` placed on ``devices`` into ``db_dir``.

    ``model``: an ONNX model or Relax IRModule, placed and fused as ``hgrt.build`` does with
    the same ``devices`` / ``placement`` (``fuse_for_tuning``), or a module already fused.
    Every target among the kernels is tuned in turn (a kernel on two devices of one target
    once). Resumable: run it again with the same ``db_dir`` and finished tasks are skipped,
    unfinished ones get only their missing trials. Each task first records hgrt's default
    schedule, measured like any candidate, so a tuned build is never slower than an untuned
    one by more than the measurement noise. ``cost_model``: ``"xgb"`` (needs xgboost, the
    ``tune`` extra: it learns from each round of ``trials_per_round`` which candidates to
    measure next), ``"random"``, or ``"auto"`` (xgb when xgboost is installed).
    ``verify``: then time each tuned kernel inside the model against the default schedule and
    keep the default where it is faster there (``verify_in_model``).
    """
    from tvm.s_tir import meta_schedule as ms

    log = log or (lambda _m: None)
    if cost_model == "auto":
        try:
            import xgboost  # noqa: F401
            cost_model = "xgb"
        except ImportError:
            cost_model = "random"
    mod = fuse_for_tuning(model, devices, placement, params, input_shapes=input_shapes)
    targets = module_targets(mod)
    if not targets:
        raise BuildError("nothing to tune: the module's kernels carry no target")
    db = _database(db_dir)
    workers = max_workers or max(1, min(os.cpu_count() or 1, 2))
    builder = ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=_builder_initializer,
                                      timeout_sec=builder_timeout_sec, max_workers=workers)
    runner = ms.runner.LocalRunner(timeout_sec=builder_timeout_sec)
    progress = _Progress(db_dir)
    summaries = []
    for target in targets:
        start = time.perf_counter()
        tasks = tuning_tasks(mod, target)
        summary = TuneSummary(db_dir=db_dir, target=str(target), tasks=len(tasks))
        log(f"tuning {len(tasks)} tasks for {target} into {db_dir} "
            f"({trials_per_task} trials per task)")
        for i, task in enumerate(tasks, 1):
            task_mod = task.dispatched[0]
            done = _records(db, task_mod, target)
            # the default schedule is measured and recorded first, so the database's best is
            # never a candidate slower than what an untuned build would run
            has_default = progress.asked(task_mod, target, "default_ns") > 0
            if not has_default and target.kind.name == "llvm":
                try:
                    secs = _record_default(db, task_mod, target, builder, runner, log)
                except Exception as e:  # noqa: BLE001 - one task failing must not lose the rest
                    log(f"  the default schedule could not be timed "
                        f"({str(e).strip().splitlines()[0][:160]})")
                    secs = None
                if secs is not None:
                    has_default = True
                    progress.record(task_mod, target, max(1, round(secs * 1e9)), "default_ns")
                    done = _records(db, task_mod, target)
            # a task whose search space holds fewer schedules than asked for (a reshape has
            # one) was finished by the run that asked: progress remembers what each run asked
            asked = progress.asked(task_mod, target)
            measured = len(done) - int(has_default)
            todo = 0 if asked >= trials_per_task else trials_per_task - measured
            head = f"task {i}/{len(tasks)} {task.task_name} (weight {task.weight})"
            if todo <= 0:
                best = _best(done)
                summary.skipped.append(task.task_name)
                if best is not None:
                    summary.best[task.task_name] = best
                log(f"{head}: done before ({len(done)} records), best "
                    f"{best * 1e3:.3f} ms" if best is not None else f"{head}: done before")
                continue
            ctx = ms.TuneContext(
                mod=task_mod, target=target, space_generator="post-order-apply",
                search_strategy=ms.search_strategy.EvolutionarySearch(
                    population_size=population_size, genetic_num_iters=2),
                task_name=task.task_name, rand_state=seed + i + len(done),
                num_threads=workers).clone()
            try:
                ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=db_dir,
                              max_trials_global=todo, max_trials_per_task=todo,
                              num_trials_per_iter=min(trials_per_round, todo),
                              builder=builder, runner=runner, database=db,
                              cost_model=(ms.cost_model.RandomModel() if cost_model == "random"
                                          else cost_model),
                              task_scheduler="round-robin")
            except Exception as e:  # noqa: BLE001 - one task failing must not lose the rest
                log(f"{head}: tuning failed ({str(e).strip().splitlines()[0][:160]})")
                continue
            recs = _records(db, task_mod, target)
            if len(recs) > len(done):  # a round where every candidate failed finishes nothing
                progress.record(task_mod, target, trials_per_task)
            best = _best(recs)
            summary.trials[task.task_name] = len(recs) - len(done)
            if best is not None:
                summary.best[task.task_name] = best
            best_s = f"{best * 1e3:.3f} ms" if best is not None else "no valid trial"
            default = progress.asked(task_mod, target, "default_ns") * 1e-9
            vs = f" (default schedule {default * 1e3:.3f} ms)" if default else ""
            log(f"{head}: {len(recs) - len(done)} trials ({len(recs)} in db), best {best_s}{vs}")
        summary.seconds = time.perf_counter() - start
        log(f"tuned {len(summary.trials)} tasks, {len(summary.skipped)} already done, "
            f"{summary.seconds:.0f} s")
        summaries.append(summary)
    if verify:
        verify_in_model(model, db_dir, devices=devices, placement=placement, params=params,
                        input_shapes=input_shapes, fused=mod, log=log)
    return summaries


def verify_in_model(model: Any, db_dir: str, *, devices: Any = "cpu", placement: Any = None,
                    params: dict[str, Any] | None = None,
                    input_shapes: dict[str, Any] | None = None, repeat: int = 20,
                    margin: float = 0.02, fused: tvm.IRModule | None = None,
                    log: Callable[[str], None] | None = print
                    ) -> dict[str, tuple[float, float]]:
    """Time every tuned kernel inside the model against its default schedule; where the tuned
    one is slower (by more than ``margin``), record that the default wins, so that
    ``apply_database`` (and so ``build``) keeps the default for it.

    MetaSchedule times a kernel alone, on random data, over and over; inside the model it runs
    after other kernels, on another cache state, and a candidate that wins alone can lose there
    (seen on squeezenet and resnet50: single convolutions 1.5-2.5x slower in the model than
    the default they beat in isolation). Both builds are profiled with hgrt's profiler (median
    of ``repeat`` runs per node) on the local devices. Returns name -> (default µs, tuned µs)
    summed over the kernel's calls; nothing is done for models that are not all on CPUs.
    ``fused``: the model's ``fuse_for_tuning`` module when the caller has it already.
    """
    import numpy as np

    import hgrt
    from hgrt.compiler import build

    log = log or (lambda _m: None)
    if isinstance(model, tvm.IRModule) and _is_fused(model):
        log("verify: given an already fused module, not a model: nothing to build and re-time")
        return {}
    mod = fused if fused is not None else fuse_for_tuning(
        model, devices, placement, params, input_shapes=input_shapes)
    if any(t.kind.name != "llvm" for t in module_targets(mod)):
        log("verify: not every device is a CPU; tuned kernels are not re-timed in the model")
        return {}
    kwargs = {"params": params, "input_shapes": input_shapes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = build(model, devices, placement, **kwargs)
        tuned = build(model, devices, placement, tuning_db=db_dir, tuning_verdicts=False,
                      **kwargs)
    times = []
    rng = np.random.default_rng(0)
    for res in (default, tuned):
        m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(i) for i in range(len(res.devices))])
        m.load_params(res.params)
        shapes, dtypes = m.get_input_info()
        for name, shape in shapes.items():
            dtype = dtypes[name]
            m.set_input(name, rng.standard_normal(shape).astype(dtype)
                        if dtype.startswith("float") else np.zeros(shape, dtype))
        per_func: dict[str, float] = {}
        for op in m.profile(repeat=repeat).ops:
            per_func[op.func] = per_func.get(op.func, 0.0) + op.median_us
        times.append(per_func)
    out, losers = {}, set()
    mine = {kernel_key(f, f.attrs["target"]) for _, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc)}
    for name in tuned.tuning.tuned:
        d, t = times[0].get(name), times[1].get(name)
        if d is None or t is None:
            continue
        out[name] = (d, t)
        if t > d * (1 + margin):
            func = mod[name]
            losers.add(kernel_key(func, func.attrs["target"]))
    _Progress(db_dir).set_default_wins(losers, scope=mine)
    total_d = sum(d for d, _ in out.values())
    total_t = sum(min(d, t) for d, t in out.values())
    log(f"verify in the model: {len(losers)} of {len(out)} tuned kernels ran slower than the "
        f"default schedule and keep it; tuned kernels {total_d / 1e3:.2f} ms -> "
        f"{total_t / 1e3:.2f} ms per run")
    return out


@dataclass
class ApplyReport:
    """Which kernels ``apply_database`` scheduled from the database, and which fell back."""

    db_dir: str
    tuned: dict[str, str] = field(default_factory=dict)  # kernel -> target it was tuned for
    fallback: list[str] = field(default_factory=list)
    default_faster: list[str] = field(default_factory=list)  # of fallback: verified in the model
    ignored_records: int = 0  # records for targets this module does not build for

    def summary(self) -> str:
        n = len(self.tuned) + len(self.fallback)
        s = f"tuned {len(self.tuned)} of {n} kernels from {self.db_dir}"
        if self.fallback:
            shown = ", ".join(self.fallback[:8]) + (" …" if len(self.fallback) > 8 else "")
            s += f"; {len(self.fallback)} fall back to the default schedule ({shown})"
        if self.default_faster:
            s += (f" ({len(self.default_faster)} of them because the default schedule ran "
                  f"faster in the model)")
        if self.ignored_records:
            s += f"; {self.ignored_records} records for other targets ignored"
        return s


def _short(target: tvm.target.Target) -> str:
    a = target.attrs
    return f"{target.kind.name}" + (f" -mcpu={a['mcpu']}" if "mcpu" in a else "") + (
        f" -arch={a['arch']}" if "arch" in a else "")


def apply_database(mod: tvm.IRModule, db_dir: str, *, log: Callable[[str], None] | None = None,
                   use_verdicts: bool = True) -> tuple[tvm.IRModule, ApplyReport]:
    """Give every kernel of the fused ``mod`` that ``db_dir`` has a record for its tuned
    schedule (marked ``tirx.is_scheduled``); returns the module and who was tuned / fell back.

    A kernel's record must match its structural hash and its ``target`` attr (kind, mcpu,
    mattr, arch); ``relax.transform.MetaScheduleApplyDatabase`` runs once per target of the
    module over that target's kernels. Records for targets the module does not build for are
    ignored with a warning (a database tuned on another CPU is never applied). A kernel whose
    tuned schedule ran slower inside the model than the default one (``verify_in_model``)
    keeps the default; ``use_verdicts=False`` applies every record regardless.
    """
    from tvm.s_tir import meta_schedule as ms

    report = ApplyReport(db_dir=db_dir)
    if not os.path.isdir(db_dir) or not os.path.exists(
            os.path.join(db_dir, "database_tuning_record.json")):
        raise BuildError(f"tuning database {db_dir!r} does not exist (no "
                         f"database_tuning_record.json): run `hgrt tune` first")
    targets = module_targets(mod)
    keys = {_target_key(t): t for t in targets}
    per_target = {k: ms.database.MemoryDatabase(module_equality="structural") for k in keys}
    other_targets: set[str] = set()
    for rec in _database(db_dir).get_all_tuning_records():
        key = _target_key(rec.target)
        if key not in per_target:
            report.ignored_records += 1
            other_targets.add(_short(rec.target))
            continue
        db = per_target[key]
        db.commit_tuning_record(ms.database.TuningRecord(
            rec.trace, db.commit_workload(rec.workload.mod), rec.run_secs, rec.target,
            rec.args_info))
    if report.ignored_records:
        warnings.warn(f"tuning database {db_dir!r}: {report.ignored_records} records for other "
                      f"targets ({sorted(other_targets)}) ignored; building for "
                      f"{sorted(_short(t) for t in targets)}", stacklevel=2)
    default_wins = _Progress(db_dir).default_wins() if use_verdicts else set()
    new = mod.clone()
    for key, target in keys.items():
        mine = _functions_for(mod, target)
        sub = tvm.IRModule(dict(mine.items()))
        with target, per_target[key], tvm.transform.PassContext(opt_level=3):
            applied = relax.transform.MetaScheduleApplyDatabase()(sub)
        for name in sorted(mine):
            f = applied[name]
            if kernel_key(mine[name], target) in default_wins:
                report.fallback.append(name)
                report.default_faster.append(name)
            elif f.attrs is not None and bool(f.attrs.get("tirx.is_scheduled", False)) and \
                    not tvm_ffi.structural_equal(f, mine[name]):
                new.update_func(new.get_global_var(name), f.with_attr("target", target))
                report.tuned[name] = _short(target)
            else:
                report.fallback.append(name)
    if log:
        log(report.summary())
    return (new if report.tuned else mod), report
