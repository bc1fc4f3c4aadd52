"""The threads that launch hgrt's kernels: whoever calls, a dispatcher of hgrt's runs the work.

TVM's parallel loops run on a pool that belongs to the thread that launches them, and libgomp
(oneDNN's OpenMP) keeps a team per launching thread; both spin for a while after each kernel and
keep their state per thread. A kernel launched from a new or rarely used thread therefore finds
cold pools and another thread's spinning workers. So no user thread launches a kernel: a call
(``run()``, ``m(x)``, ``profile()``) hands its work to a dispatcher and waits for it.

Dispatchers belong to the process, not to a module: modules share the cores, and a dispatcher
per module would multiply the pools (and the spinning) by the modules loaded. A caller takes an
idle dispatcher, preferably one whose OpenMP team need not grow, then the one that last ran
with the same thread count (its TVM pool and OpenMP team are sized and warm), else another idle
one, else a new one; so one caller at a time,
from any thread, always lands on the same dispatcher, and ``k`` concurrent callers on ``k``
dispatchers, each the one master of its pools. An idle dispatcher sleeps on a lock (no spin).
Dispatchers run no more kernel threads at once than the process may use cores (``_Cores``):
callers beyond wait their turn instead of sharing the cores by the OS's time slices.

The process's main thread hands off too, and so does a kernel provider's weight packing at
build and load: libgomp spins only its throttled count once more threads than cores have been
masters of a team of every core, so a main thread running kernels beside a dispatcher would
slow every call from a worker thread; with one team for the process, a call costs the same
from any thread, for the price of the hand-off (``python/bench_serving.py --threads``).

After ``fork()`` the child forgets the parent's dispatchers (their threads do not exist there)
and starts its own on first use; at interpreter exit they are stopped, and a call made after
that gets a ``ClosedError`` instead of waiting for a thread that will never run.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from hgrt.devices import usable_cores
from hgrt.errors import ClosedError

_local = threading.local()
_EXITING = "hgrt's dispatchers have stopped: the interpreter is exiting"


class _Job:
    """One hand-off: ``fn`` run on a dispatcher, its result or exception kept for the caller."""

    __slots__ = ("fn", "result", "error", "done")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.result, self.error = fn, None, None
        self.done = threading.Lock()
        self.done.acquire()  # released by the dispatcher when fn has returned or raised

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: B036 - every outcome goes back to the caller
            self.error = e
        finally:
            self.fn = None
            self.done.release()

    def refuse(self) -> None:
        """Never run: its dispatcher has stopped (the interpreter is exiting)."""
        self.fn, self.error = None, ClosedError(_EXITING)
        self.done.release()

    def wait(self) -> Any:
        """The result, or the exception re-raised in the caller's thread. A signal (Ctrl-C)
        while waiting is raised only once the dispatcher has finished: the job's frame and
        buffers must not be handed back while a kernel still writes them."""
        interrupted = None
        while True:
            try:
                self.done.acquire()
                break
            except BaseException as e:  # noqa: B036
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.result


class Dispatcher:
    """A long-lived thread that runs jobs one after another; the master of its TVM pool and
    its OpenMP team."""

    def __init__(self, index: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: int | None = None  # kernel threads its pool was last set to
        self.widest = 0  # the most kernel threads it has run: its OpenMP team keeps them
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name=f"hgrt-dispatch-{index}",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _local.dispatcher = self
        while True:
            job = self.jobs.get()
            if job is None:
                self.stopped = True
                self.refuse_queued()
                return
            job.run()
            job = None  # hold nothing of a call between calls

    def stop(self) -> None:
        self.jobs.put(None)

    def refuse_queued(self) -> None:
        """Refuse the jobs put after the stop (a caller that took this dispatcher just before
        the interpreter began to exit): each caller gets a ``ClosedError``, not a wait forever."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.refuse()


class _Registry:
    """The process's dispatchers: the idle ones, and how many exist."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[Dispatcher] = []
        self.all: list[Dispatcher] = []
        self.closed = False


_registry = _Registry()


def _acquire(threads: int) -> Dispatcher:
    reg = _registry
    with reg.lock:
        if reg.closed:
            raise ClosedError(_EXITING)
        if reg.idle:
            idle = reg.idle
            # first one whose OpenMP team need not grow: libgomp spins only a throttled count
            # once its teams together hold more threads than there are cores, and a second
            # dispatcher of a 2-thread team slowed light squeezenet's 1 x 2 calls 2-10 % (the
            # first had run 2-thread calls, then 1-thread ones); then the one last set to this
            # count (its pools sized and warm), then the narrowest, then the latest
            k = min(range(len(idle)), key=lambda k: (
                max(0, threads - idle[k].widest), idle[k].threads != threads, idle[k].widest,
                -k))
            return idle.pop(k)
        d = Dispatcher(len(reg.all))
        reg.all.append(d)
        return d


def _release(d: Dispatcher) -> None:
    reg = _registry
    with reg.lock:
        if d in reg.all:  # (not a dispatcher of the parent, after a fork)
            reg.idle.append(d)


def on_dispatcher() -> bool:
    """Whether the calling thread is one of hgrt's dispatchers."""
    return getattr(_local, "dispatcher", None) is not None


class _Lease:
    """The cores one job holds: set by one store, so that an interrupt (Ctrl-C between any two
    bytecodes) leaves it holding them or not, never half."""

    __slots__ = ("cores",)

    def __init__(self) -> None:
        self.cores = 0


class _Cores:
    """The kernel threads that dispatchers may run at once: the cores this process may use.
    A job takes ``threads`` of them before it starts and gives them back when it ends;
    callers beyond wait in turn (first come, first served, so a job of every core is not
    starved by a stream of one-core jobs). Four callers of one thread each on 2 cores then run
    two jobs at a time, one after another on warm caches, instead of four that the OS slices.
    What is free is counted from the leases themselves, and granting is idempotent, so an
    interrupted ``take``, ``give`` or grant leaves nothing lost or owed: the next ``take`` or
    ``give`` finishes what it left."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.lock = threading.Lock()
        self.leases: set[_Lease] = set()  # every lease that may hold cores
        self.waiting: collections.deque = collections.deque()  # (cores, Event, lease) in line

    def free(self) -> int:
        return self.total - sum(lease.cores for lease in self.leases)

    def take(self, k: int, lease: _Lease) -> None:
        """Wait for ``k`` cores (at most all of them), held by ``lease`` until ``give``."""
        k = min(k, self.total)
        if k <= 0:
            return
        with self.lock:
            self.leases.add(lease)
            self._grant()  # (what an interrupted give left ungranted)
            if not self.waiting and self.free() >= k:
                lease.cores = k
                return
            turn = (k, threading.Event(), lease)
            self.waiting.append(turn)
        try:
            while not turn[1].wait(0.05):  # set by ``_grant`` once the lease holds the cores;
                with self.lock:            # and now and then granted from here, should an
                    self._grant()          # interrupted ``give`` have left it to nobody
        except BaseException:  # interrupted in line: leave it (cores granted meanwhile are
            with self.lock:    # given back by the caller's ``give``)
                if turn in self.waiting:
                    self.waiting.remove(turn)
                    self._grant()  # (the next in line may fit now)
            raise

    def give(self, lease: _Lease) -> None:
        with self.lock:
            self.leases.discard(lease)
            lease.cores = 0
            self._grant()

    def _grant(self) -> None:
        while self.waiting:
            k, ready, lease = self.waiting[0]
            if not lease.cores:
                if self.free() < k:
                    return
                lease.cores = k
            ready.set()
            self.waiting.popleft()


_cores = _Cores(usable_cores())


def dispatch(fn: Callable[[], Any], threads: int, cores: int | None = None) -> Any:
    """``fn()`` run on a dispatcher whose kernels take ``threads`` threads (``fn`` sets them:
    ``threads.set_thread_count``), the caller waiting; its result, or its exception raised
    here. On a dispatcher already (a call inside a call), ``fn()`` runs in place. The job first
    takes ``cores`` of the process's cores (default ``threads``; 0 for work that waits on
    another device: ``_Cores``) and waits while they are in use."""
    if on_dispatcher():
        return fn()
    pool, lease = _cores, _Lease()
    try:
        pool.take(threads if cores is None else cores, lease)
        d = _acquire(threads)
        job = _Job(fn)
        try:
            d.jobs.put(job)
            if d.stopped:  # stopped between ``_acquire`` and the put: nobody will run it
                d.refuse_queued()
            return job.wait()
        finally:
            d.threads = threads
            d.widest = max(d.widest, threads)
            _release(d)
    finally:
        pool.give(lease)


def dispatchers() -> int:
    """How many dispatcher threads this process has started."""
    return len(_registry.all)


def _forget_after_fork() -> None:
    """In a forked child: the parent's dispatcher threads, and the jobs they ran, do not exist
    here."""
    global _registry, _cores
    _registry = _Registry()
    _cores = _Cores(usable_cores())


def _stop_at_exit() -> None:
    reg = _registry
    with reg.lock:
        reg.closed = True
        stopping = list(reg.all)
        reg.idle.clear()
    for d in stopping:
        d.stop()
    for d in stopping:
        d.thread.join(timeout=1.0)  # a dispatcher still in a kernel is left to the exit


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_at_exit)
