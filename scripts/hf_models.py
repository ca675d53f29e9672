"""Hugging Face transformers models, exported as users export them, against PyTorch.

Usage::

    pip install transformers diffusers   # not dependencies of gradgen
    python scripts/hf_models.py [NAME ...] [--steps 20] [--ort-python PYTHON] [--json out.json]
    python scripts/hf_models.py [NAME ...] --speed [--json out.json]
    python scripts/hf_models.py [NAME ...] --bf16 [--json out.json]
    python scripts/hf_models.py [NAME ...] --dynamic --exporters legacy,dynamo

``--dynamic`` exports with a dynamic batch axis on every input and a dynamic length on token inputs
(``dynamic_axes`` / ``Dim.AUTO``), as users export a model they train with varying shapes.

Each model is a small, randomly initialised configuration of a transformers class that returns its
own loss (GPT-2, BERT, RoBERTa, DistilBERT, Llama, Mistral, Qwen2, T5, BART, Whisper, ViT, Swin,
ResNet, Gemma, Phi, GPT-NeoX, Mixtral, DeBERTa-v2, CLIP, wav2vec2, ConvNeXt, MobileViT, SegFormer;
OPT with its embedding projections, BLOOM (ALiBi), Falcon (new decoder architecture, grouped KV),
GPT-J (interleaved rotary), Gemma2 (logit soft-capping, sliding window), Qwen3 (query / key
norms), Mamba (its sequential scan), ALBERT (one layer's weights shared by both), ELECTRA's
discriminator, MobileBERT (bottlenecks, NoNorm), Funnel (pooled queries), XLNet, Marian
(sinusoidal positions), Speech2Text (convolutional subsampler, GLU), WavLM (gated relative
position bias), BEiT (relative position bias), MobileNetV2, EfficientNet (squeeze-excitation),
LeViT (attention biases gathered by index), PoolFormer; and from diffusers, a UNet2DModel under
DDPM's noise-prediction loss and an AutoencoderKL),
its parameters perturbed so that no two are equal (the legacy exporter would merge equal
initializers). For each exporter,

- ``legacy`` (``torch.onnx.export(dynamo=False)``, no constant folding) and ``dynamo``
  (``dynamo=True, optimize=False``): the gradients of every parameter against PyTorch autograd
  (``scripts/torch_sweep.py``'s comparison: float32, rerun in float64 when a tensor is off by more
  than 1e-3), then ``--steps`` AdamW steps of ``gradgen.training`` against ``torch.optim.AdamW`` on
  the same batches (the largest relative difference of the losses);
- ``dynamo-optimized`` (``dynamo=True``, PyTorch's default: its optimizer folds constants): the same
  training comparison, with what training left out of the parameters (the notes) and with the
  tied weights tied (``tie_weights=True``); with ``--ort-python PYTHON`` (an interpreter with
  onnxruntime-training 1.19.2, docs/ORT_ARTIFACTS.md) also ONNX Runtime training's steps on
  ``generate_artifacts``' models of the same export, against PyTorch's losses.

An attention's key bias gets a gradient that is zero up to rounding (softmax is invariant to a
constant per row; a PoolFormer block's norm bias likewise, its pooling minus itself): such a tensor
scores 1 to 5 in float32 and is rerun in float64. Funnel computes its attention in float32 even in
a float64 module, so its key biases stay at that rounding (1e-10 against 1e-9) in float64 too.

What moves the training losses apart (1e-4 to 1e-3) with matching gradients is what the ONNX
graph cannot say, not rounding:

- an embedding's ``padding_idx`` (the pad token's row: BERT, OPT, ALBERT, ELECTRA, MobileBERT, Gemma,
  Gemma2, BART, Marian, Speech2Text, ...): PyTorch gives that row no gradient from the lookup,
  both exporters write a plain Gather, and the random batches hold the pad token. The dynamo
  exporter records the option with the node and gradgen applies it (those exports train to 2e-7);
  the legacy exporter keeps no record, so its exports train the pad row (1e-4 to 1e-3);
- a parameter with ``requires_grad=False`` (Marian's sinusoidal position tables, Whisper's encoder
  positions) is a PARAMETER to torch.export too, so gradgen trains it (``--freeze`` keeps it: then
  Marian and Whisper train to 1e-7); the legacy exporter marks nothing, so it trains a buffer as
  well (BART's and Marian's ``final_logits_bias``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_sweep  # noqa: E402  (the gradient comparison)

SEQ = 8
BATCH = 2


def _tokens(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _images(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


class LossOf(nn.Module):
    """``model(**inputs).loss`` with the inputs passed positionally, in ``keys``' order."""

    def __init__(self, model: nn.Module, keys: list[str]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, args))).loss


def _perturbed(module: nn.Module) -> nn.Module:
    """``module`` in eval mode (no dropout), every parameter moved by 0.05 N(0, 1): no two equal."""
    module.eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return module


def _case(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch_sweep.Case:
    return torch_sweep.Case(LossOf(_perturbed(model), list(inputs)), inputs)


def _causal_lm(config_class: str, **config: Any) -> Callable[[], torch_sweep.Case]:
    def make() -> torch_sweep.Case:
        import transformers

        cls = getattr(transformers, config_class)
        ids = _tokens(97, BATCH, SEQ)
        model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(cls(vocab_size=97, **config))
        return _case(model, {"input_ids": ids, "labels": ids.clone()})

    return make


def gpt2() -> torch_sweep.Case:
    import transformers as T

    config = T.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0
    )
    ids = _tokens(97, BATCH, SEQ)
    return _case(T.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()})


def _encoder_config(**extra: Any) -> dict[str, Any]:
    return dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=40,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        **extra,
    )


def bert() -> torch_sweep.Case:
    import transformers as T

    ids = _tokens(97, BATCH, SEQ)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 6:] = 0
    labels = ids.clone()
    labels[:, ::2] = -100
    return _case(
        T.BertForMaskedLM(T.BertConfig(**_encoder_config())),
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
    )


def roberta() -> torch_sweep.Case:
    import transformers as T

    model = T.RobertaForSequenceClassification(T.RobertaConfig(**_encoder_config()))
    return _case(model, {"input_ids": _tokens(95, BATCH, SEQ) + 2, "labels": _tokens(2, BATCH)})


def distilbert() -> torch_sweep.Case:
    import transformers as T

    config = T.DistilBertConfig(
        n_layers=2,
        dim=32,
        n_heads=4,
        hidden_dim=64,
        vocab_size=97,
        max_position_embeddings=32,
        dropout=0,
        attention_dropout=0,
    )
    return _case(
        T.DistilBertForSequenceClassification(config),
        {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(2, BATCH)},
    )


_DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def t5() -> torch_sweep.Case:
    import transformers as T

    config = T.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=64,
        vocab_size=97,
        dropout_rate=0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _case(
        T.T5ForConditionalGeneration(config),
        {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(97, BATCH, 6, seed=1)},
    )


def _seq2seq_config(**extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=97,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0,
        decoder_start_token_id=2,
        pad_token_id=1,
        **extra,
    )


def bart() -> torch_sweep.Case:
    import transformers as T

    model = T.BartForConditionalGeneration(T.BartConfig(max_position_embeddings=32, **_seq2seq_config()))
    return _case(model, {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(97, BATCH, 6, seed=1)})


def whisper() -> torch_sweep.Case:
    import transformers as T

    config = T.WhisperConfig(num_mel_bins=8, max_source_positions=8, max_target_positions=16, **_seq2seq_config())
    return _case(
        T.WhisperForConditionalGeneration(config),
        {"input_features": _images(BATCH, 8, 16), "labels": _tokens(97, BATCH, 6)},
    )


def _vision(model_class: str, config_class: str, **config: Any) -> Callable[[], torch_sweep.Case]:
    def make() -> torch_sweep.Case:
        import transformers

        model = getattr(transformers, model_class)(getattr(transformers, config_class)(num_channels=3, **config))
        return _case(model, {"pixel_values": _images(BATCH, 3, 32, 32), "labels": _tokens(3, BATCH)})

    return make


def deberta() -> torch_sweep.Case:
    import transformers as T

    config = T.DebertaV2Config(
        **_encoder_config(), relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"]
    )
    return _case(
        T.DebertaV2ForSequenceClassification(config), {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(2, BATCH)}
    )


def clip() -> torch_sweep.Case:
    import transformers as T

    text = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8)
    model = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    inputs = {"input_ids": _tokens(97, BATCH, SEQ), "pixel_values": _images(BATCH, 3, 32, 32), "return_loss": torch.tensor(True)}
    return _case(model, inputs)


def mixtral() -> torch_sweep.Case:
    import transformers as T

    config = T.MixtralConfig(
        vocab_size=97,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        **{**_DECODER, "num_key_value_heads": 4},
    )
    ids = _tokens(97, BATCH, SEQ)
    return _case(T.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids.clone()})


def _speech_ctc(model_class: str, config_class: str, **extra: Any) -> Callable[[], torch_sweep.Case]:
    """A small wav2vec2-style speech encoder (``model_class`` of ``config_class``) under CTC loss."""

    def make() -> torch_sweep.Case:
        import transformers as T

        config = getattr(T, config_class)(
            vocab_size=12,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4,
            hidden_dropout=0,
            attention_dropout=0,
            activation_dropout=0,
            feat_proj_dropout=0,
            layerdrop=0,
            mask_time_prob=0,
            ctc_loss_reduction="mean",
            pad_token_id=0,
            **extra,
        )
        labels = torch.randint(1, 12, (BATCH, 5), generator=torch.Generator().manual_seed(1))
        return _case(getattr(T, model_class)(config), {"input_values": _images(BATCH, 400), "labels": labels})

    return make


class DenoisingLoss(nn.Module):
    """DDPM's training objective on one batch: the UNet's noise prediction against the noise (MSE)."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.unet(noisy, timesteps).sample, noise)


class ReconstructionLoss(nn.Module):
    """A VAE's reconstruction of its input from the posterior mean (MSE) plus a small KL term."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        posterior = self.vae.encode(x).latent_dist
        return nn.functional.mse_loss(self.vae.decode(posterior.mean).sample, x) + 1e-3 * posterior.kl().mean()


def unet2d() -> torch_sweep.Case:
    import diffusers

    unet = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    inputs = {"noisy": _images(BATCH, 3, 16, 16), "timesteps": torch.tensor([10, 500]), "noise": _images(BATCH, 3, 16, 16) * 0.5}
    return torch_sweep.Case(DenoisingLoss(_perturbed(unet)), inputs)


def vae() -> torch_sweep.Case:
    import diffusers

    model = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    return torch_sweep.Case(ReconstructionLoss(_perturbed(model)), {"x": _images(BATCH, 3, 16, 16)})


def albert() -> torch_sweep.Case:
    import transformers as T

    ids = _tokens(97, BATCH, SEQ)
    labels = ids.clone()
    labels[:, ::2] = -100
    model = T.AlbertForPreTraining(T.AlbertConfig(embedding_size=16, classifier_dropout_prob=0, **_encoder_config()))
    return _case(model, {"input_ids": ids, "labels": labels, "sentence_order_label": _tokens(2, BATCH)})


def electra() -> torch_sweep.Case:
    import transformers as T

    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 6:] = 0
    model = T.ElectraForPreTraining(T.ElectraConfig(embedding_size=16, **_encoder_config()))
    return _case(model, {"input_ids": _tokens(97, BATCH, SEQ), "attention_mask": mask, "labels": _tokens(2, BATCH, SEQ, seed=1)})


def mobilebert() -> torch_sweep.Case:
    import transformers as T

    config = T.MobileBertConfig(
        **{**_encoder_config(), "intermediate_size": 32},
        embedding_size=16,
        true_hidden_size=16,
        intra_bottleneck_size=16,
        num_feedforward_networks=2,
        normalization_type="no_norm",
    )
    ids = _tokens(97, BATCH, SEQ)
    return _case(T.MobileBertForMaskedLM(config), {"input_ids": ids, "labels": ids.clone()})


def funnel() -> torch_sweep.Case:
    import transformers as T

    config = T.FunnelConfig(
        vocab_size=97,
        block_sizes=[1, 1],
        num_decoder_layers=1,
        d_model=32,
        n_head=4,
        d_head=8,
        d_inner=64,
        hidden_dropout=0,
        attention_dropout=0,
        activation_dropout=0,
    )
    return _case(T.FunnelForSequenceClassification(config), {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(2, BATCH)})


def xlnet() -> torch_sweep.Case:
    import transformers as T

    config = T.XLNetConfig(vocab_size=97, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0, use_mems_train=False)
    ids = _tokens(97, BATCH, SEQ)
    return _case(T.XLNetLMHeadModel(config), {"input_ids": ids, "labels": ids.clone()})


def speech2text() -> torch_sweep.Case:
    import transformers as T

    config = T.Speech2TextConfig(
        input_feat_per_channel=8,
        input_channels=1,
        conv_kernel_sizes=[5, 5],
        conv_channels=16,
        max_source_positions=32,
        max_target_positions=32,
        **_seq2seq_config(),
    )
    return _case(
        T.Speech2TextForConditionalGeneration(config),
        {"input_features": _images(BATCH, 16, 8), "labels": _tokens(97, BATCH, 6)},
    )


def marian() -> torch_sweep.Case:
    import transformers as T

    model = T.MarianMTModel(T.MarianConfig(max_position_embeddings=32, scale_embedding=True, **_seq2seq_config()))
    return _case(model, {"input_ids": _tokens(97, BATCH, SEQ), "labels": _tokens(97, BATCH, 6, seed=1)})


def levit() -> torch_sweep.Case:
    """LeViT, its attention biases gathered at each call: in eval mode transformers caches them, a
    tensor of the first call's graph (a second backward fails; the legacy exporter refuses it as a
    constant) that also keeps the biases of before any optimizer step."""
    case = _vision(
        "LevitForImageClassification",
        "LevitConfig",
        image_size=32,
        patch_size=16,
        hidden_sizes=[16, 32],
        num_attention_heads=[2, 2],
        depths=[1, 1],
        key_dim=[8, 8],
        mlp_ratio=[2, 2],
        attention_ratio=[2, 2],
        down_ops=[["Subsample", 8, 2, 4, 2, 2]],
        num_labels=3,
        drop_path_rate=0,
    )()
    for module in case.module.modules():
        if hasattr(module, "attention_bias_cache"):
            module.get_attention_biases = lambda device, m=module: m.attention_biases[:, m.attention_bias_idxs]
    return case


_NO_GQA = {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}
_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
MODELS: dict[str, Callable[[], torch_sweep.Case]] = {
    "gpt2": gpt2,
    "bert": bert,
    "roberta": roberta,
    "distilbert": distilbert,
    "llama": _causal_lm("LlamaConfig", max_position_embeddings=32, **_DECODER),
    "mistral": _causal_lm("MistralConfig", max_position_embeddings=32, sliding_window=4, **_DECODER),
    "qwen2": _causal_lm("Qwen2Config", max_position_embeddings=32, **_DECODER),
    "t5": t5,
    "bart": bart,
    "whisper": whisper,
    "vit": _vision(
        "ViTForImageClassification",
        "ViTConfig",
        num_labels=3,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        **_VIT,
    ),
    "swin": _vision(
        "SwinForImageClassification",
        "SwinConfig",
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=3,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        drop_path_rate=0,
    ),
    "resnet": _vision(
        "ResNetForImageClassification",
        "ResNetConfig",
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_labels=3,
    ),
    "gemma": _causal_lm("GemmaConfig", max_position_embeddings=32, head_dim=8, **{**_DECODER, "num_key_value_heads": 4}),
    "phi": _causal_lm(
        "PhiConfig",
        max_position_embeddings=32,
        partial_rotary_factor=0.5,
        resid_pdrop=0,
        embd_pdrop=0,
        attention_dropout=0,
        **_NO_GQA,
    ),
    "gptneox": _causal_lm("GPTNeoXConfig", max_position_embeddings=32, rotary_pct=0.5, **_NO_GQA),
    "mixtral": mixtral,
    "deberta": deberta,
    "clip": clip,
    "wav2vec2": _speech_ctc("Wav2Vec2ForCTC", "Wav2Vec2Config"),
    "convnext": _vision(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        num_labels=3,
        image_size=32,
        drop_path_rate=0,
    ),
    "mobilevit": _vision(
        "MobileViTForImageClassification",
        "MobileViTConfig",
        image_size=32,
        patch_size=2,
        hidden_sizes=[16, 16, 16],
        neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
        num_attention_heads=2,
        num_labels=3,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        classifier_dropout_prob=0,
    ),
    "segformer": _vision(
        "SegformerForImageClassification",
        "SegformerConfig",
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        num_labels=3,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        drop_path_rate=0,
    ),
    "unet2d": unet2d,
    "vae": vae,
    "opt": _causal_lm(
        "OPTConfig",
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        word_embed_proj_dim=16,
        max_position_embeddings=32,
        dropout=0,
        attention_dropout=0,
    ),
    "bloom": _causal_lm("BloomConfig", hidden_size=32, n_layer=2, n_head=4, attention_dropout=0, hidden_dropout=0),
    "falcon": _causal_lm(
        "FalconConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        max_position_embeddings=32,
        attention_dropout=0,
        hidden_dropout=0,
    ),
    "gptj": _causal_lm(
        "GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, embd_pdrop=0, resid_pdrop=0, attn_pdrop=0
    ),
    "gemma2": _causal_lm(
        "Gemma2Config",
        max_position_embeddings=32,
        head_dim=8,
        sliding_window=4,
        query_pre_attn_scalar=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **_DECODER,
    ),
    "qwen3": _causal_lm("Qwen3Config", max_position_embeddings=32, head_dim=8, **_DECODER),
    "mamba": _causal_lm("MambaConfig", hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4),
    "albert": albert,
    "electra": electra,
    "mobilebert": mobilebert,
    "funnel": funnel,
    "xlnet": xlnet,
    "marian": marian,
    "speech2text": speech2text,
    "wavlm": _speech_ctc("WavLMForCTC", "WavLMConfig", num_buckets=8, max_bucket_distance=16),
    "beit": _vision(
        "BeitForImageClassification",
        "BeitConfig",
        num_labels=3,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        layer_scale_init_value=0.1,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        drop_path_rate=0,
        **_VIT,
    ),
    "mobilenetv2": _vision(
        "MobileNetV2ForImageClassification",
        "MobileNetV2Config",
        image_size=32,
        depth_multiplier=0.25,
        min_depth=4,
        finegrained_output=False,
        num_labels=3,
        classifier_dropout_prob=0,
    ),
    "efficientnet": _vision(
        "EfficientNetForImageClassification",
        "EfficientNetConfig",
        image_size=32,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,
        num_labels=3,
        dropout_rate=0,
        drop_connect_rate=0,
    ),
    "levit": levit,
    "poolformer": _vision(
        "PoolFormerForImageClassification",
        "PoolFormerConfig",
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_encoder_blocks=2,
        patch_sizes=[7, 3],
        strides=[4, 2],
        padding=[2, 1],
        pool_size=3,
        num_labels=3,
        drop_path_rate=0,
        hidden_dropout_prob=0,
    ),
}
EXPORTERS = ("legacy", "dynamo", "dynamo-optimized")


def _export(case: torch_sweep.Case, exporter: str):
    from gradgen.bench.models import dynamo_export

    if exporter == "dynamo-optimized":
        return dynamo_export(case.module, tuple(case.inputs.values()), list(case.inputs), optimize=True)
    return torch_sweep.export(case, exporter)


def _batches(case: torch_sweep.Case, graph_inputs: list[str], steps: int) -> list[dict[str, np.ndarray]]:
    """``steps`` batches shaped as the example inputs: random tokens below the example's largest id
    (labels likewise), images from a normal distribution, attention masks of ones."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        batch = {}
        for name, example in case.inputs.items():
            if name not in graph_inputs:
                continue
            if example.is_floating_point():
                batch[name] = rng.standard_normal(tuple(example.shape)).astype(np.float32)
            elif name == "attention_mask":
                batch[name] = np.ones(tuple(example.shape), np.int64)
            else:
                batch[name] = rng.integers(0, max(int(example.max()) + 1, 2), tuple(example.shape)).astype(np.int64)
        batches.append(batch)
    return batches


def torch_losses(case: torch_sweep.Case, batches: list[dict[str, np.ndarray]]) -> list[float]:
    """PyTorch's AdamW (lr 1e-3, weight decay 0.01) on ``batches``, from the case's weights (which
    it changes: build what reads them first)."""
    module = case.module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module(*[torch.from_numpy(batch[name]) if name in batch else case.inputs[name] for name in case.inputs])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def ort_training_losses(proto, batches: list[dict[str, np.ndarray]], ort_python: str) -> list[float]:
    """ONNX Runtime training's losses over ``batches`` on the artifacts gradgen makes of ``proto``
    (AdamW, lr 1e-3, weight decay 0.01), run by ``tests/test_artifacts_ort.py``'s runner."""
    import subprocess
    import tempfile

    import onnx

    from gradgen.training.artifacts import generate_artifacts, save_artifacts
    from gradgen.training.optimizers import AdamW

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.test_artifacts_ort import RUNNER

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        onnx.save(proto, work / "model.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same notes as the trainer's build
            made = generate_artifacts(proto, optimizer=AdamW(weight_decay=0.01), tie_weights=True)
        save_artifacts(made, work / "artifacts", work / "model.onnx")
        data = {f"{step}/{name}": value for step, batch in enumerate(batches) for name, value in batch.items()}
        data["meta"] = np.array(json.dumps({"lr": 1e-3, "steps": len(batches)}))
        np.savez(work / "data.npz", **data)
        (work / "runner.py").write_text(RUNNER)
        command = [ort_python, str(work / "runner.py"), str(work / "artifacts"), str(work / "data.npz"), str(work / "out")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ONNX Runtime training failed: {done.stderr.strip().splitlines()[-1:]}")
        return json.loads((work / "out.json").read_text())["losses"]


def compare_training(case: torch_sweep.Case, proto, steps: int, ort_python: str | None = None, **options: Any) -> dict[str, Any]:
    """``steps`` AdamW steps (lr 1e-3, weight decay 0.01) of gradgen's trainer and of PyTorch's on
    the same batches, from the same weights; the notes the build gave."""
    from gradgen.training import AdamW, Trainer, build_training

    batches = _batches(case, [i.name for i in proto.graph.input], steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = build_training(proto, optimizer=AdamW(weight_decay=0.01), **options)
    ours = np.array([r.loss for r in Trainer(program, lr=1e-3).fit(batches, steps)])
    ort, ort_error = None, None
    if ort_python:
        try:
            ort = ort_training_losses(proto, batches, ort_python)
        except Exception as exc:  # noqa: BLE001 -- recorded: ONNX Runtime's refusal is not gradgen's result
            ort_error = f"{type(exc).__name__}: {str(exc)[:300]}"
    theirs = np.array(torch_losses(case, batches))
    record = {
        "params": len(program.params),
        "torch_params": sum(1 for _ in case.module.parameters()),
        "loss_first_last": [float(theirs[0]), float(theirs[-1])],
        "max_rel_loss_diff": float((np.abs(ours - theirs) / np.abs(theirs)).max()),
        "notes": [str(w.message) for w in caught],
    }
    if ort_error is not None:
        record["ort_error"] = ort_error
    if ort is not None:
        record["ort_max_rel_loss_diff"] = float((np.abs(np.array(ort) - theirs) / np.abs(theirs)).max())
    return record


@contextlib.contextmanager
def _stdout_silenced():
    """File descriptor 1 to /dev/null: the legacy exporter prints the TorchScript graph of a model it
    fails on from C++, past Python's sys.stdout."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def cpu_speed(case: torch_sweep.Case, proto, repeats: int = 20) -> dict[str, Any]:
    """One forward + backward step of the portable backward graph (every parameter) on gradgen's CPU
    Session and on ONNX Runtime, one thread each: the medians of ``repeats`` runs, taken in
    alternating rounds of five."""
    import statistics

    import onnx_ir as ir
    import onnxruntime as ort

    import gradgen
    from gradgen.executor import Session
    from gradgen.executor.threads import cpu_threads

    built = gradgen.build_backward(proto, portable=True).model
    names = [v.name for v in built.graph.inputs]
    feeds = {name: case.inputs[name].numpy() for name in case.inputs if name in names}
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    reference = ort.InferenceSession(ir.to_proto(built).SerializeToString(), options, providers=["CPUExecutionProvider"])
    times: dict[str, list[float]] = {"ort": [], "gradgen": []}
    with cpu_threads(1):
        session = Session(built)
        runs = {"ort": lambda: reference.run(None, feeds), "gradgen": lambda: session.run(feeds)}
        for run in runs.values():  # warm-up: plans, caches, the straight-line program
            for _ in range(3):
                run()
        for _ in range(max(1, repeats // 5)):
            for key, run in runs.items():
                for _ in range(5):
                    started = time.perf_counter()
                    run()
                    times[key].append((time.perf_counter() - started) * 1e3)
    ort_ms, gradgen_ms = statistics.median(times["ort"]), statistics.median(times["gradgen"])
    return {"steps": len(session.steps), "ort_ms": ort_ms, "gradgen_ms": gradgen_ms, "ratio": gradgen_ms / ort_ms}


def with_dynamic_axes(factory: Callable[[], torch_sweep.Case]) -> Callable[[], torch_sweep.Case]:
    """The case exported as users export for training with varying shapes: every input's first
    axis dynamic, and the second too for token inputs (integer, 2-D or more), each input's its own
    symbol (labels may be shorter than the inputs)."""

    def make() -> torch_sweep.Case:
        case = factory()
        axes = {}
        for name, example in case.inputs.items():
            if example.dim() >= 2 and not example.is_floating_point():
                axes[name] = {0: "batch", 1: f"{name}_length"}
            elif example.dim() >= 1:
                axes[name] = {0: "batch"}
        return dataclasses.replace(case, dynamic_axes=axes)

    return make


def run(name: str, exporter: str, steps: int, ort_python: str | None = None, dynamic: bool = False) -> dict[str, Any]:
    record: dict[str, Any] = {"model": name, "exporter": exporter}
    started = time.perf_counter()
    factory = with_dynamic_axes(MODELS[name]) if dynamic else MODELS[name]
    try:
        if exporter != "dynamo-optimized":
            torch_sweep.CASES[name] = ("hf", factory)
            for dtype in (torch.float32, torch.float64):
                with _stdout_silenced():
                    gradients = torch_sweep.run_case(name, exporter, dtype, 600)
                real = {k: v for k, v in gradients.get("errors", {}).items() if k not in gradients.get("zero_ref", {})}
                worst = max(real.values(), default=0.0)
                record[f"gradients_{str(dtype)[6:]}"] = {
                    "stage": gradients["stage"],
                    "error": gradients.get("error"),
                    "compared": gradients.get("compared"),
                    "worst": worst,
                    "worst_tensor": max(real, key=real.__getitem__) if real else None,
                }
                if gradients["stage"] != "done" or worst <= 1e-3:
                    break
            if gradients["stage"] == "export":
                return record
        torch.manual_seed(0)
        case = factory()
        with _stdout_silenced():
            proto = _export(case, exporter)
        options: dict[str, Any] = {"tie_weights": True, "ort_python": ort_python} if exporter == "dynamo-optimized" else {}
        record["training"] = compare_training(dataclasses.replace(case), proto, steps, **options)
    except Exception as exc:  # noqa: BLE001 -- a row of the table, not the end of the run
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def _gradients(module: nn.Module, inputs: dict[str, torch.Tensor], autocast: torch.dtype | None = None) -> dict[str, np.ndarray]:
    """PyTorch's gradient of every parameter (float64 copies), under CPU autocast to ``autocast``."""
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = module(*inputs.values())
    loss.float().backward()
    return {n: p.grad.detach().numpy().astype(np.float64) for n, p in module.named_parameters() if p.grad is not None}


def bf16_errors(name: str) -> dict[str, Any]:
    """issue 14's per-tensor measure on the CPU: ``max|g - g_fp32| / max|g_fp32|`` of gradgen's bf16
    gradients (``precision="bf16"``) and of PyTorch's under ``torch.autocast("cpu", bfloat16)``,
    against PyTorch's fp32 gradients, per parameter; tensors whose fp32 gradient is below 1e-6 of
    the largest (attention's key biases: rounding noise) are left out."""
    import gradgen
    from gradgen.executor import Session

    record: dict[str, Any] = {"model": name}
    torch.manual_seed(0)
    case = MODELS[name]()
    try:
        with _stdout_silenced():
            proto = _export(case, "dynamo")
    except Exception as exc:  # noqa: BLE001 -- PyTorch's exporter
        record["error"] = type(exc).__name__
        return record
    fp32 = _gradients(case.module, case.inputs)
    autocast = _gradients(case.module, case.inputs, torch.bfloat16)
    built = gradgen.build_backward(proto, precision="bf16")
    feeds = {k: v.numpy() for k, v in case.inputs.items() if k in [i.name for i in proto.graph.input]}
    out = Session(built.model).run(feeds)
    ours = {wrt: out[grad].astype(np.float64) for wrt, grad in zip(built.wrt, built.gradient_names)}
    largest = max(float(np.abs(g).max()) for g in fp32.values())
    rows = []
    for key, reference in fp32.items():
        top = float(np.abs(reference).max())
        if key in ours and top >= 1e-6 * largest:
            rows.append(
                (key, float(np.abs(ours[key] - reference).max()) / top, float(np.abs(autocast[key] - reference).max()) / top)
            )
    above = [(k, a / max(b, 1e-30)) for k, a, b in rows if a > b]
    record.update(
        tensors=len(rows),
        gradgen_worst=max(a for _, a, _ in rows),
        torch_worst=max(b for _, _, b in rows),
        above=len(above),
        worst_factor=max((f for _, f in above), default=0.0),
    )
    return record


def run_speed(name: str) -> dict[str, Any]:
    """``cpu_speed`` on the unoptimised dynamo export, or the legacy one where that fails."""
    record: dict[str, Any] = {"model": name}
    for exporter in ("dynamo", "legacy"):
        torch.manual_seed(0)
        case = MODELS[name]()
        try:
            with _stdout_silenced():
                proto = _export(case, exporter)
        except Exception as exc:  # noqa: BLE001 -- PyTorch's exporter: try the other one
            record[f"{exporter}_error"] = f"{type(exc).__name__}"
            continue
        record["exporter"] = exporter
        record.update(cpu_speed(case, proto))
        return record
    return record


def _describe_bf16(record: dict[str, Any]) -> str:
    if "tensors" not in record:
        return "export fails"
    return (
        f"{record['tensors']:4d} tensors  worst: gradgen {record['gradgen_worst']:.2e}, PyTorch {record['torch_worst']:.2e}; "
        f"gradgen above PyTorch on {record['above']} (at most {record['worst_factor']:.2f}x)"
    )


def _describe_speed(record: dict[str, Any]) -> str:
    if "ratio" not in record:
        return "both exports fail"
    return (
        f"{record['exporter']:7s} {record['steps']:5d} steps  ONNX Runtime {record['ort_ms']:8.2f} ms  "
        f"gradgen {record['gradgen_ms']:8.2f} ms  {record['ratio']:.2f}x"
    )


# the per-model modes: (measure a model by name, one line for its record)
_bf16_row = (bf16_errors, _describe_bf16)
_speed_row = (run_speed, _describe_speed)


def row(record: dict[str, Any]) -> str:
    cells = [f"{record['model']:10s} {record['exporter']:16s}"]
    for dtype in ("float32", "float64"):
        g = record.get(f"gradients_{dtype}")
        if g:
            what = f"{g['worst']:.1e} ({g['compared']} tensors)" if g["stage"] == "done" else f"{g['stage']} failed"
            cells.append(f"grad {dtype} {what}")
    t = record.get("training")
    if t:
        cells.append(f"train {t['params']}/{t['torch_params']} params, loss diff {t['max_rel_loss_diff']:.1e}")
        if "ort_error" in t:
            cells.append(f"ONNX Runtime: {t['ort_error'][:150]}")
        if "ort_max_rel_loss_diff" in t:
            cells.append(f"ONNX Runtime on the artifacts: loss diff {t['ort_max_rel_loss_diff']:.1e}")
        cells.extend(f"\n    note: {note[:220]}" for note in t["notes"])
    if record.get("error"):
        cells.append(f"error: {record['error'][:200]}")
    for dtype in ("float32", "float64"):
        error = (record.get(f"gradients_{dtype}") or {}).get("error")
        if error:
            cells.append(f"\n    {dtype}: {error[:200]}")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"models (default all): {', '.join(MODELS)}")
    parser.add_argument("--exporters", default=",".join(EXPORTERS), help=f"comma-separated, of {', '.join(EXPORTERS)}")
    parser.add_argument("--steps", type=int, default=20, help="training steps compared (default 20)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--ort-python", help="an interpreter with onnxruntime-training: also train the optimised export there")
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="export with a dynamic batch axis on every input and a dynamic length on token inputs",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="instead: each model's bf16 gradients (gradgen's and PyTorch's CPU autocast) against PyTorch's fp32, per tensor",
    )
    parser.add_argument(
        "--speed",
        action="store_true",
        help="instead: the CPU step of each model's portable backward graph, gradgen against ONNX Runtime, one thread",
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(1)
    logging_off()
    records = []
    mode = _bf16_row if args.bf16 else _speed_row if args.speed else None
    if mode is not None:  # one record per model
        measure, describe = mode
        for name in args.names or list(MODELS):
            record = measure(name)
            records.append(record)
            print(f"{name:10s} {describe(record)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=1))
        return 0
    for name in args.names or list(MODELS):
        for exporter in args.exporters.split(","):
            record = run(name, exporter, args.steps, args.ort_python, dynamic=args.dynamic)
            print(row(record), flush=True)
            records.append(record)
    if args.json:
        write_records(args.json, records)
    return 0


def write_records(path: str, records: list) -> None:
    """The sweep's records as JSON (what json cannot write, as text)."""
    Path(path).write_text(
        json.dumps(records, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    )


def logging_off() -> None:
    """transformers' config notes and torch.export's registration warnings, once per model, are noise here."""
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    raise SystemExit(main())
