"""cuBLAS / cuDNN, the kernel provider of CUDA GPUs: dense layers and matmuls through cuBLASLt
(bias and ReLU as its epilogue), convolutions through cuDNN (per-channel scales folded into
the weights; bias, residual and activation in the same call), claimed after the batch norms are
folded (``claim_cudalibs``); the kernels (``kernels`` + ``cudalibs_shim.cc``) are compiled once
per machine against the NVIDIA wheels (the ``cuda`` extra) and take their attributes from the
function name a graph node calls (``names``).

This file is the provider's declaration, what the rest of hgrt knows of it: it imports only
the registry (base layer).
"""

from typing import Any

from hgrt.providers.registry import KernelProvider

__all__ = ["PROVIDER"]


def _serves(device: Any) -> bool:
    """A CUDA GPU (a ``DeviceSpec``)."""
    return device.kind == "cuda"


PROVIDER = KernelProvider(
    name="cudalibs",
    title="cuBLAS/cuDNN",
    func_prefix="hgrt.cudalibs.",
    runtime="hgrt.providers.cudalibs.kernels",
    serves=_serves,
    passes=(("tail", "hgrt.providers.cudalibs.claim_cudalibs:claim_cudalibs"),),
    op_attr="cudalibs_op",
)
