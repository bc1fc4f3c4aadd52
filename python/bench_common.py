"""What the benchmarks share: the models, the peers (Relax VM on hgrt's kernels, onnxruntime),
timing, and the machine line every table starts with.

Every figure is a median of timed calls made in this process; ratios compare runs made here.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# a few pytorch-converted backend cases of the onnx wheel: one or two ops, so their latency
# is mostly the runtime's per-call cost rather than kernel time
PYTORCH_CASES = ("test_Conv2d", "test_ConvTranspose2d", "test_BatchNorm2d_eval", "test_Linear",
                 "test_MaxPool2d", "test_Softmax", "test_Embedding")


@dataclass
class Model:
    name: str
    model: object  # onnx ModelProto
    inputs: dict[str, np.ndarray]  # by hgrt / Relax input name


def light(name: str) -> Model:
    """A zoo model with its last layer calibrated (``hgrt.testing.zoo_model``): the outputs
    carry numbers, so the correctness columns compare more than the winning class."""
    from hgrt.testing import zoo_input, zoo_model

    model = zoo_model(name)
    return Model(name, model, zoo_input(model))


def pytorch_case(name: str) -> Model:
    import onnx

    from hgrt.testing import case_inputs, load_case

    case = load_case(f"pytorch-converted/{name}")
    return Model(name, onnx.load(case.model_path), case_inputs(case))


def machine() -> str:
    """CPU model, cores usable, load, Python, TVM and onnxruntime versions, TVM threads."""
    import tvm

    from hgrt.devices import cpu_flags
    from hgrt.runtime.threads import use_all_cores

    use_all_cores()  # what hgrt.create does: TVM_NUM_THREADS (the default) if unset

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import onnxruntime as ort

        ort_v = ort.__version__
    except ImportError:
        ort_v = "absent"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    return (f"{cpu} ({isa}), {cores} cores usable, load {os.getloadavg()[0]:.2f}; Python "
            f"{platform.python_version()}, TVM {tvm.__version__}, onnxruntime {ort_v}, "
            f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', '-')}")


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_threads(jobs: list[Callable[[], object]]) -> float:
    """Seconds for ``jobs`` run at once, a thread each, timed from a common start."""
    import threading

    start = threading.Barrier(len(jobs) + 1)

    def worker(job):
        start.wait()
        job()

    threads = [threading.Thread(target=worker, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def timed_interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds per call of each function, called in turn, so that the machine's slow
    and fast moments fall on each alike. Only for functions sharing TVM's thread pool: time
    onnxruntime with ``time_onnxruntime`` after everything else."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeat):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in samples.items()}


def time_onnxruntime(model, inputs: dict[str, np.ndarray], repeat: int
                     ) -> tuple[float, list[np.ndarray]] | None:
    """onnxruntime's median seconds per run (and its outputs) at TVM_NUM_THREADS threads, or
    None when it is not installed. Call it last: onnxruntime's pool threads spin for a long
    while after each run (its default) and a TVM kernel started meanwhile runs up to twice as
    slow, so nothing of TVM's may be timed after it in the same process."""
    ort_run = _ort_runner(model, inputs)
    if ort_run is None:
        return None
    time.sleep(0.2)  # TVM's workers spin briefly after a parallel kernel
    outs = ort_run()
    return median_time(ort_run, repeat), outs


def _ort_runner(model, inputs: dict[str, np.ndarray]) -> Callable[[], list] | None:
    """One onnxruntime run on ``inputs`` at TVM_NUM_THREADS threads (None: not installed)."""
    sess = ort_session(model, int(os.environ.get("TVM_NUM_THREADS", "1")))
    if sess is None:
        return None
    feed = ort_feed(sess, model, inputs)
    return lambda: sess.run(None, feed)


def time_against_onnxruntime(run: Callable[[], object], model, inputs: dict[str, np.ndarray],
                              repeat: int, rounds: int = 5, pause: float = 0.5,
                              min_block_s: float = 0.25, warm_s: float = 0.05
                              ) -> tuple[float, float, list[np.ndarray]] | None:
    """(``run``'s median seconds, onnxruntime's, onnxruntime's outputs) at TVM_NUM_THREADS
    threads, or None when onnxruntime is not installed. Each is timed alone, in blocks of at
    least ``repeat`` runs and ``min_block_s`` seconds that take turns ``rounds`` times after a
    pause: after a run, onnxruntime's pool threads spin for a while, and so do oneDNN's OpenMP
    threads and TVM's pool; the one timed next while they spin loses a core (interleaving
    single runs cost hgrt 6-20 %). (Blocks of 10 runs of a 3 ms model, 3 rounds, read the same
    two modules 1.00-1.08 apart across processes on this VM.)

    Each block starts with ``warm_s`` of untimed runs: after a pause the first runs of either
    side take about twice their steady time for some milliseconds (the 0.27 ms gru: its first
    7-12 runs after 0.2 s read 0.55-0.75 ms, onnxruntime's alike). A block's length comes from
    runs timed after a pause, not from the first run after onnxruntime's, which its spinning
    threads slow a hundredfold (that gru's read 20-33 ms: blocks of 8-13 runs, nearly all
    cold)."""
    ort_run = _ort_runner(model, inputs)
    if ort_run is None:
        return None
    outs = ort_run()
    fns = {"run": run, "ort": ort_run}
    time.sleep(pause)
    _warm(run, warm_s)
    once = median_time(run, 5, warmup=0)  # (warmed just above)
    block = max(repeat, int(min_block_s / max(once, 1e-6)) + 1)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            time.sleep(pause)
            _warm(fn, warm_s)
            for _ in range(block):
                t = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t)
    return statistics.median(samples["run"]), statistics.median(samples["ort"]), outs


def _warm(fn: Callable[[], object], seconds: float) -> None:
    """``fn`` called, untimed, at least twice and for at least ``seconds``."""
    end = time.perf_counter() + seconds
    fn()
    fn()
    while time.perf_counter() < end:
        fn()


def hgrt_runner(result, inputs: dict[str, np.ndarray]):
    """A GraphModule for a ``BuildResult`` on cpu(0), cpu(1)…, params and inputs set."""
    import tvm

    import hgrt

    m = hgrt.create(result.graph_json, result.lib, [tvm.cpu(i) for i in range(len(
        result.devices))])
    m.load_params(result.params)
    m.set_input(**inputs)
    return m


def hgrt_outputs(m) -> list[np.ndarray]:
    m.run()
    return [m.get_output(i).numpy() for i in range(m.get_num_outputs())]


def vm_on_hgrt_kernels(model, inputs: dict[str, np.ndarray], tuning_db: str | None = None,
                       target: dict | None = None) -> Callable[[], list[np.ndarray]]:
    """The Relax VM running the very kernels ``hgrt.build(model, ["cpu"], target=target,
    kernels="tvm")`` compiles (same fusion, same schedules, same CPU target), so a latency
    ratio compares the runtimes and nothing else. ``tuning_db``: one tuned with ``hgrt tune
    --kernels tvm`` (the VM runs no oneDNN kernel)."""
    import tvm
    from tvm import relax

    from hgrt.compiler import lower_model
    from hgrt.devices import parse_devices

    devices = parse_devices(["cpu"], targets=target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, weights = lower_model(model, devices, schedule=True, tuning_db=tuning_db)
        ex = tvm.compile(mod, target=devices[0].target,
                         relax_pipeline=relax.pipeline.default_build_pipeline())
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if "num_input" in main.attrs else len(inputs)
    # inputs in graph order (the frontend may have renamed them: "gpu_0/data_0" → "gpu_0_data_0")
    args = [tvm.runtime.tensor(v, dev) for v in inputs.values()]
    assert len(args) == n_in, (list(inputs), [p.name for p in main.params[:n_in]])
    args += [tvm.runtime.tensor(weights[p.name], dev) for p in main.params[n_in:]]
    f = vm["main"]

    def call() -> list[np.ndarray]:
        return _flatten(f(*args))

    call.run = lambda: f(*args)  # timed: no copy back
    return call


def winograd_layers(result) -> int:
    """How many of a build's convolutions oneDNN runs as Winograd (its graph's ``onednn_op``)."""
    return sum("winograd" in n.attrs.get("onednn_op", "") for n in result.graph.nodes)


def parse_target_args(items: list[str] | None) -> dict | None:
    """``--target KIND=TARGET`` values as ``hgrt compile`` reads them (``hgrt.cli``), or exit
    with the error."""
    from hgrt.cli import parse_targets
    from hgrt.errors import HgrtError

    try:
        return parse_targets(items)
    except HgrtError as e:
        raise SystemExit(f"--target: {e}") from None


def built_isa(result, device: str = "cpu:0") -> str:
    """The vector ISA (``avx2``, ``avx512``…) that a ``BuildResult``'s kernels on ``device``
    were built for: the target actually built, not the host's."""
    from hgrt.devices import as_target, vector_isa

    return vector_isa(as_target(result.targets[device])).name


# hgrt's x86 vector ISA names, narrowest first -> oneDNN's ONEDNN_MAX_CPU_ISA values
_ONEDNN_ISA = {"sse": "SSE41", "avx": "AVX", "avx2": "AVX2", "avx512": "AVX512_CORE"}


def _isas(target: dict) -> tuple[str, str]:
    """(the vector ISA of the CPU ``target``, the host's)."""
    from hgrt.devices import host_target, parse_devices, vector_isa

    return (vector_isa(parse_devices(["cpu"], targets=target)[0].target).name,
            vector_isa(host_target()).name)


def cap_onednn_isa(target: dict | None) -> None:
    """Cap oneDNN (``ONEDNN_MAX_CPU_ISA``, unless set) to the vector ISA of the CPU target the
    TVM kernels are built for when it is narrower than the host's, so both kernel providers of
    a row run one ISA; call before oneDNN is loaded (onnxruntime: ``cap_onnxruntime_isa``)."""
    if not target:
        return
    order = list(_ONEDNN_ISA)
    isa, host = _isas(target)
    if isa in order and host in order and order.index(isa) < order.index(host):
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[isa])


def add_onnxruntime_cap_option(parser) -> None:
    """The scripts' ``--cap-onnxruntime`` flag (``cap_onnxruntime_isa``)."""
    parser.add_argument("--cap-onnxruntime", action="store_true",
                        help="with --target: onnxruntime runs the target's ISA too (CPUID "
                             "capped, python/cpuid_cap.py), as it would on a host of that ISA")


def cap_onnxruntime_isa(target: dict | None, cap: bool) -> str:
    """The vector ISA onnxruntime will run (with why, where it is not the target's). With
    ``cap``, onnxruntime is loaded now under a CPUID cap to the ISA of the CPU ``target`` when
    that is narrower than the host's (``cpuid_cap.py``); call before anything loads it."""
    from hgrt.devices import host_target, vector_isa

    if not (cap and target):
        return vector_isa(host_target()).name
    from cpuid_cap import cap_onnxruntime

    return cap_onnxruntime(*_isas(target))


def ort_block_suffix(ort_isa: str) -> str:
    """What a markdown block's name gains when onnxruntime ran under the CPUID cap."""
    from cpuid_cap import CAPPED

    return "_ort_capped" if f"({CAPPED}" in ort_isa else ""


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for o in out for a in _flatten(o)]


# whether onnxruntime's pool threads spin between parallel sections (its default); off, they do
# not hold cores while hgrt's calls are timed in turns beside them (bench_corpus_table.py
# --ort-no-spin; BENCHMARKS.md, "Views of slices, ...": the gru read 0.264-0.267 ms for hgrt,
# 0.407-0.422 ms for onnxruntime that way, 0.507-0.614 and 0.373-0.607 ms with its spinning)
ORT_SPIN = True


def ort_session(model, threads: int):
    """onnxruntime's CPU provider at ``threads`` intra-op threads (spinning as ``ORT_SPIN``
    says), or None when it is not installed or cannot load the model (said on stdout)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not ORT_SPIN:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        print(f"onnxruntime cannot run {model.graph.name or 'this model'}: "
              f"{str(e).splitlines()[0][:160]}")
        return None


def ort_feed(sess, model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """hgrt's inputs under onnxruntime's names (the graph inputs that are not initializers)."""
    inits = {t.name for t in model.graph.initializer}
    onnx_names = [i.name for i in model.graph.input if i.name not in inits]
    ort_names = {i.name for i in sess.get_inputs()}
    return {o: v for o, v in zip(onnx_names, inputs.values(), strict=True) if o in ort_names}


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest |a - b| over all outputs, relative to the largest |b| of that output (random
    weights make some models' outputs tiny: an absolute difference would say nothing)."""
    out = 0.0
    for x, y in zip(a, b, strict=True):
        x = np.asarray(x, np.float64).reshape(-1)
        y = np.asarray(y, np.float64).reshape(-1)
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        out = max(out, float(np.max(np.abs(x - y))) / (scale or 1.0) if y.size else 0.0)
    return out


def write_block(path: str, name: str, command: str, body: str, with_machine: bool = True
                ) -> None:
    """Put ``body`` (with the command and, ``with_machine``, this machine's line) between the
    ``name`` markers of the markdown file ``path`` (appended when the markers are not there
    yet)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    here = [f"Machine: {machine()}; measured {time.strftime('%Y-%m-%d')}.", ""] \
        if with_machine else []
    block = "\n".join([begin, f"`{command.strip()}`", "", *here, body, end])
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(f"{name} table written to {path}")


def table(markdown: str | None, name: str, command: str, head: list[str],
          rows: Callable[[], list[str]]) -> None:
    """Print the machine line and the table head, then ``rows()`` (each printed as measured);
    with ``markdown``, write the table between the ``name`` markers of that file."""
    print(machine())
    print(*head, sep="\n")
    body = rows()
    if markdown:
        write_block(markdown, name, command, "\n".join(head + body))
