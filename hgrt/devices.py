"""Device names: "cpu", "cpu:1", "cuda", "cuda:0", "llvm" -> tvm Devices."""

from __future__ import annotations

import tvm

from hgrt.errors import DeviceError

# Target kinds and their runtime device kinds.
DEVICE_KINDS = {"cpu": "cpu", "llvm": "cpu", "cuda": "cuda", "gpu": "cuda", "rocm": "rocm",
                "vulkan": "vulkan", "opencl": "opencl", "metal": "metal"}


def split_device(name: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", 0)``."""
    kind, _, index = str(name).strip().partition(":")
    kind = kind.lower()
    if kind not in DEVICE_KINDS:
        raise DeviceError(f"device {name!r}: unknown kind {kind!r}; known: {sorted(DEVICE_KINDS)}")
    if index and not index.isdigit():
        raise DeviceError(f"device {name!r}: index {index!r} is not a non-negative integer")
    return DEVICE_KINDS[kind], int(index or 0)


def parse_device(name: str, session=None):
    """A tvm Device for ``name``; with an RPC ``session``, that session's device."""
    kind, index = split_device(name)
    if session is not None:
        return session.device(kind, index)
    return tvm.device(kind, index)
