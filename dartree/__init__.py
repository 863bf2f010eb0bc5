"""dartree: lossless speculative decoding with block-diffusion drafters and autoregressive draft trees."""

from .costmodel import CostModel
from .engine import GenerationStats
from .errors import CheckpointError, DartreeError
from .pipeline import GenerationResult, Pipeline, load
from .settings import GenerationSettings
from .trees import METHODS, TreeSettings

__version__ = "0.1.0"

__all__ = ["load", "Pipeline", "CostModel", "GenerationResult", "GenerationStats", "METHODS", "GenerationSettings", "TreeSettings", "DartreeError", "CheckpointError"]
