"""Each vision family's verdict and rules, decided once per model type: the family table
(`FAMILIES`: runs, verified against mlx-vlm's own generation on tiny random models, or why
images are refused), and the rule sets a family's checkpoint is loaded and run by (masks,
placeholders, positions, merges)."""

from __future__ import annotations

from typing import Any

from macinfer.models.mlx_lm_classes import SPARSE
from macinfer.vision.merges import granite4_targets


# Moondream 2 and 3: one processor (BOS, 729 placeholders of BOS's id, the question around them),
# the image with its BOS a prefix that attends both ways; one image a prompt.
MOONDREAM = {"moondream2", "moondream3"}


# Families whose image tokens attend to each other both ways (transformers' Gemma 3; mlx-vlm
# runs them causally: the tests check against mlx-vlm's own classes with that mask). Gemma 4
# says so in its config (`use_bidirectional_attention: "vision"`), and mlx-vlm follows it.
BOTH_WAYS_IMAGES = {"gemma3", *MOONDREAM}  # (Moondream's rows are BOS and its image: the prompt's prefix)


# Prefix LMs (PaliGemma): the whole prompt attends both ways (transformers' token types: the
# prompt is all prefix), the output causally. They ship no chat template: their processor
# writes the prompt (the images' placeholders, BOS, the text, a newline), and so does this
# one, from a single user message (mlx-vlm's prompt format for them takes the last message).
PREFIX_LM = {"paligemma"}


# Families whose processor puts BOS before every prompt whatever the template renders (DeepSeek's
# code for DeepSeek-OCR; mlx-vlm's template for it writes the content alone; Molmo 1's published
# processor, BOS or else EOS, before its images, which mlx-vlm's leaves out): the engine's
# template is made to write it.
BOS_FIRST = {"deepseekocr", "deepseekocr_2", "unlimited_ocr"}


# Families whose decoder reads the whole prompt and a window of what follows it (Unlimited-OCR's
# R-SWA, its text config's `sliding_window_size`): the `PromptAndWindow` cache kind.
PROMPT_AND_WINDOW = {"unlimited_ocr"}


# Families whose processor writes the whole prompt around any text (its placeholders at the front):
# an image's expansion is its run of placeholders alone.
PROMPT_WRITERS = MOONDREAM


# Families whose prompt holds one image at most (Moondream's: the image is the prompt's prefix).
ONE_IMAGE = MOONDREAM


# Families whose published config keeps its tower's settings in code (no `vision_config`).
TOWER_IN_CODE = {"got"}


NOT_CHAT = "not a generative chat model (detection, segmentation, depth or embeddings): out of this engine's scope"


CROSS = "its language model cross-attends to the image (no image tokens in the prompt), not run yet"


ENC_DEC = "an encoder-decoder model, not a decoder the engine runs"


# Families whose prompt holds one sentinel id an image, grown into the image's rows at the merge:
# the engine's prompt holds a placeholder a row instead (`VisionProcessor._grown`).
SENTINEL_FAMILIES = {"llava_bunny", "fastvlm", "phi4mm", "multi_modality", "phi4_siglip"}


# Families whose processor builds transformers' Siglip2 image processor, whose module imports
# torch (a Mac's MLX install has none): loaded with its torch-free twin (`processor_fixes`).
TORCH_FREE = {"phi4_siglip"}


# Families whose merge RMS-norms every row (no scale) and whose decoder (mlx-lm's) norms every
# row it is given, its own included: the merge's normed text rows are the decoder's own.
NORMED_ROWS = {"muse_glimmer"}


# Families whose merge takes one image a prompt (GOT-OCR's: a batch row's features are one
# image's), or whose tower attends across every patch it is given (mlx-vlm's HunyuanOCR tower):
# their images are encoded a call each.
ONE_IMAGE_MERGES = {"got", "hunyuan_vl"}


# Families whose language model runs image prompts under a LoRA the checkpoint keeps beside
# its base weights (`vision/modality_lora.py`).
MODALITY_LORA = {"phi4mm"}


# model_type -> None (runs: same greedy tokens and first-token logprobs as mlx-vlm on tiny random
# weights, tests/test_vision.py) or why images are refused (the text still runs where mlx-lm does).
FAMILIES: dict[str, str | None] = {
    "llava": None, "mistral3": None, "pixtral": None, "mage_vl": None, "internvl_chat": None, "internvl": None, "llava_onevision": None, "idefics3": None, "smolvlm": None,
    "llava_next": None, "granite_vision": None, "qwen2_vl": None, "qwen2_5_vl": None, "qwen3_5": None,
    "qwen3_vl": None, "qwen3_vl_moe": None, "qwen3_5_moe": None, "glm4v": None, "glm4v_moe": None,
    "gemma3": None, "gemma4": None, "gemma4_unified": None, "aya_vision": None, "paddleocr_vl": None, "glm_ocr": None, "paligemma": None,
    "idefics2": None,
    "gemma3n": None,
    "llama4": None,
    "phi4mm": None,
    "kimi_vl": None, "kimi_k25": None, "minicpmv4_6": None, "minicpmv4_7": None, "indic_ocr": None, "lfm2_vl": None, "mllama": CROSS,
    "fastvlm": None, "llava_bunny": None, "dots_ocr": None, "step3p7": None, "phi3_v": None, "multi_modality": None, "deepseekocr": None, "deepseekocr_2": None, "unlimited_ocr": None, "minicpmo": None, "molmo2": None, "jina_vlm": None, "mimo_v2": None, "granite4_vision": None, "molmo": None, "nemotron_h_nano_omni": None, "got": None, "kimi_k3": None, "muse_glimmer": None, "moondream2": None, "moondream3": None, "hunyuan_vl": None, "phi4_siglip": None,
    "mistral_large3": ("its checkpoints ship Mistral's own processor files (params.json, tekken.json), which neither "
                       "transformers' nor mlx-vlm's processor loading reads (a folder of its config alone loads a "
                       "tokenizer); its language model runs text-only"),
    "deepseek_vl_v2": ("built and checked against mlx-vlm on a tiny model, it gave mlx-vlm's tokens on most calls but "
                       "not all: in a long test process its image merge (mlx-vlm's, which sets the image's rows into "
                       "the embeddings in place) left the rows unset on some calls, in mlx-vlm's own generation too; "
                       "refused until the cause is found"),
    "clef": ("a decision model (a scoring head over a question's option spans: choice, score, yes/no), "
             "not a generative chat model"),
    "d1": ("a decision model (LFM2-VL whose readout scores a question's options: choice, score, yes/no), "
           "not a generative chat model"),
    "d1_omni": ("a decision model (LFM2-VL's tower and an audio encoder into a trunk whose head scores a "
                "question's options: choice, score, yes/no), not a generative chat model"),
    "minimax_m3_vl": "its language model does not run on the engine: " + SPARSE,
    "ernie4_5_moe_vl": ("its decoder routes image tokens to multimodal experts of their own (a second router "
                        "and expert set chosen by each token's type) and turns positions by a 3D RoPE of its "
                        "own layout; the engine's decoder carries neither yet"),
    "falcon_ocr": ("its decoder (mlx-vlm's own, no mlx-lm class) turns image patches by 2D positions of its own "
                   "(`pos_hw`, golden-ratio frequencies) and lets them attend both ways by a mask its merge "
                   "builds; not run yet"),
    "molmo_point": ("its output vocabulary grows with each image: a pointing head scores the image's patches, "
                    "sub-patches and locations as tokens past the text's (keys from the image's features), under "
                    "a logit processor that orders the points; the engine samples the text vocabulary only"),
    "zaya1_vl": ("its decoder (ZAYA1's, which mlx-lm lacks) runs a vision LoRA on the image tokens' rows only "
                 "(a per-token adapter chosen by an image mask), which the engine's rows do not carry"),
    "plamo2vl": ("its tokenizer is PLaMo's own Python tokenizer (an Aho-Corasick match over `tokenizer.jsonl`, "
                 "mlx-vlm's `Plamo2Tokenizer`), with no fast `tokenizer.json` for the engine's tokenizer to read; its "
                 "processor also writes the whole prompt in its own instruction format"),
    "inkling": ("its decoder (mlx-vlm's own) attends over short convolutions of K and V with a learned "
                "relative-position bias added to every score (`banded_additive_mask`), which the paged attention "
                "does not take"),
    "muse_spark": ("mlx-lm's class for it holds its own vision tower under Meta's checkpoint names (fused "
                   "projections), so an mlx-vlm conversion's weights do not load into it (checked on a tiny one), "
                   "and its language model alone is not mapped onto mlx-lm's names yet"),
    "glm5_next": ("its decoder (GLM-5-Next's, which mlx-lm lacks) selects each query's keys by DeepSeek Sparse "
                  "Attention over pooled index keys (`index_kpool`) beside linear-attention layers; the engine's "
                  "paged path runs the indexer as mlx-lm's GLM-5 has it only"),
    "qwen4_exp": ("its decoder's Qwen Sparse Attention picks each query's keys by an index of its own (an index "
                  "cache beside the KV cache); the engine's paged attention runs DeepSeek Sparse Attention's "
                  "indexer only, and dense attention would not be this model past the selection's budget"),
    **dict.fromkeys(("youtu_vl", "llmjpvl"), (
        "mlx-vlm ships no processor for it and transformers has none: its images are prepared by the "
        "checkpoint's own remote code, which the engine does not execute (nor can a test get it offline to "
        "build a faithful tiny model); not run")),
    "qwen3_omni_moe": ("an omni model whose config nests a thinker (a Qwen3-VL-MoE-style tower with DeepStack, "
                       "an audio encoder, multimodal RoPE whose positions count audio) beside a talker and a "
                       "code-to-wave speech decoder; the engine loads neither that nesting nor the thinker alone yet"),
    "diffusion_gemma": ("a diffusion language model (it denoises blocks of the answer together, not token "
                        "after token), which the engine's autoregressive decoding does not run"),
    "prism_hadamard_qwen35": None, "florence2": ENC_DEC, "nemotron_parse": ENC_DEC,
    **{t: NOT_CHAT for t in ("sam3", "sam3_1", "sam3d_body", "sam3d_objects", "rfdetr", "rt_detr_v2", "siglip",
                             "pp_doclayout_v3", "video_depth_anything", "colidefics3", "colqwen2_5",
                             "qwen3_vl_embedding", "llama_nemotron_vl_embedding", "embedding_gemma2",
                             "cohere_compass", "falcon_perception", "locateanything")},
}


# Families whose merge embeds a vocabulary of its own (Gemma 3n's vision vocabulary: the
# image's end token besides its placeholders, by `embed_vision`): those rows are the image's too.
OWN_VOCAB = {"gemma3n"}


# Families whose decoder (mlx-lm's) scales token embeddings but takes given ones as they are,
# where the published merge gives text rows scaled (transformers' Gemma 3n; mlx-vlm's merge
# leaves them unscaled): the engine's given text rows are scaled so.
SCALED_TEXT_ROWS = {"gemma3n"}


# Families whose language model turns image positions by multimodal RoPE: the style.
MROPE_STYLE = {"glm4v": "chunked", "glm4v_moe": "chunked", "glm_ocr": "chunked", "paddleocr_vl": "chunked", "qwen2_vl": "chunked", "qwen2_5_vl": "chunked", "qwen3_5": "interleaved", "qwen3_5_moe": "interleaved",
               "indic_ocr": "interleaved", "minicpmv4_7": "interleaved", "prism_hadamard_qwen35": "interleaved",
               "qwen3_vl": "interleaved", "qwen3_vl_moe": "interleaved",
               # HunyuanOCR's XD-RoPE: four axes (sequence, width, height, image), chunked sections
               "hunyuan_vl": "chunked"}


# Families whose vision tower also feeds the first decoder layers (Qwen3-VL's DeepStack).
DEEPSTACK_FAMILIES = {"qwen3_vl", "qwen3_vl_moe"}


def deepstack_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """The decoder layers after which an image's DeepStack entries are added: Qwen3-VL's first
    layers (one a listed tower layer); Granite 4 Vision's, before each layer its projectors
    target but the first (whose features are the image's input rows: `merges.granite4_vision`)."""
    if config.get("model_type") in DEEPSTACK_FAMILIES:
        return tuple(range(len(config["vision_config"].get("deepstack_visual_indexes") or [])))
    if config.get("model_type") == "granite4_vision":
        return tuple(layer - 1 for layer in sorted(set(granite4_targets(config))) if layer > 0)
    return ()


UNVERIFIED = ("its image path is not verified on the engine yet (no tiny model of it is built and checked "
              "against mlx-vlm; docs/vision.md)")


def vision_model_types() -> list[str]:
    """mlx-vlm's model types that have a vision tower (its packages with a vision config or model)."""
    import os

    import mlx_vlm.models as pkg

    root, out = pkg.__path__[0], []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder) or name.startswith("_"):
            continue
        for f in os.listdir(folder):
            if f.endswith(".py"):
                with open(os.path.join(folder, f), encoding="utf-8") as fh:
                    text = fh.read()
                if "VisionConfig" in text or "VisionModel" in text:  # defined or taken from another family
                    out.append(name)
                    break
    return out


def vision_table() -> dict[str, str]:
    """Every vision model type mlx-vlm implements: "runs", or why images are refused."""
    return {t: "runs" if FAMILIES.get(t, UNVERIFIED) is None else FAMILIES.get(t, UNVERIFIED)
            for t in vision_model_types()}


def tokenizer_source(path: str, config: dict[str, Any]) -> str:
    """Where a checkpoint's text tokenizer is: its folder, or, for Moondream 2, the repository its
    own code loads (its checkpoints bundle a stale GPT-2 tokenizer the model does not use; mlx-vlm's
    processor loads that repository too)."""
    if config.get("model_type") == "moondream2":
        from mlx_vlm.models.moondream2 import processing_moondream2

        return processing_moondream2.TOKENIZER_REPO
    return path


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) or config.get("model_type") in TOWER_IN_CODE


def family(config: dict[str, Any]) -> str | None:
    """The config's mlx-vlm model type (its aliases resolved: nanoLLaVA's `llava-qwen2` is `llava_bunny`)."""
    model_type = config.get("model_type")
    try:
        from mlx_vlm.utils import MODEL_REMAPPING
    except ImportError:
        return model_type
    return MODEL_REMAPPING.get(model_type, model_type)


def verdict(config: dict[str, Any]) -> str | None:
    """None when images run for this config, else why not (a text-only model: None is never
    asked: `is_vision_config` first)."""
    return FAMILIES.get(family(config), UNVERIFIED)


# Families whose image placeholders are the tokenizer's unknown token, between the image's
# markers (MiniCPM-o's), where neither the config nor the processor names an image id.
UNK_PLACEHOLDERS = {"minicpmo"}
# Families whose config's image id is the prompt's marker, its placeholders the patch token its
# image processor writes (Jina-VLM's `<|image|>` and `<im_patch>`).
PATCH_PLACEHOLDERS = {"jina_vlm", "jvlm"}
# Families whose images go before the prompt's text (after its lead token), not where a
# message holds them: Molmo 1's processor prepends each image's tokens to the whole prompt.
IMAGES_FIRST = {"molmo"}
# Families whose processor writes an image's placeholders as negative ids (-k for image k;
# each image is expanded alone, as image 1): the engine's prompt holds a real id there.
NEGATIVE_PLACEHOLDERS = {"phi3_v"}


# Families whose processor writes a fixed placeholder id its config does not name (Moondream's 0,
# which is BOS's too: the image's run is BOS and its 729 rows).
FIXED_PLACEHOLDERS = dict.fromkeys(MOONDREAM, 0)


def image_token_id(config: dict[str, Any]) -> int | None:
    if config.get("model_type") in NEGATIVE_PLACEHOLDERS:
        return -1
    if config.get("model_type") in FIXED_PLACEHOLDERS:
        return FIXED_PLACEHOLDERS[config["model_type"]]
    for key in ("image_token_index", "image_token_id", "image_token", "media_placeholder_token_id", "image_patch_id",
                "im_patch_token"):  # (GOT-OCR's name for it)
        v = config.get(key)
        if isinstance(v, int):
            return v
    return None


def both_ways_images(config: dict[str, Any]) -> bool:
    text = config.get("text_config") or config
    return config.get("model_type") in BOTH_WAYS_IMAGES or text.get("use_bidirectional_attention") == "vision"
