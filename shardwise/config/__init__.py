"""Typed configuration: model shapes (with named presets), parallel degrees and training knobs.

Every field carries a docstring so `--help` and the planner can explain it. All validation that can be
done before any process starts lives here and raises `ConfigError`, whose message names the bad value and
what would be valid; the CLI turns it into exit status 2. This package is the bottom floor: it imports
nothing of shardwise but the pure `rules` layer (a test enforces it).
"""
from .errors import ConfigError
from .model import MODEL_PRESETS, ModelConfig, get_model_config
from .parallel import AXES, ParallelConfig
from .training import TrainConfig

__all__ = ["AXES", "ConfigError", "MODEL_PRESETS", "ModelConfig", "ParallelConfig", "TrainConfig", "get_model_config"]
