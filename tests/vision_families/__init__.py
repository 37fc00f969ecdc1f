"""Every vision family's tiny checkpoint builder (`BUILDERS`: model type -> a function of
the folder that returns the config and the processor), by family line, and the families
whose reference departs from mlx-vlm's plain generation."""

from __future__ import annotations

from tests.vision_families.deepseek import (_deepseekocr, _deepseekocr_2, _multi_modality, _unlimited_ocr,
                                           deepseek_vl_hybrid_layout)
from tests.vision_families.got import _got, got_instruction
from tests.vision_families.hunyuan import _hunyuan_vl, random_markers
from tests.vision_families.kimi import _kimi_k3, _kimi_k25, _kimi_vl
from tests.vision_families.gemma import _gemma3, _gemma3n, _gemma4, _gemma4_unified, _llama4, _paligemma
from tests.vision_families.mimo import _mimo_v2
from tests.vision_families.molmo import _jina_vlm, _molmo, _molmo2, random_tables
from tests.vision_families.moondream import _moondream2, _moondream3, moondream_question, random_temperatures
from tests.vision_families.muse import _muse_glimmer
from tests.vision_families.nemotron import _nemotron_h_nano_omni
from tests.vision_families.llava import (_aya_vision, _fastvlm, _granite4_vision, _granite_vision, _idefics2, _idefics3, _internvl,
                                         _internvl_hf, _llava, _llava_bunny, _llava_next, _llava_onevision, _mistral3)
from tests.vision_families.phi import _phi3_v, _phi4_siglip, _phi4mm, phi4mm_lora_layout
from tests.vision_families.qwen import (_dots_ocr, _glm4v, _glm4v_moe, _glm_ocr, _indic_ocr,
                                        _lfm2_vl, _mage_vl, _minicpmo, _minicpmv, _paddleocr_vl, _prism, _qwen2_vl, _qwen3_5,
                                        _qwen3_vl, _qwen3_vl_moe, _step3p7)


# Families whose image tokens attend each other both ways (transformers' rule), which mlx-vlm's
# generation runs causally: their reference is mlx-vlm's classes with that mask (`both_ways_greedy`).
# (Moondream's BOS and image: its published prefix, which mlx-vlm's generation drops)
BOTH_WAYS = {"gemma3", "moondream2", "moondream3"}

# Families whose published merge mlx-vlm's departs from: their reference packs the image as
# transformers does (`anyres_greedy`).
ANYRES = {"llava_next", "granite_vision"}

# Families whose mlx-vlm forward departs from transformers' beyond the image (Gemma 3n's text
# rows and KV-sharing layers): their reference is `gemma3n_greedy`.
TEXT_FIXED = {"gemma3n"}

# Families whose published processor puts BOS (EOS where the tokenizer has none) before the
# images, which mlx-vlm's leaves out (Molmo 1's): their reference is `lead_first_greedy`.
LEAD_FIRST = {"molmo"}

# Families with no chat template (prefix LMs): the reference prompt is mlx-vlm's own format.
PROMPT_ONLY = {"paligemma"}

# checkpoints with the embedding as the output head
TIED = {"hunyuan_vl", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "paligemma"}

BUILDERS = {"llava": _llava, "multi_modality": _multi_modality, "deepseekocr": _deepseekocr, "deepseekocr_2": _deepseekocr_2, "unlimited_ocr": _unlimited_ocr, "minicpmo": _minicpmo, "molmo2": _molmo2, "jina_vlm": _jina_vlm, "mimo_v2": _mimo_v2, "granite4_vision": _granite4_vision, "molmo": _molmo, "nemotron_h_nano_omni": _nemotron_h_nano_omni, "got": _got, "kimi_k3": _kimi_k3, "muse_glimmer": _muse_glimmer, "moondream2": _moondream2, "moondream3": _moondream3, "hunyuan_vl": _hunyuan_vl, "phi4_siglip": _phi4_siglip, "phi4mm": _phi4mm, "phi3_v": _phi3_v, "step3p7": _step3p7, "dots_ocr": _dots_ocr, "llava_bunny": _llava_bunny, "fastvlm": _fastvlm, "gemma4_unified": _gemma4_unified, "glm4v_moe": _glm4v_moe, "mage_vl": _mage_vl, "gemma3n": _gemma3n, "llama4": _llama4, "minicpmv4_6": _minicpmv,
            "minicpmv4_7": lambda path: _minicpmv(path, "minicpmv4_7"), "paligemma": _paligemma, "aya_vision": _aya_vision, "internvl": _internvl_hf, "llava_next": _llava_next, "granite_vision": _granite_vision, "glm_ocr": _glm_ocr, "paddleocr_vl": _paddleocr_vl, "kimi_vl": _kimi_vl, "kimi_k25": _kimi_k25, "lfm2_vl": _lfm2_vl, "glm4v": _glm4v, "idefics2": _idefics2, "gemma3": _gemma3, "gemma4": _gemma4, "llava_onevision": _llava_onevision, "internvl_chat": _internvl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe,
            "qwen3_5_moe": lambda path: _qwen3_5(path, moe=True), "idefics3": _idefics3, "pixtral": lambda path: _mistral3(path, "pixtral"), "smolvlm": lambda path: _idefics3(path, "smolvlm"), "qwen3_5": _qwen3_5, "prism_hadamard_qwen35": _prism, "indic_ocr": _indic_ocr, "mistral3": _mistral3, "qwen2_vl": _qwen2_vl,
            "qwen2_5_vl": lambda path: _qwen2_vl(path, "qwen2_5_vl")}
# Families whose published checkpoint keeps weights in another layout than mlx-vlm's module
# tree (Phi-4 multimodal's vision LoRA beside its base weights): params -> the published ones.
WEIGHT_LAYOUTS = {"phi4mm": phi4mm_lora_layout, "molmo": random_tables, "molmo2": random_tables, "jina_vlm": random_tables, "moondream3": random_temperatures, "hunyuan_vl": random_markers, "deepseek_vl_hybrid": deepseek_vl_hybrid_layout}
# A family's other layouts (a tower of another kind under the same model type), by name.
VARIANTS = {"deepseek_vl_hybrid": lambda path: _multi_modality(path, hybrid=True)}
# Families whose mlx-vlm processor drops a token the reference prompt must then carry: Phi-3
# Vision's skips the first token of the text after each image (a SentencePiece tokenizer's
# prefix-space piece there), which the tiny byte tokenizer does not write: a space stands in.
# DeepSeek-OCR's puts BOS first itself (the engine's template writes it: `BOS_FIRST`) and drops
# a prompt's last token (its inference mode): the reference prompt has no BOS and one more token.
REFERENCE_TEXT = {"phi3_v": lambda rendered: rendered.replace("<|image_1|>", "<|image_1|> "),
                  **dict.fromkeys(("deepseekocr", "deepseekocr_2"), lambda rendered: rendered.removeprefix("<unk>") + " "),
                  "unlimited_ocr": lambda rendered: rendered.removeprefix("<unk>"),  # (its processor drops none)
                  "got": got_instruction, "moondream2": moondream_question,
                  "moondream3": moondream_question}
