"""The Hugging Face `model_type`s shardwise builds a model from: `hf/config.py` reads them, and the flags'
help (`--model-config`) names them from here, so the list a user reads is the list the reader accepts."""
from __future__ import annotations

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
             "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "glm4_moe", "minimax_m2",
             "deepseek_v32", "glm_moe_dsa")
"""config.json model_types read directly (GLM-4.5/4.6/4.7, MiniMax-M2 and Kimi-Linear: docs/families-2026.md,
docs/kimi-linear.md; DeepSeek-V3.2 and GLM-5's sparse attention: docs/sparse-attention.md)."""
# The published Qwen3.5 checkpoints are multimodal: the language model's config.json fields nest under `text_config`
# (model_type -> that of the text model), beside a vision tower shardwise does not model.
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def model_types() -> tuple[str, ...]:
    """Every model_type a config.json may name: the text models' and the multimodal wrappers'."""
    return SUPPORTED + tuple(MULTIMODAL)
