"""The ``hgrt`` command line: compile, run, and friends.

    hgrt tune model.onnx --device cpu:0 --device cpu:1 --place nn.conv2d=cpu:1 --db tuning/
    hgrt compile model.onnx --device cpu:0 --device cpu:1 --place nn.conv2d=cpu:1 \
        --tuning-db tuning/ -o out/
    hgrt compile model.onnx --device cpu:0 --device cpu:1 --target cpu=raspberry-pi/4b-aarch64 \
        -o out/       # for a board: cross-linked with aarch64-linux-gnu-g++ (or --cc)
    hgrt compile model.onnx --device cpu --target 'cpu=llvm -mcpu=haswell' -o out/  # AVX2
    hgrt run out/ --input x=x.npy [--device cpu:0 --device cpu:1] [--save-output y.npz]
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
import time

import numpy as np

from hgrt import providers
from hgrt.errors import HgrtError, InputError

log = logging.getLogger("hgrt")


def at_least(low: int):
    """An argparse type: an integer >= ``low`` (a usage error otherwise, not a traceback or a
    count that silently means something else, as --top -1 dropping the last row did)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InputError(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _load_inputs(items: list[str] | None) -> dict[str, np.ndarray]:
    inputs = {}
    for name, path in _pairs(items, "--input").items():
        try:
            inputs[name] = np.load(path)
        except (OSError, ValueError) as e:
            raise InputError(f"--input {name}={path}: cannot read a .npy file: {e}") from e
    return inputs


def _input_shapes(items: list[str] | None) -> dict[str, list[int]]:
    shapes = {}
    for name, dims in _pairs(items, "--input-shape").items():
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise InputError(f"--input-shape {name}={dims}: expected comma-separated integers") \
                from None
    return shapes


# ---- compile ------------------------------------------------------------------------------

def _placement(args: argparse.Namespace):
    import hgrt

    return hgrt.Placement(
        rules=_pairs(args.place, "--place"),
        overrides=_pairs(args.override, "--override"),
        preferred=args.prefer,
        fallback=args.fallback or args.device[0],
    )


def _kernels(args: argparse.Namespace):
    """``--kernels`` with its per-op ``--kernels-rule`` / ``--kernels-override``: what
    ``hgrt.build(kernels=)`` takes."""
    rules = _pairs(args.kernels_rule, "--kernels-rule")
    overrides = _pairs(args.kernels_override, "--kernels-override")
    winograd = winograd_arg(args)
    if not rules and not overrides and winograd is None:
        return args.kernels
    from hgrt.relay_passes.util.kernels import WINOGRAD_SHARE, Kernels

    return Kernels.of(Kernels(args.kernels, rules=rules, overrides=overrides,  # checked now
                              winograd=WINOGRAD_SHARE if winograd is None else winograd))


def winograd_arg(args: argparse.Namespace) -> bool | float | None:
    """``--winograd all|none|SHARE`` (``--no-winograd``: none) as ``Kernels(winograd=)``
    takes it; None where neither was given."""
    if args.no_winograd:
        if args.winograd not in (None, "none"):
            raise SystemExit(f"hgrt: --no-winograd and --winograd {args.winograd} contradict")
        return False
    if args.winograd is None:
        return None
    if args.winograd in ("all", "none"):
        return args.winograd == "all"
    try:
        share = float(args.winograd)
    except ValueError:
        share = -1.0
    if not share >= 0:
        raise SystemExit(f"hgrt: --winograd {args.winograd!r}: all, none or a share >= 0 of "
                         f"the model's weight bytes (0.1)")
    return share


def parse_targets(items: list[str] | None) -> dict[str, str] | None:
    """``--target`` values as ``hgrt.build(target=)`` takes them: ``KIND=TARGET`` or
    ``DEVICE=TARGET`` (``cpu=raspberry-pi/4b-aarch64``, ``cpu:1={"kind": "llvm", ...}``,
    ``cpu=llvm -mcpu=haswell``), or a target alone for the devices of its kind. TARGET is a
    tag, a JSON target or a classic option string (``hgrt.devices.as_target``). The benchmarks
    (``python/bench_*.py --target``) parse theirs here too.

    >>> parse_targets(["cpu=llvm -mcpu=haswell"])
    {'cpu': 'llvm -mcpu=haswell'}
    """
    from hgrt.devices import as_target, kind_of, split_device

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        # a KEY= prefix names a device ("cpu", "cuda:1"); "llvm -mcpu=haswell" or JSON do not
        if sep and re.fullmatch(r"\s*[A-Za-z_]+(:\w*)?\s*", key):
            split_device(key)  # a DeviceError naming the known kinds
            as_target(value, f"--target {key.strip()}")  # a bad target fails here, by name
            out[key.strip()] = value.strip()
        else:
            out[kind_of(as_target(item, "--target")).name] = item
    return out or None


def isa_lines(result) -> list[str]:
    """Per CPU device of a ``BuildResult``, the target, vector ISA and cores its kernels were
    built for: ``cpu:0: llvm mcpu=haswell, vector ISA avx2 (256-bit, 16 registers), 2 cores``;
    a target without ``-num-cores`` says that its TVM kernels run serial."""
    from hgrt.devices import as_target, is_cpu, vector_isa

    lines = []
    for name, spec in result.targets.items():
        if not is_cpu(name):
            continue
        t = as_target(spec)
        what = " ".join([t.kind.name] + [f"{k}={t.attrs[k]}" for k in ("mtriple", "mcpu")
                                         if k in t.attrs and str(t.attrs[k])])
        isa = vector_isa(t)
        cores = int(t.attrs.get("num-cores", 0) or 0)
        lines.append(f"{name}: {what}, vector ISA {isa.name} ({isa.bits}-bit, "
                     f"{isa.registers} registers), " + (
                         f"{cores} core{'s' if cores > 1 else ''}" if cores else
                         "1 core (no -num-cores in its target: TVM's kernels run serial)"))
    return lines


def cmd_compile(args: argparse.Namespace) -> int:
    import hgrt

    t0 = time.perf_counter()
    if args.stages or args.cut:
        return _compile_stages(args, t0)
    result = hgrt.build(args.model, devices=args.device, placement=_placement(args),
                        input_shapes=_input_shapes(args.input_shape) or None,
                        tuning_db=args.tuning_db, target=parse_targets(args.target),
                        kernels=_kernels(args), verbose=True)
    hgrt.save(args.output, result, cc=args.cc)
    for line in isa_lines(result):
        print(line)
    print(f"compiled {args.model} for {args.device} in {time.perf_counter() - t0:.1f} s "
          f"-> {args.output}/ (graph.json, lib.so, params.bin)")
    return 0


def _compile_stages(args: argparse.Namespace, t0: float) -> int:
    """``--stages K`` (or ``--cut``): a pipeline of K stages, each on ``--device``'s devices."""
    from hgrt.stages import split

    k = args.stages or len(args.cut) + 1
    budgets = list(args.stage_budget or [])
    keys = list(args.stage_key or [])
    for what, given in (("--stage-budget", budgets), ("--stage-key", keys)):
        if given and len(given) != k:
            raise SystemExit(f"hgrt: {what} given {len(given)} times for {k} stages: give it "
                             f"once per stage, in order")
    if args.cut and len(args.cut) != k - 1:
        raise SystemExit(f"hgrt: --cut given {len(args.cut)} times for {k} stages: give K - 1")
    stages = [{"devices": list(args.device), "budget": budgets[i] if budgets else None,
               "key": keys[i] if keys else None} for i in range(k)]
    res = split(args.model, stages, cuts=args.cut or None, placement=_placement(args),
                input_shapes=_input_shapes(args.input_shape) or None,
                tuning_db=args.tuning_db, target=parse_targets(args.target),
                kernels=_kernels(args), link_bytes_per_s=args.stage_link)
    res.save(args.output)
    print(res.report())
    print(f"compiled {args.model} into {k} pipeline stages for {args.device} in "
          f"{time.perf_counter() - t0:.1f} s -> {args.output}/ (pipeline.json, "
          f"{', '.join(f'stage{i}/' for i in range(k))})")
    return 0


# ---- zoo ----------------------------------------------------------------------------------

def cmd_zoo(args: argparse.Namespace) -> int:
    from hgrt.zoo import zoo_listing, zoo_write

    if args.list:
        print("\n".join(zoo_listing()))
        return 0
    if not args.name or not args.output:
        raise InputError("hgrt zoo NAME -o FILE.onnx (or hgrt zoo --list)")
    what, inputs = zoo_write(args.name, args.output, args.size, args.seed)
    print(f"{what} -> {args.output}")
    if args.input:  # the first input as .npy; every input by name as .npz
        if args.input.endswith(".npz"):
            np.savez(args.input, **inputs)
        else:
            np.save(args.input, next(iter(inputs.values())))
        print(f"inputs {', '.join(f'{k} {list(v.shape)}' for k, v in inputs.items())} -> "
              f"{args.input}")
    return 0


# ---- tune ---------------------------------------------------------------------------------

def cmd_tune(args: argparse.Namespace) -> int:
    from hgrt.tune import tune

    if not args.verbose:  # MetaSchedule's per-round log stays in DB/logs/, off the console
        logging.getLogger("tvm.s_tir.meta_schedule").propagate = False
    t0 = time.perf_counter()
    summaries = tune(args.model, args.db, args.trials_per_task, devices=args.device,
                     placement=_placement(args),
                     input_shapes=_input_shapes(args.input_shape) or None,
                     cost_model=args.cost_model, kernels=_kernels(args),
                     verify=not args.no_verify)
    for s in summaries:
        print(f"{s.target}: {s.tasks} tasks, {len(s.trials)} tuned now, "
              f"{len(s.skipped)} done before, {s.seconds:.0f} s")
    q = shlex.quote  # patterns (nn.conv*) would be globbed by the shell
    same = [f"--device {q(d)}" for d in args.device]
    same += [f"--place {q(p)}" for p in args.place or []]
    same += [f"--override {q(o)}" for o in args.override or []]
    same += [f"--{k} {v}" for k, v in (("prefer", args.prefer), ("fallback", args.fallback),
                                       ("kernels", args.kernels)) if v and v != "auto"]
    same += [f"--kernels-rule {q(r)}" for r in args.kernels_rule or []]
    same += [f"--kernels-override {q(o)}" for o in args.kernels_override or []]
    same += ["--no-winograd"] if args.no_winograd else []
    same += [f"--winograd {args.winograd}"] if args.winograd is not None else []
    same += [f"--input-shape {q(i)}" for i in args.input_shape or []]
    print(f"database {args.db}/ written in {time.perf_counter() - t0:.0f} s; build with "
          f"`hgrt compile {args.model} {' '.join(same)} --tuning-db {args.db} -o OUT`")
    return 0


# ---- run ----------------------------------------------------------------------------------

def _run_pipeline(args: argparse.Namespace) -> int:
    """``hgrt run`` of a pipeline directory: stage k on the board of the k-th ``--rpc-key`` (or
    the key saved with the stage; none: this machine)."""
    import hgrt
    from hgrt.pipelines import load_pipeline, read_doc

    doc = read_doc(args.artifacts)
    n = len(doc["stages"])
    keys = list(args.rpc_key or []) or [s.get("key") for s in doc["stages"]]
    if len(keys) != n:
        raise SystemExit(f"hgrt: the pipeline has {n} stages: give --rpc-key once per stage "
                         f"(got {len(keys)})")
    if any(keys) and not args.rpc_tracker:
        raise SystemExit("hgrt: the stages name tracker keys: give --rpc-tracker HOST:PORT")
    sessions = [hgrt.rpc.connect(tracker=args.rpc_tracker, key=key) if key else None
                for key in keys]
    inputs = _load_inputs(args.input)
    for t in doc["inputs"]:
        if t["name"] not in inputs:
            if not args.random_inputs:
                raise InputError(f"no value for input {t['name']!r}: give --input NAME=FILE.npy "
                                 f"(or --random-inputs); expected {t['dtype']}{t['shape']}")
            inputs[t["name"]] = np.random.default_rng(0).standard_normal(
                t["shape"]).astype(t["dtype"])
    with load_pipeline(args.artifacts, sessions) as p:
        outputs = p(inputs)
        for i, out in enumerate(outputs):
            print(f"output {i}: shape {out.shape} {out.dtype}  mean {float(np.mean(out)):.6g}  "
                  f"first {np.ravel(out)[:4]}")
        if args.repeat:
            t0 = time.perf_counter()
            for _ in p.map([inputs] * args.repeat):
                pass
            dt = time.perf_counter() - t0
            print(f"{args.repeat} inputs streamed through {n} stages on "
                  f"{', '.join(p.boards)}: {args.repeat / dt:.1f} inputs/s; ms per input by "
                  f"stage {', '.join(f'{t:.2f}' for t in p.stage_ms())} (tensors "
                  f"{'board to board' if p.transfer == 'direct' else 'through this process'})")
    if args.save_output:
        np.savez(args.save_output, *outputs)
        print(f"outputs saved to {args.save_output}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hgrt.pipelines import is_pipeline

    if is_pipeline(args.artifacts):
        return _run_pipeline(args)
    if args.rpc_key and len(args.rpc_key) > 1:
        raise SystemExit("hgrt: --rpc-key given more than once: one module runs on one board "
                         "(a pipeline directory takes one per stage)")
    m, devices = _module_for(args)
    m.run()
    outputs = [m.get_output(i).numpy() for i in range(m.get_num_outputs())]
    where = ", ".join(str(d) for d in devices)
    for i, out in enumerate(outputs):
        print(f"output {i}: shape {out.shape} {out.dtype}  mean {float(np.mean(out)):.6g}  "
              f"first {np.ravel(out)[:4]}")
    if args.repeat:
        r = m.benchmark(repeat=args.repeat, number=1)
        print(f"run() on [{where}]: {r}")
    if args.save_output:
        np.savez(args.save_output, *outputs)
        print(f"outputs saved to {args.save_output}")
    return 0


def _module_for(args: argparse.Namespace):
    """A GraphModule for the artifacts named on the command line, params loaded, inputs set."""
    import hgrt

    session = None
    if getattr(args, "rpc_tracker", None):
        key = args.rpc_key[0] if isinstance(args.rpc_key, list) else args.rpc_key
        session = hgrt.rpc.connect(tracker=args.rpc_tracker, key=key or "")
    m = hgrt.load(args.artifacts, args.device, session=session)
    devices = m.devices
    inputs = _load_inputs(args.input)
    shapes, dtypes = m.get_input_info()
    missing = [n for n in shapes if n not in inputs]
    if missing:
        if not args.random_inputs:
            raise InputError(f"no value for inputs {missing}: give --input NAME=FILE.npy (or "
                             f"--random-inputs); expected "
                             f"{[(n, shapes[n], dtypes[n]) for n in missing]}")
        rng = np.random.default_rng(0)
        for n in missing:
            inputs[n] = rng.standard_normal(shapes[n]).astype(dtypes[n])
    m.set_input(**inputs)
    return m, devices


def cmd_profile(args: argparse.Namespace) -> int:
    m, _ = _module_for(args)
    report = m.profile(repeat=args.repeat)
    print(report.table(top=args.top))
    if args.json:
        print(f"kernel rates per device written to {report.save_rates(args.json)}")
    if args.trace:
        report.save_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from hgrt.inspect import format_ops, format_summary, inspect_artifacts

    summary, files = inspect_artifacts(args.artifacts, args.out)
    print(format_summary(summary))
    if args.ops:
        print(format_ops(summary["ops"]))
    print("pictures:", *files, sep="\n  ")
    return 0


# ---- entry point --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hgrt", description="heterogeneous graph runtime for TVM")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    _add_compile_command(sub)
    _add_run_command(sub)
    _add_profile_command(sub)
    _add_inspect_command(sub)
    _add_tune_command(sub)
    _add_zoo_command(sub)

    from hgrt.rpc.cli import register as register_rpc

    register_rpc(sub)
    return p


def _add_compile_command(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compile", help="compile an ONNX model into graph.json + lib.so + params")
    _model_args(c)
    c.add_argument("--tuning-db", help="a MetaSchedule database written by `hgrt tune`")
    c.add_argument("--target", action="append", metavar="KIND=TARGET",
                   help="build the devices of KIND (or one DEVICE) for another machine or CPU: "
                        "a TVM target tag, JSON target or option string, e.g. "
                        "cpu=raspberry-pi/4b-aarch64 or 'cpu=llvm -mcpu=haswell' (repeat for "
                        "cpu and cuda; default: this host)")
    c.add_argument("--cc", help="the compiler that links lib.so (default: this host's, or the "
                                "cross compiler of the target's triple, aarch64-linux-gnu-g++)")
    c.add_argument("--stages", type=at_least(1), metavar="K",
                   help="cut the model into K pipeline stages, each on the --device list, where "
                        "the slowest stage is fastest (hgrt run streams inputs through them)")
    c.add_argument("--cut", action="append", metavar="NODE",
                   help="cut the pipeline after this op (its binding name; K - 1 of them)")
    c.add_argument("--stage-budget", action="append", type=at_least(1), metavar="BYTES",
                   help="weight bytes a stage may hold (once per stage, in order)")
    c.add_argument("--stage-link", type=float, default=1.1e8, metavar="BYTES_PER_S",
                   help="how fast a tensor goes from one stage's board to the next (default "
                        "1.1e8, Gigabit Ethernet): what a cut's bytes cost in the split")
    c.add_argument("--stage-key", action="append", metavar="KEY",
                   help="the tracker key of the board a stage runs on (once per stage)")
    c.add_argument("-o", "--output", required=True, help="artifact directory")
    c.set_defaults(func=cmd_compile)


def _add_run_command(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run compiled artifacts")
    r.add_argument("artifacts", help="directory written by `hgrt compile`")
    r.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    r.add_argument("--random-inputs", action="store_true", help="fill missing inputs randomly")
    r.add_argument("--device", action="append",
                   help="devices in order (default: those the graph was compiled for)")
    r.add_argument("--repeat", type=at_least(0), default=0, help="also time run() this many times")
    r.add_argument("--save-output", help="write the outputs to this .npz")
    r.add_argument("--rpc-tracker", metavar="HOST:PORT", help="run on a remote machine")
    r.add_argument("--rpc-key", action="append",
                   help="device key registered with the tracker (a pipeline: once per stage)")
    r.set_defaults(func=cmd_run)


def _add_profile_command(sub: argparse._SubParsersAction) -> None:
    pr = sub.add_parser("profile", help="per-op times of compiled artifacts, by op and device")
    pr.add_argument("artifacts")
    pr.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    pr.add_argument("--random-inputs", action="store_true")
    pr.add_argument("--device", action="append")
    pr.add_argument("--repeat", type=at_least(1), default=10, help="runs per op (median taken)")
    pr.add_argument("--top", type=at_least(1), default=30, help="rows of the table (slowest first)")
    pr.add_argument("--trace", help="write a Chrome trace JSON here")
    pr.add_argument("--json", help="write each device's measured kernel rates here (for "
                                   "hgrt.Placement(auto=True, profile=...))")
    pr.set_defaults(func=cmd_profile)


def _add_inspect_command(sub: argparse._SubParsersAction) -> None:
    ins = sub.add_parser("inspect", help="nodes per device, copies, memory plan, pictures")
    ins.add_argument("artifacts")
    ins.add_argument("--out", help="where to write the pictures (default ARTIFACTS/inspect)")
    ins.add_argument("--ops", action="store_true",
                     help="per kernel: node, op, device, provider, and why each was chosen")
    ins.set_defaults(func=cmd_inspect)


def _add_tune_command(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tune", help="MetaSchedule-tune the kernels of a placed model into a "
                                    "database that `compile --tuning-db` applies")
    _model_args(t)
    t.add_argument("--db", required=True, help="database directory (created; resumed if there)")
    t.add_argument("--trials-per-task", type=at_least(1), default=16,
                   help="measured candidates per distinct kernel (default 16)")
    t.add_argument("--cost-model", choices=("auto", "random", "xgb"), default="auto",
                   help="xgb needs xgboost (pip install 'hgrt[tune]'); auto: xgb if installed")
    t.add_argument("--no-verify", action="store_true",
                   help="skip timing the tuned kernels inside the model against the default "
                        "schedule (then every tuned kernel is applied)")
    t.set_defaults(func=cmd_tune)


def _add_zoo_command(sub: argparse._SubParsersAction) -> None:
    z = sub.add_parser("zoo", help="write a model to try hgrt on: a light zoo model of the "
                                   "onnx wheel (squeezenet, resnet50, ...) or a corpus model "
                                   "(corpus/gpt2.dynamo, ...), random weights; --list")
    z.add_argument("name", nargs="?", help="a name that --list shows")
    z.add_argument("--list", action="store_true", help="list the models")
    z.add_argument("-o", "--output", help="the .onnx file to write")
    z.add_argument("--size", choices=("tiny", "real"), default="tiny",
                   help="corpus: the committed tiny config, or the real one (exported on "
                        "demand: pip install 'hgrt[corpus]')")
    z.add_argument("--input", help="also write random inputs: the first to a .npy, all to a .npz")
    z.add_argument("--seed", type=at_least(0), default=0)
    z.set_defaults(func=cmd_zoo)


def _model_args(p: argparse.ArgumentParser) -> None:
    """What compile and tune share: the model, its devices and where its ops go."""
    p.add_argument("model", help="path of an .onnx file")
    p.add_argument("--device", action="append", required=True,
                   help="a device, in order (repeat): cpu, cpu:1, cuda:0 ...; the first is the "
                        "primary device")
    p.add_argument("--place", action="append", metavar="OP=DEVICE",
                   help="put every op matching OP (a Relax op name or pattern) on DEVICE")
    p.add_argument("--override", action="append", metavar="NODE=DEVICE",
                   help="put one node (by its binding name) on DEVICE")
    p.add_argument("--prefer", help="device for ops no rule places")
    p.add_argument("--fallback", help="device for ops the preferred device cannot run")
    p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...")
    choices = providers.kernel_choices()
    p.add_argument("--kernels", choices=choices, default="auto",
                   help="who computes the ops a kernel provider can take: tvm, a provider, or "
                        "auto (default: each provider where it is installed and pays; tune "
                        "leaves what a provider computes untuned)")
    p.add_argument("--kernels-rule", action="append", metavar="OP=PROVIDER",
                   help="who computes every op matching OP (nn.conv2d, matmul, a pattern): "
                        f"{', '.join(choices)} (repeat)")
    p.add_argument("--kernels-override", action="append", metavar="NODE=PROVIDER",
                   help="who computes one convolution or matmul (by its binding name, as the "
                        "placement report lists it) (repeat)")
    p.add_argument("--winograd", metavar="all|none|SHARE", default=None,
                   help="which 3x3 convolutions of a provider with Winograd kernels run as "
                        "Winograd where it is faster "
                        "(its weights take 4x the bytes): all, none, or those whose growth "
                        "stays within SHARE of the model's weight bytes (default 0.1)")
    p.add_argument("--no-winograd", action="store_true",
                   help="3x3 convolutions stay direct (--winograd none)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # hgrt's own messages at INFO; other libraries' (MetaSchedule logs every search round at
    # INFO) only with --verbose
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("hgrt").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (HgrtError, OSError) as e:  # a user error: one line, no traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"hgrt {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
