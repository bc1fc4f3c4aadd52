"""What the corpus holds: each model's family, its tiny and real configs and its inputs.

A spec is data only (no torch here): ``hgrt.corpus.builders`` turns it into a torch module. The
real config is the published architecture's (distilbert-base, roberta-base, ViT-B/16, Swin-T,
OPT-125m, GPT-Neo-125M, SmolLM-135M for the Llama-style decoder, GPT-2 small, T5-small,
MobileNetV1/V2 1.0 at 224, EfficientNet-B0, ConvNeXt-T, RegNetY-4GF, ResNet-50, ShuffleNetV2
1.0x); the tiny config keeps its op mix with a few narrow layers. Every fourth model is held out
of any tuning loop (``held_out``): benchmarks report those apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPORTERS = ("dynamo", "torchscript")  # torch.onnx.export(dynamo=True) and dynamo=False
TORCHSCRIPT_OPSET = 17


@dataclass(frozen=True)
class Spec:
    """One corpus model. ``kind`` names its builder (``builders.BUILDERS``); ``tiny`` and
    ``real`` are config keyword arguments; ``inputs`` per size: (name, shape, dtype, high) with
    ``high`` the bound of integer ids (0 for floats); ``quantize``: the model whose
    ``torchscript`` export ``onnxruntime.quantization.quantize_static`` turns into int8 QDQ."""

    name: str
    family: str
    kind: str
    tiny: dict = field(default_factory=dict)
    real: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    quantize: str | None = None


def _ids(seq_tiny: int, vocab_tiny: int, seq_real: int, vocab_real: int) -> dict:
    return {"tiny": [("input_ids", [1, seq_tiny], "int64", vocab_tiny)],
            "real": [("input_ids", [1, seq_real], "int64", vocab_real)]}


def _image(tiny: int, real: int) -> dict:
    return {"tiny": [("pixel_values", [1, 3, tiny, tiny], "float32", 0)],
            "real": [("pixel_values", [1, 3, real, real], "float32", 0)]}


_TEXT_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 64}
# the dynamo exporter cannot decompose these models' SDPA attention (a view of a transposed
# tensor): they export with the eager attention, as their users must
_EAGER = {"attn_implementation": "eager"}

SPECS: tuple[Spec, ...] = (
    # encoders
    Spec("distilbert", "encoder", "DistilBertForSequenceClassification",
         {"vocab_size": 256, "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64,
          "max_position_embeddings": 64, "num_labels": 4},
         {"num_labels": 4}, _ids(8, 256, 128, 30522)),
    Spec("roberta", "encoder", "RobertaForSequenceClassification",
         {**_TEXT_TINY, "vocab_size": 256, "type_vocab_size": 1, "num_labels": 4},
         {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1,
          "num_labels": 4}, _ids(8, 256, 128, 50265)),
    Spec("albert", "encoder", "AlbertForSequenceClassification",
         {**_TEXT_TINY, "vocab_size": 256, "embedding_size": 16, "num_labels": 4},
         {"vocab_size": 30000, "embedding_size": 128, "hidden_size": 768,
          "num_attention_heads": 12, "intermediate_size": 3072, "num_labels": 4},
         _ids(8, 256, 128, 30000)),
    Spec("vit", "encoder", "ViTForImageClassification",
         {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 64, "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    # tiny: a shifted-window mask of 32 * 32 * 4 * 4 elements, which the dynamo exporter
    # keeps a computation (Equal, Not, Where) as at 224 (it folds inputs of up to 8192)
    Spec("swin", "encoder", "SwinForImageClassification",
         {"image_size": 64, "patch_size": 2, "embed_dim": 8, "depths": [2, 2, 2],
          "num_heads": [1, 2, 4], "window_size": 4, "num_labels": 10, **_EAGER},
         {"num_labels": 1000, **_EAGER}, _image(64, 224)),
    # decoders at a static length, no cache; tiny at 128 tokens too: the dynamo exporter
    # keeps the (128, 128) causal mask a computation (And), as at the real config (it folds
    # constants of up to 8192 elements)
    Spec("opt", "decoder", "OPTForCausalLM",
         {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "ffn_dim": 64, "max_position_embeddings": 256,
          "word_embed_proj_dim": 32},
         {}, _ids(128, 256, 128, 50272)),
    Spec("gpt_neo", "decoder", "GPTNeoForCausalLM",
         {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
          "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 256,
          "window_size": 4},
         {"num_layers": 12, "attention_types": [[["global", "local"], 6]], "hidden_size": 768,
          "num_heads": 12, "vocab_size": 50257, "max_position_embeddings": 2048,
          "window_size": 256}, _ids(128, 256, 128, 50257)),
    Spec("llama", "decoder", "LlamaForCausalLM",
         {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
         {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
          "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "max_position_embeddings": 2048}, _ids(128, 256, 128, 49152)),
    Spec("gpt2", "decoder", "GPT2LMHeadModel",
         {"vocab_size": 256, "n_positions": 256, "n_embd": 32, "n_layer": 2, "n_head": 2},
         {}, _ids(128, 256, 128, 50257)),
    # the encoder of an encoder-decoder; tiny at 128 tokens too: the dynamo exporter keeps
    # the (128, 128) relative position buckets a computation (Abs, Log, Min, Where ...)
    Spec("t5_encoder", "encoder", "T5EncoderModel",
         {"vocab_size": 256, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2,
          "num_heads": 2, **_EAGER},
         {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
          "num_heads": 8, **_EAGER}, _ids(128, 256, 128, 32128)),
    # CNNs
    Spec("mobilenet_v1", "cnn", "MobileNetV1ForImageClassification",
         {"depth_multiplier": 0.25, "image_size": 32, "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    Spec("mobilenet_v2", "cnn", "MobileNetV2ForImageClassification",
         {"depth_multiplier": 0.25, "image_size": 32, "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    # tiny: two blocks in stages 4-6, whose second block adds its input back (Add)
    Spec("efficientnet", "cnn", "EfficientNetForImageClassification",
         {"image_size": 32, "width_coefficient": 0.25, "depth_coefficient": 0.4,
          "hidden_dim": 320, "num_labels": 10},
         {"image_size": 224, "width_coefficient": 1.0, "depth_coefficient": 1.0,
          "hidden_dim": 1280, "num_labels": 1000}, _image(32, 224)),
    Spec("convnext", "cnn", "ConvNextForImageClassification",
         {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1], "image_size": 32,
          "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    Spec("regnet", "cnn", "RegNetForImageClassification",
         {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1],
          "groups_width": 8, "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    Spec("resnet", "cnn", "ResNetForImageClassification",
         {"embedding_size": 8, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
          "num_labels": 10},
         {"num_labels": 1000}, _image(32, 224)),
    Spec("shufflenet", "cnn", "ShuffleNetV2",
         {"stages": [8, 16, 32], "repeats": [2, 2, 2], "conv5": 64, "num_labels": 10},
         {"stages": [116, 232, 464], "repeats": [4, 8, 4], "conv5": 1024, "num_labels": 1000},
         {"tiny": [("x", [1, 3, 32, 32], "float32", 0)],
          "real": [("x", [1, 3, 224, 224], "float32", 0)]}),
    # recurrent: 2 layers each; the LSTM bidirectional, the GRU given its initial state; tiny
    # hidden sizes whose recurrent weights (4 or 3 gates * hidden * hidden) exceed the 8192
    # elements the dynamo exporter folds: their gate reordering stays Concat, Slice, Unsqueeze
    Spec("lstm", "recurrent", "LSTM",
         {"input_size": 8, "hidden_size": 48, "bidirectional": True, "num_labels": 10},
         {"input_size": 128, "hidden_size": 256, "bidirectional": True, "num_labels": 10},
         {"tiny": [("x", [1, 8, 8], "float32", 0)],
          "real": [("x", [1, 32, 128], "float32", 0)]}),
    Spec("gru", "recurrent", "GRU",
         {"input_size": 8, "hidden_size": 64, "num_labels": 10},
         {"input_size": 128, "hidden_size": 256, "num_labels": 10},
         {"tiny": [("x", [1, 8, 8], "float32", 0), ("h0", [2, 1, 64], "float32", 0)],
          "real": [("x", [1, 32, 128], "float32", 0), ("h0", [2, 1, 256], "float32", 0)]}),
    Spec("rnn", "recurrent", "RNN",
         {"input_size": 8, "hidden_size": 16, "num_labels": 10},
         {"input_size": 128, "hidden_size": 256, "num_labels": 10},
         {"tiny": [("x", [1, 8, 8], "float32", 0)],
          "real": [("x", [1, 32, 128], "float32", 0)]}),
)

# int8 QDQ versions (per channel, calibrated on random data) of three float models
QUANTIZED: tuple[Spec, ...] = tuple(
    Spec(f"{base}_int8", "int8", "quantize_static", quantize=base)
    for base in ("resnet", "mobilenet_v2", "vit"))

ALL: tuple[Spec, ...] = SPECS + QUANTIZED
BY_NAME: dict[str, Spec] = {s.name: s for s in ALL}
# every fourth model, counted in the order above: kept out of any tuning loop
HELD_OUT: frozenset[str] = frozenset(s.name for i, s in enumerate(ALL) if i % 4 == 3)


def spec(name: str) -> Spec:
    """The spec called ``name`` (an ``InputError`` listing the corpus otherwise)."""
    from hgrt.errors import InputError, did_you_mean

    if name not in BY_NAME:
        raise InputError(f"corpus model {did_you_mean(name, list(BY_NAME))}")
    return BY_NAME[name]


# inputs whose batch is not their first axis: a recurrent layer's initial state
BATCH_AXIS = {"h0": 1}


def inputs_of(s: Spec, size: str, batch: int = 1) -> list[tuple[str, list[int], str, int]]:
    """The inputs of ``s`` at ``size`` ("tiny" or "real") with ``batch`` samples; a quantized
    model's are its base's."""
    inputs = (BY_NAME[s.quantize] if s.quantize else s).inputs[size]
    if batch == 1:
        return inputs
    out = []
    for name, shape, dtype, high in inputs:
        axis = BATCH_AXIS.get(name, 0)
        out.append((name, [*shape[:axis], shape[axis] * batch, *shape[axis + 1:]], dtype, high))
    return out
