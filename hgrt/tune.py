"""``hgrt.tune``: MetaSchedule tuning of a model's fused kernels into a JSON database, which
``build(..., tuning_db=)`` reads back (``hgrt.relay_passes.inner.tuning_db``).

>>> tune("model.onnx", "tuning/", trials_per_task=16, devices=["cpu:0", "cpu:1"],
...      placement=hgrt.Placement(rules={"nn.conv2d": "cpu:1"}),
...      kernels="tvm")  # doctest: +SKIP
task 1/18 fused_conv2d_add_relu (weight 1): 16 trials (16 in db), best 0.412 ms
>>> res = hgrt.build("model.onnx", ["cpu:0", "cpu:1"], placement, kernels="tvm",
...                  tuning_db="tuning/")  # doctest: +SKIP
>>> print(res.tuning.summary())  # doctest: +SKIP
tuned 18 of 38 kernels from tuning/; 20 fall back to the default schedule (...)

A task is one distinct fused PrimFunc (structural hash) for one target: a function placed on two
devices of two targets is tuned once per target. Tuning is resumable: a task that already has
``trials_per_task`` measured records in the database is skipped, one with fewer gets only the
missing trials, and every record is appended to the same JSON files (MetaSchedule writes a
task's records when its round finishes).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from hgrt import providers
from hgrt.api import create
from hgrt.compiler import build, lower_model
from hgrt.devices import kind_of
from hgrt.errors import BuildError
from hgrt.relay_passes.inner import tuning_db
from hgrt.relay_passes.inner.cpu_schedule import default_schedule_trace
from hgrt.relay_passes.util.relax_util import CALL_DPS_PACKED, bindings, callee, op_name, prim_funcs

__all__ = ["TuneSummary", "fuse_for_tuning", "provider_calls", "tune", "tuning_tasks",
           "verify_in_model", "verify_whole_runs"]

# registered in each builder worker by _builder_initializer: tvm.build without the
# `import tvm.s_tir.tensor_intrin` of MetaSchedule's default_build (~46 s per worker here)
BUILD_FUNC = "hgrt.tune.build_without_tensor_intrin"


def _builder_initializer() -> None:
    def build(mod, target, _params):
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        return tvm_build(mod, target=target)

    tvm_ffi.register_global_func(BUILD_FUNC, build, override=True)


def fuse_for_tuning(model: Any, devices: Any = "cpu", placement: Any = None,
                    params: dict[str, Any] | None = None, *,
                    input_shapes: dict[str, Any] | None = None,
                    kernels: Any = "auto") -> tvm.IRModule:
    """A model (ONNX path / ModelProto, Relax IRModule) → the placed, fused module ``build``
    schedules (``hgrt.compiler.lower_model``): same passes, same devices, placement and kernel
    provider (``kernels``, as ``build``'s: the ops a provider computes are no TVM kernels, so
    there is nothing of them to tune), so the functions, their structural hashes and targets are the
    ones ``build`` looks up. A module that is already fused is returned as it is."""
    if isinstance(model, tvm.IRModule) and prim_funcs(model):
        return model
    return lower_model(model, devices, placement, params, input_shapes=input_shapes,
                       kernels=kernels)[0]


def provider_calls(mod: tvm.IRModule) -> int:
    """How many calls of ``mod``'s ``main`` go to a kernel provider's kernels (no TVM kernel to
    tune)."""
    return sum(1 for b in bindings(mod["main"]) if op_name(b.value) == CALL_DPS_PACKED
               and callee(b.value)[1].get("provider") in providers.names())


def tuning_tasks(mod: tvm.IRModule, target: tvm.target.Target | str) -> list:
    """MetaSchedule tasks (``ExtractedTask``) of the fused ``mod`` for the kernels on ``target``.

    ``ms.relax_integration.extract_tasks`` dedups by structural hash and weights each task by
    its number of call sites; functions placed on another target are left out.
    """
    target = tvm.target.Target(target)
    mine = tuning_db.functions_for(mod, target)
    stripped = mod.clone()
    for name, f in prim_funcs(mod).items():
        stripped.update_func(stripped.get_global_var(name), tuning_db.as_recorded(f))
    bare = [tuning_db.bare_func(f) for f in mine.values()]
    return [t for t in ms.relax_integration.extract_tasks(stripped, target)
            if t.task_name in mine or any(tvm_ffi.structural_equal(
                tuning_db.bare_func(t.dispatched[0]["main"]), f) for f in bare)]


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


def _best(records: list) -> float | None:
    return min((sum(float(x) for x in r.run_secs) / len(r.run_secs) for r in records
                if r.run_secs), default=None)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


class _Tuner:
    """One ``tune`` run: the database and its progress file, MetaSchedule's builder and runner,
    and the search settings; ``target`` tunes the tasks of one target."""

    def __init__(self, db_dir: str, trials_per_task: int, trials_per_round: int,
                 population_size: int, timeout_sec: float, workers: int, seed: int,
                 cost_model: str, log: Callable[[str], None]) -> None:
        self.db_dir, self.db = db_dir, tuning_db.open_database(db_dir)
        self.progress = tuning_db.TuningProgress(db_dir)
        self.trials, self.per_round = trials_per_task, trials_per_round
        self.population, self.workers, self.seed = population_size, workers, seed
        self.cost_model, self.log = cost_model, log
        self.builder = ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=_builder_initializer,
                                               timeout_sec=timeout_sec, max_workers=workers)
        self.runner = ms.runner.LocalRunner(timeout_sec=timeout_sec)

    def records(self, task_mod: tvm.IRModule, target: tvm.target.Target) -> list:
        if not self.db.has_workload(task_mod):
            return []
        key = tuning_db.target_key(target)
        recs = self.db.get_top_k(self.db.commit_workload(task_mod), 1 << 30)
        return [r for r in recs if tuning_db.target_key(r.target) == key]

    def target(self, mod: tvm.IRModule, target: tvm.target.Target) -> TuneSummary:
        start = time.perf_counter()
        tasks = tuning_tasks(mod, target)
        summary = TuneSummary(db_dir=self.db_dir, target=str(target), tasks=len(tasks))
        self.log(f"tuning {len(tasks)} tasks for {target} into {self.db_dir} "
                 f"({self.trials} trials per task)")
        for i, task in enumerate(tasks, 1):
            self.task(task, f"task {i}/{len(tasks)} {task.task_name} (weight {task.weight})",
                      self.seed + i, target, summary)
        summary.seconds = time.perf_counter() - start
        self.log(f"tuned {len(summary.trials)} tasks, {len(summary.skipped)} already done, "
                 f"{summary.seconds:.0f} s")
        return summary

    def task(self, task: Any, head: str, seed: int, target: tvm.target.Target,
             summary: TuneSummary) -> None:
        task_mod = task.dispatched[0]
        # the default schedule is measured and recorded first, so the database's best is
        # never a candidate slower than what an untuned build would run
        has_default = self.time_default(task_mod, target)
        done = self.records(task_mod, target)
        # a task whose search space holds fewer schedules than asked for (a reshape has
        # one) was finished by the run that asked: progress remembers what each run asked
        asked = self.progress.asked(task_mod, target)
        todo = 0 if asked >= self.trials else self.trials - (len(done) - int(has_default))
        if todo > 0:
            try:
                self.search(task_mod, task.task_name, target, todo, seed + len(done))
            except Exception as e:  # one task failing must not lose the rest
                self.log(f"{head}: tuning failed ({_first_line(e)})")
                return
        recs = self.records(task_mod, target) if todo > 0 else done
        best = _best(recs)
        if best is not None:
            summary.best[task.task_name] = best
        if todo <= 0:
            summary.skipped.append(task.task_name)
            self.log(f"{head}: done before ({len(done)} records), best "
                     f"{best * 1e3:.3f} ms" if best is not None else f"{head}: done before")
            return
        if len(recs) > len(done):  # a round where every candidate failed finishes nothing
            self.progress.record(task_mod, target, self.trials)
        summary.trials[task.task_name] = len(recs) - len(done)
        best_s = f"{best * 1e3:.3f} ms" if best is not None else "no valid trial"
        default = self.progress.asked(task_mod, target, "default_ns") * 1e-9
        vs = f" (default schedule {default * 1e3:.3f} ms)" if default else ""
        self.log(f"{head}: {len(recs) - len(done)} trials ({len(recs)} in db), best {best_s}{vs}")

    def search(self, task_mod: tvm.IRModule, name: str, target: tvm.target.Target, todo: int,
               seed: int) -> None:
        ctx = ms.TuneContext(
            mod=task_mod, target=target, space_generator="post-order-apply",
            search_strategy=ms.search_strategy.EvolutionarySearch(
                population_size=self.population, genetic_num_iters=2),
            task_name=name, rand_state=seed, num_threads=self.workers).clone()
        ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=self.db_dir,
                      max_trials_global=todo, max_trials_per_task=todo,
                      num_trials_per_iter=min(self.per_round, todo), builder=self.builder,
                      runner=self.runner, database=self.db, task_scheduler="round-robin",
                      cost_model=(ms.cost_model.RandomModel() if self.cost_model == "random"
                                  else self.cost_model))

    def time_default(self, task_mod: tvm.IRModule, target: tvm.target.Target) -> bool:
        """Whether the database holds a timed default schedule of the task, timing it now
        when it does not (CPU tasks only)."""
        if self.progress.asked(task_mod, target, "default_ns") > 0:
            return True
        if target.kind.name != "llvm":
            return False
        try:
            secs = self.record_default(task_mod, target)
        except Exception as e:  # one task failing must not lose the rest
            self.log(f"  the default schedule could not be timed ({_first_line(e)})")
            return False
        if secs is not None:
            self.progress.record(task_mod, target, max(1, round(secs * 1e9)), "default_ns")
        return secs is not None

    def record_default(self, task_mod: tvm.IRModule, target: tvm.target.Target) -> float | None:
        """Build and time hgrt's default schedule of the task with MetaSchedule's own builder
        and runner, and commit it as a tuning record; its mean seconds, or None when it cannot
        be scheduled, built or run."""
        func = task_mod["main"]
        trace = default_schedule_trace(func, target)
        if trace is None:
            return None
        sch = tvm.s_tir.Schedule(task_mod)
        trace.apply_to_schedule(sch, remove_postproc=False)
        built = self.builder.build([ms.builder.BuilderInput(sch.mod, target)])[0]
        if built.error_msg:
            self.log(f"  the default schedule does not build: "
                     f"{built.error_msg.splitlines()[0][:160]}")
            return None
        args_info = ms.arg_info.ArgInfo.from_prim_func(func)
        device = kind_of(target).name  # MetaSchedule names devices by kind too
        try:
            res = self.runner.run([ms.runner.RunnerInput(built.artifact_path, device,
                                                         args_info)])[0].result()
        finally:  # the builder exports into a temporary directory of its own, one per call
            shutil.rmtree(os.path.dirname(built.artifact_path), ignore_errors=True)
        if res.error_msg or not res.run_secs:
            return None
        secs = [float(x) for x in res.run_secs]
        self.db.commit_tuning_record(ms.database.TuningRecord(
            trace, self.db.commit_workload(task_mod), secs, target, args_info))
        return sum(secs) / len(secs)


def tune(model: Any, db_dir: str, trials_per_task: int = 16, *, devices: Any = "cpu",
         placement: Any = None, params: dict[str, Any] | None = None,
         input_shapes: dict[str, Any] | None = None, trials_per_round: int = 16,
         population_size: int = 128, builder_timeout_sec: float = 60.0,
         max_workers: int | None = None, seed: int = 0, cost_model: str = "auto",
         kernels: Any = "auto", verify: bool = True,
         log: Callable[[str], None] | None = print) -> list[TuneSummary]:
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
    ``kernels``: the provider the model will be built with (``build``'s ``kernels``; default
    ``"auto"``, as ``build``'s): what a kernel provider computes there is not tuned. Tune with
    the provider you build with: the TVM kernels left in a build with a provider are not all
    those of a TVM-only build (oneDNN's: the ops between its kernels run on NHWC tensors).
    ``verify``: then time each tuned kernel inside the model against the default schedule and
    keep the default where it is faster there (``verify_in_model``).
    """
    log = log or (lambda _m: None)
    if cost_model == "auto":
        cost_model = "xgb" if importlib.util.find_spec("xgboost") else "random"
    mod = fuse_for_tuning(model, devices, placement, params, input_shapes=input_shapes,
                          kernels=kernels)
    claimed = provider_calls(mod)
    if claimed:
        log(f"kernels={kernels}: {claimed} calls go to kernel providers and are not tuned "
            f"(tune with kernels='tvm' to tune every op)")
    targets = tuning_db.module_targets(mod)
    if not targets:
        raise BuildError("nothing to tune: the module's kernels carry no target")
    workers = max_workers or max(1, min(os.cpu_count() or 1, 2))
    tuner = _Tuner(db_dir, trials_per_task, trials_per_round, population_size,
                   builder_timeout_sec, workers, seed, cost_model, log)
    summaries = [tuner.target(mod, target) for target in targets]
    if verify:
        verify_in_model(model, db_dir, devices=devices, placement=placement, params=params,
                        input_shapes=input_shapes, fused=mod, kernels=kernels, log=log)
    return summaries


def verify_in_model(model: Any, db_dir: str, *, devices: Any = "cpu", placement: Any = None,
                    params: dict[str, Any] | None = None,
                    input_shapes: dict[str, Any] | None = None, repeat: int = 20,
                    margin: float = 0.02, fused: tvm.IRModule | None = None,
                    kernels: Any = "auto", log: Callable[[str], None] | None = print
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
    ``fused``: the model's ``fuse_for_tuning`` module when the caller has it already;
    ``kernels``: the provider both builds use (``build``'s).

    Then the kernels kept, together, against the default schedule in whole runs
    (``whole_runs``): a kernel's time profiled alone does not add up to the run's (light
    squeezenet: the 12 kept made the profiled kernels 2.6 % faster and whole runs 3 % slower),
    so unless the tuned build runs ``margin`` faster, every kernel keeps the default
    (``verify_whole_runs``).
    """
    log = log or (lambda _m: None)
    if isinstance(model, tvm.IRModule) and prim_funcs(model):
        log("verify: given an already fused module, not a model: nothing to build and re-time")
        return {}
    mod = fused if fused is not None else fuse_for_tuning(
        model, devices, placement, params, input_shapes=input_shapes, kernels=kernels)
    if any(t.kind.name != "llvm" for t in tuning_db.module_targets(mod)):
        log("verify: not every device is a CPU; tuned kernels are not re-timed in the model")
        return {}
    kwargs = {"params": params, "input_shapes": input_shapes, "kernels": kernels}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = build(model, devices, placement, **kwargs)
        tuned = build(model, devices, placement, tuning_db=db_dir, tuning_verdicts=False, **kwargs)
    times = []
    for res in (default, tuned):
        m = _module(res)
        per_func: dict[str, float] = {}
        for op in m.profile(repeat=repeat).ops:
            per_func[op.func] = per_func.get(op.func, 0.0) + op.median_us
        times.append(per_func)
    out = {n: (times[0][n], times[1][n]) for n in tuned.tuning.tuned
           if n in times[0] and n in times[1]}
    key = {n: tuning_db.kernel_key(f, f.attrs["target"]) for n, f in prim_funcs(mod).items()}
    losers = {key[n] for n, (d, t) in out.items() if t > d * (1 + margin)}
    tuning_db.TuningProgress(db_dir).set_default_wins(losers, scope=set(key.values()))
    total_d = sum(d for d, _ in out.values())
    total_t = sum(min(d, t) for d, t in out.values())
    log(f"verify in the model: {len(losers)} of {len(out)} tuned kernels ran slower than the "
        f"default schedule and keep it; tuned kernels {total_d / 1e3:.2f} ms -> "
        f"{total_t / 1e3:.2f} ms per run")
    if set(key[n] for n in out) - losers:
        verify_whole_runs(model, db_dir, devices=devices, placement=placement, margin=margin,
                          repeat=repeat, default=default, fused=mod, log=log, **kwargs)
    return out


def verify_whole_runs(model: Any, db_dir: str, *, devices: Any = "cpu", placement: Any = None,
                      margin: float = 0.02, repeat: int = 20, default: Any = None,
                      fused: tvm.IRModule | None = None,
                      log: Callable[[str], None] | None = print, **build_kwargs: Any) -> bool:
    """Time whole runs of the model built with the tuned kernels the database keeps (its
    verdicts applied) against the default schedule's build; unless the tuned build is
    ``margin`` faster, record that every kernel keeps the default. True when the tuned ones
    stay. It starts from the verdicts recorded (``verify_in_model`` sets them just before);
    after a loss recorded here, no tuned kernel is left to time until they are set again. A
    kernel that several models sharing a database have in common keeps the verdict of the
    model verified last. ``default``, ``fused``: the default build and ``fuse_for_tuning``'s
    module when the caller has them."""
    log = log or (lambda _m: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = default or build(model, devices, placement, **build_kwargs)
        chosen = build(model, devices, placement, tuning_db=db_dir, **build_kwargs)
    if not chosen.tuning.tuned:
        return False
    t_default, t_chosen = whole_runs(_module(default), _module(chosen), repeat)
    if t_chosen <= t_default * (1 - margin):
        log(f"verify whole runs: {t_default * 1e3:.2f} ms -> {t_chosen * 1e3:.2f} ms")
        return True
    funcs = prim_funcs(fused if fused is not None else fuse_for_tuning(
        model, devices, placement, build_kwargs.get("params"),
        input_shapes=build_kwargs.get("input_shapes"), kernels=build_kwargs.get("kernels", "auto")))
    keys = {tuning_db.kernel_key(f, f.attrs["target"]) for f in funcs.values()}
    kept = {tuning_db.kernel_key(funcs[n], funcs[n].attrs["target"])
            for n in chosen.tuning.tuned if n in funcs}
    progress = tuning_db.TuningProgress(db_dir)
    progress.set_default_wins(progress.default_wins() & keys | kept, scope=keys)
    log(f"verify whole runs: the {len(kept)} tuned kernels kept, together, run the model in "
        f"{t_chosen * 1e3:.2f} ms against the default schedule's {t_default * 1e3:.2f} ms (not "
        f"{margin:.0%} faster): every kernel keeps the default schedule")
    return False


def _module(res: Any) -> Any:
    """A GraphModule of a build on the local CPUs, params loaded, inputs seeded random."""
    m = create(res.graph, res.lib, [tvm.cpu(i) for i in range(len(res.devices))])
    m.load_params(res.params)
    rng = np.random.default_rng(0)
    shapes, dtypes = m.get_input_info()
    for name, shape in shapes.items():
        m.set_input(name, rng.standard_normal(shape).astype(dtypes[name])
                    if dtypes[name].startswith("float") else np.zeros(shape, dtypes[name]))
    return m


def whole_runs(a: Any, b: Any, repeat: int, rounds: int = 5) -> tuple[float, float]:
    """Median seconds of ``a.run()`` and ``b.run()``, in blocks of ``repeat`` runs taking
    turns ``rounds`` times (so the machine's slow moments fall on both alike)."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for m, times in zip((a, b), samples, strict=True):
            m.run()  # warm-up: the other's kernels had the caches
            for _ in range(repeat):
                start = time.perf_counter()
                m.run()
                times.append(time.perf_counter() - start)
    return float(np.median(samples[0])), float(np.median(samples[1]))
