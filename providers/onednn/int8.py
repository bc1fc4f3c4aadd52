"""Int8 kernels for QDQ models. A claimed convolution or dense layer (``chains``) computes in
int8 where the host has VNNI (``VNNI_ISAS``) and

- its input is a dequantize of one scale and zero point from an int8 or uint8 tensor (how a QDQ
  model feeds every layer): the kernel quantizes the float input onto that grid itself, as
  uint8 (an int8 grid shifted by 128), a reorder that costs a tenth of the convolution;
- its weights are an int8 grid per output channel (``weight_grid``: the dequantized weights the
  import folded, recovered bit for bit, never approximately);
- the uint8 zero point is 0 (the grid of a ReLU's output) or nothing pads the input (a dense
  layer, an unpadded convolution): the zero point's share of the sums is then a constant per
  channel, folded into the bias (a padded border would read the grid's zero as 0).

The kernel then computes what the float kernel computed on those numbers (the products exact in
int32, times the input's scale and the weights' per channel, plus the bias, then the post-ops),
about 4x faster (oneDNN's brgconv on AVX-512 VNNI, 2 threads, ``python/bench_onednn_primitives.cc``:
a 3x3 64 -> 64 convolution at 56x56 980 -> 251 us, a 1x1 256 -> 64 one 447 -> 115 us).
"""

from __future__ import annotations

import numpy as np

from hgrt.providers.onednn.chains import Chain, ChainGraph, quant_scalars
from hgrt.relay_passes.util.relax_util import op_name

# oneDNN's ISAs with VNNI (u8 x s8 dot products without saturation): where int8 pays and where
# weights packed without the scale adjustment older ISAs need run
VNNI_ISAS = frozenset({"avx512_core_vnni", "avx512_core_bf16", "avx512_core_fp16",
                       "avx512_core_amx", "avx512_core_amx_fp16", "avx2_vnni", "avx2_vnni_2"})
# the largest magnitude of an int8 grid's weights: symmetric (127, or 128 where -128 occurs),
# a reduced range (63, 64); then any other, down to 16 (a channel whose peak missed the end)
_PEAKS = (127, 128, 63, 64, *range(126, 15, -1))


def _guesses(peak: np.ndarray):
    """Scales to try per channel: its peak (then the tensor's: one scale for all) over a grid's
    largest number, and the float32 numbers next to that."""
    for top in _PEAKS:
        for base in (peak, np.full_like(peak, peak.max())) if top in _PEAKS[:4] else (peak,):
            s = (base / np.float32(top)).astype(np.float32)
            up, down = np.nextafter(s, np.float32(np.inf)), np.nextafter(s, np.float32(0))
            yield from (s, up, down, np.nextafter(up, np.float32(np.inf)),
                        np.nextafter(down, np.float32(0)))


def _on_grid(rows: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per row, whether ``rows`` are int8 numbers times ``s`` bit for bit."""
    q = np.rint(rows / s[:, None])
    return ((q >= -128) & (q <= 127)).all(axis=1) & (
        (q.astype(np.float32) * s[:, None]) == rows).all(axis=1)


def weight_grid(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``w`` (output channels first) as int8 numbers times a float32 scale per output channel,
    ``(q, scale)`` with ``q * scale == w`` bit for bit in float32 (what a dequantize computed),
    or None where no such grid holds (``_guesses`` the scales tried)."""
    rows = np.ascontiguousarray(w, dtype=np.float32).reshape(w.shape[0], -1)
    peak = np.abs(rows).max(axis=1)
    scale = np.ones(len(rows), np.float32)
    found = peak == 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for s in _guesses(peak):
            todo = np.flatnonzero(~found & (s > 0) & np.isfinite(s))
            if not len(todo):
                break
            todo = todo[_on_grid(rows[todo, :16], s[todo])]  # a few numbers first: cheap
            ok = todo[_on_grid(rows[todo], s[todo])]
            scale[ok], found[ok] = s[ok], True
    if not found.all():
        return None
    q = np.rint(rows / scale[:, None]).astype(np.int8)
    return q.reshape(w.shape), scale


def input_grid(g: ChainGraph, chain: Chain) -> tuple[float, int] | None:
    """The uint8 grid ``(scale, zero point)`` of the chain's input where that input is a
    dequantize of one scale and zero point from an int8 or uint8 tensor, else None."""
    b = g.binding_of.get(chain.x)
    if b is None or op_name(b.value) != "relax.dequantize":
        return None
    dtype = str(getattr(b.value.args[0].ty, "dtype", ""))
    grid = quant_scalars(g, b.value)
    if dtype not in ("int8", "uint8") or grid is None:
        return None
    scale, zero = grid
    zero += 128 if dtype == "int8" else 0
    return (scale, int(zero)) if float(zero).is_integer() and 0 <= zero <= 255 else None


def _padded(chain: Chain) -> bool:
    return chain.kind == "conv2d" and any(int(p) for p in chain.root.value.attrs.padding)


def int8_able(g: ChainGraph, chain: Chain) -> bool:
    """Whether ``to_int8`` would make ``chain`` an int8 kernel (it changes nothing)."""
    grid = input_grid(g, chain)
    return grid is not None and not (grid[1] and _padded(chain)) \
        and weight_grid(chain.weight) is not None


def to_int8(g: ChainGraph, chain: Chain) -> bool:
    """Make ``chain`` an int8 kernel where it can be one (see the module doc): its weights the
    int8 grid, ``wscale`` the input's scale times theirs per output channel, ``grid`` the
    input's, the zero point's share in the bias. Whether it did."""
    grid = input_grid(g, chain)
    if grid is None or (grid[1] and _padded(chain)):
        return False
    found = weight_grid(chain.weight)
    if found is None:
        return False
    q, wscale = found
    scales = np.float64(grid[0]) * wscale.astype(np.float64)
    if grid[1]:  # sum((u - z) * w) = sum(u * w) - z * sum(w), per output channel
        sums = q.reshape(len(q), -1).astype(np.int64).sum(axis=1)
        chain.bias = (chain.bias - scales * grid[1] * sums).astype(np.float32)
    chain.weight, chain.wscale, chain.grid = q, scales.astype(np.float32), grid
    chain.label[0] = f"{chain.label[0]}(int8)"
    return True


def quantize_chains(g: ChainGraph, chains: list[Chain], isa: str) -> int:
    """The chains that become int8 kernels (``to_int8``) on a host of ``isa``: how many."""
    if isa not in VNNI_ISAS:
        return 0
    return sum(to_int8(g, c) for c in chains)


__all__ = ["VNNI_ISAS", "input_grid", "int8_able", "quantize_chains", "to_int8", "weight_grid"]
