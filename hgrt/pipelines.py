"""Pipelines: a model's stages (``hgrt.split``) on devices or boards, inputs streamed through.

While stage k works on input i, stage k+1 works on input i - 1: one thread of hgrt's per stage
hands each input's tensors from stage to stage through bounded queues (``depth`` inputs wait
before a stage at most, so ``submit`` blocks when the first stage is that far behind:
backpressure), and every stage is an ordinary module (``GraphModule`` here, or one of an RPC
session, a board) called through its thread-safe call API.

Tensors between stages: when every stage is on a board (``transfer="direct"``, the default
there), the client sends the model's inputs to the inbox of the first stage that reads them and
each board sends what later stages read straight to the next board's inbox, a plain TCP socket
beside the RPC session (``hgrt.rpc.channel``); only the last stage's outputs come back through
RPC. TVM RPC moves bytes at about 50 MiB/s here, a socket at over 1 GiB/s. Otherwise
(``transfer="client"``, or a stage on this machine) they go through this process as numpy arrays.

    p = hgrt.pipeline(split_result)                  # or hgrt.load_pipeline("out/", ...)
    fut = p.submit({"data_0": x}); y = fut.result()  # a concurrent.futures.Future
    ys = list(p.map(frames))                          # outputs in input order
    y = p({"data_0": x})                              # one input, blocking
    p.close()                                         # or `with hgrt.pipeline(...) as p:`

A stage that fails (a board lost) fails the inputs in flight behind it with an error that names
the stage and its board; the pipeline is then closed to new inputs, and nothing waits forever.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np

from hgrt.errors import ClosedError, ExecutionError, HgrtError, InputError, RemoteError
from hgrt.rpc import channel, wire
from hgrt.rpc.client import RemoteGraphModule
from hgrt.rpc.session import describe, session_index

logger = logging.getLogger("hgrt.pipeline")
DEPTH = 2  # inputs that may wait before each stage
TRANSFERS = ("auto", "direct", "client")
SERVED_KEPT = 256  # the latest stage times kept for stage_ms()
CLOSE_TIMEOUT = 30.0  # seconds close() lets the inputs in flight finish before it stops them
ABORT_GRACE = 5.0  # seconds a stage has to stop once its stream is aborted
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


def read_doc(directory: str) -> dict:
    """The checked ``pipeline.json`` of ``directory`` (``ArtifactError`` when it is not one)."""
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
                  depth: int = DEPTH, transfer: str = "auto") -> Pipeline:
    """The pipeline saved in ``directory``: stage k on ``sessions[k]`` (an RPC session, e.g.
    ``hgrt.rpc.connect(tracker=..., key=...)``; None: this machine) and ``devices[k]`` (default:
    the devices the stage was built for). ``transfer``: "direct" (board to board), "client"
    (through this process) or "auto": direct when every stage is on a board and their inboxes
    can be reached, else through this process (with a warning that says why)."""
    from hgrt.api import load

    directory = os.fspath(directory)
    if transfer not in TRANSFERS:
        raise InputError(f"transfer={transfer!r}: one of {TRANSFERS}")
    doc = read_doc(directory)
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
    direct = transfer == "direct" or (transfer == "auto" and all(s is not None
                                                                  for s in sessions))
    try:
        if direct and transfer == "auto":
            try:
                return Pipeline(modules, doc, boards, depth, direct=True)
            except Exception as e:  # noqa: BLE001 - boards that cannot reach each other (NAT,
                #                     a tunnel), an older server, one session for two stages
                logger.warning("pipeline: board-to-board transfer is not possible (%s); the "
                               "tensors between stages go through this process", e)
                direct = False
        return Pipeline(modules, doc, boards, depth, direct=direct)
    except BaseException:
        for m in modules:
            _close_quietly(m)
        raise


def pipeline(res: Any, sessions: list | None = None, depth: int = DEPTH,
             transfer: str = "auto") -> Pipeline:
    """A pipeline of ``res`` (``hgrt.split``'s result) on this machine (``sessions``: an RPC
    session per stage, or None for this machine, as ``load_pipeline``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hgrt_pipeline_") as tmp:
        save_split(tmp, res)
        return load_pipeline(tmp, sessions, depth=depth, transfer=transfer)


def _board_name(session: Any, stage: dict) -> str:
    if session is None:
        return f"this machine ({', '.join(stage['devices'])})"
    return describe(session)


def _close_quietly(m: Any) -> None:
    try:
        m.close()
    except HgrtError:
        pass


def _stage_thread(pipeline: weakref.ref, q: queue.Queue, k: int) -> None:
    """Stage ``k``'s thread: it holds its pipeline only while it works on an input, so that an
    unclosed pipeline that nobody holds is collected (its finalizer stops the threads)."""
    while True:
        item = q.get()
        p = pipeline()
        if p is None or not p._stage_step(k, item):
            return
        del p, item


def _stop_queues(queues: list[queue.Queue]) -> None:
    """A pipeline was collected unclosed: its stage threads, idle, stop."""
    for q in queues:
        try:
            q.put_nowait(_STOP)
        except queue.Full:
            pass


def _settle(fut: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Answer ``fut`` unless another stage already did (board to board, an input is in two
    stages' hands at once: the one that fails first answers)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class _Item:
    __slots__ = ("future", "values", "seq")

    def __init__(self, future: Future, values: dict[str, np.ndarray], seq: int) -> None:
        self.future, self.values, self.seq = future, values, seq


def _tensor_types(modules: list, stages: list[dict],
                  inputs: dict[str, tuple]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``(dtype, shape)`` of every tensor that passes between stages, by name: the model's
    inputs, and each stage's inputs and outputs as its module's graph has them."""
    types = {n: (np.dtype(d).name, tuple(shape)) for n, (shape, d) in inputs.items()}
    for m, s in zip(modules, stages, strict=True):
        g = m.graph
        shapes, dtypes = m.get_input_info()
        types.update((n, (str(dtypes[n]), tuple(shapes[n]))) for n in s["inputs"] if n in shapes)
        for n, (nid, idx, _) in zip(s["outputs"], g.heads, strict=True):
            e = g.entry_id(nid, idx)
            types[n] = (str(g.dtypes[e]), tuple(int(d) for d in g.shapes[e]))
    return types


class _Links:
    """Board-to-board transfer: each stage's inbox, each board's link to the next one, the
    client's link to every inbox, and what each stage takes, sends and returns."""

    def __init__(self, modules: list, stages: list[dict], inputs: dict[str, tuple],
                 outputs: list[str], keep: list[set[str]], window: int) -> None:
        for k, m in enumerate(modules):
            if not isinstance(m, RemoteGraphModule):
                raise InputError(f"transfer='direct': stage {k} is not on a board (an RPC "
                                 f"session); use transfer='client'")
        owner: dict[int, int] = {}
        for k, m in enumerate(modules):
            index = session_index(m.devices[0])
            j = owner.setdefault(index, k)
            if j != k:
                raise InputError(f"transfer='direct': stages {j} and {k} are on one RPC session "
                                 f"({describe(index)}); a board runs one stage of a pipeline: "
                                 f"give each stage a session of its own, or use "
                                 f"transfer='client'")
        self.modules, self.boxes, self.client = modules, [], []
        self.stream = secrets.token_hex(8)  # this pipeline's inputs in the boards' inboxes
        try:
            inboxes = [m.inbox() for m in modules]
            for k in range(len(modules) - 1):
                self.boxes.append(modules[k].link(inboxes[k + 1]))
            # each must answer as the inbox: over an SSH tunnel, the address a board gives is
            # its own loopback, which here is this machine's (another service, or nothing)
            self.client = [channel.Outbox(*where, verify=True) for where in inboxes]
            self.inboxes = [str(where) for where in inboxes]
        except BaseException:
            self.close()
            raise
        first = {n: next(k for k, s in enumerate(stages) if n in s["inputs"]) for n in inputs
                 if any(n in s["inputs"] for s in stages)}
        self.sends = [[n for n in inputs if first.get(n) == k] for k in range(len(stages))]
        self.specs, arriving = [], []
        for k, (m, s) in enumerate(zip(modules, stages, strict=True)):
            take = list(dict.fromkeys(self.sends[k] + arriving))
            have = take + [n for n in s["outputs"] if n not in take]
            last = k == len(stages) - 1
            send = [] if last else [n for n in have if n in keep[k]]
            self.specs.append(wire.stage_spec(
                take, s["outputs"], self.stream, {n: m.get_input_index(n) for n in s["inputs"]},
                send, wire.NO_LINK if last else self.boxes[k], outputs if last else []))
            arriving = send
        types = _tensor_types(modules, stages, inputs)
        try:  # before any tensor is sent: each inbox admits only what its stage takes
            for m, spec in zip(modules, self.specs, strict=True):
                m.announce(wire.announcement(spec, {n: types[n] for n in spec["take"]}, window,
                                             0))
        except BaseException:
            self.close()
            raise

    def feed(self, item: _Item) -> None:
        """Send the model's inputs of ``item`` to the stages that first read them, ahead of
        their turn (a board's inbox holds them until its stage takes them)."""
        client = self.client
        if not client:
            raise ClosedError("the pipeline was closed")
        for k, names in enumerate(self.sends):
            for n in names:
                client[k].send(item.seq, n, item.values[n], self.stream)

    def run(self, k: int, item: _Item) -> tuple[float, bytes]:
        return self.modules[k].run_stage(item.seq, self.specs[k])

    def abort(self, why: str) -> None:
        """Wake every stage that waits for tensors: it fails with ``why``."""
        for box in self.client:
            try:
                box.abort(why, self.stream)
            except HgrtError:
                pass

    def close(self) -> None:
        for box in self.client:
            box.close()
        for m, key in zip(self.modules, self.boxes, strict=False):
            m.unlink(key)
        self.client, self.boxes, self.modules = [], [], []


class Pipeline:
    """Stages run at once on a stream of inputs; see the module doc."""

    def __init__(self, modules: list, doc: dict, boards: list[str], depth: int = DEPTH,
                 direct: bool = False) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InputError(f"pipeline depth must be a positive integer, got {depth!r}")
        self.modules, self.boards, self.depth = modules, boards, depth
        self.stages = doc["stages"]
        self.inputs = {t["name"]: (tuple(t["shape"]), np.dtype(t["dtype"]))
                       for t in doc["inputs"]}
        self.output_names = [t["name"] for t in doc["outputs"]]
        self._out_types = [(tuple(t["shape"]), np.dtype(t["dtype"])) for t in doc["outputs"]]
        self._seq = itertools.count()  # this pipeline's inputs, from 0 (its stream's first)
        # after stage k, the values no later stage (nor the result) reads are dropped
        later: set[str] = set(self.output_names)
        self._keep: list[set[str]] = []
        for s in reversed(self.stages):
            self._keep.insert(0, set(later))
            later |= set(s["inputs"])
        for m in modules:
            m.configure_calls(callers=1)
        # inputs a stage's inbox may hold past its last: what is queued before it and before
        # every earlier stage, twice over
        self.links = _Links(modules, self.stages, self.inputs, self.output_names, self._keep,
                            min(channel.WINDOW, 2 * len(modules) * (depth + 1))) \
            if direct else None
        self.transfer = "direct" if direct else "client"
        self._queues = [queue.Queue(maxsize=depth) for _ in modules]
        self._served = [collections.deque(maxlen=SERVED_KEPT) for _ in modules]
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # stage 0 took an input: room to submit
        self._stop_sent = False
        self._busy: list[_Item | None] = [None] * len(modules)  # the input each stage is on
        self._broken: HgrtError | None = None
        self._closed = False
        # the threads hold the pipeline only while they work on an input: one dropped
        # unclosed is collected, and its finalizer ends them
        me = weakref.ref(self)
        self._threads = [threading.Thread(target=_stage_thread, args=(me, q, k), daemon=True,
                                          name=f"hgrt-pipeline-stage{k}")
                         for k, q in enumerate(self._queues)]
        self._finalizer = weakref.finalize(self, _stop_queues, self._queues)
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
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._space:  # open and queued under one lock: close() cannot come in between
            item = _Item(fut, values, next(self._seq))
            while True:
                self._check_open()
                try:
                    self._queues[0].put_nowait(item)
                    break
                except queue.Full:
                    self._space.wait(0.1)
        if self.links is not None:  # while earlier inputs run: the boards' inboxes hold them
            try:
                self.links.feed(item)
            except HgrtError as e:  # a board's inbox is gone: every stage stops, saying why
                with self._lock:
                    if self._broken is None:
                        self._broken = RemoteError(f"pipeline input {item.seq}: sending it to "
                                                   f"the stages' boards failed: {e}")
                        self._broken.__cause__ = e
                self.links.abort(str(self._broken))
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
    def _stage_step(self, k: int, item: Any) -> bool:
        """Stage ``k``'s work on ``item``, just taken from its queue; False at the stop."""
        last = k == len(self._queues) - 1
        if k == 0:
            with self._space:
                self._space.notify_all()
        if item is _STOP:
            if not last:
                self._queues[k + 1].put(_STOP)
            return False
        if self._broken is not None:
            _settle(item.future, error=self._broken)
            return True
        self._run_item(k, item, last)
        return True

    def _run_item(self, k: int, item: _Item, last: bool) -> None:
        """One input through stage ``k``; a failure breaks the pipeline, naming the stage."""
        self._busy[k] = item
        try:
            if self.links is not None:
                if not last:  # the next board waits for its tensors while this one works
                    self._queues[k + 1].put(item)
                served, data = self.links.run(k, item)
                self._served[k].append(served)
                if last:
                    _settle(item.future, result=self._unpack(data))
                return
            t0 = time.perf_counter()
            outs = self.modules[k]({n: item.values[n] for n in self.stages[k]["inputs"]})
            self._served[k].append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: B036 - the stage is gone: stop, say which
            with self._lock:
                first = self._broken is None
                err = self._stage_error(k, e) if first else self._broken
                self._broken = err
            _settle(item.future, error=err)
            if first and self.links is not None:
                self.links.abort(str(err))
            self._drain(k)
            return
        values = {n: v for n, v in item.values.items() if n in self._keep[k]}
        values.update((n, v) for n, v in zip(self.stages[k]["outputs"], outs, strict=True)
                      if n in self._keep[k])
        item.values = values
        if last:
            _settle(item.future, result=[values[n] for n in self.output_names])
        else:
            self._queues[k + 1].put(item)

    def stage_ms(self) -> list[float | None]:
        """Per stage, the median milliseconds of its latest inputs (None: none yet): with
        board-to-board transfer, the board's own time from its tensors' arrival to its last
        send; through the client, the stage's call (its tensors in and out included)."""
        return [1e3 * float(np.median(list(d))) if d else None for d in self._served]

    def _unpack(self, data: bytes) -> list[np.ndarray]:
        return [a.copy() for a in wire.arrays_from_bytes(data, self._out_types,
                                                         "the last stage")]

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
                _settle(item.future, error=self._broken)

    def _stage_error(self, k: int, e: BaseException) -> HgrtError:
        why = str(e).removeprefix(f"{self.boards[k]}: ")  # the board is named once
        if self.links is not None and k + 1 < len(self.modules) \
                and f"to the inbox at {self.links.inboxes[k + 1]} failed" in why:
            # the next board stopped taking its tensors: it is the one lost
            k, why = k + 1, f"stage {k} could not send it its tensors: {why}"
        where = f"pipeline stage {k} on {self.boards[k]}"
        if isinstance(e, RemoteError | ClosedError) or self.stages[k].get("key") \
                or isinstance(self.modules[k], RemoteGraphModule):
            err: HgrtError = RemoteError(f"{where}: {why}")
        else:
            err = ExecutionError(f"{where}: {why}")
        err.__cause__ = e
        return err

    # ---- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the stages and close every stage's module. The inputs in flight finish first
        (or fail where a stage broke) within ``CLOSE_TIMEOUT`` seconds; after that they fail
        with a ``ClosedError`` and the boards' stages that wait for tensors are stopped. The
        pipeline then lets go of its modules (the RPC sessions stay the caller's). A stage
        still busy after all that keeps its module open, and close() says so with an
        ``ExecutionError`` naming it."""
        with self._space:
            if self._closed:
                return
            self._closed = True
            self._space.notify_all()
        stuck = self._stop(time.monotonic() + CLOSE_TIMEOUT)
        if stuck:  # stop the stream at the boards and fail what waits
            with self._lock:
                self._broken = self._broken or ClosedError(
                    f"the pipeline was closed while stages {stuck} were still busy")
            if self.links is not None:
                self.links.abort(str(self._broken))
            self._drain(len(self._queues) - 1)
            stuck = self._stop(time.monotonic() + ABORT_GRACE)
            for k in stuck:  # its input is answered now, whenever the stage comes back
                if self._busy[k] is not None:
                    _settle(self._busy[k].future, error=self._broken)
        closed = ClosedError("the pipeline was closed")
        for q in self._queues:  # an input submitted as close() began: it gets an answer too
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    _settle(item.future, error=closed)
        if self.links is not None:
            self.links.close()
        for k, m in enumerate(self.modules):
            if k not in stuck:
                _close_quietly(m)
        self.modules = [m if k in stuck else None for k, m in enumerate(self.modules)]
        if stuck:
            raise ExecutionError(f"pipeline close: stages {stuck} on "
                                 f"{[self.boards[k] for k in stuck]} did not stop; their "
                                 f"modules are left open")

    def _stop(self, deadline: float) -> list[int]:
        """Send the stop behind the inputs in flight and wait for the stages until
        ``deadline``; the stages still running."""
        if not self._stop_sent:
            try:
                self._queues[0].put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
                self._stop_sent = True
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return [k for k, t in enumerate(self._threads) if t.is_alive()]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return (f"<hgrt.Pipeline {len(self.boards)} stages on {self.boards}, transfer "
                f"{self.transfer} ({state})>")
