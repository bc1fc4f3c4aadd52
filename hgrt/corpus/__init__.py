"""A corpus of today's architectures as their users export them, to test and benchmark on.

Twenty models from their configs with seeded random weights (nothing downloaded): encoders
(DistilBERT, RoBERTa, ALBERT, ViT, Swin), decoders at a static length without a cache (OPT,
GPT-Neo, a Llama-style config, GPT-2), T5's encoder, CNNs (MobileNetV1/V2, EfficientNet,
ConvNeXt, RegNet, ResNet from transformers; a ShuffleNetV2 written in torch), recurrent nets
(2-layer ``torch.nn.LSTM`` bidirectional, ``GRU`` given its initial state, ``RNN``), and int8
QDQ versions of three (``onnxruntime.quantization.quantize_static``, per channel). Each is
exported by both of torch's exporters (``dynamo=True`` and ``dynamo=False``).

Two sizes: the tiny configs are committed as ONNX files with a manifest (``entries``), so tests
need no torch; the real configs are exported on demand (``generate.real_path``, the
``corpus`` extra: ``pip install 'hgrt[corpus]'``). Every fourth model is held out of tuning
(``Entry.held_out``).

    hgrt zoo --list
    hgrt zoo corpus/gpt2.dynamo -o gpt2.onnx

>>> from hgrt.corpus import entry
>>> e = entry("lstm.torchscript")
>>> sorted(e.seeded_inputs())
['x']
"""

from hgrt.corpus.manifest import Entry, corpus_dir, entries, entry, read_manifest, seeded_inputs
from hgrt.corpus.specs import ALL, EXPORTERS, HELD_OUT, SPECS, Spec, spec

__all__ = ["ALL", "EXPORTERS", "HELD_OUT", "SPECS", "Entry", "Spec", "corpus_dir", "entries",
           "entry", "read_manifest", "seeded_inputs", "spec"]
