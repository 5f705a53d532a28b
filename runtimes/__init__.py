"""Model runtimes (ONNX Runtime)."""
from .onnx_backend import (OnnxDecoderBackend, OnnxSeq2SeqBackend, SessionConfig, available_providers, open_backend,
                           resolve_providers)

__all__ = ["OnnxDecoderBackend", "OnnxSeq2SeqBackend", "SessionConfig", "available_providers", "open_backend",
           "resolve_providers"]
