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
    from hgrt.runtime import onednn
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


def _at_once(jobs: list[tuple[int, float]]) -> tuple[int, list[int]]:
    """Dispatch ``(threads, seconds)`` jobs from a thread each, all at once: the most kernel
    threads that ran at the same time, and the order the jobs started in."""
    lock, running, most, order = threading.Lock(), [0], [0], []

    def job(k, threads, seconds):
        with lock:
            running[0] += threads
            most[0] = max(most[0], running[0])
            order.append(k)
        time.sleep(seconds)
        with lock:
            running[0] -= threads

    callers = [threading.Thread(target=dispatch.dispatch, args=(
        lambda k=k, t=t, s=s: job(k, t, s), t)) for k, (t, s) in enumerate(jobs)]
    for k, c in enumerate(callers):
        queued = len(dispatch._cores.waiting)
        c.start()
        deadline = time.monotonic() + 5
        while k not in order and len(dispatch._cores.waiting) <= queued \
                and time.monotonic() < deadline:  # running or in line before the next comes
            time.sleep(0.001)
    for c in callers:
        c.join(30)
    assert not any(c.is_alive() for c in callers), "a job never got its cores"
    return most[0], order


def test_jobs_run_no_more_kernel_threads_at_once_than_there_are_cores():
    cores = dispatch._cores.total
    most, _ = _at_once([(1, 0.05)] * (2 * cores + 1))
    assert most == cores  # every core busy, none oversubscribed
    most, _ = _at_once([(cores + 3, 0.02)] * 2)  # a share above the cores takes them all
    assert most == cores + 3  # (counted as asked; one such job at a time)


def test_a_job_of_every_core_is_not_starved_by_one_core_jobs():
    """First come, first served: one-core jobs that come after a job of every core wait for
    it, though a core is free before all of them are."""
    cores = dispatch._cores.total
    if cores < 2:
        pytest.skip("needs 2 cores")
    jobs = [(1, 0.1)] + [(cores, 0.01)] + [(1, 0.01)] * 3
    _, order = _at_once(jobs)
    assert order.index(1) < min(order.index(k) for k in range(2, len(jobs)))


def test_a_caller_interrupted_while_waiting_for_cores_leaves_none_taken():
    import signal

    cores = dispatch._Cores(1)
    cores.take(1)  # all taken

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            cores.take(1)  # waits in line, then Ctrl-C
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not cores.waiting  # out of the line
    cores.give(1)
    assert cores.free == 1 and cores.take(1) == 1  # nothing lost, nothing owed


def test_four_one_thread_callers_hold_no_more_frames_than_cores(chain):
    chain.configure_calls(callers=4, threads_per_call=1)
    x = np.zeros(N, "float32")
    start = threading.Barrier(4)

    def caller():
        start.wait()
        for _ in range(30):
            chain(x=x)

    callers = [threading.Thread(target=caller) for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(30)
    assert 1 <= chain._frames.made <= min(4, dispatch._cores.total)


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
