"""edgespec: exact speculative decoding (Leviathan, Kalman, Matias, ICML 2023) for ONNX Runtime
and XLA. This module only re-exports the public API."""
from .adaptive import AdaptiveGamma
from .api import Engine, GenerationOutput, StreamChunk, TextStream, load
from .backend import Backend
from .config import GenerationConfig, SamplingConfig
from .drafters import ModelDrafter, NgramDrafter
from .errors import (BundleError, EdgeSpecError, EdgeSpecWarning, EngineBusyError, InvalidArgumentError, ProviderError,
                     PromptTooLongError)
from .loop import GenerationResult, GenerationStats, generate, iter_generate, speculative_step
from .rejection import speculative_sample
from . import theory

__version__ = "0.1.0"


__all__ = [
    "AdaptiveGamma", "Backend", "BundleError", "EdgeSpecError", "EdgeSpecWarning", "Engine", "EngineBusyError",
    "GenerationConfig", "GenerationOutput", "GenerationResult", "GenerationStats", "InvalidArgumentError",
    "ModelDrafter", "NgramDrafter", "PromptTooLongError", "ProviderError", "SamplingConfig", "StreamChunk",
    "TextStream", "generate", "iter_generate", "load", "speculative_sample", "speculative_step", "theory",
]
