"""The packed-weight blob of hgrt's oneDNN kernels: its header, defined once, here.

A blob is a uint8 weight: a header of ``HEADER_INT64`` int64 slots (``HEADER_SLOTS``, in order),
the weights in the layout oneDNN chose at build, then the float32 bias. ``make_header`` fills
what a claimed op computes; the shim's ``pack`` fills the layout slots and the checksum. The
shim reads the same slots through ``providers/onednn/onednn_blob.h``, which this module generates:

    python -m hgrt.providers.onednn.blob > providers/onednn/onednn_blob.h

``tests/runtime/test_blob_format.py`` fails when that file is not what this module generates,
and when the compiled shim reports another format (``hgrt.onednn.blob_format``). A slot added
or moved changes every blob: raise both versions with it.

>>> h = make_header("dense", (1, 8), (1, 4), post=[("relu", 0.0, 0.0)])
>>> int(h[SLOT["kind"]]) == KIND["dense"], int(h[SLOT["post0"]]) == POST_OP["relu"]
(True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAGIC = 0x4C4E4E4454524748  # "HGRTDNNL", little endian
# 4 and 5: the checksum covers the header too (2 and 3 summed the weights only, so a header
# edited to another layout of the same bytes ran with wrong numbers)
HEADER_VERSION = 4
HEADER_VERSION_WINOGRAD = 5  # a Winograd blob (set at pack): an older shim refuses it
# a direct blob with a post-op of ELTWISE_POST_OPS (set at pack): an older shim refuses it, and
# says to rebuild; blobs without one keep version 4 and load as they always did
HEADER_VERSION_ELTWISE = 6
# a direct blob with a post-op of QUANT_POST_OPS (set at pack): a shim of version 6 refuses it
HEADER_VERSION_QUANT = 7
# a blob of int8 weights whose kernel quantizes its input (``src_dt`` uint8): a shim of version 7
# refuses it
HEADER_VERSION_INT8 = 8
HEADER_INT64 = 64  # 512 bytes
MAX_POST_OPS = 3
HEADER_SLOTS = ("magic", "version", "kind", "n", "ic", "ih", "iw", "oc", "oh", "ow", "kh", "kw",
                "sh", "sw", "pad_t", "pad_l", "pad_b", "pad_r", "dil_h", "dil_w", "groups",
                # 3 slots per post-op: its POST_OP (0: none), alpha, beta (float64 bits)
                *(f"post{k}{s}" for k in range(MAX_POST_OPS) for s in ("", "_alpha", "_beta")),
                "wei_tag", "wei_offset", "wei_bytes", "bias_offset", "isa", "dnnl_version",
                "src_tag", "dst_tag", "res_tag",  # activations: 0 NCHW, or NHWC
                # of the header (this slot as 0), the packed weights and the bias
                "checksum",
                # a max pool after the convolution (a model's stem; 0: none), its output H, W
                "pool_kh", "pool_kw", "pool_sh", "pool_sw", "pool_pad_t", "pool_pad_l",
                "pool_pad_b", "pool_pad_r", "pool_oh", "pool_ow",
                "algo",  # a convolution's algorithm: ALGO
                # the input's grid where the kernel computes in int8 (SRC_DT: 0 float32); the
                # weights are then int8, and their per-channel scales follow the bias
                "src_dt", "src_scale", "src_zp")
SLOT = {name: i for i, name in enumerate(HEADER_SLOTS)}
KIND = {"conv2d": 1, "dense": 2}
# 0: none; alpha, beta as oneDNN's eltwise algorithm takes them (swish: alpha the factor of x
# in its sigmoid; hardswish: x * clip(alpha * x + beta, 0, 1)); quant_s8 and quant_u8: alpha
# the scale, beta the zero point of an int8 or uint8 grid, x -> (clip(round(x / alpha) + beta,
# grid) - beta) * alpha (ONNX's QuantizeLinear then DequantizeLinear)
POST_OP = {"relu": 1, "clip": 2, "sum": 3, "gelu_erf": 4, "gelu_tanh": 5, "swish": 6,
           "hardswish": 7, "sigmoid": 8, "tanh": 9, "quant_s8": 10, "quant_u8": 11}
QUANT_POST_OPS = ("quant_s8", "quant_u8")
ELTWISE_POST_OPS = ("gelu_erf", "gelu_tanh", "swish", "hardswish", "sigmoid", "tanh",
                    *QUANT_POST_OPS)
ALGO = {"direct": 0, "winograd": 1}
# what the kernel computes on: float32, or the input quantized to uint8 (x -> round(x / scale)
# + zero point; ``src_scale`` float64 bits) by int8 weights, their scales per output channel
SRC_DT = {"float32": 0, "uint8": 1}  # oneDNN's direct convolution, or Winograd F(4x4, 3x3)
assert len(HEADER_SLOTS) <= HEADER_INT64, "the header overflows its bytes"


def _ints(values: Any, n: int) -> list[int]:
    out = [int(v) for v in values]
    return out * (n // len(out)) if len(out) in (1, n // 2) else out


def make_header(kind: str, x: tuple[int, ...], out: tuple[int, ...],
                kernel: tuple[int, int] = (1, 1), strides: Any = (1, 1), padding: Any = (0,),
                dilation: Any = (1, 1), groups: int = 1,
                post: list[tuple[str, float, float]] | None = None,
                grid: tuple[float, int] | None = None) -> np.ndarray:
    """A blob header before packing (``pack`` fills the layout slots): ``kind`` "conv2d"
    (``x``, ``out`` NCHW; ``padding`` top, left, bottom, right) or "dense" (``x``, ``out``
    2-D); ``post``: post-ops in order, (a ``POST_OP`` name, alpha, beta); ``grid``: the
    uint8 grid (scale, zero point) the input is quantized to for int8 weights (None: float32)."""
    h = np.zeros(HEADER_INT64, "int64")
    fields = {"magic": MAGIC, "version": HEADER_VERSION, "kind": KIND[kind], "n": x[0],
              "ic": x[1], "oc": out[1], "groups": 1}
    if kind == "conv2d":
        fields.update(ih=x[2], iw=x[3], oh=out[2], ow=out[3], kh=kernel[0], kw=kernel[1],
                      groups=int(groups))
        fields.update(zip(("sh", "sw"), _ints(strides, 2), strict=True))
        fields.update(zip(("dil_h", "dil_w"), _ints(dilation, 2), strict=True))
        fields.update(zip(("pad_t", "pad_l", "pad_b", "pad_r"), _ints(padding, 4), strict=True))
    for k, (op, lo, hi) in enumerate(post or []):
        fields[f"post{k}"] = POST_OP[op]
        fields[f"post{k}_alpha"] = int(np.float64(lo).view(np.int64))
        fields[f"post{k}_beta"] = int(np.float64(hi).view(np.int64))
    if grid is not None:
        fields.update(src_dt=SRC_DT["uint8"], src_scale=int(np.float64(grid[0]).view(np.int64)),
                      src_zp=int(grid[1]))
    for name, value in fields.items():
        h[SLOT[name]] = value
    return h


def winograd_growth(h: np.ndarray) -> int:
    """The bytes a convolution's weights grow by as Winograd: 6x6 numbers per filter where the
    direct convolution keeps 3x3 (the shim pads neither)."""
    return (36 - 9) * 4 * int(h[SLOT["ic"]]) * int(h[SLOT["oc"]])


def blob_bytes(params: Any) -> dict[str, int]:
    """What oneDNN's packed weights among ``params`` (``(name, array)`` pairs) take against
    plain float32 weights and biases: ``blobs``, ``packed`` bytes, ``plain`` bytes, and the
    ``winograd`` convolutions with the bytes their weights grew by (``winograd_growth``)."""
    out = {"blobs": 0, "packed": 0, "plain": 0, "winograd": 0, "winograd_growth": 0}
    for _, value in params:
        value = np.asarray(value)
        if value.dtype != np.uint8 or value.nbytes < HEADER_INT64 * 8:
            continue
        h = value[:HEADER_INT64 * 8].view(np.int64)
        if int(h[SLOT["magic"]]) != MAGIC:
            continue
        ic, oc = int(h[SLOT["ic"]]), int(h[SLOT["oc"]])
        taps = int(h[SLOT["kh"]]) * int(h[SLOT["kw"]]) if h[SLOT["kind"]] == KIND["conv2d"] \
            else 1
        out["blobs"] += 1
        out["packed"] += value.nbytes
        out["plain"] += 4 * (oc * ic // max(int(h[SLOT["groups"]]), 1) * taps + oc)
        if int(h[SLOT["algo"]]) == ALGO["winograd"]:
            out["winograd"] += 1
            out["winograd_growth"] += winograd_growth(h)
    return out


# ---- the C++ side: providers/onednn/onednn_blob.h ---------------------------------------

# C++ names: k + CamelCase, parts of one or two letters upper case (kIC, kPoolKH, kPadT); the
# magic and version slots leave the plain names to the constants
_CPP_RENAMED = {"magic": "kMagicSlot", "version": "kVersionSlot"}


def _cpp_name(name: str) -> str:
    return _CPP_RENAMED.get(name) or "k" + "".join(
        part.upper() if len(part) <= 2 else part.capitalize() for part in name.split("_"))


def _enums() -> list[tuple[str, str, str, list[tuple[str, int]]]]:
    """(C++ enum, its type, the prefix of its ``blob_format`` keys, (name, value) pairs)."""
    return [("Slot", "int", "slot", list(SLOT.items())),
            ("Kind", "int64_t", "kind", list(KIND.items())),
            ("PostOp", "int64_t", "post_op", list(POST_OP.items())),
            ("Algo", "int64_t", "algo", list(ALGO.items())),
            ("SrcDt", "int64_t", "src_dt", list(SRC_DT.items()))]


def _constants() -> list[tuple[str, str, str, int]]:
    """(``blob_format`` key, C++ type, C++ name, value) of the format's single numbers."""
    return [("magic", "int64_t", "kMagic", MAGIC),
            ("version", "int64_t", "kVersion", HEADER_VERSION),
            ("version_winograd", "int64_t", "kVersionWinograd", HEADER_VERSION_WINOGRAD),
            ("version_eltwise", "int64_t", "kVersionEltwise", HEADER_VERSION_ELTWISE),
            ("version_quant", "int64_t", "kVersionQuant", HEADER_VERSION_QUANT),
            ("version_int8", "int64_t", "kVersionInt8", HEADER_VERSION_INT8),
            ("header_int64", "int", "kSlots", HEADER_INT64),
            ("max_post_ops", "int", "kMaxPostOps", MAX_POST_OPS)]


def blob_format() -> dict[str, int]:
    """Every number of the format by name: what the compiled shim's ``hgrt.onednn.blob_format``
    must report (``slot.<name>``: a slot's position; ``kind.``, ``post_op.``, ``algo.``: codes;
    ``magic``, ``version``, ``version_winograd``, ``version_eltwise``, ``version_quant``,
    ``version_int8``, ``header_int64``, ``max_post_ops``; ``src_dt.``: codes)."""
    out = {key: value for key, _, _, value in _constants()}
    for _, _, prefix, items in _enums():
        out.update((f"{prefix}.{name}", value) for name, value in items)
    return out


def cpp_header() -> str:
    """The text of ``providers/onednn/onednn_blob.h``: this module's format as the shim's
    constants and enums (``Slot`` ends with ``kUsedSlots``; ``PostOp`` starts with
    ``kNoPost``), and the table ``kBlobFormat`` that ``hgrt.onednn.blob_format`` reports
    (``blob_format()``)."""
    lines = ["// The packed-weight blob's header, generated from providers/onednn/blob.py:",
             "//   python -m hgrt.providers.onednn.blob > providers/onednn/onednn_blob.h",
             "// Edit that file and generate this one; tests/runtime/test_blob_format.py compares.",
             "#pragma once", "", "#include <cstdint>", "", "namespace hgrt_onednn {", ""]
    for _, ctype, name, value in _constants():
        lines.append(f"constexpr {ctype} {name} = {hex(value) if name == 'kMagic' else value};")
    lines += ["constexpr int64_t kHeaderBytes = 8 * static_cast<int64_t>(kSlots);", ""]
    for enum, ctype, _, items in _enums():
        lines.append(f"enum {enum} : {ctype} {{")
        if enum == "PostOp":
            lines.append("  kNoPost = 0,")
        lines += [f"  {_cpp_name(name)} = {value}," for name, value in items]
        if enum == "Slot":
            lines.append(f"  kUsedSlots = {len(HEADER_SLOTS)},")
        lines += ["};", ""]
    lines += ["struct BlobFormatEntry {", "  const char* name;", "  int64_t value;", "};", "",
              "// every number of the format by name, as onednn_blob.blob_format() lists them",
              "constexpr BlobFormatEntry kBlobFormat[] = {"]
    lines += [f'    {{"{key}", {name}}},' for key, _, name, _ in _constants()]
    for _, _, prefix, items in _enums():
        lines += [f'    {{"{prefix}.{name}", {_cpp_name(name)}}},' for name, _ in items]
    lines += ["};", "", "}  // namespace hgrt_onednn", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(cpp_header(), end="")
