"""The function names of cuBLAS/cuDNN kernels: what a graph node calls, with the kernel's
attributes in it (the shim parses them once per node; shapes come from the tensors).

    hgrt.cudalibs.dense[_bias][_relu]                   x [..., K] @ W [K, N] (+ bias [N])
    hgrt.cudalibs.matmul[_tb][_relu]                    a [..., M, K] @ b [..., K, N]
                                                        (tb: b is [..., N, K], read transposed)
    hgrt.cudalibs.conv2d_s<h>x<w>_p<h>x<w>_d<h>x<w>_g<groups>[_res][_<act>]
                                                        NCHW x OIHW + bias [C] (+ residual),
                                                        act: relu | clip<hi> | silu | sigmoid |
                                                        tanh (clip6p0: min(max(x, 0), 6.0))

>>> conv2d_name((2, 2), (1, 1), (1, 1), 1, residual=True, act="relu")
'hgrt.cudalibs.conv2d_s2x2_p1x1_d1x1_g1_res_relu'
>>> conv2d_name((1, 1), (0, 0), (1, 1), 32, act="clip", clip_hi=6.0)
'hgrt.cudalibs.conv2d_s1x1_p0x0_d1x1_g32_clip6p0'
"""

from __future__ import annotations

from collections.abc import Sequence

from hgrt.providers.cudalibs import PROVIDER

__all__ = ["CONV_ACTIVATIONS", "conv2d_name", "dense_name", "matmul_name"]

CONV_ACTIVATIONS = ("relu", "clip", "silu", "sigmoid", "tanh")  # what cuDNN applies after it


def _act(act: str | None, clip_hi: float = 0.0) -> list[str]:
    if act is None:
        return []
    if act == "clip":
        return ["clip" + repr(float(clip_hi)).replace(".", "p")]
    return [act]


def dense_name(bias: bool, act: str | None = None) -> str:
    return PROVIDER.func_prefix + "_".join(["dense", *(["bias"] if bias else []), *_act(act)])


def matmul_name(trans_b: bool, act: str | None = None) -> str:
    return PROVIDER.func_prefix + "_".join(["matmul", *(["tb"] if trans_b else []), *_act(act)])


def conv2d_name(strides: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                groups: int, residual: bool = False, act: str | None = None,
                clip_hi: float = 0.0) -> str:
    """``padding``: (h, w), the same before and after (cuDNN pads symmetrically)."""
    parts = ["conv2d", "s{}x{}".format(*strides), "p{}x{}".format(*padding),
             "d{}x{}".format(*dilation), f"g{groups}", *(["res"] if residual else []),
             *_act(act, clip_hi)]
    return PROVIDER.func_prefix + "_".join(parts)
