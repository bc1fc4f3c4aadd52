"""Single ops on a GPU: TVM's kernel against cuBLAS/cuDNN's, each op a whole hgrt module
(``python/gpu_ops_prepare.py`` builds them; seeded weights made here), ``run()`` medians; with
``--micro``, the shim's kernels called directly against PyTorch's on the same shapes (issue time
per call without a sync, and time per call over 200 calls with one). Works on a runtime-only
TVM (``TVM_USE_RUNTIME_LIB=1``); writes ``$OUT/ops.json`` (and ``micro.json``) where OUT is set.

    python3 python/gpu_ops.py [DIR] [--micro]
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import json
import os
import sys
import time

import numpy as np
import tvm

import hgrt


def _save(rows: list, name: str) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


def ops(folder: str) -> list[dict]:
    devs = [hgrt.devices.runtime_device("cuda:0"), tvm.cpu(0)]
    rows = []
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    for e in index:
        try:
            with open(f"{e['dir']}/shapes.json") as f:
                shapes = json.load(f)
            rng = np.random.default_rng(0)
            params = {n: rng.normal(0, 0.05, s).astype(d) if d.startswith("float")
                      else np.zeros(s, d) for n, (s, d) in shapes.items()}
            with open(f"{e['dir']}/graph.json") as f:
                m = hgrt.create(f.read(), f"{e['dir']}/lib.so", devs)
            m.load_params(params)
            m.set_input(**dict(np.load(e["dir"].rsplit(".", 1)[0] + ".inputs.npz")))
            m.run()
            b = m.benchmark(repeat=15, number=20, warmup=3)
            rows.append({"case": e["case"], "build": e["build"], "macs": e["macs"],
                         "us": round(b.median * 1e6, 1)})
        except Exception as ex:  # noqa: BLE001 - the row says what failed
            rows.append({"case": e["case"], "build": e["build"],
                         "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
        print(rows[-1], flush=True)
    return rows


def _per_call(call, sync, n: int = 200) -> tuple[float, float]:
    call()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return round((t1 - t0) / n * 1e6, 1), round((t2 - t0) / n * 1e6, 1)


def micro() -> list[dict]:
    import torch

    from hgrt.providers.cudalibs import kernels, names

    dev = hgrt.devices.runtime_device("cuda:0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(0)

    def t(shape):
        return tvm.runtime.tensor(rng.normal(size=shape).astype("float32"), dev)

    rows = []
    for n, c, h, o, k, p, g in [(1, 64, 55, 16, 1, 0, 1), (1, 16, 55, 64, 3, 1, 1),
                                (1, 64, 56, 64, 3, 1, 1), (1, 256, 56, 64, 1, 0, 1),
                                (1, 512, 28, 128, 1, 0, 1), (1, 32, 112, 32, 3, 1, 32)]:
        oh = h + 2 * p - k + 1
        x, w, b, y = t((n, c, h, h)), t((o, c // g, k, k)), t((o,)), t((n, o, oh, oh))
        X = torch.randn(n, c, h, h, device="cuda")
        W, B = torch.randn(o, c // g, k, k, device="cuda"), torch.randn(o, device="cuda")
        for act in ("relu", None):
            f = kernels.kernel_function(names.conv2d_name((1, 1), (p, p), (1, 1), g, act=act))
            ours = _per_call(lambda f=f, x=x, w=w, b=b, y=y: f(x, w, b, y), dev.sync)

            def theirs(act=act, X=X, W=W, B=B, p=p, g=g):
                r = torch.nn.functional.conv2d(X, W, B, padding=p, groups=g)
                return torch.relu_(r) if act else r

            peer = _per_call(theirs, torch.cuda.synchronize)
            rows.append({"op": f"conv {c}->{o} {k}x{k} {h}x{h} groups {g} "
                               f"{act or 'no activation'}", "hgrt": ours, "torch": peer})
            print(rows[-1], flush=True)
    for m_, k, n_ in [(128, 768, 768), (128, 768, 3072), (197, 768, 2304), (1, 2048, 1000)]:
        x, w, b, y = t((m_, k)), t((k, n_)), t((n_,)), t((m_, n_))
        f = kernels.kernel_function(names.dense_name(True))
        ours = _per_call(lambda f=f, x=x, w=w, b=b, y=y: f(x, w, b, y), dev.sync)
        X, W = torch.randn(m_, k, device="cuda"), torch.randn(n_, k, device="cuda")
        B = torch.randn(n_, device="cuda")
        peer = _per_call(lambda X=X, W=W, B=B: torch.nn.functional.linear(X, W, B),
                         torch.cuda.synchronize)
        rows.append({"op": f"dense {m_}x{k} -> {n_} + bias", "hgrt": ours, "torch": peer})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    folder = next((a for a in sys.argv[1:] if not a.startswith("-")), ".gpu0/ops")
    _save(ops(folder), "ops.json")
    if "--micro" in sys.argv:
        _save(micro(), "micro.json")


if __name__ == "__main__":
    main()
