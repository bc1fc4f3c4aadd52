"""The links between devices: what one copy costs (a latency plus bytes over a bandwidth), and
where hgrt keeps what it measures or builds once per machine (``cache_root``).

A local CUDA GPU's link to the host is measured once (``measure_link``: tensors of a few sizes
copied both ways, the median of several copies each) and kept as JSON in the cache, keyed by
the GPU's name and id; a machine without one (a build host) keeps ``DEFAULT_LINK``. Each
``Link`` says where it came from: "measured", "cached", "profile" (the ``links`` of an
``hgrt profile --json`` file) or "default".

>>> DEFAULT_LINK.seconds(8e6)  # 5 us + 1 ms
0.001005
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from hgrt.devices.identity import split_device

SIZES = (4 << 10, 256 << 10, 4 << 20)  # bytes per measured copy
REPEAT = 15


@dataclass(frozen=True)
class Link:
    """One copy between a device and the host costs ``latency_s + nbytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float
    source: str = "default"  # "measured", "cached", "profile" or "default"

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def describe(self) -> str:
        return f"{self.latency_s * 1e6:.1f} us + {self.bytes_per_s / 1e9:.1f} GB/s ({self.source})"


DEFAULT_LINK = Link(5e-6, 8e9)  # a PCIe link of a few GB/s, a few microseconds a copy


def cache_root() -> Path:
    """Where hgrt keeps what it builds or measures once per machine (``HGRT_CACHE_DIR``, else
    ~/.cache/hgrt)."""
    return Path(os.environ.get("HGRT_CACHE_DIR", "~/.cache/hgrt")).expanduser()


def _median_seconds(copy: Callable[[], None], sync: Callable[[], None], repeat: int) -> float:
    copy()
    sync()  # warm: the first copy pays for pinned staging buffers
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _fit(sizes: tuple[int, ...], seconds: list[float]) -> dict[str, float]:
    """latency: the smallest copy's time; bandwidth: the slope from the smallest to the largest."""
    latency = max(seconds[0], 1e-7)
    slope = (seconds[-1] - seconds[0]) / (sizes[-1] - sizes[0])
    bandwidth = 1.0 / slope if slope > 0 else sizes[-1] / max(seconds[-1], 1e-9)
    return {"latency_s": latency, "bytes_per_s": bandwidth}


def measure_link(dev: tvm.runtime.Device, sizes: tuple[int, ...] = SIZES,
                 repeat: int = REPEAT) -> dict[str, Any]:
    """Host -> ``dev`` and ``dev`` -> host copies of ``sizes`` bytes (``Tensor.copyfrom`` /
    ``copyto``), the median time of ``repeat`` each; the link is their mean."""
    host_dev = tvm.cpu(0)
    out: dict[str, Any] = {"sizes": list(sizes)}
    for way in ("h2d", "d2h"):
        seconds = []
        for n in sizes:
            host = tvm.runtime.tensor(np.ones(n, "uint8"), host_dev)
            there = tvm.runtime.empty((n,), "uint8", dev)
            copy = (lambda h=host, t=there: t.copyfrom(h)) if way == "h2d" else \
                (lambda h=host, t=there: t.copyto(h))
            seconds.append(_median_seconds(copy, dev.sync, repeat))
        out[way] = {"seconds": seconds, **_fit(sizes, seconds)}
    out["latency_s"] = (out["h2d"]["latency_s"] + out["d2h"]["latency_s"]) / 2
    out["bytes_per_s"] = 2 / (1 / out["h2d"]["bytes_per_s"] + 1 / out["d2h"]["bytes_per_s"])
    return out


def cached_link(key: str, measure: Callable[[], dict[str, Any]]) -> Link:
    """The link cached under ``key`` ("cached"), else ``measure()`` written there ("measured")."""
    path = cache_root() / "links" / (re.sub(r"[^\w.-]+", "_", key) + ".json")
    try:
        data = json.loads(path.read_text())
        return Link(float(data["latency_s"]), float(data["bytes_per_s"]), "cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure anew
    data = {"key": key, **measure()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # whole files only, should two builds measure at once
    return Link(float(data["latency_s"]), float(data["bytes_per_s"]), "measured")


def link_of(name: str, profile: Mapping[str, Any] | None = None) -> Link:
    """The link between device ``name`` and the host: from ``profile`` (``{"cuda:0":
    {"latency_s", "bytes_per_s"}}``) if it names the device, measured (once, then cached) for a
    CUDA GPU on this machine, else ``DEFAULT_LINK``."""
    if profile and name in profile:
        got = profile[name]
        return replace(DEFAULT_LINK, latency_s=float(got["latency_s"]),
                       bytes_per_s=float(got["bytes_per_s"]), source="profile")
    kind, index = split_device(name)
    if kind != "cuda":
        return DEFAULT_LINK
    dev = tvm.cuda(index)
    if not dev.exist:
        return DEFAULT_LINK
    return cached_link(f"{dev.device_name}-cuda{index}", lambda: measure_link(dev))
