"""A run's steps called one after another: in native code when it can be built, else in Python.

``StepLoop(calls)`` takes a tuple of ``(func, args)``; ``run(overrides)`` calls each in order,
with ``(step, pos, tensor)`` overrides put in place of bound arguments for that run only (a
caller's own input and output buffers). A step that raises ends the run with ``StepFailed``
naming its index.

Why native: a Python loop takes the GIL back after every kernel. Two threads running kernels
at once (two callers) then queue for it after each of light squeezenet's 40 kernels, and on a
VM each hand-over wakes a sleeping core: ``python python/bench_executor.py --callers 2`` (two
threads, each running a chain of 400 tiny kernels) reads 0.535 us per op with the loop in
Python and 0.201 us native (Intel Xeon, AVX-512, 2 vCPUs). ``step_loop.cc`` holds no GIL for
the whole list. It is compiled once per machine (``native``); without g++
and ninja, or with ``HGRT_NATIVE_STEPS=0``, the loop stays in Python (the same results).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import tvm
import tvm_ffi

from hgrt.runtime import native

log = logging.getLogger("hgrt")

SOURCE = Path(__file__).with_name("step_loop.cc")
_lock = threading.Lock()
_loaded: list = []  # [(make, failed)] once built, [None] when the Python loop is used


class StepFailed(Exception):
    """Step ``step`` of a run raised ``cause`` (also the ``__cause__``)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(step, cause)
        self.step, self.cause = step, cause


def _native():
    """(hgrt.steps.make, hgrt.steps.failed), or None where the loop stays in Python."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            why = "HGRT_NATIVE_STEPS=0" if os.environ.get("HGRT_NATIVE_STEPS", "1") == "0" \
                else native.missing_tools()
            funcs = None
            if why is None:
                try:
                    native.build_and_load("hgrt_steps", [SOURCE])
                    funcs = (tvm.get_global_func("hgrt.steps.make"),
                             tvm.get_global_func("hgrt.steps.failed"))
                except Exception as e:  # noqa: BLE001 - any build failure: the Python loop
                    why = f"could not build {SOURCE.name}: {e}"
            if why is not None:
                log.info("hgrt runs its steps in a Python loop (%s): slower with several "
                         "threads calling at once", why)
            _loaded.append(funcs)
    return _loaded[0]


def native_steps() -> bool:
    """Whether runs call their steps from native code in this process."""
    return _native() is not None


class StepLoop:
    """Calls ``calls`` in order: ``run(overrides)``."""

    def __init__(self, calls: tuple) -> None:
        self.calls = calls
        self._native = self._failed = None
        funcs, solo = [], []
        for func, _ in calls:
            inner = getattr(func, "solo_of", None)  # threads.solo: native does the same
            funcs.append(inner if inner is not None else func)
            solo.append(int(inner is not None))
        # a Python function among the steps (a closed module's, a test's) keeps the loop in
        # Python: its exception then reaches the caller as it was raised. (One wrapped as a
        # tvm_ffi.Function runs natively, and its exception comes back as TVM FFI maps it.)
        found = _native() if calls and all(isinstance(f, tvm_ffi.Function) for f in funcs) \
            else None
        if found is not None:
            make, self._failed = found
            from hgrt.runtime.threads import CPUS, SHARE_ALL_CORES

            self._native = make(funcs, [list(args) for _, args in calls], solo, SHARE_ALL_CORES,
                                CPUS)

    def run(self, overrides: tuple = ()) -> None:
        """Every step once; ``overrides``: ``(step, pos, tensor)`` for this run only."""
        if self._native is not None:
            try:
                self._native(*(x for o in overrides for x in o))
            except Exception as e:
                step = int(self._failed())
                if step < 0:  # a bad override, before any step ran
                    raise
                raise StepFailed(step, e) from e
            return
        calls = self.calls
        if overrides:
            calls = list(calls)
            for si, pos, tensor in overrides:
                func, args = calls[si]
                calls[si] = (func, args[:pos] + (tensor,) + args[pos + 1:])
        i = 0
        try:
            for i, (func, args) in enumerate(calls):  # noqa: B007 - i names the fault
                func(*args)
        except Exception as e:
            raise StepFailed(i, e) from e
