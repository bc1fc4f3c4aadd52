"""oneDNN, the kernel provider of x86-64 CPUs: convolutions and dense layers with their
post-ops, and the NHWC ops between them (``claim_onednn``), per-channel affine chains after its
kernels (``claim_affine``), weights packed once into blobs (``blob``) by the shim
(``kernels`` + ``onednn_*.cc``, compiled once per machine against the oneDNN wheels).

This file is the provider's declaration, what the rest of hgrt knows of it: it imports only
the registry (base layer, so that the graph's validation can read it).
"""

from typing import Any

from hgrt.providers.registry import KernelProvider

__all__ = ["PROVIDER"]

MIB = 1 << 20


def _winograd_note(graph: Any, device: int) -> str:
    """What Winograd convolutions' weights take of a logical device's (36 numbers per filter
    where a direct convolution keeps 9), said where there are any."""
    nbytes = 0
    for node in graph.nodes:
        if "(winograd)" in node.attrs.get("onednn_op", "") and len(node.inputs) > 1:
            blob = graph.entry_id(node.inputs[1][0], node.inputs[1][1])  # (input, blob, ...)
            if graph.entry_device(blob) == device:
                nbytes += graph.entry_bytes(blob)
    if not nbytes:
        return ""
    return (f"; {nbytes / MIB:.1f} MiB of the weights are Winograd convolutions' (built with "
            f"Kernels(..., winograd=False) / --winograd none they take about a quarter of "
            f"that)")


def _serves(device: Any) -> bool:
    """An x86-64 CPU (a ``DeviceSpec``): an aarch64 board's build leaves its ops to TVM."""
    triple = str(device.target.attrs.get("mtriple", "")) if device.kind == "cpu" else "none"
    return device.kind == "cpu" and (not triple or triple.startswith("x86_64"))


def _weights_line(w: dict) -> str:
    return (f"oneDNN's weights: {w['packed'] / MIB:.1f} MiB packed in {w['blobs']} blobs for "
            f"{w['plain'] / MIB:.1f} MiB of plain weights and biases"
            + (f"; {w['winograd']} Winograd convolutions add "
               f"{w['winograd_growth'] / MIB:.1f} MiB of it" if w.get("winograd") else ""))


PROVIDER = KernelProvider(
    name="onednn",
    title="oneDNN",
    func_prefix="hgrt.onednn.",
    runtime="hgrt.providers.onednn.kernels",
    serves=_serves,
    passes=(("claim", "hgrt.providers.onednn.claim_onednn:claim_onednn"),
            ("tail", "hgrt.providers.onednn.claim_affine:claim_affine")),
    inplace=True,  # the sum post-op reads each residual element before writing it
    any_alignment=True,  # its kernels load unaligned
    solo_neighbours=True,  # its OpenMP threads spin between kernels
    op_attr="onednn_op",
    isa_attr="onednn_isa",
    weights_summary="hgrt.providers.onednn.blob:blob_bytes",
    format_weights=_weights_line,
    device_note=_winograd_note,
    options=("winograd",),
)
