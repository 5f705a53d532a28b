"""Bundle manifest (``edgespec.json``) and safe bundle loading.

A bundle is a folder::

    BUNDLE/
      edgespec.json          versioned manifest (schema below)
      target/                ONNX graph(s), tokenizer.json, config.json, ...
      draft/                 same layout (absent for a single-model bundle)

Loading never needs torch or the ``onnx`` package: the ``.onnx`` files are checked with a small
protobuf walker that detects truncation, Git LFS pointers, and external-data references that
would read outside the model folder.
"""
from __future__ import annotations

import json
import mmap
import os
import shlex
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from . import contract
from .errors import BundleError, UnsafeFileError

LFS_POINTER_PREFIX = b"version https://git-lfs"


def _is_lfs_pointer(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(len(LFS_POINTER_PREFIX)) == LFS_POINTER_PREFIX


@dataclass(frozen=True)
class ModelManifest:
    """What the runtime (and memory-read accounting) needs to know about one exported model."""

    path: str  # folder inside the bundle ("target" or "draft")
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    kind: str  # contract.KIND_DECODER or contract.KIND_SEQ2SEQ
    files: dict[str, str]  # graph role -> file name (contract.GRAPH_FILES)
    vocab_size: int  # logits per position (embedding rows, may exceed the tokenizer)
    tokenizer_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    decoder_start_token_id: int | None
    num_layers: int
    num_kv_heads: int
    head_size: int
    max_positions: int
    dtype: str  # "fp32" | "fp16": dtype of activations / KV cache
    quantization: str  # "none" | "int8-rowwise" (target) | "int8-dynamic" (draft; older targets) | "int8-blockwise" (older targets)
    parameter_bytes: dict[str, int]  # total / per_forward (weights read by one decoder forward) / encoder
    validation: dict[str, Any] = field(default_factory=dict)
    kv_layout: str = contract.KV_CONCAT  # contract.KV_LAYOUTS; bundles written before static graphs: concat


@dataclass(frozen=True)
class BundleManifest:
    schema_version: int
    models: dict[str, ModelManifest]  # role -> model
    shared_vocab_size: int  # embedding rows both models have (= target vocab if no draft); prompts for speculation stay below it
    opset: int  # the highest default-domain ONNX opset of the bundle's graphs
    library_versions: dict[str, str]
    tokenizer_check: dict[str, Any] = field(default_factory=dict)
    # Extra formats beside ONNX, e.g. {"xla": {"target": {...}, "draft": {...}}} (role/xla/xla.json).
    formats: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> ModelManifest:
        return self.models[contract.ROLE_TARGET]

    @property
    def draft(self) -> ModelManifest | None:
        return self.models.get(contract.ROLE_DRAFT)

    @property
    def sample_vocab_size(self) -> int:
        """The ids generation samples from, with or without a draft: the tokenizer's. Embedding rows
        past the tokenizer are padding (no token; T5: 32100 tokens, 32128 rows) and are never emitted."""
        return min(self.target.tokenizer_size, self.target.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"format": contract.BUNDLE_FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "edgespec.json") -> "BundleManifest":
        version = data.get("schema_version")
        if isinstance(version, str) and version.strip().isdigit():  # "1" is not 1 (a hand edit, another writer)
            raise BundleError(f"{where}: schema_version is the string {version!r}; it must be the integer {version.strip()} "
                              "(no quotes): fix the file or re-export the bundle (`edgespec export ...`)")
        newest = max(contract.SUPPORTED_SCHEMA_VERSIONS)
        if version is not None and not isinstance(version, str) and (isinstance(version, bool) or not isinstance(version, int)):
            # true == 1 and 1.0 == 1 in Python: both were read as version 1, and 2.0 was called too old
            raise BundleError(f"{where}: schema_version is {json.dumps(version)[:40]}, not an integer; write it as an "
                              f"integer (this edgespec reads {', '.join(map(str, contract.SUPPORTED_SCHEMA_VERSIONS))}) "
                              "or re-export the bundle (`edgespec export ...`)")
        if isinstance(version, int) and not isinstance(version, bool) and version > newest:
            raise BundleError(f"{where}: manifest schema version {version} is newer than this edgespec reads (at most "
                              f"{newest}); upgrade edgespec (`pip install -U edgespec`), or re-export the bundle with "
                              "this version from its checkpoints (`edgespec export ...`)")
        if version is None:  # (it said "schema version None is not supported")
            raise BundleError(f"{where}: schema_version is {'null' if 'schema_version' in data else 'missing'}; an "
                              "edgespec manifest names its version: re-export the bundle (`edgespec export ...`)")
        if version not in contract.SUPPORTED_SCHEMA_VERSIONS:
            raise BundleError(
                f"{where}: manifest schema version {version!r} is not supported by this edgespec "
                f"(supported: {', '.join(map(str, contract.SUPPORTED_SCHEMA_VERSIONS))}); "
                "re-export the bundle with this edgespec version (`edgespec export ...`)"
            )
        try:
            if data.get("format", contract.BUNDLE_FORMAT) != contract.BUNDLE_FORMAT:
                raise ValueError(f"format is {data.get('format')!r:.60}, not {contract.BUNDLE_FORMAT!r}")
            missing = [k for k in ("models", "shared_vocab_size", "opset") if k not in data]
            if missing:
                raise ValueError(f"it lacks {', '.join(missing)}")
            if not isinstance(data.get("models"), dict):
                raise TypeError(f"'models' must be an object mapping role -> model, got {type(data.get('models')).__name__}")
            for key in ("shared_vocab_size", "opset"):  # (int() took "17", 17.9 and true)
                if not _is_int(data[key]):
                    raise TypeError(f"{key} must be an integer, got {json.dumps(data[key])[:40]}")
            models = {role: _model(role, m) for role, m in data["models"].items()}
            for role, m in models.items():
                _check_model_fields(role, m)
            manifest = cls(
                schema_version=version,
                models=models,
                shared_vocab_size=int(data["shared_vocab_size"]),
                opset=int(data["opset"]),
                library_versions=dict(data.get("library_versions", {})),
                tokenizer_check=dict(data.get("tokenizer_check", {})),
                formats=dict(data.get("formats", {})),
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise BundleError(f"{where}: manifest is malformed ({exc}); re-export the bundle with `edgespec export`") from exc
        if not 1 <= manifest.shared_vocab_size <= _MAX_INT or not 0 <= manifest.opset <= _MAX_INT:
            raise BundleError(f"{where}: manifest is malformed (shared_vocab_size {manifest.shared_vocab_size}, opset "
                              f"{manifest.opset} out of range); re-export the bundle with `edgespec export`")
        if contract.ROLE_TARGET not in models:
            raise BundleError(f"{where}: manifest has no target model; re-export the bundle with `edgespec export`")
        return manifest


_MAX_INT = 2**31 - 1  # every count and id in a manifest fits int32; larger values are corruption
_STR_FIELDS = ("path", "architecture", "model_type", "kind", "dtype", "quantization")
_COUNT_FIELDS = ("vocab_size", "tokenizer_size", "num_layers", "num_kv_heads", "head_size", "max_positions")
# Far above any real model, low enough that buffers sized from them cannot exhaust memory by themselves.
_COUNT_MAX = {"num_layers": 4096, "num_kv_heads": 4096, "head_size": 16384, "max_positions": 1 << 24}
_OPTIONAL_ID_FIELDS = ("bos_token_id", "pad_token_id", "decoder_start_token_id")


def _model(role, entry) -> ModelManifest:
    """One model entry as a ModelManifest; missing or unknown fields are named (not a Python signature error)."""
    if not isinstance(entry, dict):
        raise TypeError(f"model {role!r} must be an object, got {type(entry).__name__}")
    names = {f.name for f in fields(ModelManifest)}
    required = {f.name for f in fields(ModelManifest) if f.default is MISSING and f.default_factory is MISSING}
    missing, unknown = sorted(required - entry.keys()), sorted(entry.keys() - names)
    if missing or unknown:
        raise ValueError(f"model {role!r}" + (f" lacks {', '.join(missing)}" if missing else "")
                         + (" and" if missing and unknown else "") + (f" has unknown fields {', '.join(unknown)}" if unknown else ""))
    return ModelManifest(**entry)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_model_fields(role, m: ModelManifest) -> None:
    """Types and ranges of one model entry (raises TypeError/ValueError; from_dict wraps them)."""
    if not isinstance(role, str) or not role:
        raise TypeError(f"model role {role!r} is not a non-empty string")
    for name in _STR_FIELDS:
        if not isinstance(getattr(m, name), str):
            raise TypeError(f"{role}.{name} must be a string, got {getattr(m, name)!r:.60}")
    if m.kind not in contract.GRAPH_FILES:
        raise ValueError(f"{role}.kind must be one of {', '.join(contract.GRAPH_FILES)}, got {m.kind!r:.60}")
    if m.dtype not in contract.DTYPES or m.quantization not in contract.QUANT_LABELS:
        raise ValueError(f"{role}.dtype must be one of {', '.join(contract.DTYPES)} and {role}.quantization one of "
                         f"{', '.join(contract.QUANT_LABELS)}; got {m.dtype!r:.20}, {m.quantization!r:.30}")
    for name in _COUNT_FIELDS:
        v, hi = getattr(m, name), _COUNT_MAX.get(name, _MAX_INT)
        if not _is_int(v) or not 1 <= v <= hi:
            raise ValueError(f"{role}.{name} must be an integer in [1, {hi}], got {v!r:.60}")
    for name in _OPTIONAL_ID_FIELDS:
        v = getattr(m, name)
        if v is not None and (not _is_int(v) or not 0 <= v <= _MAX_INT):
            raise ValueError(f"{role}.{name} must be null or an integer in [0, {_MAX_INT}], got {v!r:.60}")
    if not isinstance(m.eos_token_ids, list) or not all(_is_int(i) and 0 <= i <= _MAX_INT for i in m.eos_token_ids):
        raise ValueError(f"{role}.eos_token_ids must be a list of non-negative integers, got {m.eos_token_ids!r:.60}")
    if not isinstance(m.files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in m.files.items()):
        raise TypeError(f"{role}.files must map graph role -> file name (strings), got {m.files!r:.60}")
    for v in m.files.values():
        # a plain file name inside the model folder: no separators, no "..", not absolute
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError(f"{role}.files names {v!r:.60}, which is not a plain file name inside the model folder")
    if not isinstance(m.parameter_bytes, dict) or not all(_is_int(v) for v in m.parameter_bytes.values()):
        raise TypeError(f"{role}.parameter_bytes must map names to integers, got {m.parameter_bytes!r:.60}")
    if m.kv_layout not in contract.KV_LAYOUTS:
        raise ValueError(f"{role}.kv_layout must be one of {', '.join(contract.KV_LAYOUTS)}, got {m.kv_layout!r:.60}")
    if m.kv_layout == contract.KV_STATIC and m.kind != contract.KIND_DECODER:
        raise ValueError(f"{role}.kv_layout {m.kv_layout!r} is only defined for decoder-only models")
    if not isinstance(m.validation, dict):
        raise TypeError(f"{role}.validation must be an object, got {m.validation!r:.60}")


def write_manifest(folder: Path, manifest: BundleManifest) -> Path:
    """Write edgespec.json through a temporary file + fsync + rename: never a half-written manifest."""
    path = Path(folder) / contract.MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


# An export writes into a temporary folder holding this marker (with the exporter's pid) and removes
# the marker only after renaming the folder into place: a folder with the marker is never a bundle.
PARTIAL_MARKER = ".edgespec-export-in-progress"
MAX_MANIFEST_BYTES = 16 << 20  # real manifests are a few KB


def load_bundle(folder: str | os.PathLike, *, allow_partial: bool = False,
                roles: Sequence[str] | None = None) -> BundleManifest:
    """Read and verify a bundle: manifest, files present and intact, no unsafe external data.

    ``roles``: verify only these models' files (``("target",)`` for plain decoding; None: all).
    ``allow_partial`` is for the exporter only: it checks its temporary folder before the rename.
    """
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise BundleError(f"{str(root)!r} is a file, not a bundle folder; pass the folder written by `edgespec export --out`")
    if not root.is_dir():
        raise BundleError(f"bundle folder {str(root)!r} does not exist; pass the folder written by `edgespec export --out`")
    if not allow_partial and os.path.lexists(root / PARTIAL_MARKER):
        raise BundleError(
            f"{str(root)!r} is an unfinished export (an `edgespec export` was interrupted or is still running); "
            "it is not a bundle: delete it and run `edgespec export` again"
        )
    mpath = root / contract.MANIFEST_NAME
    if not mpath.is_file() and (root / "pair.json").is_file():  # a pair from train-pair: checkpoints, not a bundle
        ready = (root / "bundle" / contract.MANIFEST_NAME).is_file()
        raise BundleError(
            f"{str(root)!r} is a trained pair (Hugging Face checkpoints), not a bundle; "
            + (f"its bundle/ (which edgespec demo exports) is {str(root / 'bundle')!r}" if ready else
               f"export one: edgespec export --target {shlex.quote(str(root / 'target'))} --draft "
               f"{shlex.quote(str(root / 'draft'))} --out BUNDLE"))
    parent = root.resolve().parent   # (resolved: "." inside target/ has no parent of its own)
    if not mpath.is_file() and (parent / contract.MANIFEST_NAME).is_file():  # a bundle's target/ or draft/
        raise BundleError(f"{str(root)!r} is the {root.resolve().name}/ folder inside a bundle; pass the bundle folder "
                          f"itself, {str(parent)!r}")
    if not mpath.is_file() and (root / "config.json").is_file():  # a Hugging Face checkpoint (a pair's target/)
        pair = root.resolve().parent
        hint = (f"; its pair's bundle is {str(pair / 'bundle')!r}" if (pair / "pair.json").is_file() and
                (pair / "bundle" / contract.MANIFEST_NAME).is_file() else "")
        raise BundleError(
            f"{str(root)!r} is a Hugging Face checkpoint, not an edgespec bundle; export it first: edgespec export "
            f"--target {shlex.quote(str(root))} [--draft DRAFT_CHECKPOINT] --out BUNDLE{hint}")
    if not mpath.is_file():
        raise BundleError(
            f"{str(root)!r} has no {contract.MANIFEST_NAME}; it is not an edgespec bundle "
            "(or an export was interrupted): run `edgespec export` again"
        )
    if mpath.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{mpath} is {mpath.stat().st_size} bytes, far larger than a manifest; re-export the bundle")
    raw = mpath.read_bytes()
    if raw.startswith(LFS_POINTER_PREFIX):
        raise BundleError(f"{mpath} is a Git LFS pointer, not the file; run `git lfs pull` in the repository")
    try:
        data = json.loads(raw.decode("utf-8-sig"))  # (an editor's byte-order mark was "not valid JSON")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit, nesting
        raise BundleError(f"{mpath} is not valid JSON ({str(exc)[:200]}); re-export the bundle with `edgespec export`") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{mpath} is not a JSON object; re-export the bundle with `edgespec export`")
    manifest = BundleManifest.from_dict(data, where=str(mpath))
    for role, model in manifest.models.items():
        if roles is not None and role not in roles:
            continue
        try:
            check_model_folder(root, model, role)
        except (OSError, ValueError) as exc:  # name too long, unreadable file, embedded NUL, ...
            raise BundleError(f"{role} model of {str(root)!r} cannot be read ({str(exc)[:300]}); copy the bundle "
                              "again or re-export it with `edgespec export`") from exc
    return manifest


def model_dir(root: str | os.PathLike, model: ModelManifest) -> Path:
    return Path(root) / model.path


def check_model_folder(root: Path, model: ModelManifest, role: str) -> None:
    if Path(model.path).is_absolute() or ".." in Path(model.path.replace("\\", "/")).parts:
        raise UnsafeFileError(f"manifest path {model.path!r} for {role} leaves the bundle; re-export the bundle")
    if "\0" in model.path or not Path(model.path).parts:
        raise BundleError(f"manifest path {model.path!r} for {role} is not a folder name; re-export the bundle")
    folder = root / model.path
    if not folder.is_dir():
        raise BundleError(f"bundle is missing the {role} folder {str(folder)!r}; copy the whole bundle or re-export it")
    inside = Path(root).resolve()
    _refuse_outside(folder, inside)
    expected = contract.GRAPH_FILES[model.kind]
    if set(model.files) != set(expected):
        raise BundleError(f"{role}: manifest lists graphs {sorted(model.files)} but a {model.kind} model needs {sorted(expected)}; re-export")
    for name in [*model.files.values(), contract.TOKENIZER_FILE]:
        p = folder / name
        if p.is_dir():
            raise BundleError(f"{p} is a folder, not the file the bundle needs; copy the whole bundle again or re-export "
                              "it with `edgespec export`")
        if not p.is_file():
            raise BundleError(f"bundle is missing {p}; copy the whole bundle or re-export it with `edgespec export`")
        _refuse_outside(p, inside)
        if p.stat().st_size == 0:
            raise BundleError(f"{p} is empty (interrupted copy?); copy the bundle again or re-export it")
        if _is_lfs_pointer(p):
            raise BundleError(
                f"{p} is a Git LFS pointer file, not the model; run `git lfs pull` (or download the real file) "
                "in the repository the bundle came from"
            )
    config = folder / contract.CONFIG_FILE  # optional (runtimes cross-check positions with it), read if there
    if config.is_file():
        _refuse_outside(config, inside)
    for name in model.files.values():
        check_onnx_file(folder / name)


def _refuse_outside(path: Path, inside: Path) -> None:
    """A bundle's folder or file must resolve inside the bundle (``inside``, resolved): a symbolic
    link out of it is refused, as external data is (check_onnx_file), so nothing is read from elsewhere."""
    real = path.resolve()
    if inside not in real.parents:
        raise UnsafeFileError(f"{path} resolves outside the bundle ({real}); replace the link with what it points to "
                              "(cp -L; a folder: cp -rL) or re-export the bundle")


# ---- minimal protobuf walk over an ONNX ModelProto ------------------------------------------------
# Wire format: each field is a varint key (field_number << 3 | wire_type) followed by a varint
# (type 0), 8 bytes (1), a varint length + bytes (2) or 4 bytes (5). We descend only into the
# messages that can hold tensors: ModelProto.graph (7), .training_info (20) and .functions (25),
# TrainingInfoProto.initialization (1) .algorithm (2), GraphProto.node (1), .initializer (5),
# .sparse_initializer (15), NodeProto.attribute (5), FunctionProto.node (7) .attribute_proto (11),
# AttributeProto.t (5) .g (6) .tensors (10) .graphs (11) .sparse_tensor (22) .sparse_tensors (23),
# SparseTensorProto.values (1) .indices (2), TensorProto.external_data (13) holding
# StringStringEntryProto {key 1, value 2}. (A Constant's sparse_value with external data passed
# unseen, and ONNX Runtime read it, from outside the folder through a hard link: a review's find.)

_MODEL_CHILDREN = {7: "graph", 20: "training", 25: "function"}
_TRAINING_CHILDREN = {1: "graph", 2: "graph"}
_GRAPH_CHILDREN = {1: "node", 5: "tensor", 15: "sparse"}
_NODE_CHILDREN = {5: "attribute"}
_ATTR_CHILDREN = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}
_SPARSE_CHILDREN = {1: "tensor", 2: "tensor"}
_FUNCTION_CHILDREN = {7: "node", 11: "attribute"}


class _Truncated(Exception):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise _Truncated
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _Truncated


def _fields(buf, start: int, end: int):
    """Yield (field_number, wire_type, value_start, value_end_or_varint) for one message."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise _Truncated
        if wt == 0:
            v, pos = _varint(buf, pos, end)
            yield num, wt, v, pos
        elif wt == 1:
            pos += 8
            yield num, wt, pos - 8, pos
        elif wt == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Truncated
            yield num, wt, pos, pos + n
            pos += n
        elif wt == 5:
            pos += 4
            yield num, wt, pos - 4, pos
        else:
            raise _Truncated
    if pos != end:
        raise _Truncated


def _external_locations(buf, start: int, end: int, kind: str, out: list[tuple[str, str, str]]) -> None:
    """Appends (location, offset, length) of every external-data tensor (the entries' strings)."""
    children = {"graph": _GRAPH_CHILDREN, "node": _NODE_CHILDREN, "attribute": _ATTR_CHILDREN,
                "sparse": _SPARSE_CHILDREN, "function": _FUNCTION_CHILDREN, "training": _TRAINING_CHILDREN}.get(kind)
    if kind == "tensor":
        entries: dict[bytes, str] = {}
        for num, wt, a, b in _fields(buf, start, end):
            if num == 13 and wt == 2:  # StringStringEntryProto
                key = value = b""
                for n2, w2, a2, b2 in _fields(buf, a, b):
                    if w2 == 2 and n2 == 1:
                        key = bytes(buf[a2:b2])
                    elif w2 == 2 and n2 == 2:
                        value = bytes(buf[a2:b2])
                entries[key] = value.decode("utf-8", "replace")
        if b"location" in entries:
            out.append((entries[b"location"], entries.get(b"offset", "0"), entries.get(b"length", "")))
        return
    for num, wt, a, b in _fields(buf, start, end):
        child = children.get(num) if wt == 2 else None
        if child is not None:
            _external_locations(buf, a, b, child, out)


def onnx_external_data_locations(path: Path) -> list[str]:
    """Locations of every external-data tensor in an ONNX file; BundleError if it is truncated/corrupt."""
    return [loc for loc, _, _ in _external_data(path)]


def _external_data(path: Path) -> list[tuple[str, str, str]]:
    """(location, offset, length) of every external-data tensor, as written (strings)."""
    size = path.stat().st_size
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        locations: list[tuple[str, str, str]] = []
        saw_graph = False
        try:
            for num, wt, a, b in _fields(buf, 0, size):
                if wt == 2 and num in _MODEL_CHILDREN:
                    saw_graph = saw_graph or num == 7
                    _external_locations(buf, a, b, _MODEL_CHILDREN[num], locations)
        except (_Truncated, RecursionError):
            raise BundleError(
                f"{path} is truncated or corrupt (not a complete ONNX protobuf); copy it again or re-export the bundle"
            ) from None
        if not saw_graph:
            raise BundleError(f"{path} holds no ONNX graph (corrupt or not an ONNX file); re-export the bundle")
        return locations


def onnx_opsets(path: Path) -> dict[str, int]:
    """domain -> opset version from ModelProto.opset_import (field 8); {} if unreadable."""
    out: dict[str, int] = {}
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for num, wt, a, b in _fields(buf, 0, len(buf)):
                if num == 8 and wt == 2:
                    domain, version = "", 0
                    for n2, w2, a2, b2 in _fields(buf, a, b):
                        if n2 == 1 and w2 == 2:
                            domain = bytes(buf[a2:b2]).decode("utf-8", "replace")
                        elif n2 == 2 and w2 == 0:
                            version = a2
                    out[domain or "ai.onnx"] = version
    except (_Truncated, OSError, ValueError):
        pass
    return out


def check_onnx_file(path: Path) -> None:
    """Structural check of one .onnx file and of the external data it references."""
    folder = path.parent.resolve()
    spans: dict[str, list[tuple[str, str]]] = {}  # location -> (offset, length) of its tensors, as written
    for loc, offset, length in _external_data(path):
        spans.setdefault(loc, []).append((offset, length))
    for loc, extents in spans.items():
        p = Path(loc)
        if p.is_absolute() or loc.startswith(("/", "\\")) or ".." in p.parts or ".." in Path(loc.replace("\\", "/")).parts:
            raise UnsafeFileError(
                f"{path} references external data at {loc!r}, outside its model folder; "
                "only files next to the .onnx are allowed: re-export the bundle (do not edit external-data paths)"
            )
        target = path.parent / p
        if target.is_symlink():
            raise UnsafeFileError(
                f"{path}: external data {loc!r} is a symbolic link; replace it with the real file (cp -L) or re-export"
            )
        if not target.is_file():
            raise BundleError(f"{path}: external data file {loc!r} is missing; copy the whole model folder or re-export")
        if folder not in target.resolve().parents:
            raise UnsafeFileError(f"{path}: external data {loc!r} resolves outside {folder}; re-export the bundle")
        if target.stat().st_nlink > 1:
            raise UnsafeFileError(
                f"{path}: external data {loc!r} is a hard link (shared with a file elsewhere); "
                "replace it with a plain copy or re-export"
            )
        try:
            end = max(int(offset) + (int(length) if length else 0) for offset, length in extents)
        except ValueError:
            raise BundleError(f"{path}: external data {loc!r} has an offset or length that is not a number (corrupt); "
                              "re-export the bundle") from None
        size = target.stat().st_size
        if _is_lfs_pointer(target):
            raise BundleError(f"{path}: external data file {loc!r} is a Git LFS pointer file, not the weights; run "
                              "`git lfs pull` (or download the real file) in the repository the bundle came from")
        if end > size:  # ONNX Runtime would blame the .onnx file in a raw message
            raise BundleError(f"{path}: external data file {loc!r} is truncated ({size} bytes; its tensors end at "
                              f"byte {end}); copy the whole model folder again or re-export the bundle")
