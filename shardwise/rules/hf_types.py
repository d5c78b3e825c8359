"""The Hugging Face `model_type`s shardwise builds a model from: `hf/config.py` reads them, and the flags'
help (`--model-config`) names them from here, so the list a user reads is the list the reader accepts."""
from __future__ import annotations

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
             "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
"""config.json model_types read directly."""
SUPPORTED += ("deepseek_v32", "glm_moe_dsa")  # DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5
# The published Qwen3.5 checkpoints are multimodal: the language model's config.json fields nest under `text_config`
# (model_type -> that of the text model), beside a vision tower shardwise does not model.
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def model_types() -> tuple[str, ...]:
    """Every model_type a config.json may name: the text models' and the multimodal wrappers'."""
    return SUPPORTED + tuple(MULTIMODAL)
