"""Tiny checkpoints of DeepSeek's vision line: Janus / DeepSeek-VL (`multi_modality`: a
SigLIP tower, an MLP aligner, a Llama decoder)."""

from __future__ import annotations

from typing import Any

from tests.vision_families.common import TEXT, _tokenizer


def _tiny_sam() -> None:
    """mlx-vlm builds DeepSeek-VL's SAM tower (the hybrid tower's 1024 px side) from its
    constructor's defaults, not the config (ViT-B: 768 wide, 12 layers): the tiny model keeps
    its shape (16 px patches, windows of 14, a global layer, the neck resized to 96 x 96 and
    two stride-2 convolutions: 24 x 24 rows) at 32 wide, two layers. Set for the test process,
    as FastVLM's block lists are (`_tiny_fastvit`)."""
    from mlx_vlm.models.multi_modality.sam import SAMEncoder

    d = list(SAMEncoder.__init__.__defaults__)
    d[3:6], d[7], d[15], d[16] = [32, 2, 2], 32, (1,), (32, 64)  # width, depth, heads; neck; global; downsamples
    SAMEncoder.__init__.__defaults__ = tuple(d)


_tiny_sam()


def _multi_modality(path: str, hybrid: bool = False) -> tuple[dict, Any]:
    """Janus(-Pro)'s understanding path: a SigLIP ViT at 384 px (32 px patches here: 144
    rows), a two-layer GELU aligner, a Llama decoder. Its checkpoints ship a tokenizer and
    remote-code processor classes: mlx-vlm loads the tokenizer and its own image processor
    (a pad to a square), puts the config's image id where the prompt says `<image>`, and its
    merge grows that one id into the image's rows (a sentinel family). `hybrid`: DeepSeek-VL's
    tower instead, SAM at 1024 px and SigLIP at 384 px (16 px patches: 576 rows), each half
    of the aligner's first layer."""
    if hybrid:
        cfg_for = {"image_size": 384, "select_feature": "same", "select_layer": -1, "output_dim": 64}
        vision = {"model_type": "vision", "cls": "HybridVisionTower", "hidden_size": 64, "num_hidden_layers": 1,
                  "intermediate_size": 64, "num_attention_heads": 2, "image_size": 384, "patch_size": 16,
                  "params": {"concat_type": "tuple",
                             "high_res_cfg": {**cfg_for, "image_size": 1024, "model_name": "sam_b_downsample",
                                              "pixel_mean": [0.48145466, 0.4578275, 0.40821073],
                                              "pixel_std": [0.26862954, 0.26130258, 0.27577711]},
                             "low_res_cfg": {**cfg_for, "model_name": "siglip_large_patch16_384",
                                             "pixel_mean": [0.5] * 3, "pixel_std": [0.5] * 3}}}
        projector, rows = "low_high_hybrid_split_mlp_gelu", 576
    else:
        vision = {"model_type": "vision", "cls": "CLIPVisionTower", "hidden_size": 32, "num_hidden_layers": 2,
                  "intermediate_size": 64, "num_attention_heads": 2, "image_size": 384, "patch_size": 32,
                  "params": {"image_size": 384, "model_name": "siglip_large_patch16_384", "select_feature": "same",
                             "select_layer": -1}}
        projector, rows = "mlp_gelu", 144
    aligner = {"cls": "MlpProjector", "model_type": "aligner",
               "params": {"depth": 2, "input_dim": vision["hidden_size"], "n_embed": TEXT["hidden_size"],
                          "projector_type": projector}}
    tok = _tokenizer(["<image_placeholder>"], "<image>")
    cfg = {"model_type": "multi_modality", "text_config": dict(TEXT), "vision_config": vision,
           "aligner_config": aligner, "image_token_index": tok.convert_tokens_to_ids("<image_placeholder>"),
           "num_image_tokens": rows, "eos_token_id": 2}
    return cfg, tok


def deepseek_vl_hybrid_layout(params: dict, seed: int) -> dict:
    """The SAM side's high-resolution neck joins by a learned factor initialised to zero: set
    off zero so the branch shows in the features."""
    return {k: (v + 0.5 if k.endswith("hd_alpha_downsamples") else v) for k, v in params.items()}


def _tiny_deepseek_ocr_sam() -> None:
    """DeepSeek-OCR's SAM tower is built from a config class and constructor defaults fixed in
    mlx-vlm's code (ViT-B at 1024 px, 1024 channels out): the tiny model keeps its shape (16 px
    patches, windows of 14, a global layer, the neck at 256 channels and its two stride-2
    convolutions: 16 x 16 rows at 1024 px, 10 x 10 at 640) at 32 wide, two layers, 64 out."""
    from mlx_vlm.models.deepseekocr import deepseekocr, sam

    class TinySAM(deepseekocr.SAMViTConfig):
        def __init__(self) -> None:
            super().__init__(width=32, layers=2, heads=2, global_attn_indexes=(1,))

    deepseekocr.SAMViTConfig = TinySAM
    d = list(sam.SAMEncoder.__init__.__defaults__)
    d[-1] = 64  # final_out_chans
    sam.SAMEncoder.__init__.__defaults__ = tuple(d)


_tiny_deepseek_ocr_sam()


def _deepseekocr(path: str) -> tuple[dict, Any]:
    """DeepSeek-OCR: SAM's features are a CLIP-L's patch embeddings; both concatenated, a linear
    projector; a global 1024 px view and 640 px tiles for a large picture, each row closed by a
    newline embedding, a view separator after; a DeepSeek-MoE decoder (plain attention, greedy
    softmax routing over routed and shared experts: mlx-lm's `deepseek`). Its processor is
    mlx-vlm's own: the prompt as text, `<image>` where an image goes (its default template
    reads string content only; the tiny one renders image parts, as the other families')."""
    from mlx_vlm.models.deepseekocr.processing_deepseekocr import DeepseekOCRProcessor

    text = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "topk_method": "greedy",
            "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
            "v_head_dim": 0, "use_mla": False, "vocab_size": 300, "rms_norm_eps": 1e-6, "bos_token_id": 0,
            "eos_token_id": 1}
    vision = {"model_type": "vision", "layers": 1, "hidden_size": 64, "intermediate_size": 64,
              "num_attention_heads": 2, "image_size": 224, "patch_size": 14}
    # (the tokens its processor adds, within the tiny vocabulary)
    tok = _tokenizer(["<image>", "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>",
                      "<|Assistant|>", "<｜▁pad▁｜>"], "<image>")
    tok.bos_token = "<unk>"  # (id 0: its processor puts id 0 first, DeepSeek's BOS)
    proc = DeepseekOCRProcessor(tokenizer=tok, candidate_resolutions=[[1024, 1024]], patch_size=16,
                                downsample_ratio=4, chat_template=tok.chat_template)
    cfg = {"model_type": "deepseekocr", "text_config": text, "vision_config": vision,
           "projector_config": {"projector_type": "linear", "input_dim": 128, "n_embed": 64},
           "image_token_index": proc.image_token_id, "tile_tag": "2D", "global_view_pos": "head", "eos_token_id": 1}
    return cfg, proc


def _tiny_deepseek_ocr_2() -> None:
    """DeepSeek-OCR 2 takes SAM (896 channels out, fixed in mlx-vlm's code, as its Qwen2
    encoder's width) into a Qwen2-0.5B encoder whose depth, heads and MLP mlx-vlm's config
    fixes in code: the tiny model keeps its width and query grids, one layer, a narrow MLP."""
    from mlx_vlm.models.deepseekocr_2 import config, deepseekocr_2

    class TinySAM(deepseekocr_2.SAMViTConfig):
        def __init__(self) -> None:
            super().__init__(width=32, layers=2, heads=2, global_attn_indexes=(1,))

    deepseekocr_2.SAMViTConfig = TinySAM
    full = config.VisionConfig.from_dict.__func__

    def tiny(cls: Any, params: dict) -> Any:
        out = full(cls, params)
        out.params["qwen2"].update(layers=1, intermediate_size=64)
        return out

    config.VisionConfig.from_dict = classmethod(tiny)


_tiny_deepseek_ocr_2()


def _deepseekocr_2(path: str) -> tuple[dict, Any]:
    """DeepSeek-OCR 2: SAM into a Qwen2 encoder with learned queries (16 x 16 for the 1024 px
    global view, 12 x 12 for each 768 px tile), a linear projector, a view separator; DeepSeek-
    OCR's decoder and processor rules (mlx-vlm's own processor, `<image>` in the text)."""
    from mlx_vlm.models.deepseekocr_2.processing_deepseekocr import DeepseekOCR2Processor

    cfg, proc = _deepseekocr(path)
    proc = DeepseekOCR2Processor(tokenizer=proc.tokenizer, candidate_resolutions=[[1024, 1024]], patch_size=16,
                                 downsample_ratio=4, chat_template=proc.tokenizer.chat_template)
    cfg.update(model_type="deepseekocr_2", vision_config={"model_type": "vision", "width": {"qwen2-0-5b": {"dim": 896}}},
               projector_config={"projector_type": "linear", "input_dim": 896, "n_embed": 64})
    return cfg, proc


def _unlimited_ocr(path: str) -> tuple[dict, Any]:
    """Unlimited-OCR: DeepSeek-OCR's towers, processor rules and decoder, whose layers read the
    whole prompt and a window of the output after it (R-SWA, `sliding_window_size`: 8 here, so
    a short answer runs past it)."""
    from mlx_vlm.models.unlimited_ocr.processing_unlimitedocr import UnlimitedOCRProcessor

    cfg, proc = _deepseekocr(path)
    proc = UnlimitedOCRProcessor(tokenizer=proc.tokenizer, candidate_resolutions=[[1024, 1024]], patch_size=16,
                                 downsample_ratio=4, chat_template=proc.tokenizer.chat_template)
    cfg.update(model_type="unlimited-ocr", image_token_index=proc.image_token_id)  # (as published)
    cfg["text_config"].update(sliding_window_size=8, sliding_window=8)
    return cfg, proc
