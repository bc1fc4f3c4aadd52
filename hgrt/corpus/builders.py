"""Torch modules for the corpus specs, with seeded random weights that keep outputs informative.

Needs the ``corpus`` extra (torch, transformers). ``build(spec, size)`` makes the module from its
config (never a download), then: BatchNorm statistics measured on random data (a few forward
passes in train mode, then eval: random running statistics can make a CNN's output independent
of its input), and the last linear layer rescaled so that the logits have a standard deviation
of ``LOGITS_STD`` (random weights otherwise give logits of hundreds, and a comparison of their
softmax sees only the winning class).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hgrt.corpus.manifest import seeded_inputs
from hgrt.corpus.specs import BATCH_AXIS, Spec, inputs_of
from hgrt.errors import HgrtError

LOGITS_STD = 3.0
SEED = 0


class CorpusError(HgrtError, RuntimeError):
    """A corpus model cannot be made or exported as its spec says."""


def example_inputs(spec: Spec, size: str, seed: int = 1, batch: int = 1
                   ) -> dict[str, np.ndarray]:
    """Seeded inputs of ``spec`` at ``size`` with ``batch`` samples: standard-normal floats,
    integer ids below their bound."""
    return seeded_inputs(inputs_of(spec, size, batch), seed)


def _hf(kind: str, config: dict):
    import transformers

    model_cls = getattr(transformers, kind)
    config_cls = model_cls.config_class
    # no cache, eager graph of today's default attention, untied head (rescaled alone)
    extra = {"use_cache": False, "tie_word_embeddings": False}
    return model_cls(config_cls(**extra, **config))


def _wrap_hf(model, causal: bool):
    """The first output of a transformers model as a plain tensor (no dict, no cache). A
    decoder gets an all-ones attention mask, as generation code passes it (without one,
    transformers looks for packed sequences with ``torch.diff``, which opset 17 lacks)."""
    import torch

    class HFLogits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            if causal:
                mask = torch.ones_like(args[0])
                return self.inner(args[0], attention_mask=mask, return_dict=False)[0]
            return self.inner(*args, return_dict=False)[0]

    return HFLogits(model)


def _channel_shuffle(x, groups: int):
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


def _shufflenet(stages: list[int], repeats: list[int], conv5: int, num_labels: int):
    """ShuffleNetV2 as torchvision writes it: a stride-1 unit splits its channels in two
    (``chunk``), a stride-2 unit runs two branches; each unit ends in a channel shuffle."""
    import torch
    from torch import nn

    def conv_bn(cin, cout, k, stride=1, groups=1, relu=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return layers + [nn.ReLU(inplace=True)] if relu else layers

    class Unit(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.stride = stride
            half = cout // 2
            if stride > 1:
                self.branch1 = nn.Sequential(*conv_bn(cin, cin, 3, stride, cin, relu=False),
                                             *conv_bn(cin, half, 1))
            b2_in = cin if stride > 1 else half
            self.branch2 = nn.Sequential(*conv_bn(b2_in, half, 1),
                                         *conv_bn(half, half, 3, stride, half, relu=False),
                                         *conv_bn(half, half, 1))

        def forward(self, x):
            if self.stride == 1:
                x1, x2 = x.chunk(2, dim=1)
                out = torch.cat((x1, self.branch2(x2)), dim=1)
            else:
                out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
            return _channel_shuffle(out, 2)

    class ShuffleNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Sequential(*conv_bn(3, 24, 3, 2))
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            units, cin = [], 24
            for cout, n in zip(stages, repeats, strict=True):
                units += [Unit(cin, cout, 2)] + [Unit(cout, cout, 1) for _ in range(n - 1)]
                cin = cout
            self.stages = nn.Sequential(*units)
            self.conv5 = nn.Sequential(*conv_bn(cin, conv5, 1))
            self.fc = nn.Linear(conv5, num_labels)

        def forward(self, x):
            x = self.conv5(self.stages(self.maxpool(self.conv1(x))))
            return self.fc(x.mean([2, 3]))

    return ShuffleNetV2()


def _recurrent(kind: str, input_size: int, hidden_size: int, num_labels: int,
               bidirectional: bool = False):
    """A 2-layer ``torch.nn.{LSTM,GRU,RNN}`` (batch first) and a linear head on every step;
    the GRU takes its initial state as a second input."""
    from torch import nn

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(input_size, hidden_size, num_layers=2, batch_first=True,
                                         bidirectional=bidirectional)
            self.head = nn.Linear(hidden_size * (2 if bidirectional else 1), num_labels)

        def forward(self, x, h0=None):
            y, _ = self.rnn(x) if h0 is None else self.rnn(x, h0)
            return self.head(y)

    return Recurrent()


def _make(spec: Spec, size: str):
    config = dict(spec.tiny if size == "tiny" else spec.real)
    if spec.kind == "ShuffleNetV2":
        return _shufflenet(**config)
    if spec.kind in ("LSTM", "GRU", "RNN"):
        return _recurrent(spec.kind, **config)
    return _wrap_hf(_hf(spec.kind, config), spec.family == "decoder")


def build(spec: Spec, size: str = "tiny") -> Any:
    """``spec``'s torch module at ``size`` in eval mode, seeded and calibrated (module doc)."""
    import torch

    if spec.quantize:
        raise CorpusError(f"{spec.name} is quantized from {spec.quantize}: build that one")
    torch.manual_seed(SEED)
    model = _make(spec, size)
    _measure_batch_norm(model, spec, size)
    model.eval()
    _scale_logits(model, spec, size)
    return model


def torch_args(spec: Spec, size: str, seed: int = 1, batch: int = 1) -> tuple:
    import torch

    return tuple(torch.from_numpy(v) for v in example_inputs(spec, size, seed, batch).values())


def _measure_batch_norm(model, spec: Spec, size: str, passes: int = 4) -> None:
    import torch

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # a plain average over the passes
    model.train()
    with torch.no_grad():
        for i in range(passes):
            model(*_batch(spec, size, seed=100 + i))


def _batch(spec: Spec, size: str, seed: int, batch: int = 4) -> tuple:
    """``batch`` seeded inputs stacked along the batch axis (states: axis 1)."""
    import torch

    parts = [torch_args(spec, size, seed * 10 + k) for k in range(batch)]
    return tuple(torch.cat(p, dim=BATCH_AXIS.get(name, 0))
                 for (name, *_), p in zip(inputs_of(spec, size), zip(*parts, strict=True),
                                              strict=True))


def _last_linear(model):
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1] if linears else None


def _scale_logits(model, spec: Spec, size: str) -> None:
    """Rescale the last linear layer (the classifier or LM head) to logits of std LOGITS_STD;
    models that end in a norm (an encoder's hidden states) are left as they are."""
    import torch

    head = _last_linear(model)
    if spec.kind == "T5EncoderModel" or head is None:
        return
    with torch.no_grad():
        std = float(model(*torch_args(spec, size)).std())
        if not np.isfinite(std) or std == 0:
            raise CorpusError(f"{spec.name}: logits of standard deviation {std}")
        head.weight.mul_(LOGITS_STD / std)
        if head.bias is not None:
            head.bias.mul_(LOGITS_STD / std)


def check_informative(model, spec: Spec, size: str) -> float:
    """How far apart the outputs of two different inputs are, relative to their spread; a
    ``CorpusError`` when they are (almost) the same."""
    import torch

    with torch.no_grad():
        a = model(*torch_args(spec, size, seed=1)).numpy()
        b = model(*torch_args(spec, size, seed=2)).numpy()
    gap = float(np.max(np.abs(a - b)) / max(float(np.std(a)), 1e-12))
    if not np.isfinite(gap) or gap < 1e-2:
        raise CorpusError(f"{spec.name} ({size}): two different inputs give outputs within "
                          f"{gap:.1e} of their spread: the output does not depend on the input")
    return gap
