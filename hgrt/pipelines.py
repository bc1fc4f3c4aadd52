"""Pipelines: a model's stages (``hgrt.split``) on devices or boards, inputs streamed through.

While stage k works on input i, stage k+1 works on input i - 1: one thread of hgrt's per stage
hands each input's tensors from stage to stage through bounded queues (``depth`` inputs wait
before a stage at most, so ``submit`` blocks when the first stage is that far behind:
backpressure), and every stage is an ordinary module (``GraphModule`` here, or one of an RPC
session, a board) called through its thread-safe call API. Tensors between stages go through
this process as numpy arrays: between two boards, board to client to board.

    p = hgrt.pipeline(split_result)                  # or hgrt.load_pipeline("out/", ...)
    fut = p.submit({"data_0": x}); y = fut.result()  # a concurrent.futures.Future
    ys = list(p.map(frames))                          # outputs in input order
    y = p({"data_0": x})                              # one input, blocking
    p.close()                                         # or `with hgrt.pipeline(...) as p:`

A stage that fails (a board lost) fails the inputs in flight behind it with an error that names
the stage and its board; the pipeline is then closed to new inputs, and nothing waits forever.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from hgrt.errors import ClosedError, ExecutionError, HgrtError, InputError, RemoteError

DEPTH = 2  # inputs that may wait before each stage
FORMAT = 1
_STOP = object()


def save_split(directory: str, res: Any) -> None:
    """``res`` (a ``SplitResult``) as one artifact directory: ``stage<k>/`` per stage (as
    ``hgrt.save`` writes it) and ``pipeline.json`` (the stages' devices, budgets, keys, inputs
    and outputs)."""
    from hgrt.artifacts import save

    os.makedirs(directory, exist_ok=True)
    stages = []
    for k, (spec, plan, built) in enumerate(zip(res.stages, res.plans, res.builds,
                                                strict=True)):
        save(os.path.join(directory, f"stage{k}"), built)
        stages.append({"dir": f"stage{k}", "devices": list(spec.devices), "budget": spec.budget,
                       "key": spec.key, "inputs": [t.name for t in plan.inputs],
                       "outputs": [t.name for t in plan.outputs],
                       "estimated_ms": 1e3 * plan.estimated_s,
                       "weight_bytes": plan.weight_bytes})
    doc = {"hgrt_pipeline": FORMAT, "stages": stages,
           "inputs": [_tensor_doc(t) for t in res.inputs],
           "outputs": [_tensor_doc(t) for t in res.outputs]}
    with open(os.path.join(directory, "pipeline.json"), "w") as f:
        json.dump(doc, f, indent=1)


def _tensor_doc(t: Any) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


def is_pipeline(directory: str) -> bool:
    return os.path.isfile(os.path.join(os.fspath(directory), "pipeline.json"))


def _read_doc(directory: str) -> dict:
    from hgrt.artifacts import ArtifactError

    path = os.path.join(directory, "pipeline.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        stages = doc["stages"]
        if doc.get("hgrt_pipeline") != FORMAT or not isinstance(stages, list) or not stages:
            raise ValueError(f"format {doc.get('hgrt_pipeline')!r}, {len(stages)} stages")
        for s in stages:
            for key in ("dir", "devices", "inputs", "outputs"):
                s[key]  # noqa: B018 - each must exist
        for t in doc["inputs"] + doc["outputs"]:
            t["name"], tuple(t["shape"]), np.dtype(t["dtype"])  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: not a pipeline description ({e})") from e
    return doc


def load_pipeline(directory: str, sessions: list | None = None, devices: list | None = None,
                  depth: int = DEPTH) -> Pipeline:
    """The pipeline saved in ``directory``: stage k on ``sessions[k]`` (an RPC session, e.g.
    ``hgrt.rpc.connect(tracker=..., key=...)``; None: this machine) and ``devices[k]`` (default:
    the devices the stage was built for)."""
    from hgrt.api import load

    directory = os.fspath(directory)
    doc = _read_doc(directory)
    n = len(doc["stages"])
    sessions = list(sessions) if sessions is not None else [None] * n
    devices = list(devices) if devices is not None else [None] * n
    if len(sessions) != n or len(devices) != n:
        raise InputError(f"the pipeline in {directory!r} has {n} stages: give {n} sessions and "
                         f"device lists (got {len(sessions)} and {len(devices)})")
    modules = []
    try:
        for s, session, devs in zip(doc["stages"], sessions, devices, strict=True):
            modules.append(load(os.path.join(directory, s["dir"]), devs or s["devices"],
                                session=session))
    except BaseException:
        for m in modules:
            _close_quietly(m)
        raise
    boards = [_board_name(sess, s) for sess, s in zip(sessions, doc["stages"], strict=True)]
    return Pipeline(modules, doc, boards, depth)


def pipeline(res: Any, sessions: list | None = None, depth: int = DEPTH) -> Pipeline:
    """A pipeline of ``res`` (``hgrt.split``'s result) on this machine (``sessions``: an RPC
    session per stage, or None for this machine, as ``load_pipeline``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hgrt_pipeline_") as tmp:
        save_split(tmp, res)
        return load_pipeline(tmp, sessions, depth=depth)


def _board_name(session: Any, stage: dict) -> str:
    if session is None:
        return f"this machine ({', '.join(stage['devices'])})"
    from hgrt.rpc.session import describe

    return describe(session)


def _close_quietly(m: Any) -> None:
    try:
        m.close()
    except HgrtError:
        pass


class _Item:
    __slots__ = ("future", "values")

    def __init__(self, future: Future, values: dict[str, np.ndarray]) -> None:
        self.future, self.values = future, values


class Pipeline:
    """Stages run at once on a stream of inputs; see the module doc."""

    def __init__(self, modules: list, doc: dict, boards: list[str], depth: int = DEPTH) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InputError(f"pipeline depth must be a positive integer, got {depth!r}")
        self.modules, self.boards, self.depth = modules, boards, depth
        self.stages = doc["stages"]
        self.inputs = {t["name"]: (tuple(t["shape"]), np.dtype(t["dtype"]))
                       for t in doc["inputs"]}
        self.output_names = [t["name"] for t in doc["outputs"]]
        # after stage k, the values no later stage (nor the result) reads are dropped
        later: set[str] = set(self.output_names)
        self._keep: list[set[str]] = []
        for s in reversed(self.stages):
            self._keep.insert(0, set(later))
            later |= set(s["inputs"])
        for m in modules:
            m.configure_calls(callers=1)
        self._queues = [queue.Queue(maxsize=depth) for _ in modules]
        self._lock = threading.Lock()
        self._broken: HgrtError | None = None
        self._closed = False
        self._threads = [threading.Thread(target=self._stage_loop, args=(k,), daemon=True,
                                          name=f"hgrt-pipeline-stage{k}")
                         for k in range(len(modules))]
        for t in self._threads:
            t.start()

    # ---- feeding -------------------------------------------------------------------------
    def _checked(self, inputs: Any) -> dict[str, np.ndarray]:
        if not isinstance(inputs, dict):
            raise InputError(f"a pipeline input is a dict of arrays by input name "
                             f"({list(self.inputs)}), got {type(inputs).__name__}")
        unknown = sorted(set(inputs) - set(self.inputs))
        if unknown:
            raise InputError(f"unknown pipeline inputs {unknown}; inputs: {list(self.inputs)}")
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise InputError(f"pipeline inputs {missing} not given; inputs: {list(self.inputs)}")
        out = {}
        for name, value in inputs.items():
            shape, dtype = self.inputs[name]
            arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
            if arr.shape != shape or arr.dtype != dtype:
                raise InputError(f"pipeline input {name!r}: expected {dtype}{list(shape)}, got "
                                 f"{arr.dtype}{list(arr.shape)}")
            out[name] = arr
        return out

    def submit(self, inputs: dict) -> Future:
        """Start ``inputs`` (a dict by input name) through the stages; a Future of the outputs
        (a list of numpy arrays, in the model's order). Blocks while ``depth`` inputs already
        wait before the first stage. A bad input is refused here, before stage 0."""
        values = self._checked(inputs)
        with self._lock:
            self._check_open()
            fut: Future = Future()
            fut.set_running_or_notify_cancel()
        self._queues[0].put(_Item(fut, values))
        return fut

    def __call__(self, inputs: dict) -> list[np.ndarray]:
        return self.submit(inputs).result()

    def map(self, inputs, window: int | None = None):
        """The outputs of each of ``inputs`` (an iterable of dicts), in order; at most
        ``window`` (default: stages x (depth + 1)) in flight."""
        window = window or len(self.modules) * (self.depth + 1)
        pending: list[Future] = []
        for x in inputs:
            pending.append(self.submit(x))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()

    def _check_open(self) -> None:
        if self._broken is not None:
            raise ClosedError(f"the pipeline stopped: {self._broken}")
        if self._closed:
            raise ClosedError("the pipeline is closed")

    # ---- the stages ------------------------------------------------------------------------
    def _stage_loop(self, k: int) -> None:
        q, last = self._queues[k], k == len(self.modules) - 1
        while True:
            item = q.get()
            if item is _STOP:
                if not last:
                    self._queues[k + 1].put(_STOP)
                return
            if self._broken is not None:
                item.future.set_exception(self._broken)
                continue
            try:
                outs = self.modules[k]({n: item.values[n] for n in self.stages[k]["inputs"]})
            except BaseException as e:  # noqa: B036 - the stage is gone: stop, say which
                err = self._stage_error(k, e)
                with self._lock:
                    self._broken = self._broken or err
                item.future.set_exception(err)
                self._drain(k)
                continue
            values = {n: v for n, v in item.values.items() if n in self._keep[k]}
            values.update((n, v) for n, v in zip(self.stages[k]["outputs"], outs, strict=True)
                          if n in self._keep[k])
            item.values = values
            if last:
                item.future.set_result([values[n] for n in self.output_names])
            else:
                self._queues[k + 1].put(item)

    def _drain(self, k: int) -> None:
        """Fail what waits before the stages up to ``k`` (they cannot pass the broken one)."""
        for j in range(k + 1):
            while True:
                try:
                    item = self._queues[j].get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queues[j].put(_STOP)  # (close() waits for it to pass)
                    break
                item.future.set_exception(self._broken)

    def _stage_error(self, k: int, e: BaseException) -> HgrtError:
        where = f"pipeline stage {k} on {self.boards[k]}"
        if isinstance(e, RemoteError | ClosedError) or self.stages[k].get("key") \
                or "rpc" in type(self.modules[k]).__name__.lower():
            err: HgrtError = RemoteError(f"{where}: {e}")
        else:
            err = ExecutionError(f"{where}: {e}")
        err.__cause__ = e
        return err

    # ---- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the stages (inputs in flight finish first, or fail where a stage broke) and
        close every stage's module."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queues[0].put(_STOP)
        for t in self._threads:
            t.join(timeout=30)
        for m in self.modules:
            _close_quietly(m)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"<hgrt.Pipeline {len(self.modules)} stages on {self.boards} ({state})>"
