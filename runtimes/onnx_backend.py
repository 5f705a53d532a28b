"""ONNX Runtime backends (decoder-only and T5) implementing ``edgespec.backend.Backend``.

KV cache schemes (the bundle's ``kv_layout``, see ``edgespec.contract``), both rewound by moving
an integer, never the data:

* static (``_KVInPlace``; edgespec's own Llama and GPT-2 graphs, export/static_kv.py): one buffer per KV
  tensor, [1, H, max_length, D], allocated once and bound as BOTH past and present through
  IOBinding. The graph's attention op writes the k new tokens at positions [P, P + k) in place and
  attends over [0, P + k), P being read from the attention mask. ``rewind_to(n)`` sets the
  length; the stale tail is masked out and overwritten by the next call. No copy, ever: this is
  the scheme the speculative loop wants (a rejection costs nothing).
* concat (``_KVPingPong``; optimum's graphs): the graph takes ``past`` [1, H, P, D] and returns
  ``present`` [1, H, P+k, D] = concat(past, new), so it copies the past every call (O(P), inherent
  to those graphs). Each KV tensor has two flat buffers (sides A and B) of capacity
  H * max_length * D; a call binds ``past`` to the first H*P*D elements of the current side and
  ``present`` to the first H*(P+k)*D of the other, then the sides swap. ``rewind_to(n)`` only sets
  the length, but a contiguous [1, H, n, D] tensor is not a prefix of a [1, H, P, D] one (the head
  stride changes), so the first call after a rewind compacts the kept prefix into the other side:
  one O(n) copy per rejection round. Exporting with the static layout removes it.

Logits are bound to a fresh ``np.empty`` per call (no copy afterwards), so the caller may keep them
across calls (the loop keeps the draft's q for every drafted token).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec import contract
from edgespec.runtimes import huge_pages
from edgespec.bundle import ModelManifest
from edgespec.errors import (
    BundleError,
    EdgeSpecError,
    InsufficientMemoryError,
    InvalidArgumentError,
    ModelExecutionError,
    PromptTooLongError,
    ProviderError,
)

# Short names accepted on the command line and in the API -> ONNX Runtime provider names.
PROVIDER_ALIASES: dict[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "cann": "CANNExecutionProvider",
    "acl": "ACLExecutionProvider",
    "armnn": "ArmNNExecutionProvider",
    "vitisai": "VitisAIExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
    "azure": "AzureExecutionProvider",
    "webnn": "WebNNExecutionProvider",
}
_ORT_TO_ALIAS = {v: k for k, v in PROVIDER_ALIASES.items()}
# Providers that run no ordinary operator (Azure's runs remote-endpoint ops only): asked for, every
# node of a bundle would silently run on the CPU fallback. Refused, and not listed as available.
NOT_COMPUTE = frozenset({"AzureExecutionProvider"})


def available_providers() -> list[str]:
    """Short names (or ORT names when there is no short one) of the compute providers this onnxruntime has."""
    import onnxruntime as ort

    return [_ORT_TO_ALIAS.get(p, p) for p in ort.get_available_providers() if p not in NOT_COMPUTE]


def provider_names(names: Sequence[str] | str) -> list[str]:
    """A provider list as given (comma-separated string or sequence), without blanks."""
    if isinstance(names, str):
        items = names.split(",")
        if any(not n.strip() for n in items) and any(n.strip() for n in items):
            raise ProviderError(f"the provider list {names!r} has an empty item; separate names with single commas: "
                                f"{','.join(n.strip() for n in items if n.strip())}")
        names = [n for n in items if n.strip()]
    return [n.strip() for n in names]


def resolve_providers(names: Sequence[str] | str) -> tuple[str, ...]:
    """Map an ordered list of provider names to ORT names; ProviderError if one is not available."""
    import onnxruntime as ort

    names = provider_names(names)
    if not names:
        raise ProviderError(f"no execution provider given; name one or more, in order (e.g. providers=['cpu'], CLI "
                            f"--provider cpu); available: {', '.join(available_providers())}")
    have = ort.get_available_providers()
    out = []
    for name in names:
        ort_name = PROVIDER_ALIASES.get(name.lower(), name)
        if ort_name not in have and ort_name not in set(ort.get_all_providers()) | set(PROVIDER_ALIASES.values()):
            raise ProviderError(
                f"unknown execution provider {name!r}: use a short name "
                f"({', '.join(a for a, o in PROVIDER_ALIASES.items() if o not in NOT_COMPUTE)}) or ONNX "
                f"Runtime's own (e.g. CUDAExecutionProvider); available in this build: {', '.join(available_providers())}")
        if ort_name in NOT_COMPUTE:
            raise ProviderError(
                f"execution provider {name!r} runs only ONNX Runtime's remote-call operators, none of a model's, so "
                f"every node would fall back to the CPU; choose a compute provider: {', '.join(available_providers())}")
        if ort_name not in have:
            raise ProviderError(
                f"execution provider {name!r} is not available in this onnxruntime build; available: "
                f"{', '.join(available_providers())}. Install the onnxruntime package built for it "
                "(e.g. onnxruntime-gpu for cuda) or pick an available one"
            )
        if ort_name not in out:
            out.append(ort_name)
    return tuple(out)


MAX_THREADS = 4096  # intra-op threads per session (ONNX Runtime takes an int32; a bigger count crashed its binding)


@dataclass(frozen=True)
class SessionConfig:
    """How one model's ONNX Runtime sessions are built. Target and draft may differ."""

    providers: tuple[str, ...] = ("cpu",)
    intra_op_threads: int = 0  # 0: ONNX Runtime's default (one per physical core)
    spinning: bool | None = None  # intra-op thread spin-waiting; None: ORT default (on)
    huge_pages: bool = True  # CPU: move the session's weights onto transparent huge pages (runtimes/huge_pages.py)

    def __post_init__(self) -> None:
        t = self.intra_op_threads
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_THREADS:
            raise InvalidArgumentError(f"threads must be an integer from 0 to {MAX_THREADS} (0 = ONNX Runtime default); "
                                       f"got {t!r}")
        if not isinstance(self.huge_pages, bool):
            raise InvalidArgumentError(f"huge_pages must be True or False (CLI: --no-huge-pages for False); "
                                       f"got {self.huge_pages!r}")


def _one_line(exc: BaseException, limit: int = 1000) -> str:
    """ONNX Runtime's message on one line (its messages end with newlines), shortened."""
    return " ".join(str(exc).split())[:limit]


def make_session(path: Path, cfg: SessionConfig):
    import onnxruntime as ort

    providers = resolve_providers(cfg.providers)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cfg.intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if cfg.spinning is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.spinning else "0")
    before = huge_pages.anonymous_ranges() if cfg.huge_pages and PROVIDER_ALIASES["cpu"] in providers else None
    try:
        sess = ort.InferenceSession(str(path), opts, providers=list(providers))
    except Exception as exc:  # ORT raises its own exception types (InvalidProtobuf, Fail, ...)
        from edgespec.bundle import onnx_opsets

        msg = _one_line(exc)
        if "opset" in msg.lower():
            opsets = ", ".join(f"{d} {v}" for d, v in onnx_opsets(path).items()) or "unknown"
            raise BundleError(
                f"ONNX Runtime {ort.__version__} cannot load {path}: the model uses opset(s) {opsets}, which this "
                f"onnxruntime does not support ({msg[-200:].strip()}); upgrade onnxruntime (pip install -U onnxruntime) "
                "or re-export the bundle with a supported opset (`edgespec export --opset N`)"
            ) from exc
        raise _ort_failure(f"ONNX Runtime cannot load {path}", msg, ignore=str(path)) or BundleError(
            f"ONNX Runtime cannot load {path}: {msg}; the file is corrupt or not an edgespec export: re-export the "
            "bundle") from exc
    if before is not None:
        huge_pages.collapse_new(before)
    missing = [p for p in providers if p not in sess.get_providers()]
    if missing:
        raise ProviderError(
            f"ONNX Runtime did not enable {', '.join(missing)} for {path.name} (it fell back to "
            f"{', '.join(sess.get_providers())}); check the provider's libraries/drivers or choose another provider"
        )
    return sess


# The oldest onnxruntime whose GroupQueryAttention the static-KV graphs can trust: 1.18 and 1.19 load
# them but compute a call of k > 1 tokens over a cache wrongly (logits 0.3 off on a tiny Llama while
# 1-token steps are right), so plain decoding looks fine and speculative output is not the target's;
# 1.17 cannot load them (a review's find, run on 1.17.3-1.32.0).
STATIC_KV_MIN_ORT = (1, 20)


def _check_static_kv_support(path: Path) -> None:
    import re

    import onnxruntime as ort

    found = re.match(r"(\d+)\.(\d+)", ort.__version__)
    if found is not None and tuple(map(int, found.groups())) < STATIC_KV_MIN_ORT:
        need = ".".join(map(str, STATIC_KV_MIN_ORT))
        raise BundleError(
            f"{path} is a static-KV graph (GroupQueryAttention), which needs onnxruntime >= {need}; this is "
            f"{ort.__version__}, whose multi-token steps over a cache are wrong: pip install -U 'onnxruntime>={need}' "
            "(or re-export with `--graph optimum`)")


def _float_type(sess, name: str):
    t = next(i.type for i in sess.get_inputs() if i.name == name)
    if t == "tensor(float)":
        return np.float32
    if t == "tensor(float16)":
        return np.float16
    raise BundleError(f"unsupported KV dtype {t} for {name}; re-export the bundle in fp32")


def quiet_run_options():
    """RunOptions for every run: a failed run is raised as a ModelExecutionError with ORT's message
    in it, and ORT's own log line of the same error (colored, on stderr) would print it again."""
    import onnxruntime as ort

    opts = ort.RunOptions()
    opts.log_severity_level = 4
    return opts


class _Binder:
    """Thin, allocation-free access to an IOBinding: names and the CPU device are resolved once."""

    def __init__(self, sess, where: str = "model"):
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        self._where = where
        self._io = sess.io_binding()
        # The public IOBinding methods rebuild an OrtDevice and do bookkeeping on every call; the
        # underlying C binding takes the same arguments, so the hot path calls it directly.
        self._c = self._io._iobinding
        self._run = sess._sess.run_with_iobinding
        self._dev = OrtDevice.make("cpu", 0)._get_c_device()
        self._opts = quiet_run_options()

    def input(self, name: str, dtype, shape: tuple, ptr: int) -> None:
        self._c.bind_input(name, self._dev, dtype, shape, ptr)

    def output(self, name: str, dtype, shape: tuple, ptr: int) -> None:
        self._c.bind_output(name, self._dev, dtype, shape, ptr)

    def run(self) -> None:
        try:  # free when nothing is raised (zero-cost exceptions)
            self._run(self._c, self._opts)
        except Exception as exc:  # ORT's Fail / InvalidArgument / RuntimeException
            msg = _one_line(exc)
            raise _ort_failure(f"ONNX Runtime failed running {self._where}", msg) or ModelExecutionError(
                f"ONNX Runtime failed running {self._where}: {msg}; the graph does not match its manifest (corrupt or "
                "hand-edited file): re-export the bundle with `edgespec export`") from exc


# ONNX Runtime's words for failures that no re-export fixes: the memory, or the provider's device
_OUT_OF_MEMORY = ("failed to allocate", "bad_alloc", "out of memory", "cudaerrormemoryallocation")
_DEVICE = ("cuda error", "cudnn", "cublas", "cufft", "curand", "hip error", "rocm", "dml", "coreml", "qnn", "openvino",
           "tensorrt")


def _ort_failure(what: str, msg: str, ignore: str = "") -> EdgeSpecError | None:
    """The typed error for an ONNX Runtime failure caused by memory or by an execution provider's
    device (their advice is not to re-export: a review found an allocation failure told so); None
    for the others, which a corrupt or hand-edited graph explains. ``ignore``: text of the message
    not read for its words (the model's path: a folder named qnn_models is no QNN failure)."""
    low = (msg.replace(ignore, "") if ignore else msg).lower()
    if any(k in low for k in _OUT_OF_MEMORY):
        return InsufficientMemoryError(
            f"{what}: {msg}; the model's buffers do not fit in memory: free memory (close other engines or "
            "programs), use a shorter prompt or fewer new tokens, or a smaller (or int8) export")
    if any(k in low for k in _DEVICE):
        return ModelExecutionError(
            f"{what}: {msg}; the execution provider's device or libraries failed: check its drivers, or run on "
            "another provider (providers=['cpu'], CLI --provider cpu)")
    return None


def _alloc(shape, dtype, count: int, kv) -> np.ndarray:
    """One KV buffer (np.empty: no page is committed until written); a typed error when the cache
    (``count`` such buffers) cannot be had."""
    try:
        return np.empty(shape, dtype=dtype)
    except (MemoryError, ValueError) as exc:
        gib = count * kv.heads * kv.capacity * kv.head_size * np.dtype(dtype).itemsize / 2**30
        raise InsufficientMemoryError(
            f"cannot allocate the KV cache ({gib:.3g} GiB for {kv.capacity} positions x {kv.heads} heads x "
            f"{kv.head_size}); use a machine with more memory or a bundle exported with fewer max positions") from exc


class _KVPingPong:
    """Two flat buffers per KV tensor; see the module docstring for why and how."""

    def __init__(self, n_tensors: int, heads: int, head_size: int, capacity: int, dtype):
        self.heads, self.head_size, self.capacity, self.dtype = heads, head_size, capacity, dtype
        self.n_tensors = n_tensors
        self.release()

    def release(self) -> None:
        """(Re)allocate the buffers. np.empty commits pages only when first written, so a large
        max_length is cheap, and dropping the old buffers gives their written pages back."""
        size = self.heads * self.capacity * self.head_size
        # Nothing may point at the old buffers once they are dropped: where an allocation below fails,
        # no pointer into freed memory is left for the next call to bind (ONNX Runtime wrote the cache
        # there; a review's find), and prepare() allocates again.
        self.buffers = self.ptrs = None
        self.buffers = [[_alloc(size, self.dtype, 2 * self.n_tensors, self) for _ in range(self.n_tensors)]
                        for _side in range(2)]
        self.ptrs = [[b.ctypes.data for b in side] for side in self.buffers]
        self.side = 0  # side holding the current cache
        self.physical = 0  # tokens stored in that side (layout [1, H, physical, D])

    def prepare(self, n: int) -> None:
        """Before a call on a cache of logical length ``n``: compact if a rewind left a longer tail."""
        if self.buffers is None:  # a release whose allocation failed (after free(), so n = 0)
            self.release()
        if self.physical != n:
            self.compact(n)

    def reset(self) -> None:
        self.physical = 0

    def compact(self, n: int) -> None:
        """Make the current side hold exactly the first ``n`` tokens (after a rewind)."""
        h, d, p = self.heads, self.head_size, self.physical
        src_side, dst_side = self.buffers[self.side], self.buffers[1 - self.side]
        for src, dst in zip(src_side, dst_side):
            np.copyto(dst[: h * n * d].reshape(h, n, d), src[: h * p * d].reshape(h, p, d)[:, :n])
        self.side = 1 - self.side
        self.physical = n

    def bind(self, binder: _Binder, past_names, present_names, past_len: int, new: int) -> None:
        h, d, dt = self.heads, self.head_size, self.dtype
        past_shape, present_shape = (1, h, past_len, d), (1, h, past_len + new, d)
        for name, ptr in zip(past_names, self.ptrs[self.side]):
            binder.input(name, dt, past_shape, ptr)
        for name, ptr in zip(present_names, self.ptrs[1 - self.side]):
            binder.output(name, dt, present_shape, ptr)

    def bind_present_only(self, binder: _Binder, present_names, new: int) -> None:
        shape = (1, self.heads, new, self.head_size)
        for name, ptr in zip(present_names, self.ptrs[1 - self.side]):
            binder.output(name, self.dtype, shape, ptr)

    def commit(self, length: int) -> None:
        self.side = 1 - self.side
        self.physical = length


class _KVInPlace:
    """One [1, H, capacity, D] buffer per KV tensor, bound as past AND present (static layout)."""

    def __init__(self, n_tensors: int, heads: int, head_size: int, capacity: int, dtype):
        self.shape = (1, heads, capacity, head_size)
        self.heads, self.head_size, self.capacity, self.dtype = heads, head_size, capacity, dtype
        self.n_tensors = n_tensors
        self.release()

    def release(self) -> None:
        """(Re)allocate the buffers; see _KVPingPong.release."""
        self._bound: _Binder | None = None  # new pointers: bind again (none left bound where the allocation fails)
        self.buffers = self.ptrs = None
        self.buffers = [_alloc(self.shape, self.dtype, self.n_tensors, self) for _ in range(self.n_tensors)]
        self.ptrs = [b.ctypes.data for b in self.buffers]

    def prepare(self, n: int) -> None:
        # positions >= n are ignored by the graph (the mask says P = n) and overwritten
        if self.buffers is None:  # a release whose allocation failed: allocate again
            self.release()

    def reset(self) -> None:
        pass

    def bind(self, binder: _Binder, past_names, present_names, past_len: int, new: int) -> None:
        if self._bound is binder:  # same buffers, same shapes every call: IOBinding keeps them bound
            return
        for past, present, ptr in zip(past_names, present_names, self.ptrs):
            binder.input(past, self.dtype, self.shape, ptr)
            binder.output(present, self.dtype, self.shape, ptr)
        self._bound = binder

    def commit(self, length: int) -> None:
        pass


def _as_ids(ids, vocab_size: int | None = None) -> np.ndarray:
    arr = np.ascontiguousarray(ids, dtype=np.int64).reshape(1, -1)
    if arr.shape[1] == 0:
        raise InvalidArgumentError("token block is empty; pass at least one token id")
    if vocab_size is not None:
        # a draft step's block is one id: Python's min/max of a short list cost ~1 us, numpy's ~4
        short = arr[0].tolist() if arr.shape[1] <= 64 else None
        lo, hi = (min(short), max(short)) if short is not None else (int(arr.min()), int(arr.max()))
        if lo < 0 or hi >= vocab_size:
            raise InvalidArgumentError(f"token ids must be in [0, {vocab_size}); got min {lo}, max {hi}")
    return arr


def check_positions(folder: Path, model: ModelManifest) -> None:
    """A manifest that promises more positions than the model was exported for (its config.json,
    which export copies beside the graphs) is refused at load, not when generation gets there."""
    path = Path(folder) / contract.CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a cross-check only: the graphs need no config.json (hand-made bundles may lack one)
    limit = contract.config_positions(config, model.kind) if isinstance(config, dict) else None
    if limit is not None and model.max_positions > limit:
        raise BundleError(
            f"{path.parent}: the manifest says max_positions {model.max_positions}, but the model takes {limit} "
            f"positions (its {contract.CONFIG_FILE}): the manifest was edited, or an older exporter wrote it (before "
            "2026-11-30, a Phi-3 longrope model's limit was not applied); re-export the bundle with `edgespec export`")


class _PositionCache:
    """length / rewind_to / free shared by both backends: the cache is a position into _KVPingPong."""

    _len: int
    _kv: "_KVPingPong"

    @property
    def length(self) -> int:
        return self._len

    def rewind_to(self, n: int) -> None:
        # (a float was taken and broke the next call: the XLA backend's check)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._len:
            raise InvalidArgumentError(f"rewind_to(n) needs an integer 0 <= n <= length={self._len}; got {n!r}")
        self._len = int(n)  # O(1): the stale tail is dropped lazily (see module docstring)

    def free(self) -> None:
        self._len = 0
        self._kv.release()  # the written pages go back to the system; the next prefill writes new ones


class OnnxDecoderBackend(_PositionCache):
    """A decoder-only model (GPT-2, Llama, ...) from one bundle folder."""

    def __init__(self, folder: str | Path, model: ModelManifest, session: SessionConfig = SessionConfig()):
        if model.kind != contract.KIND_DECODER:
            raise BundleError(f"{folder}: model kind {model.kind!r} is not decoder-only; use OnnxSeq2SeqBackend")
        self.vocab_size = model.vocab_size
        self.max_length = model.max_positions
        check_positions(folder, model)
        path = Path(folder) / model.files["decoder"]
        static = model.kv_layout == contract.KV_STATIC
        if static:
            _check_static_kv_support(path)
        self._sess = make_session(path, session)
        names = {i.name for i in self._sess.get_inputs()}
        self._past = contract.decoder_past_names(model.num_layers)
        self._present = contract.decoder_present_names(model.num_layers)
        check_graph_io(self._sess, path, model,
                       required_inputs=(contract.INPUT_IDS, *self._past, *((contract.ATTENTION_MASK,) if static else ())),
                       optional_inputs=() if static else (contract.ATTENTION_MASK, contract.POSITION_IDS),
                       required_outputs=(contract.LOGITS, *self._present))
        if not static and contract.POSITION_IDS not in names and model.model_type in POSITION_IDS_MODEL_TYPES:
            raise BundleError(
                f"{path}: the graph has no {contract.POSITION_IDS} input, but the {model.model_type} graphs "
                f"`edgespec export` writes with kv_layout {model.kv_layout!r} (the manifest's; the default where it is "
                f"absent) take one. Either the manifest lost this model's kv_layout (a graph written with kv_layout "
                f"{contract.KV_STATIC!r} takes none) or the file was not made by edgespec: re-export the bundle")
        self._has_mask = contract.ATTENTION_MASK in names
        self._has_pos = contract.POSITION_IDS in names
        self._dtype = _float_type(self._sess, self._past[0])
        self._logits_dtype = _float_type_out(self._sess, contract.LOGITS)
        kv_cls = _KVInPlace if static else _KVPingPong
        self._kv = kv_cls(len(self._past), model.num_kv_heads, model.head_size, self.max_length, self._dtype)
        self._bind = _Binder(self._sess, path.name)
        # Constant helper inputs: attention_mask is all ones (one unpadded sequence), position_ids
        # are an arange; a call binds a prefix / a window of them by pointer arithmetic.
        self._ones = np.ones(self.max_length, dtype=np.int64)
        self._arange = np.arange(self.max_length, dtype=np.int64)
        self._ones_ptr, self._arange_ptr = self._ones.ctypes.data, self._arange.ctypes.data
        self._len = 0
        self._ids = None  # keeps the bound input_ids alive during the run

    def prefill(self, ids) -> np.ndarray:
        arr = _as_ids(ids, self.vocab_size)
        self._len = 0
        self._kv.reset()
        return self._forward(arr)[-1]

    def extend(self, ids) -> np.ndarray:
        return self._forward(_as_ids(ids, self.vocab_size))

    def _forward(self, arr: np.ndarray) -> np.ndarray:
        p, k = self._len, arr.shape[1]
        total = p + k
        if total > self.max_length:
            raise PromptTooLongError(f"sequence would reach {total} tokens but the model has {self.max_length} positions; use a shorter prompt or fewer new tokens")
        kv, b = self._kv, self._bind
        kv.prepare(p)
        self._ids = arr
        b.input(contract.INPUT_IDS, np.int64, (1, k), arr.ctypes.data)
        if self._has_mask:
            b.input(contract.ATTENTION_MASK, np.int64, (1, total), self._ones_ptr)
        if self._has_pos:
            b.input(contract.POSITION_IDS, np.int64, (1, k), self._arange_ptr + 8 * p)
        kv.bind(b, self._past, self._present, p, k)
        logits = np.empty((k, self.vocab_size), dtype=self._logits_dtype)
        b.output(contract.LOGITS, self._logits_dtype, (1, k, self.vocab_size), logits.ctypes.data)
        b.run()
        kv.commit(total)
        self._len = total
        return logits



# Model types whose decoder graphs, as exported by optimum-onnx (edgespec export), take position_ids.
POSITION_IDS_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "opt"})


def check_graph_io(sess, path: Path, model: ModelManifest, required_inputs, optional_inputs, required_outputs) -> None:
    """The graph takes exactly the inputs the runtime binds and has the outputs it reads, with KV and
    logits dimensions that match the manifest; BundleError naming what differs otherwise."""
    inputs = {i.name: i for i in sess.get_inputs()}
    outputs = {o.name: o for o in sess.get_outputs()}
    missing = [n for n in required_inputs if n not in inputs]
    extra = [n for n in inputs if n not in required_inputs and n not in optional_inputs]
    missing_out = [n for n in required_outputs if n not in outputs]
    problems = []
    if missing:
        problems.append(f"missing input(s) {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    if extra:
        problems.append(f"unexpected input(s) {', '.join(extra[:6])}")
    if missing_out:
        problems.append(f"missing output(s) {', '.join(missing_out[:6])}{' ...' if len(missing_out) > 6 else ''}")
    if not problems:
        expect = {1: model.num_kv_heads, 3: model.head_size}
        for name in required_inputs:
            shape = inputs[name].shape
            if name.startswith("past_key_values.") and ".encoder." not in name:
                for axis, want in expect.items():
                    got = shape[axis] if len(shape) == 4 else None
                    if len(shape) != 4 or (isinstance(got, int) and got != want):
                        problems.append(f"{name} has shape {shape}, the manifest says [batch, {model.num_kv_heads}, "
                                        f"seq, {model.head_size}]")
                        break
            if problems:
                break
        lshape = outputs[contract.LOGITS].shape if contract.LOGITS in outputs else None
        if lshape is not None and (len(lshape) != 3 or (isinstance(lshape[2], int) and lshape[2] != model.vocab_size)):
            problems.append(f"logits have shape {lshape}, the manifest says vocab {model.vocab_size}")
    if problems:
        raise BundleError(f"{path}: the graph does not match the edgespec contract for a {model.num_layers}-layer "
                          f"{model.model_type} ({'; '.join(problems)}); re-export the bundle with `edgespec export`")


def _float_type_out(sess, name: str):
    t = next(o.type for o in sess.get_outputs() if o.name == name)
    return np.float16 if t == "tensor(float16)" else np.float32


class OnnxSeq2SeqBackend(_PositionCache):
    """An encoder-decoder model (T5). ``prefill(prompt)`` runs the encoder once and the first
    decoder step on the decoder start token; ``length`` then counts decoder tokens (1)."""

    is_encoder_decoder = True

    def __init__(self, folder: str | Path, model: ModelManifest, session: SessionConfig = SessionConfig()):
        if model.kind != contract.KIND_SEQ2SEQ:
            raise BundleError(f"{folder}: model kind {model.kind!r} is not encoder-decoder; use OnnxDecoderBackend")
        folder = Path(folder)
        self.vocab_size = model.vocab_size
        self.max_length = model.max_positions
        check_positions(folder, model)
        self._start = int(model.decoder_start_token_id if model.decoder_start_token_id is not None else model.pad_token_id or 0)
        self._enc = make_session(folder / model.files["encoder"], session)
        self._dec0 = make_session(folder / model.files["decoder"], session)
        self._dec = make_session(folder / model.files["decoder_with_past"], session)
        n = model.num_layers
        self._self_past = contract.seq2seq_self_past_names(n)
        self._self_present = contract.seq2seq_self_present_names(n)
        self._cross_past = contract.seq2seq_cross_past_names(n)
        self._cross_present = contract.seq2seq_cross_present_names(n)
        self._dtype = _float_type(self._dec, self._self_past[0])
        self._logits_dtype = _float_type_out(self._dec, contract.LOGITS)
        self._heads, self._head = model.num_kv_heads, model.head_size
        self._kv = _KVPingPong(len(self._self_past), self._heads, self._head, self.max_length, self._dtype)
        enc_path, dec0_path, dec_path = (folder / model.files[r] for r in ("encoder", "decoder", "decoder_with_past"))
        check_graph_io(self._enc, enc_path, model, required_inputs=(contract.ENCODER_INPUT_IDS, contract.ENCODER_ATTENTION_MASK),
                       optional_inputs=(), required_outputs=(contract.ENCODER_OUTPUT,))
        check_graph_io(self._dec0, dec0_path, model,
                       required_inputs=(contract.DECODER_INPUT_IDS, contract.DECODER_ENCODER_HIDDEN_STATES,
                                        contract.DECODER_ENCODER_ATTENTION_MASK),
                       optional_inputs=(), required_outputs=(contract.LOGITS, *self._self_present, *self._cross_present))
        check_graph_io(self._dec, dec_path, model,
                       required_inputs=(contract.DECODER_INPUT_IDS, contract.DECODER_ENCODER_ATTENTION_MASK,
                                        *self._self_past, *self._cross_past),
                       optional_inputs=(),
                       required_outputs=(contract.LOGITS, *self._self_present))
        self._b0, self._b = _Binder(self._dec0, dec0_path.name), _Binder(self._dec, dec_path.name)
        self._enc_name = enc_path.name
        self._enc_opts = quiet_run_options()
        self._len = 0
        self._ids = None
        self._enc_state = None  # (hidden, mask, cross KV arrays) of the current prompt

    def prefill(self, ids) -> np.ndarray:
        src = _as_ids(ids, self.vocab_size)
        if src.shape[1] > self.max_length:
            raise PromptTooLongError(f"prompt has {src.shape[1]} tokens but the encoder takes at most {self.max_length}; shorten it", "prompt")
        mask = np.ones_like(src)
        # The encoder runs once per prompt; its output only feeds the first decoder call, which
        # returns the cross-attention KV reused (bound, never copied) by every later call.
        try:
            (hidden,) = self._enc.run([contract.ENCODER_OUTPUT], {contract.ENCODER_INPUT_IDS: src, contract.ENCODER_ATTENTION_MASK: mask},
                                      self._enc_opts)
        except Exception as exc:
            raise ModelExecutionError(f"ONNX Runtime failed running {self._enc_name}: {_one_line(exc)}; the graph does not "
                                      "match its manifest (corrupt or hand-edited file): re-export the bundle") from exc
        s = src.shape[1]
        cross = [np.empty((1, self._heads, s, self._head), dtype=self._dtype) for _ in self._cross_present]
        self._enc_state = (np.ascontiguousarray(hidden), mask, cross)
        self._len = 0
        self._kv.reset()
        return self._forward(np.array([[self._start]], dtype=np.int64))[-1]

    def extend(self, ids) -> np.ndarray:
        if self._enc_state is None:
            raise InvalidArgumentError("extend() before prefill(): call prefill(prompt_ids) first")
        return self._forward(_as_ids(ids, self.vocab_size))

    def _forward(self, arr: np.ndarray) -> np.ndarray:
        p, k = self._len, arr.shape[1]
        total = p + k
        if total > self.max_length:
            raise PromptTooLongError(f"decoder would reach {total} tokens but the model allows {self.max_length}; ask for fewer new tokens", "max_new_tokens")
        hidden, mask, cross = self._enc_state
        kv = self._kv
        kv.prepare(p)
        self._ids = arr
        logits = np.empty((k, self.vocab_size), dtype=self._logits_dtype)
        lshape = (1, k, self.vocab_size)
        if p == 0:  # first decoder call: no past; emits the cross-attention KV
            b = self._b0
            b.input(contract.DECODER_INPUT_IDS, np.int64, (1, k), arr.ctypes.data)
            b.input(contract.DECODER_ENCODER_HIDDEN_STATES, self._dtype, hidden.shape, hidden.ctypes.data)
            b.input(contract.DECODER_ENCODER_ATTENTION_MASK, np.int64, mask.shape, mask.ctypes.data)
            kv.bind_present_only(b, self._self_present, k)
            for name, arr_c in zip(self._cross_present, cross):
                b.output(name, self._dtype, arr_c.shape, arr_c.ctypes.data)
        else:
            b = self._b
            b.input(contract.DECODER_INPUT_IDS, np.int64, (1, k), arr.ctypes.data)
            b.input(contract.DECODER_ENCODER_ATTENTION_MASK, np.int64, mask.shape, mask.ctypes.data)
            kv.bind(b, self._self_past, self._self_present, p, k)
            for name, arr_c in zip(self._cross_past, cross):
                b.input(name, self._dtype, arr_c.shape, arr_c.ctypes.data)
        b.output(contract.LOGITS, self._logits_dtype, lshape, logits.ctypes.data)
        b.run()
        kv.commit(total)
        self._len = total
        return logits

    def free(self) -> None:
        super().free()
        self._enc_state = None


def open_backend(folder: str | Path, model: ModelManifest, session: SessionConfig = SessionConfig()):
    """The backend class matching ``model.kind``."""
    cls = OnnxSeq2SeqBackend if model.kind == contract.KIND_SEQ2SEQ else OnnxDecoderBackend
    return cls(folder, model, session)
