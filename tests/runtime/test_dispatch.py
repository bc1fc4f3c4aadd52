"""hgrt's own threads launch every kernel: whoever calls, a dispatcher runs the work. The same
dispatcher serves one caller at a time from any thread; concurrent callers get one each; after
fork the child starts its own; at exit a call is refused, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.runtime import dispatch
from hgrt.testing import N, add_one_chain, elementwise_lib


@pytest.fixture
def chain():
    g = add_one_chain(N, 6)
    m = hgrt.create(g.json(pools=True), elementwise_lib(), [tvm.cpu(0)])
    yield m
    m.close()


def _recording(m):
    """Record the thread each run's first step runs on."""
    seen = []
    calls = m._calls
    m._calls = ((lambda: seen.append(threading.current_thread()), ()),) + calls
    return seen


def test_kernels_run_on_a_dispatcher_the_same_one_from_any_thread(chain):
    """Worker threads one after another and the main thread hand their runs to the same
    dispatcher: one OpenMP master for the process (module doc)."""
    seen = _recording(chain)
    x = np.arange(N, dtype="float32")
    for _ in range(2):
        t = threading.Thread(target=lambda: chain.run(x=x))
        t.start()
        t.join()
    chain.run(x=x)
    assert len(seen) == 3 and seen[0].ident == seen[1].ident == seen[2].ident, seen
    assert seen[0].name.startswith("hgrt-dispatch-")
    np.testing.assert_array_equal(chain.get_output(0).numpy(), x + 6)


def test_concurrent_callers_each_get_a_dispatcher_and_the_single_call_s_bits(chain):
    chain.configure_calls(callers=3, threads_per_call=1)
    x = np.random.default_rng(0).standard_normal((8, N)).astype("float32")
    want = [chain(x=xi)[0] for xi in x]
    got: dict[int, list] = {}
    start = threading.Barrier(3)

    def caller(k):
        start.wait()
        got[k] = [chain(x=x[i])[0] for i in range(k, len(x), 3) for _ in range(20)]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, outs in got.items():
        for j, out in enumerate(outs):
            np.testing.assert_array_equal(out, want[k + 3 * (j // 20)])
    assert dispatch.dispatchers() >= 1


def test_a_call_inside_a_dispatcher_runs_in_place():
    inner, outer = [], []

    def caller():
        outer.append(dispatch.dispatch(lambda: dispatch.dispatch(
            lambda: inner.append(threading.current_thread()) or threading.current_thread(),
            1), 1))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert inner == outer and inner[0].name.startswith("hgrt-dispatch-")


def test_an_error_on_the_dispatcher_reaches_the_caller_naming_the_node(chain):
    def boom():
        raise RuntimeError("kernel failed")

    chain._calls = ((boom, ()),) + chain._calls[1:]
    with pytest.raises(hgrt.ExecutionError, match=r"node \d+ 'add_one_\d+'.*kernel failed"):
        chain.run(x=np.zeros(N, "float32"))


def _run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


# what both fork scripts do once the parent ran ``m`` on ``x``: the same run in a forked child,
# its output as ``got`` (the child killed after 30 s rather than waited for)
IN_A_FORKED_CHILD = """
    def child(q):
        m.run(x=x)
        q.put(m.get_output(0).numpy())

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    try:
        got = q.get(timeout=30)
    finally:
        p.join(timeout=5)
        p.kill()
"""

FORK_CHILD = """
    import multiprocessing as mp
    import numpy as np
    import tvm
    import hgrt
    from hgrt.providers.onednn import kernels as onednn
    from hgrt.testing import conv_model, reference

    model = conv_model()
    kernels = "onednn" if onednn.unavailable_reason() is None else "tvm"
    res = hgrt.build(model, ["cpu"], kernels=kernels)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype("float32")
    m.run(x=x)  # the parent's dispatcher, its TVM pool and OpenMP team exist now

""" + IN_A_FORKED_CHILD + """
    np.testing.assert_allclose(got, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    print("forked child ran", kernels, flush=True)
"""


def test_a_forked_child_runs_on_fresh_dispatchers():
    """The parent ran oneDNN's kernels (an OpenMP team) and TVM's: a child that ran them on
    the thread fork() left it (the parent's team gone) waited forever."""
    proc = _run_child(FORK_CHILD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forked child ran" in proc.stdout


EXIT_CALL = """
    import atexit
    import numpy as np

    def late():  # registered before hgrt's own: runs after its dispatchers stopped
        try:
            m.run(x=np.zeros(N, "float32"))
            print("ran at exit", flush=True)
        except hgrt.HgrtError as e:
            print("refused:", type(e).__name__, e, flush=True)

    atexit.register(late)
    import tvm
    import hgrt
    from hgrt.testing import N, add_one_chain, elementwise_lib

    m = hgrt.create(add_one_chain(N, 2).json(pools=True), elementwise_lib(), [tvm.cpu(0)])
    m.run(x=np.zeros(N, "float32"))
"""


def test_a_call_during_interpreter_exit_is_refused_not_hung():
    proc = _run_child(EXIT_CALL, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: ClosedError" in proc.stdout and "interpreter is exiting" in proc.stdout


def test_idle_means_idle(chain):
    """After a call returns, hgrt's threads sleep: the process uses next to no CPU."""
    x = np.zeros(N, "float32")
    for _ in range(50):
        chain.run(x=x)
    time.sleep(0.2)  # the pools' bounded spin (threads.SPIN_COUNT yields)
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(0.5)
    cpu = time.process_time() - c0
    assert cpu < 0.1 * (time.perf_counter() - t0), cpu


FORK_STREAMS = """
    import multiprocessing as mp
    import numpy as np
    from test_streams import branchy, branchy_reference, module, planned

    m = module(planned(branchy()))
    m.configure_streams(parallel=True)  # the runner's stream workers exist in the parent
    x = np.random.default_rng(0).standard_normal(16).astype("float32")
    m.run(x=x)

""" + IN_A_FORKED_CHILD + """
    np.testing.assert_allclose(got, branchy_reference(x), rtol=1e-6)
    print("forked child ran its streams", flush=True)
"""


def test_a_forked_child_starts_its_own_stream_workers():
    here = os.path.dirname(os.path.abspath(__file__))
    proc = _run_child(f"import sys; sys.path.insert(0, {here!r})\n" + textwrap.dedent(
        FORK_STREAMS))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forked child ran its streams" in proc.stdout


@pytest.fixture
def own_dispatchers(monkeypatch):
    """Dispatchers of the test's own: what its jobs leave (threads, widest) stays with them."""
    monkeypatch.setattr(dispatch, "_registry", dispatch._Registry())


def _at_once(jobs: list[tuple[int, float]], hold: threading.Event | None = None
             ) -> tuple[int, list[int]]:
    """Dispatch ``(threads, seconds)`` jobs from a thread each, all at once, each started only
    once the one before runs or waits in line: the most kernel threads that ran at the same
    time, and the order the jobs started in. With ``hold``, a job also waits for it."""
    lock, running, most, order = threading.Lock(), [0], [0], []

    def job(k, threads, seconds):
        with lock:
            running[0] += threads
            most[0] = max(most[0], running[0])
            order.append(k)
        if hold is not None:
            hold.wait(30)
        time.sleep(seconds)
        with lock:
            running[0] -= threads

    callers = [threading.Thread(target=dispatch.dispatch, daemon=True, args=(
        lambda k=k, t=t, s=s: job(k, t, s), t)) for k, (t, s) in enumerate(jobs)]
    for k, c in enumerate(callers):
        queued = len(dispatch._cores.waiting)
        c.start()
        deadline = time.monotonic() + 10
        while k not in order and len(dispatch._cores.waiting) <= queued \
                and time.monotonic() < deadline:  # running or in line before the next comes
            time.sleep(0.001)
    if hold is not None:
        hold.set()
    for c in callers:
        c.join(30)
    assert not any(c.is_alive() for c in callers), "a job never got its cores"
    return most[0], order


def test_jobs_run_no_more_kernel_threads_at_once_than_there_are_cores(own_dispatchers):
    cores = dispatch._cores.total
    # every job holds its cores until all have started or queued: exactly `cores` run at once
    most, _ = _at_once([(1, 0.0)] * (2 * cores + 1), hold=threading.Event())
    assert most == cores  # every core busy, none oversubscribed
    most, _ = _at_once([(cores + 3, 0.0)] * 2, hold=threading.Event())
    assert most == cores + 3  # a share above the cores takes them all: one such job at a time


def test_a_job_of_every_core_is_not_starved_by_one_core_jobs(own_dispatchers):
    """First come, first served: one-core jobs that come after a job of every core wait for
    it, though a core is free before all of them are."""
    cores = dispatch._cores.total
    if cores < 2:
        pytest.skip("needs 2 cores")
    jobs = [(1, 0.1)] + [(cores, 0.01)] + [(1, 0.01)] * 3
    _, order = _at_once(jobs)
    assert order.index(1) < min(order.index(k) for k in range(2, len(jobs)))


@pytest.mark.parametrize("when", ["in line", "just granted"])
def test_a_caller_interrupted_while_waiting_for_cores_leaves_none_taken(when):
    """Ctrl-C while a caller waits for cores: it leaves the line, or, granted them just before
    it saw the signal, gives them back in ``dispatch``'s ``finally`` (here: ``give``)."""
    import signal

    cores = dispatch._Cores(1)
    first, second = dispatch._Lease(), dispatch._Lease()
    cores.take(1, first)  # all taken

    def interrupt(*_):
        if when == "just granted":
            cores.give(first)  # the cores go to the caller in line...
            assert second.cores == 1
        raise KeyboardInterrupt  # ...which raises before it returns from take

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            try:
                cores.take(1, second)  # waits in line, then Ctrl-C
            finally:
                cores.give(second)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not cores.waiting  # out of the line
    if when == "in line":
        cores.give(first)
    assert cores.free() == 1  # nothing lost, nothing owed
    third = dispatch._Lease()
    cores.take(1, third)
    assert third.cores == 1


def test_an_interrupted_give_is_finished_by_the_next_caller():
    """A ``give`` cut short after it freed the cores but before it woke the line: the waiting
    caller still gets them (the line is granted again while it waits)."""
    cores = dispatch._Cores(1)
    first, second = dispatch._Lease(), dispatch._Lease()
    cores.take(1, first)
    got = threading.Event()
    t = threading.Thread(target=lambda: (cores.take(1, second), got.set()), daemon=True)
    t.start()
    while not cores.waiting:
        time.sleep(0.001)
    with cores.lock:  # what give does, up to its grant
        cores.leases.discard(first)
        first.cores = 0
    assert got.wait(5), "the caller in line was left waiting for free cores"
    assert second.cores == 1


def test_a_job_put_to_a_dispatcher_that_stopped_is_refused(monkeypatch):
    """A caller took a dispatcher just before the interpreter began to exit, and its job went
    in behind the stop: it gets a ClosedError, not a wait forever, and gives back its cores."""
    d = dispatch.Dispatcher(99)
    d.stop()
    d.thread.join(5)
    reg = dispatch._Registry()
    reg.idle, reg.all = [d], [d]
    monkeypatch.setattr(dispatch, "_registry", reg)
    got = []

    def caller():
        try:
            dispatch.dispatch(lambda: 1, 1)
        except hgrt.ClosedError as e:
            got.append(e)

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the job behind the stop was left waiting"
    assert got and "interpreter is exiting" in str(got[0])
    assert dispatch._cores.free() == dispatch._cores.total


def test_more_one_thread_callers_than_cores_hold_no_more_frames_than_cores(chain):
    callers = dispatch._cores.total + 2
    chain.configure_calls(callers=callers, threads_per_call=1)
    x = np.zeros(N, "float32")
    start = threading.Barrier(callers)

    def caller():
        start.wait()
        for _ in range(30):
            chain(x=x)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(callers)]
    for c in threads:
        c.start()
    for c in threads:
        c.join(30)
    assert 1 <= chain._frames.made <= dispatch._cores.total


def test_a_call_waiting_for_a_frame_holds_no_cores(chain):
    """Every frame in use: a call waits for one on its own thread, holding none of the
    process's cores (other calls run meanwhile), and runs once a frame comes back."""
    chain.configure_calls(callers=1, threads_per_call=1, max_frames=1)
    x = np.arange(N, dtype="float32")
    want = chain(x=x)[0]
    frame = chain._frames.take()  # the only frame, held
    out = []
    t = threading.Thread(target=lambda: out.append(chain(x=x)[0]), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not chain._frames._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert chain._frames._waiting == 1  # waiting for the frame...
    assert dispatch._cores.free() == dispatch._cores.total  # ...on no core
    chain._frames.give(frame)
    t.join(10)
    np.testing.assert_array_equal(out[0], want)


def test_a_wide_job_goes_to_the_dispatcher_whose_team_is_already_wide(monkeypatch):
    """libgomp spins only a throttled count once its teams together hold more threads than
    there are cores: a 2-thread job goes back to the dispatcher that already ran 2-thread jobs,
    though another ran last and at 1 thread, and 1-thread jobs leave that one free."""
    from types import SimpleNamespace as D

    reg = dispatch._Registry()
    wide, narrow = D(name="wide", threads=1, widest=2), D(name="narrow", threads=1, widest=1)
    reg.idle = [wide, narrow]  # (the narrow one released last)
    reg.all = list(reg.idle)
    monkeypatch.setattr(dispatch, "_registry", reg)
    assert dispatch._acquire(2) is wide
    reg.idle = [narrow, wide]
    assert dispatch._acquire(1) is narrow  # a 1-thread job: the narrow one
    reg.idle = [wide, D(name="last at 2", threads=2, widest=2)]
    assert dispatch._acquire(2).name == "last at 2"  # both wide: the one set to 2 already
