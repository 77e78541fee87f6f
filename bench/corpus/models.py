"""The corpus: real architectures from timm, transformers and torchvision, with random weights.

Each row builds a torch module in eval mode and its example inputs at small sizes, from fixed
seeds, with nothing downloaded: timm's `pretrained=False`, transformers' small configs
(`XConfig(hidden_size=64, ...)` then `XModel(config)`), torchvision's `weights=None`. Weights the
libraries initialize to zero are randomized and BatchNorm statistics are measured on random images
(bench/zoo.py), so that verification compares outputs that are not ~0.

A row's name is `<family>/<model>`. `ci=True` rows make the fixed subset tests/corpus/ checks on
every test run; `gpu_only_verify=True` marks a row the Triton interpreter cannot verify within the
CPU leg's time limit per row: the CPU leg exports and compiles it without verifying, and only the
GPU leg (the default exporter) verifies it. No row is marked now: the five that needed 224-256 px
(crossvit_tiny_240, visformer_tiny, efficientformer_l1, halonet26t, maxvit_t) verify in the
interpreter in one to a few minutes each.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.zoo import _calibrate_batchnorm, _randomize_zero_init, import_torchvision

Example = dict[str, torch.Tensor]
Built = tuple[nn.Module, Example]
FAMILIES = ("timm", "transformers", "torchvision")
SEED = 0


@dataclass(frozen=True)
class Row:
    name: str  # "<family>/<model>"
    family: str  # one of FAMILIES
    build: Callable[[], Built]
    ci: bool = False
    gpu_only_verify: bool = False


def _seed(name: str) -> None:
    torch.manual_seed(SEED)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED + 1)


def _randomize_small_norms(module: nn.Module) -> nn.Module:
    """Norm scales initialized to zero (a residual block's last BatchNorm in timm's ResNets) or
    layer scales initialized near zero (1e-5, 1e-6): the branch they scale would contribute nothing
    and verification would not see it. Both get values of order one tenth to one."""
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() != 1 or p.numel() == 0:
                continue
            top = float(p.abs().max())
            if top == 0.0 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif 0.0 < top < 1e-3:
                p.copy_(0.1 + 0.02 * torch.randn(p.shape, generator=gen))
    return module


def _unit_batchnorm_scales(module: nn.Module) -> nn.Module:
    """BatchNorm scales drawn like the other weights (transformers' MobileViT: |gamma| about 0.015)
    get values about one, as training leaves them: each such norm would shrink the activations
    some 60-fold, and after a few stages they sit below fp16's smallest normal (1e-6 to 1e-9), so
    the row would test rounding, not the model."""
    gen = torch.Generator().manual_seed(SEED + 3)
    with torch.no_grad():
        for m in module.modules():
            small = isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None
            if small and float(m.weight.abs().mean()) < 0.1:
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=gen))
    return module


def _vision_module(module: nn.Module, size: int | tuple[int, int]) -> nn.Module:
    module = _unit_batchnorm_scales(_randomize_small_norms(_randomize_zero_init(module)))
    h, w = (size, size) if isinstance(size, int) else size
    if h == w:
        module = _calibrate_batchnorm(module, h)
    else:  # _calibrate_batchnorm takes square images
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            for m in norms:
                m.reset_running_stats()
                m.momentum = None
            module.train()
            with torch.no_grad():
                for _ in range(2):
                    module(torch.randn(8, 3, h, w, generator=torch.Generator().manual_seed(1)))
    return module.eval()


class _Select(nn.Module):
    """One tensor out of whatever the wrapped module returns: a tuple's first element, a dict's
    key, a list of feature maps (each is an output)."""

    def __init__(self, inner: nn.Module, key: str | int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.key = key

    def forward(self, x: torch.Tensor) -> Any:
        out = self.inner(x)
        if isinstance(out, dict):
            if self.key in out:
                return out[self.key]
            return tuple(out.values())
        if isinstance(out, (tuple, list)):
            return out[self.key] if isinstance(self.key, int) else tuple(out)
        return out


# --- timm -----------------------------------------------------------------------------------------


def _timm(model: str, size: int | tuple[int, int] = 64, **kwargs: Any) -> Callable[[], Built]:
    def build() -> Built:
        import_torchvision()  # timm imports torchvision
        import timm

        _seed(model)
        m = timm.create_model(model, pretrained=False, num_classes=10, **kwargs)
        h, w = (size, size) if isinstance(size, int) else size
        return _vision_module(m, size), {"x": torch.randn(1, 3, h, w, generator=_gen())}

    return build


# (model, size, create_model kwargs, ci, gpu_only_verify): the smallest variant of each family.
_TIMM: list[tuple[str, Any, dict[str, Any], bool, bool]] = [
    ("test_resnet", 32, {}, True, False),
    ("test_efficientnet", 32, {}, True, False),
    ("test_convnext", 32, {}, True, False),
    ("test_vit", 32, {}, True, False),
    ("test_byobnet", 32, {}, False, False),
    ("test_nfnet", 32, {}, False, False),
    ("test_mambaout", 32, {}, False, False),
    ("resnet18", 64, {}, False, False),
    ("resnet10t", 64, {}, False, False),
    ("resnext26ts", 64, {}, False, False),
    ("regnetx_002", 64, {}, False, False),
    ("regnety_002", 64, {}, False, False),
    ("efficientnet_b0", 64, {}, False, False),
    ("efficientnet_lite0", 64, {}, False, False),
    ("efficientnetv2_rw_t", 64, {}, False, False),
    ("tf_efficientnetv2_b0", 64, {}, False, False),
    ("mobilenetv1_100", 64, {}, False, False),
    ("mobilenetv2_050", 64, {}, False, False),
    ("mobilenetv3_small_050", 64, {}, False, False),
    ("mobilenetv4_conv_small", 64, {}, False, False),
    ("mobilenetv4_hybrid_medium", 64, {}, False, False),
    ("mnasnet_small", 64, {}, False, False),
    ("ghostnet_050", 64, {}, False, False),
    ("ghostnetv2_100", 64, {}, False, False),
    ("repghostnet_050", 64, {}, False, False),
    ("lcnet_050", 64, {}, True, False),
    ("fbnetc_100", 64, {}, False, False),
    ("spnasnet_100", 64, {}, False, False),
    ("tinynet_e", 64, {}, False, False),
    ("mixnet_s", 64, {}, False, False),
    ("hardcorenas_a", 64, {}, False, False),
    ("convnext_atto", 64, {}, False, False),
    ("vit_tiny_patch16_224", 64, {"img_size": 64}, False, False),
    ("vit_small_patch16_224", 64, {"img_size": 64}, False, False),
    ("deit_tiny_patch16_224", 64, {"img_size": 64}, False, False),
    ("deit3_small_patch16_224", 64, {"img_size": 64}, False, False),
    ("flexivit_small", 64, {"img_size": 64}, False, False),
    ("eva02_tiny_patch14_224", 56, {"img_size": 56}, False, False),
    ("beit_base_patch16_224", 64, {"img_size": 64}, False, False),
    ("swin_tiny_patch4_window7_224", 64, {"img_size": 64, "window_size": 4}, False, False),
    ("mixer_s16_224", 64, {"img_size": 64}, False, False),
    ("resmlp_12_224", 64, {"img_size": 64}, False, False),
    ("gmlp_ti16_224", 64, {"img_size": 64}, False, False),
    ("poolformer_s12", 64, {}, False, False),
    ("poolformerv2_s12", 64, {}, False, False),
    ("levit_128s", 64, {"img_size": 64}, False, False),
    ("coat_lite_tiny", 64, {"img_size": 64}, False, False),
    ("crossvit_tiny_240", 240, {}, False, False),
    ("cait_xxs24_224", 64, {"img_size": 64}, False, False),
    ("xcit_nano_12_p16_224", 64, {"img_size": 64}, False, False),
    ("pit_ti_224", 64, {"img_size": 64}, False, False),
    ("convit_tiny", 64, {"img_size": 64}, False, False),
    ("tnt_s_patch16_224", 64, {"img_size": 64}, False, False),
    ("twins_svt_small", 64, {"img_size": 64}, False, False),
    ("pvt_v2_b0", 64, {}, False, False),
    ("visformer_tiny", 224, {}, False, False),
    ("dla46_c", 64, {}, False, False),
    ("dla34", 64, {}, False, False),
    ("dpn48b", 64, {}, False, False),
    ("densenet121", 64, {}, False, False),
    ("inception_v3", 96, {}, False, False),
    ("inception_v4", 96, {}, False, False),
    ("inception_resnet_v2", 96, {}, False, False),
    ("inception_next_atto", 64, {}, False, False),
    ("xception41", 64, {}, False, False),
    ("legacy_xception", 64, {}, False, False),
    ("res2net50_14w_8s", 64, {}, False, False),
    ("rexnet_100", 64, {}, False, False),
    ("hrnet_w18_small", 64, {}, False, False),
    ("nf_resnet26", 64, {}, False, False),
    ("nf_regnet_b0", 64, {}, False, False),
    ("dm_nfnet_f0", 64, {}, False, False),
    ("cspresnet50", 64, {}, False, False),
    ("cspdarknet53", 64, {}, False, False),
    ("cs3darknet_s", 64, {}, False, False),
    ("darknet17", 64, {}, False, False),
    ("ese_vovnet19b_slim", 64, {}, False, False),
    ("ese_vovnet19b_dw", 64, {}, False, False),
    ("tresnet_m", 64, {}, False, False),
    ("repvgg_a0", 64, {}, False, False),
    ("mobileone_s0", 64, {}, False, False),
    ("repvit_m0_9", 64, {}, False, False),
    ("mobilevit_xxs", 64, {}, False, False),
    ("mobilevitv2_050", 64, {}, False, False),
    ("efficientformer_l1", 224, {}, False, False),
    ("efficientformerv2_s0", 64, {"img_size": 64}, False, False),
    ("fastvit_t8", 64, {}, False, False),
    ("edgenext_xx_small", 64, {}, False, False),
    ("maxvit_nano_rw_256", 64, {"img_size": 64}, False, False),
    ("coatnet_nano_rw_224", 64, {"img_size": 64}, False, False),
    ("efficientvit_b0", 64, {}, False, False),
    ("efficientvit_m0", 64, {"img_size": 64}, False, False),
    ("tiny_vit_5m_224", 64, {}, False, False),  # timm 1.0 takes no img_size: windows pad
    ("gcvit_xxtiny", 64, {"img_size": 64}, False, False),
    ("davit_tiny", 64, {}, False, False),
    ("focalnet_tiny_srf", 64, {}, False, False),
    ("hiera_tiny_224", 64, {"img_size": 64}, False, False),
    ("sequencer2d_s", 64, {}, False, False),
    ("selecsls42b", 64, {}, False, False),
    ("hgnetv2_b0", 64, {}, False, False),
    ("hgnet_tiny", 64, {}, False, False),
    ("rdnet_tiny", 64, {}, False, False),
    ("vgg11", 64, {}, False, False),
    ("resnest14d", 64, {}, False, False),
    ("skresnet18", 64, {}, False, False),
    ("seresnext26d_32x4d", 64, {}, False, False),
    ("legacy_seresnet18", 64, {}, False, False),
    ("ecaresnet26t", 64, {}, False, False),
    ("gernet_s", 64, {}, False, False),
    ("regnetz_b16", 64, {}, False, False),
    ("botnet26t_256", 64, {"img_size": 64}, False, False),
    ("halonet26t", 256, {}, False, False),  # 8-px halo blocks at stride 32: 256 px at least
    ("lambda_resnet26t", 64, {"img_size": 64}, False, False),
    ("mambaout_femto", 64, {}, False, False),
    ("starnet_s1", 64, {}, False, False),
]


# --- transformers ---------------------------------------------------------------------------------

SEQ = 16
VOCAB = 128
# The small-config fields most families read; each family adds or overrides its own.
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}
_DECODER = {**_SMALL, "num_key_value_heads": 2, "use_cache": False, "head_dim": 32}
_VISION = {**_SMALL, "image_size": 32, "patch_size": 8, "num_channels": 3}
_STAGES = {
    "num_channels": 3,
    "depths": [1, 1],
    "hidden_sizes": [16, 32],
    "embed_dim": 16,
    "embed_dims": [16, 32],
    "num_heads": [1, 2],
    "image_size": 32,
    "num_stages": 2,
}
_AUDIO = {
    **_SMALL,
    "conv_dim": [16, 16],
    "conv_stride": [5, 2],
    "conv_kernel": [10, 3],
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
    "num_feat_extract_layers": 2,
    "do_stable_layer_norm": False,
}
_SEQ2SEQ = {
    "vocab_size": VOCAB,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 64,
    "use_cache": False,
}
# Special token ids inside the small vocabulary (some families default to ids of their real one).
_TOKENS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "cls_token_id": 1,
    "sep_token_id": 2,
    "decoder_start_token_id": 1,
}
_T5 = {"vocab_size": VOCAB, "d_model": 64, "d_kv": 32, "d_ff": 128, "num_layers": 2, "num_heads": 2}


class _HFFirst(nn.Module):
    """A transformers model's first output (its last hidden state), from one named input."""

    def __init__(self, inner: nn.Module, arg: str) -> None:
        super().__init__()
        self.inner = inner
        self.arg = arg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(**{self.arg: x})[0]  # a ModelOutput's first field, or a tuple's


def _hf(
    model_cls: str,
    config_cls: str,
    config: dict[str, Any],
    inputs: str = "text",
    encoder: bool = False,
) -> Callable[[], Built]:
    """`inputs`: text (input_ids 1 x SEQ), image (pixel_values 1 x 3 x size x size), audio
    (input_values 1 x 1600), features (input_features 1 x mel x frames, Whisper and Speech2Text),
    spectrogram (input_values 1 x frames x mel, AST). `encoder`: export model.get_encoder()."""

    def build() -> Built:
        import_torchvision()  # transformers imports torchvision where it is installed
        import transformers

        _seed(model_cls)
        cfg = getattr(transformers, config_cls)(**config)
        model = getattr(transformers, model_cls)(cfg)
        if encoder:
            model = model.get_encoder()
        model = _randomize_small_norms(_randomize_zero_init(model))
        gen = _gen()
        arg = "input_ids"
        if inputs == "text":
            x = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
        elif inputs == "image":
            size = config.get("image_size", 32)
            size = int(size[0] if isinstance(size, (list, tuple)) else size)
            x = torch.randn(1, 3, size, size, generator=gen)
            arg = "pixel_values"
            model = _vision_module(model, size) if _has_batchnorm(model) else model
        elif inputs == "audio":
            x, arg = torch.randn(1, 1600, generator=gen), "input_values"
        elif inputs == "features":
            mel = int(config.get("num_mel_bins", config.get("input_feat_per_channel", 16)))
            frames = 2 * int(config.get("max_source_positions", 32))
            x, arg = torch.randn(1, mel, frames, generator=gen), "input_features"
            if model_cls.startswith("Speech2Text"):
                x = x.transpose(1, 2).contiguous()
        elif inputs == "spectrogram":
            x = torch.randn(1, int(config["max_length"]), int(config["num_mel_bins"]), generator=gen)
            arg = "input_values"
        else:
            raise ValueError(inputs)
        return _HFFirst(model, arg).eval(), {arg: x}

    return build


def _has_batchnorm(m: nn.Module) -> bool:
    return any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())


# (row name, model class, config class, config, inputs, encoder, ci); one line per row.
# fmt: off
_HF: list[tuple[str, str, str, dict[str, Any], str, bool, bool]] = [
    # encoders
    ("bert", "BertModel", "BertConfig", _SMALL, "text", False, True),
    ("roberta", "RobertaModel", "RobertaConfig", {**_SMALL, "pad_token_id": 1}, "text", False, False),
    ("albert", "AlbertModel", "AlbertConfig", {**_SMALL, "embedding_size": 32}, "text", False, False),
    (
        "distilbert",
        "DistilBertModel",
        "DistilBertConfig",
        {"vocab_size": VOCAB, "dim": 64, "n_layers": 2, "n_heads": 2, "hidden_dim": 128},
        "text",
        False,
        True,
    ),
    ("electra", "ElectraModel", "ElectraConfig", {**_SMALL, "embedding_size": 32}, "text", False, False),
    ("deberta", "DebertaModel", "DebertaConfig", _SMALL, "text", False, False),
    ("deberta-v2", "DebertaV2Model", "DebertaV2Config", _SMALL, "text", False, False),
    ("mpnet", "MPNetModel", "MPNetConfig", _SMALL, "text", False, False),
    ("xlm-roberta", "XLMRobertaModel", "XLMRobertaConfig", {**_SMALL, "pad_token_id": 1}, "text", False, False),
    ("camembert", "CamembertModel", "CamembertConfig", {**_SMALL, "pad_token_id": 1}, "text", False, False),
    ("convbert", "ConvBertModel", "ConvBertConfig", {**_SMALL, "embedding_size": 64}, "text", False, False),
    ("ernie", "ErnieModel", "ErnieConfig", _SMALL, "text", False, False),
    ("rembert", "RemBertModel", "RemBertConfig", {**_SMALL, "input_embedding_size": 32, "output_embedding_size": 32}, "text", False, False),
    ("roformer", "RoFormerModel", "RoFormerConfig", {**_SMALL, "embedding_size": 64}, "text", False, False),
    ("squeezebert", "SqueezeBertModel", "SqueezeBertConfig", {**_SMALL, "embedding_size": 64}, "text", False, False),
    ("data2vec-text", "Data2VecTextModel", "Data2VecTextConfig", {**_SMALL, "pad_token_id": 1}, "text", False, False),
    ("megatron-bert", "MegatronBertModel", "MegatronBertConfig", _SMALL, "text", False, False),
    ("mobilebert", "MobileBertModel", "MobileBertConfig", {**_SMALL, "embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32, "num_feedforward_networks": 2}, "text", False, False),
    ("fnet", "FNetModel", "FNetConfig", _SMALL, "text", False, False),
    ("modernbert", "ModernBertModel", "ModernBertConfig", {**_SMALL, "global_attn_every_n_layers": 2, "local_attention": 8, **_TOKENS}, "text", False, False),
    ("esm", "EsmModel", "EsmConfig", {**_SMALL, "pad_token_id": 1, "position_embedding_type": "rotary"}, "text", False, False),
    ("ibert", "IBertModel", "IBertConfig", {**_SMALL, "pad_token_id": 1}, "text", False, False),
    ("funnel", "FunnelBaseModel", "FunnelConfig", {"vocab_size": VOCAB, "block_sizes": [1, 1], "d_model": 64, "n_head": 2, "d_head": 32, "d_inner": 128}, "text", False, False),
    ("nystromformer", "NystromformerModel", "NystromformerConfig", {**_SMALL, "num_landmarks": 4, "segment_means_seq_len": SEQ}, "text", False, False),
    ("bigbird", "BigBirdModel", "BigBirdConfig", {**_SMALL, "attention_type": "original_full"}, "text", False, False),
    ("xlm", "XLMModel", "XLMConfig", {"vocab_size": VOCAB, "emb_dim": 64, "n_layers": 2, "n_heads": 2, "max_position_embeddings": 64}, "text", False, False),
    # decoders, prefill (no cache)
    ("gpt2", "GPT2Model", "GPT2Config", {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "use_cache": False}, "text", False, True),
    ("gpt-neo", "GPTNeoModel", "GPTNeoConfig", {**_SMALL, "num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": 8, "use_cache": False}, "text", False, False),
    ("gptj", "GPTJModel", "GPTJConfig", {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2, "rotary_dim": 16, "n_positions": 64, "use_cache": False}, "text", False, False),
    ("gpt-neox", "GPTNeoXModel", "GPTNeoXConfig", {**_DECODER}, "text", False, False),
    ("gpt-bigcode", "GPTBigCodeModel", "GPTBigCodeConfig", {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "use_cache": False}, "text", False, False),
    ("opt", "OPTModel", "OPTConfig", {**_DECODER, "ffn_dim": 128, "word_embed_proj_dim": 64}, "text", False, False),
    ("bloom", "BloomModel", "BloomConfig", {"vocab_size": VOCAB, "hidden_size": 64, "n_layer": 2, "n_head": 2, "use_cache": False}, "text", False, False),
    ("llama", "LlamaModel", "LlamaConfig", _DECODER, "text", False, True),
    ("mistral", "MistralModel", "MistralConfig", _DECODER, "text", False, False),
    ("qwen2", "Qwen2Model", "Qwen2Config", _DECODER, "text", False, False),
    ("qwen3", "Qwen3Model", "Qwen3Config", _DECODER, "text", False, False),
    ("phi", "PhiModel", "PhiConfig", _DECODER, "text", False, False),
    ("phi3", "Phi3Model", "Phi3Config", {**_DECODER, "pad_token_id": 0}, "text", False, False),
    ("gemma", "GemmaModel", "GemmaConfig", _DECODER, "text", False, False),
    ("gemma2", "Gemma2Model", "Gemma2Config", _DECODER, "text", False, False),
    ("gemma3-text", "Gemma3TextModel", "Gemma3TextConfig", {**_DECODER, "sliding_window": 8}, "text", False, False),
    ("falcon", "FalconModel", "FalconConfig", {**_SMALL, "new_decoder_architecture": True, "num_kv_heads": 2, "use_cache": False}, "text", False, False),
    ("stablelm", "StableLmModel", "StableLmConfig", _DECODER, "text", False, False),
    ("starcoder2", "Starcoder2Model", "Starcoder2Config", _DECODER, "text", False, False),
    ("olmo", "OlmoModel", "OlmoConfig", _DECODER, "text", False, False),
    ("olmo2", "Olmo2Model", "Olmo2Config", _DECODER, "text", False, False),
    ("cohere", "CohereModel", "CohereConfig", _DECODER, "text", False, False),
    ("granite", "GraniteModel", "GraniteConfig", _DECODER, "text", False, False),
    ("glm", "GlmModel", "GlmConfig", {**_DECODER, "pad_token_id": 0}, "text", False, False),
    ("helium", "HeliumModel", "HeliumConfig", _DECODER, "text", False, False),
    ("smollm3", "SmolLM3Model", "SmolLM3Config", {**_DECODER, "pad_token_id": 0}, "text", False, False),
    ("mixtral", "MixtralModel", "MixtralConfig", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}, "text", False, False),
    ("codegen", "CodeGenModel", "CodeGenConfig", {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2, "rotary_dim": 16, "n_positions": 64, "n_ctx": 64, "use_cache": False}, "text", False, False),
    ("biogpt", "BioGptModel", "BioGptConfig", _DECODER, "text", False, False),
    ("xglm", "XGLMModel", "XGLMConfig", {"vocab_size": VOCAB, "d_model": 64, "num_layers": 2, "attention_heads": 2, "ffn_dim": 128, "max_position_embeddings": 64, "use_cache": False}, "text", False, False),
    ("mpt", "MptModel", "MptConfig", {"vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq_len": 64, "use_cache": False}, "text", False, False),
    ("persimmon", "PersimmonModel", "PersimmonConfig", _DECODER, "text", False, False),
    # vision
    ("vit", "ViTModel", "ViTConfig", _VISION, "image", False, True),
    ("deit", "DeiTModel", "DeiTConfig", _VISION, "image", False, False),
    ("beit", "BeitModel", "BeitConfig", _VISION, "image", False, False),
    ("data2vec-vision", "Data2VecVisionModel", "Data2VecVisionConfig", _VISION, "image", False, False),
    ("dinov2", "Dinov2Model", "Dinov2Config", _VISION, "image", False, False),
    ("vit-msn", "ViTMSNModel", "ViTMSNConfig", _VISION, "image", False, False),
    ("yolos", "YolosModel", "YolosConfig", {**_VISION, "image_size": [32, 32], "num_detection_tokens": 4}, "image", False, False),
    ("clip-vision", "CLIPVisionModel", "CLIPVisionConfig", _VISION, "image", False, False),
    ("siglip-vision", "SiglipVisionModel", "SiglipVisionConfig", _VISION, "image", False, False),
    ("swin", "SwinModel", "SwinConfig", {**_STAGES, "patch_size": 4, "window_size": 4, "num_heads": [1, 2]}, "image", False, False),
    ("swinv2", "Swinv2Model", "Swinv2Config", {**_STAGES, "patch_size": 4, "window_size": 4, "num_heads": [1, 2]}, "image", False, False),
    ("convnext", "ConvNextModel", "ConvNextConfig", _STAGES, "image", False, False),
    ("convnextv2", "ConvNextV2Model", "ConvNextV2Config", _STAGES, "image", False, False),
    ("resnet", "ResNetModel", "ResNetConfig", {**_STAGES, "embedding_size": 16, "layer_type": "basic"}, "image", False, False),
    ("regnet", "RegNetModel", "RegNetConfig", {**_STAGES, "embedding_size": 16, "groups_width": 8}, "image", False, False),
    ("bit", "BitModel", "BitConfig", {**_STAGES, "hidden_sizes": [128, 256], "embedding_size": 32, "layer_type": "bottleneck", "global_padding": "SAME"}, "image", False, False),
    ("mobilevit", "MobileViTModel", "MobileViTConfig", {"image_size": 64, "hidden_sizes": [32, 48, 64], "neck_hidden_sizes": [8, 8, 16, 16, 24, 32, 64], "num_attention_heads": 2}, "image", False, False),
    ("mobilevitv2", "MobileViTV2Model", "MobileViTV2Config", {"image_size": 64, "width_multiplier": 0.5}, "image", False, False),
    ("mobilenet-v1", "MobileNetV1Model", "MobileNetV1Config", {"image_size": 64, "depth_multiplier": 0.25}, "image", False, False),
    ("mobilenet-v2", "MobileNetV2Model", "MobileNetV2Config", {"image_size": 64, "depth_multiplier": 0.35}, "image", False, False),
    ("levit", "LevitModel", "LevitConfig", {"image_size": 64, "hidden_sizes": [32, 48, 64], "num_attention_heads": [1, 2, 2], "depths": [1, 1, 1], "key_dim": [8, 8, 8]}, "image", False, False),
    ("poolformer", "PoolFormerModel", "PoolFormerConfig", {"image_size": 32, "depths": [1, 1, 1, 1], "hidden_sizes": [16, 16, 32, 32]}, "image", False, False),
    ("pvt", "PvtModel", "PvtConfig", {"image_size": 32, "depths": [1, 1, 1, 1], "hidden_sizes": [16, 16, 32, 32], "num_attention_heads": [1, 1, 2, 2]}, "image", False, False),
    ("pvt-v2", "PvtV2Model", "PvtV2Config", {"image_size": 32, "depths": [1, 1, 1, 1], "hidden_sizes": [16, 16, 32, 32], "num_attention_heads": [1, 1, 2, 2]}, "image", False, False),
    ("segformer", "SegformerModel", "SegformerConfig", {"image_size": 32, "depths": [1, 1, 1, 1], "hidden_sizes": [16, 16, 32, 32], "decoder_hidden_size": 32}, "image", False, False),
    ("focalnet", "FocalNetModel", "FocalNetConfig", {"image_size": 32, "embed_dim": 16, "depths": [1, 1], "focal_levels": [2, 2], "focal_windows": [3, 3]}, "image", False, False),
    ("hiera", "HieraModel", "HieraConfig", {"image_size": [64, 64], "embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "query_stride": [2, 2], "num_query_pool": 1, "masked_unit_size": [4, 4], "patch_stride": [4, 4]}, "image", False, False),
    # audio
    ("wav2vec2", "Wav2Vec2Model", "Wav2Vec2Config", _AUDIO, "audio", False, True),
    ("hubert", "HubertModel", "HubertConfig", _AUDIO, "audio", False, False),
    ("wavlm", "WavLMModel", "WavLMConfig", {**_AUDIO, "num_buckets": 32, "max_bucket_distance": 64}, "audio", False, False),
    ("data2vec-audio", "Data2VecAudioModel", "Data2VecAudioConfig", _AUDIO, "audio", False, False),
    ("sew", "SEWModel", "SEWConfig", {**_AUDIO, "squeeze_factor": 2}, "audio", False, False),
    ("unispeech", "UniSpeechModel", "UniSpeechConfig", _AUDIO, "audio", False, False),
    ("whisper-encoder", "WhisperModel", "WhisperConfig", {**_SEQ2SEQ, **_TOKENS, "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 32}, "features", True, False),
    ("speech2text-encoder", "Speech2TextModel", "Speech2TextConfig", {**_SEQ2SEQ, "input_feat_per_channel": 16, "max_source_positions": 64, "conv_channels": 32}, "features", True, False),
    ("ast", "ASTModel", "ASTConfig", {**_SMALL, "num_mel_bins": 32, "max_length": 32, "patch_size": 8, "frequency_stride": 8, "time_stride": 8}, "spectrogram", False, False),
    # the encoders of encoder-decoders
    ("t5-encoder", "T5EncoderModel", "T5Config", _T5, "text", False, True),
    ("mt5-encoder", "MT5EncoderModel", "MT5Config", _T5, "text", False, False),
    ("umt5-encoder", "UMT5EncoderModel", "UMT5Config", _T5, "text", False, False),
    ("longt5-encoder", "LongT5EncoderModel", "LongT5Config", {**_T5, "local_radius": 4}, "text", False, False),
    ("bart-encoder", "BartModel", "BartConfig", _SEQ2SEQ, "text", True, False),
    ("mbart-encoder", "MBartModel", "MBartConfig", _SEQ2SEQ, "text", True, False),
    ("pegasus-encoder", "PegasusModel", "PegasusConfig", _SEQ2SEQ, "text", True, False),
    ("marian-encoder", "MarianModel", "MarianConfig", {**_SEQ2SEQ, "pad_token_id": 0, "decoder_start_token_id": 0}, "text", True, False),
    ("blenderbot-encoder", "BlenderbotModel", "BlenderbotConfig", _SEQ2SEQ, "text", True, False),
    ("plbart-encoder", "PLBartModel", "PLBartConfig", _SEQ2SEQ, "text", True, False),
    ("led-encoder", "LEDModel", "LEDConfig", {**_SEQ2SEQ, "max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 64, "attention_window": [8, 8]}, "text", True, False),
]
# fmt: on


# --- torchvision ----------------------------------------------------------------------------------


def _tv(
    model: str, size: int = 64, key: str | int | None = None, frames: int = 0, **kwargs: Any
) -> Callable[[], Built]:
    """A torchvision.models constructor by its dotted name under torchvision.models. `key`: the
    output to keep (segmentation models return a dict). `frames`: a video model's clip length."""

    def build() -> Built:
        import_torchvision()
        import torchvision.models as tv

        _seed(model)
        ctor: Any = tv
        for part in model.split("."):
            ctor = getattr(ctor, part)
        m = ctor(weights=None, **kwargs)
        gen = _gen()
        if frames:
            m = _randomize_small_norms(_randomize_zero_init(m))
            m = _calibrate_video(m, frames, size)
            x = torch.randn(1, 3, frames, size, size, generator=gen)
        else:
            m = _vision_module(m, size)
            x = torch.randn(1, 3, size, size, generator=gen)
        if key is not None:
            m = _Select(m, key).eval()
        return m, {"x": x}

    return build


def _calibrate_video(module: nn.Module, frames: int, size: int) -> nn.Module:
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    module.train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            module(torch.randn(4, 3, frames, size, size, generator=gen))
    return module.eval()


class _Backbone(nn.Module):
    """A detection model's feature extractor (FPN outputs), as a tuple of feature maps."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.inner(x).values())


def _tv_detection(kind: str, size: int = 64) -> Callable[[], Built]:
    def build() -> Built:
        import_torchvision()
        import torchvision.models.detection as det
        from torchvision.models.detection import backbone_utils

        _seed(kind)
        if kind == "resnet18_fpn":
            inner: nn.Module = backbone_utils.resnet_fpn_backbone(
                backbone_name="resnet18", weights=None, trainable_layers=5
            )
        elif kind == "mobilenet_v3_fpn":
            inner = backbone_utils.mobilenet_backbone(
                backbone_name="mobilenet_v3_large", weights=None, fpn=True, trainable_layers=6
            )
        elif kind == "fasterrcnn_resnet50_fpn":
            inner = det.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone
        elif kind == "retinanet_resnet50_fpn":
            inner = det.retinanet_resnet50_fpn(weights=None, weights_backbone=None).backbone
        elif kind == "fcos_resnet50_fpn":
            inner = det.fcos_resnet50_fpn(weights=None, weights_backbone=None).backbone
        elif kind == "maskrcnn_resnet50_fpn":
            inner = det.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone
        elif kind == "keypointrcnn_resnet50_fpn":
            inner = det.keypointrcnn_resnet50_fpn(weights=None, weights_backbone=None).backbone
        elif kind == "ssdlite320_mobilenet_v3_large":
            inner = det.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None).backbone
        else:
            raise KeyError(kind)
        m = _Backbone(inner)
        return _vision_module(m, size), {"x": torch.randn(1, 3, size, size, generator=_gen())}

    return build


# (row name, builder, ci, gpu_only_verify); one line per row.
# fmt: off
_TV: list[tuple[str, Callable[[], Built], bool, bool]] = [
    ("resnet18", _tv("resnet18", num_classes=10), False, False),
    ("resnet50", _tv("resnet50", num_classes=10), False, False),
    ("resnext50_32x4d", _tv("resnext50_32x4d", num_classes=10), False, False),
    ("wide_resnet50_2", _tv("wide_resnet50_2", num_classes=10), False, False),
    ("alexnet", _tv("alexnet", num_classes=10), False, False),
    ("vgg11", _tv("vgg11", num_classes=10), False, False),
    ("vgg11_bn", _tv("vgg11_bn", num_classes=10), False, False),
    ("squeezenet1_0", _tv("squeezenet1_0", num_classes=10), False, False),
    ("squeezenet1_1", _tv("squeezenet1_1", num_classes=10), True, False),
    ("densenet121", _tv("densenet121", num_classes=10), False, False),
    ("googlenet", _tv("googlenet", num_classes=10, aux_logits=False, init_weights=True), False, False),
    ("inception_v3", _tv("inception_v3", 96, num_classes=10, aux_logits=False, init_weights=True), False, False),
    ("shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5", num_classes=10), True, False),
    ("mobilenet_v2", _tv("mobilenet_v2", num_classes=10), False, False),
    ("mobilenet_v3_small", _tv("mobilenet_v3_small", num_classes=10), True, False),
    ("mobilenet_v3_large", _tv("mobilenet_v3_large", num_classes=10), False, False),
    ("mnasnet0_5", _tv("mnasnet0_5", num_classes=10), False, False),
    ("efficientnet_b0", _tv("efficientnet_b0", num_classes=10), False, False),
    ("efficientnet_v2_s", _tv("efficientnet_v2_s", num_classes=10), False, False),
    ("regnet_x_400mf", _tv("regnet_x_400mf", num_classes=10), False, False),
    ("regnet_y_400mf", _tv("regnet_y_400mf", num_classes=10), False, False),
    ("convnext_tiny", _tv("convnext_tiny", num_classes=10), False, False),
    ("vit_b_16", _tv("vit_b_16", num_classes=10, image_size=64), False, False),
    ("swin_t", _tv("swin_t", num_classes=10), False, False),
    ("swin_v2_t", _tv("swin_v2_t", num_classes=10), False, False),
    ("maxvit_t", _tv("maxvit_t", 224, num_classes=10), False, False),
    # segmentation (the "out" map)
    ("fcn_resnet50", _tv("segmentation.fcn_resnet50", key="out", num_classes=4, weights_backbone=None), False, False),
    ("deeplabv3_resnet50", _tv("segmentation.deeplabv3_resnet50", key="out", num_classes=4, weights_backbone=None), False, False),
    ("deeplabv3_mobilenet_v3_large", _tv("segmentation.deeplabv3_mobilenet_v3_large", key="out", num_classes=4, weights_backbone=None), False, False),
    ("lraspp_mobilenet_v3_large", _tv("segmentation.lraspp_mobilenet_v3_large", key="out", num_classes=4, weights_backbone=None), False, False),
    # detection backbones (FPN feature maps)
    ("resnet18_fpn", _tv_detection("resnet18_fpn"), False, False),
    ("mobilenet_v3_fpn", _tv_detection("mobilenet_v3_fpn"), False, False),
    ("fasterrcnn_resnet50_fpn.backbone", _tv_detection("fasterrcnn_resnet50_fpn"), False, False),
    ("retinanet_resnet50_fpn.backbone", _tv_detection("retinanet_resnet50_fpn"), False, False),
    ("fcos_resnet50_fpn.backbone", _tv_detection("fcos_resnet50_fpn"), False, False),
    ("maskrcnn_resnet50_fpn.backbone", _tv_detection("maskrcnn_resnet50_fpn"), False, False),
    ("keypointrcnn_resnet50_fpn.backbone", _tv_detection("keypointrcnn_resnet50_fpn"), False, False),
    ("ssdlite320_mobilenet_v3_large.backbone", _tv_detection("ssdlite320_mobilenet_v3_large"), False, False),
    # video
    ("r3d_18", _tv("video.r3d_18", 32, frames=4, num_classes=10), False, False),
    ("mc3_18", _tv("video.mc3_18", 32, frames=4, num_classes=10), False, False),
    ("r2plus1d_18", _tv("video.r2plus1d_18", 32, frames=4, num_classes=10), False, False),
]
# fmt: on


def _rows() -> list[Row]:
    rows = [
        Row(f"timm/{name}", "timm", _timm(name, size, **kw), ci=ci, gpu_only_verify=gpu)
        for name, size, kw, ci, gpu in _TIMM
    ]
    rows += [
        Row(f"transformers/{name}", "transformers", _hf(cls, cfg_cls, cfg, inputs, enc), ci=ci)
        for name, cls, cfg_cls, cfg, inputs, enc, ci in _HF
    ]
    rows += [
        Row(f"torchvision/{name}", "torchvision", build, ci=ci, gpu_only_verify=gpu)
        for name, build, ci, gpu in _TV
    ]
    return sorted(rows, key=lambda r: r.name)


ROWS: list[Row] = _rows()
BY_NAME: dict[str, Row] = {r.name: r for r in ROWS}


def select(patterns: Iterable[str] = (), family: str | None = None, ci: bool | None = None) -> list[Row]:
    """Rows whose name matches any of `patterns` (globs or exact names; none: all rows)."""
    pats = [p for p in patterns if p]
    unknown = [p for p in pats if not any(ch in p for ch in "*?[") and p not in BY_NAME]
    if unknown:
        raise KeyError(
            f"no corpus row named {', '.join(unknown)}; names look like 'timm/resnet18' "
            "(see bench/corpus/models.py), and globs like 'timm/*' select several"
        )
    out = [r for r in ROWS if not pats or any(fnmatch.fnmatchcase(r.name, p) for p in pats)]
    if family:
        if family not in FAMILIES:
            raise KeyError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
        out = [r for r in out if r.family == family]
    if ci is not None:
        out = [r for r in out if r.ci == ci]
    return out
