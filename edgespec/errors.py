"""The one error family edgespec raises. Every message says how to fix the problem."""
import sys
import warnings


class EdgeSpecError(Exception):
    """Base class of every error edgespec raises on purpose.

    The CLI prints ``str(error)`` and exits with a non-zero code, no traceback.
    """

    exit_code = 2


class EdgeSpecWarning(UserWarning):
    """A setting that works but is likely slower than the alternative the message names.

    The CLI prints it as one ``warning:`` line on stderr."""


def warn(message: str) -> None:
    """Warn with an EdgeSpecWarning attributed to the first caller outside edgespec (the line of the
    user's script that called the API), as Python 3.12's ``skip_file_prefixes`` does; counting
    frames by hand broke whenever a helper moved a warning one call deeper."""
    dirs = tuple(m.__file__.rsplit("__init__.py", 1)[0] for m in
                 (sys.modules.get(n) for n in ("edgespec", "edgespec.export", "edgespec.runtimes"))
                 if m is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 2  # (stacklevel 1 is this function)
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, EdgeSpecWarning, stacklevel=level)


class InvalidArgumentError(EdgeSpecError, ValueError):
    """A parameter (sampling setting, gamma, lenience, prompt, ...) is out of range."""


class NonFiniteLogitsError(EdgeSpecError, FloatingPointError):
    """A model produced NaN or +inf logits."""


class PromptTooLongError(InvalidArgumentError):
    """Prompt (plus max_new_tokens) does not fit the model's positions or KV buffers.

    ``knob``: what fixes it, "prompt" (a shorter one), "max_new_tokens" (fewer), or None (either)."""

    def __init__(self, message: str, knob: str | None = None):
        super().__init__(message)
        self.knob = knob


class BundleError(EdgeSpecError):
    """A bundle or model folder is missing, corrupted, of an unknown version, or unsafe."""


class UnsafeFileError(BundleError):
    """A file would make us unpickle data or read outside the model folder."""


class CheckpointError(EdgeSpecError):
    """A source checkpoint folder cannot be used (missing files, pickle-only weights, ...)."""


class UnsupportedArchitectureError(EdgeSpecError):
    """The model architecture is not one edgespec can export or run."""


class TokenizerMismatchError(EdgeSpecError):
    """Draft and target do not share a tokenizer."""


class ValidationError(EdgeSpecError):
    """An exported model disagrees with its source model beyond tolerance."""


class OutputExistsError(EdgeSpecError):
    """The output folder exists (or lies inside an input folder)."""


class OutputPathError(EdgeSpecError):
    """The output cannot be written there (permissions, a read-only file system)."""


class ProviderError(EdgeSpecError):
    """An execution provider or platform that was asked for is not available."""


class TrainingError(EdgeSpecError):
    """A corpus or model size cannot be used for training or distillation."""


class DiskFullError(EdgeSpecError, OSError):
    """The disk (or a file-size limit) ran out while writing; nothing partial was kept."""


class EngineBusyError(EdgeSpecError):
    """An Engine is in use by another generate call (or a stream was superseded by a later call)."""


class ModelExecutionError(BundleError):
    """ONNX Runtime failed while running a model that loaded (a corrupt or hand-edited graph)."""


class InsufficientMemoryError(EdgeSpecError, MemoryError):
    """A buffer the model needs (KV cache, ...) cannot be allocated."""
