"""The CUDA path end to end, for a machine with a GPU: run it there first.

light squeezenet (random weights, the last layer calibrated) built for [cpu, cuda] with
convolutions on the GPU and for cuda only; both run and compared with onnxruntime (CPU) on the
ONNX file (ONNX's reference evaluator where it is not installed); the profile with its
GPU track; the memory plan of the GPU pool; and the split model run remotely over a loopback
TVM RPC tracker + `hgrt rpc-server`. Without a GPU it says so and exits 0. It builds on the GPU
machine, so that machine needs TVM's compiler; where only TVM's runtime can travel (a wheel too
large to carry), `python/gpu_bench.py` checks the same builds, made here, against onnxruntime.

    python python/gpu_check.py [--model squeezenet] [--no-rpc]
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import tvm

import hgrt
from hgrt.testing import onnx_reference, zoo_input, zoo_model


def cuda_arch() -> str:
    major, minor = tvm.cuda(0).compute_version.split(".")
    return f"sm_{major}{minor}"


def check(name: str, got: np.ndarray, refs: dict) -> None:
    for ref_name, want in refs.items():
        if want is None:
            continue
        err = float(np.max(np.abs(got - want)))
        print(f"  {name}: max |hgrt - {ref_name}| = {err:.3g}")
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def local_runs(model, inputs: dict, refs: dict, arch: str, out_dir: str) -> str:
    """Split and cuda-only builds, run locally; returns the split artifact directory."""
    split_dir = os.path.join(out_dir, "split")
    configs = {
        "split (conv on cuda)": (["cpu:0", "cuda:0"],
                                 hgrt.Placement(rules={"nn.conv2d": "cuda:0"}, fallback="cpu:0")),
        "cuda only": (["cuda:0", "cpu:0"], hgrt.Placement(preferred="cuda:0", fallback="cpu:0")),
    }
    for label, (names, placement) in configs.items():
        t0 = time.perf_counter()
        res = hgrt.build(model, names, placement, cuda_arch=arch)
        copies = sum(1 for n in res.graph.nodes if n.func_name == "__copy")
        print(f"{label}: built in {time.perf_counter() - t0:.1f} s, {copies} copies, pools "
              + ", ".join(f"{names[m.device]} {m.planned_bytes / 2**20:.2f} MiB (lower bound "
                          f"{m.lower_bound / 2**20:.2f})" for m in res.memory_report))
        devices = [hgrt.devices.runtime_device(n) for n in names]
        art = hgrt.save(split_dir if label.startswith("split") else
                        os.path.join(out_dir, "cuda"), res)
        m = hgrt.load(art, devices)
        m.set_input(**inputs)
        m.run()
        check(label, m.get_output(0).numpy(), refs)
        print(f"  run(): {m.benchmark(repeat=10, number=5)}")
        report = m.profile(repeat=10)
        print(report.table(top=8))
        trace = os.path.join(out_dir, f"{label.split()[0]}_trace.json")
        report.save_chrome_trace(trace)
        print(f"  Chrome trace: {trace}")
    return split_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remote_run(art: str, inputs: dict, refs: dict) -> None:
    """The split artifacts over a loopback tracker + hgrt rpc-server, on remote cpu + cuda."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                               "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)])]
    try:
        time.sleep(2)
        procs.append(subprocess.Popen([sys.executable, "-m", "hgrt", "rpc-server", "--tracker",
                                       f"127.0.0.1:{port}", "--key", "gpu", "--port",
                                       str(free_port())]))
        remote = hgrt.rpc.connect(tracker=f"127.0.0.1:{port}", key="gpu", timeout=120)
        with hgrt.load(art, ["cpu:0", "cuda:0"], session=remote) as m:
            m.set_input(**inputs)
            m.run()
            check("remote split", m.get_output(0).numpy(), refs)
            print(f"  remote run() (in the server): {m.benchmark(repeat=10, number=5)}")
        print(f"  server after close: {hgrt.rpc.stats(remote)}")
    finally:
        for p in reversed(procs):
            subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="squeezenet")
    ap.add_argument("--no-rpc", action="store_true", help="skip the remote run")
    ap.add_argument("--out", default=None, help="artifact directory (default: a temp dir)")
    args = ap.parse_args()
    if not tvm.cuda(0).exist:
        print("gpu_check: no GPU here (tvm.cuda(0).exist is False); nothing to check")
        return 0
    arch = cuda_arch()
    print(f"GPU: {tvm.cuda(0).device_name}, compute {tvm.cuda(0).compute_version} ({arch}), "
          f"{tvm.cuda(0).total_global_memory / 2**30:.1f} GiB")
    model = zoo_model(args.model)  # calibrated: the softmax carries numbers, not one class
    inputs = zoo_input(model)
    refs = {"onnxruntime (cpu)": onnx_reference(model, inputs)[0]}
    out_dir = args.out or tempfile.mkdtemp(prefix="hgrt_gpu_check_")
    art = local_runs(model, inputs, refs, arch, out_dir)
    if not args.no_rpc:
        remote_run(art, inputs, refs)
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
