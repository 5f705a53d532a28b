"""edgespec: exact speculative decoding (Leviathan, Kalman, Matias, ICML 2023) for ONNX Runtime
and XLA. This module only re-exports the public API."""
from .adaptive import AdaptiveGamma
from .api import load
from .backend import Backend
from .config import GenerationConfig, SamplingConfig
from .drafters import ModelDrafter, NgramDrafter
from .errors import EdgeSpecError, EdgeSpecWarning, EngineBusyError
from .loop import GenerationResult, GenerationStats, generate, iter_generate, speculative_step
from .rejection import speculative_sample
from . import theory

__version__ = "0.1.0"


__all__ = [
    "AdaptiveGamma", "Backend", "EdgeSpecError", "EdgeSpecWarning", "EngineBusyError", "GenerationConfig", "GenerationResult",
    "GenerationStats", "ModelDrafter", "NgramDrafter", "SamplingConfig", "generate",
    "iter_generate", "load", "speculative_sample", "speculative_step", "theory",
]
