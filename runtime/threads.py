"""hgrt's one thread budget: how many cores a run, a call, a device may use.

Every thread that calls a parallel TVM kernel gets its own TVM thread pool, sized by
``TVM_NUM_THREADS`` when the pool starts, or later by ``runtime.config_threadpool``, which sets
the CALLING thread's pool; oneDNN's kernels take as many OpenMP threads as that pool has. hgrt's
kernels are only launched by its own threads (``runtime/dispatch.py``: a dispatcher per
concurrent call, a worker per extra stream), so this budget is their configuration: N callers
each running kernels on all cores would oversubscribe the machine N times; a caller's share is
``cores // callers``, set on the dispatcher that runs its call.

- ``process_threads()``: what a plain ``run()`` uses: TVM_NUM_THREADS, which ``create`` sets to
  every core this process may use unless the user chose (TVM itself starts half the hardware
  threads on x86: one worker on a 2-vCPU VM);
- ``CallBudget``: the share of one caller of the call API (``threads_per_call``, ``max_frames``),
  applied to the calling thread's pool before each call;
- ``solo``: a kernel that runs on its caller's thread alone, whatever the share (the injective
  TVM kernels between oneDNN kernels, see there).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass

import tvm

from hgrt.devices import usable_cores
from hgrt.errors import InputError
from hgrt.spin import LOADED_BEFORE, SPIN_COUNT  # noqa: F401  (set before TVM loads)

if LOADED_BEFORE:
    logging.getLogger("hgrt").warning(
        "libgomp was loaded before hgrt (torch imported first?): the kernel providers' OpenMP "
        "threads spin with its defaults, which can hold cores TVM's next kernels need; set "
        "GOMP_SPINCOUNT=%d and OMP_WAIT_POLICY=active before Python starts", SPIN_COUNT)

_config_threadpool = tvm.get_global_func("runtime.config_threadpool")
_num_threads = tvm.get_global_func("runtime.NumThreads")
_warned: list[bool] = []
# TVM's kSpecifyThreadShareAllCore: the pool's threads may run on every core listed. (kBig
# pins a 1-thread pool's caller to core 0: two callers or streams then share one core.)
SHARE_ALL_CORES = -3
CPUS = [str(c) for c in sorted(os.sched_getaffinity(0))] if hasattr(os, "sched_getaffinity") \
    else [str(c) for c in range(os.cpu_count() or 1)]
_local = threading.local()


def use_all_cores() -> None:
    """Before TVM's first parallel kernel: give its pools every usable core, unless the user
    set ``TVM_NUM_THREADS``. (A pool started earlier keeps the size TVM gave it;
    ``set_thread_count`` warns.)"""
    os.environ.setdefault("TVM_NUM_THREADS", str(usable_cores()))


def process_threads() -> int:
    try:
        return max(1, int(os.environ.get("TVM_NUM_THREADS", "")))
    except ValueError:
        return usable_cores()


def set_thread_count(n: int) -> None:
    """Kernels called from this thread run on ``n`` threads (this thread's TVM pool)."""
    if getattr(_local, "threads", None) != n:
        _config_threadpool(SHARE_ALL_CORES, int(n), CPUS)
        _local.threads = n
        got = n if _warned else _num_threads()
        if got < n:
            # TVM sizes a thread's pool once, when it starts (TVM_NUM_THREADS, else its own
            # default: one thread on a 2-vCPU VM); configuring asks for no more than that
            _warned.append(True)
            warnings.warn(f"this thread's TVM pool runs {got} thread(s), not {n}: TVM sizes a "
                          f"pool once, when it starts (TVM_NUM_THREADS, else TVM's default; a "
                          f"parallel TVM kernel run before hgrt.create starts it early), and "
                          f"never above that; set TVM_NUM_THREADS before the first kernel",
                          RuntimeWarning, stacklevel=2)


def restore_thread_count() -> None:
    """This thread's pool at ``process_threads()``: set once per thread, and again after hgrt
    changed it. (A pool TVM started before ``use_all_cores`` -- a parallel kernel run before
    ``create`` -- cannot grow past TVM's own default, one thread on a 2-vCPU VM: plain runs
    were measured at half speed on it; ``set_thread_count`` warns.)"""
    if getattr(_local, "threads", None) != process_threads():
        set_thread_count(process_threads())


def solo(func):
    """``func`` (a TVM kernel) run on the calling thread alone, the thread's pool put back after.

    For the small element-moving TVM kernels beside a provider's kernels whose OpenMP threads
    spin on the other cores after they return (``solo_neighbours``): a TVM kernel on two
    threads would wait for a core for its worker longer than it takes alone.
    A kernel that reduces (a pool, LRN) keeps the share: there the spin is small beside it."""

    def call(*args):
        share = getattr(_local, "threads", None)
        if share is None or share <= 1:
            return func(*args)
        _config_threadpool(SHARE_ALL_CORES, 1, CPUS)
        try:
            return func(*args)
        finally:
            _config_threadpool(SHARE_ALL_CORES, share, CPUS)

    call.__wrapped__ = call.solo_of = func  # (step_loop runs it solo in native code)
    return call


@dataclass(frozen=True)
class CallBudget:
    """How callers of one module share the cores: ``callers`` expected at once, each with
    ``threads_per_call`` kernel threads (default: cores // callers) and its own activation
    frame; at most ``max_frames`` frames (default: callers), a caller beyond waits for one."""

    callers: int = 1
    threads_per_call: int | None = None
    max_frames: int | None = None

    def __post_init__(self) -> None:
        for name in ("callers", "threads_per_call", "max_frames"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InputError(f"call budget: {name} must be a positive integer, got "
                                 f"{value!r}")

    @property
    def threads(self) -> int:
        return self.threads_per_call or max(1, process_threads() // self.callers)

    @property
    def frames(self) -> int:
        return self.max_frames or self.callers
