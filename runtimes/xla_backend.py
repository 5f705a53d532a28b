"""Backend over ``jax.export`` artifacts written by ``edgespec.export.xla`` (the XLA reference path).

The KV buffers stay on the device between calls (jax arrays, donated to each step so XLA updates
them in place); only logits come back to the host, as float32 numpy. Rolling back sets a position.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import (
    BundleError,
    InvalidArgumentError,
    PromptTooLongError,
    ProviderError,
    UnsafeFileError,
)

FORMAT = "edgespec-xla"
FORMAT_VERSION = 1
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what export --platforms lowers for


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def available_platforms() -> list[str]:
    """Export platform names (cpu, cuda, rocm, tpu) this jax installation can run on."""
    import jax

    found = []
    for backend in ("cpu", "cuda", "rocm", "tpu", "gpu"):
        try:
            devs = jax.devices(backend)
        except RuntimeError:
            continue
        if not devs:
            continue
        name = _export_platform(devs[0])
        if name not in found:
            found.append(name)
    return found


def _export_platform(device) -> str:
    p = device.platform.lower()
    if p == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    return p


def _device_for(platform: str):
    import jax

    for backend in ((platform, "gpu") if platform in ("cuda", "rocm") else (platform,)):
        try:
            devs = jax.devices(backend)
        except RuntimeError:
            continue
        for d in devs:
            if _export_platform(d) == platform:
                return d
    return None


def _check_fields(manifest: dict, mpath: Path) -> None:
    """The xla.json fields the backend reads, with their types (a BundleError naming the field)."""
    def bad(what: str) -> BundleError:
        return BundleError(f"{mpath}: {what}; re-export the model")

    ints = ["vocab_size", "max_length", "verify_width"] + (["max_source_length"] if manifest.get("encoder_decoder") else [])
    for name in ints:
        v = manifest.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad(f"{name} must be a positive integer, got {v!r:.40}")
    if not isinstance(manifest.get("model_type"), str) or not isinstance(manifest.get("encoder_decoder"), bool):
        raise bad("model_type (a string) and encoder_decoder (true/false) are required")
    arts = manifest.get("artifacts")
    if not isinstance(arts, dict) or not all(
            isinstance(entries, dict) and all(isinstance(k, str) and k.isascii() and k.isdigit() and isinstance(e, dict)
                                              and isinstance(e.get("file"), str) for k, e in entries.items())
            for entries in arts.values()):
        raise bad("artifacts must map kind -> {size: {file, sha256}}")
    w = manifest.get("weights", {})
    if not isinstance(w, dict) or not isinstance(w.get("tensors", {}), dict) or not w.get("tensors"):
        raise bad("weights.tensors must name the weight tensors and their shapes")


def _check_signature(kind: str, size: int, exp, manifest: dict, path: Path) -> None:
    """An artifact's own shapes must be what xla.json says (the manifest has no checksum of its own):
    ids [size] in, logits [..., vocab_size] out, a KV buffer of max_length positions."""
    got = {"ids": exp.in_avals[-2].shape, "kv": exp.out_avals[-1].shape}
    ok = got["ids"] == (size,) and len(got["kv"]) == 5 and got["kv"][3] == manifest["max_length"]
    if kind in ("extend", "prefill"):
        got["logits"] = exp.out_avals[0].shape
        ok = ok and got["logits"][-1] == manifest["vocab_size"]
    if kind == "encode":
        got["cross_kv"] = exp.out_avals[0].shape
        ok = ok and len(got["cross_kv"]) == 5 and got["cross_kv"][3] == manifest["max_source_length"]
    if not ok:
        raise BundleError(f"{path.name} has shapes {got}, which do not match xla.json (vocab_size "
                          f"{manifest['vocab_size']}, max_length {manifest['max_length']}, size {size}): the manifest "
                          "was edited or the files mixed; re-export the model")


class XlaBackend:
    """One model (GPT-2, Llama, T5) and its static KV buffers for one sequence (batch 1).

    For T5 (``is_encoder_decoder``): ``prefill(ids)`` encodes the prompt, computes the cross-attention
    K/V once, and feeds the decoder start token; ``length`` counts decoder tokens (start token
    included) and ``max_length`` is the decoder buffer; ``max_prompt_length`` is the encoder bucket.
    """

    def __init__(self, folder: Path, manifest: dict[str, Any], platform: str, device, params, exported: dict):
        import jax

        self.folder = folder
        self.manifest = manifest
        self.platform = platform
        self.device = device
        self.model_type: str = manifest["model_type"]
        self.is_encoder_decoder: bool = bool(manifest["encoder_decoder"])
        self.vocab_size: int = int(manifest["vocab_size"])
        self.max_length: int = int(manifest["max_length"])
        self.verify_width: int = int(manifest["verify_width"])
        self.widths: list[int] = sorted(int(w) for w in exported["extend"])
        self.prefill_buckets: list[int] = sorted(int(b) for b in exported.get("prefill", {}))
        self.max_prompt_length: int = (int(manifest["max_source_length"]) if self.is_encoder_decoder
                                       else self.max_length)
        specials = manifest.get("special_tokens", {})
        self.decoder_start_token_id: int | None = specials.get("decoder_start_token_id")
        if self.is_encoder_decoder and self.decoder_start_token_id is None:
            self.decoder_start_token_id = specials.get("pad_token_id", 0)
        self._params = params
        # weight bytes a decoder call reads (the bench's counts): not the encoder's, nor the cross-attention
        # K/V projections, which run once per prompt (t5_encode)
        self.parameter_bytes = sum(int(v.nbytes) for k, v in params.items()
                                   if not k.startswith("encoder.") and not k.endswith(("EncDecAttention.k.weight",
                                                                                        "EncDecAttention.v.weight")))
        # jit wrappers around Exported.call; kv (and nothing else) is donated: updated in place.
        self._extend = {int(k): jax.jit(e.call, donate_argnums=(1,)) for k, e in exported["extend"].items()}
        self._prefill = {int(k): jax.jit(e.call) for k, e in exported.get("prefill", {}).items()}
        self._encode = {int(k): jax.jit(e.call) for k, e in exported.get("encode", {}).items()}
        self._kv = None
        self._cross = None
        self._enc_len = None
        self._length = 0

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, model_dir: str | Path, platform: str | None = None) -> "XlaBackend":
        """Load ``model_dir/xla/xla.json`` (or ``model_dir/xla.json``) and its artifacts.

        ``platform``: cpu, cuda, rocm or tpu; default: jax's default device if the artifacts were
        lowered for it, else the first of the artifact's platforms that is available.
        """
        import jax
        from jax import export as jexport

        folder = Path(model_dir)
        if (folder / "xla" / "xla.json").is_file():
            folder = folder / "xla"
            # the same rule as ONNX external data: nothing read from outside the model folder
            if folder.is_symlink() or Path(model_dir).resolve() not in folder.resolve().parents:
                raise UnsafeFileError(f"{folder} is a symbolic link (or resolves outside {model_dir}); replace it with "
                                      "the real folder (cp -rL) or re-export the model")
        mpath = folder / "xla.json"
        if not mpath.is_file():
            raise BundleError(f"{model_dir} has no xla/xla.json; export the model with "
                              "`edgespec export --format onnx+xla` (edgespec.export.xla.export_xla)")
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, ValueError) as exc:
            raise BundleError(f"{mpath} is not valid JSON ({exc}); re-export the model") from exc
        if not isinstance(manifest, dict):
            raise BundleError(f"{mpath}: the manifest is not a JSON object; re-export the model")
        if manifest.get("format") != FORMAT:
            raise BundleError(f"{mpath} is not an edgespec XLA manifest (format={manifest.get('format')!r}); re-export")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise BundleError(f"{mpath} has format_version {manifest.get('format_version')!r}; this edgespec reads "
                              f"version {FORMAT_VERSION}; re-export the model with this edgespec")
        _check_fields(manifest, mpath)
        made_by = manifest.get("jax_version", "unknown")
        art_platforms = [str(p) for p in manifest.get("platforms", [])]

        # ---- platform
        avail = available_platforms()
        if platform is None:
            default = _export_platform(jax.devices()[0])
            choice = default if default in art_platforms else next((p for p in art_platforms if p in avail), None)
            if choice is None:
                raise ProviderError(
                    f"the XLA artifacts in {folder} were lowered for {art_platforms}, but this machine's jax offers "
                    f"{avail}; re-export with --platforms {','.join(avail) or 'cpu'} (or install jax for "
                    f"{'/'.join(art_platforms)})")
            platform = choice
        platform = str(platform).lower()
        if platform not in _KNOWN_PLATFORMS:
            raise ProviderError(f"unknown XLA platform {platform!r}: use one of {', '.join(_KNOWN_PLATFORMS)} "
                                f"(these artifacts have {art_platforms}; this machine's jax offers {avail})")
        if platform not in art_platforms:
            raise ProviderError(
                f"the XLA artifacts in {folder} were lowered for {art_platforms}, not {platform!r} (available here: "
                f"{avail}); re-export with --platforms {platform} or pick one of {art_platforms}")
        device = _device_for(platform)
        if device is None:
            raise ProviderError(
                f"platform {platform!r} is not available to this jax (available: {avail}; the artifacts have "
                f"{art_platforms}); install the matching jax plugin or choose another (platform={avail[0] if avail else 'cpu'!r}, CLI "
                f"--platform {avail[0] if avail else 'cpu'})")

        # ---- artifacts
        def safe(name: str) -> Path:
            p = (folder / name)
            if Path(name).is_absolute() or ".." in Path(name).parts or p.resolve().parent != folder.resolve():
                raise UnsafeFileError(f"{mpath} names a file outside the model folder ({name!r}); refusing to read it")
            if not p.is_file():
                raise BundleError(f"{p} is missing; re-export the model")
            if p.stat().st_nlink > 1:
                raise UnsafeFileError(f"{p} is a hard link (shared with a file elsewhere); replace it with a plain copy "
                                      "or re-export the model")
            return p

        exported: dict[str, dict[int, Any]] = {}
        for kind, entries in manifest.get("artifacts", {}).items():
            for size, entry in entries.items():
                path = safe(entry["file"])
                data = path.read_bytes()
                if entry.get("sha256") and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise BundleError(f"{path} does not match its checksum in xla.json (corrupted or edited); re-export")
                try:
                    exp = jexport.deserialize(bytearray(data))
                except Exception as exc:
                    raise BundleError(
                        f"jax {jax.__version__} cannot deserialize {path.name} (made by jax {made_by}): {exc}; "
                        f"re-export the model with this jax, or install jax=={made_by}") from exc
                if platform not in exp.platforms:
                    raise ProviderError(f"{path.name} was lowered for {list(exp.platforms)}, not {platform!r}; re-export "
                                        f"with --platforms {platform}")
                _check_signature(kind, int(size), exp, manifest, path)
                exported.setdefault(kind, {})[int(size)] = exp
        if not exported.get("extend") or 1 not in exported["extend"]:
            raise BundleError(f"{mpath} lists no width-1 extend artifact; re-export the model")
        if manifest.get("encoder_decoder"):
            if not exported.get("encode"):
                raise BundleError(f"{mpath} lists no encoder artifact; re-export the model")
        elif not exported.get("prefill"):
            raise BundleError(f"{mpath} lists no prefill artifact; re-export the model")

        # ---- weights
        w = manifest.get("weights", {})
        wpath = safe(w.get("file", "weights.safetensors"))
        if w.get("sha256") and _sha256(wpath) != w["sha256"]:
            raise BundleError(f"{wpath} does not match its checksum in xla.json (corrupted or edited); re-export")
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(wpath))
        except Exception as exc:
            raise BundleError(f"cannot read {wpath} ({exc}); re-export the model") from exc
        expected = w.get("tensors", {})
        for name, shape in expected.items():
            if name not in tensors or list(tensors[name].shape) != list(shape):
                raise BundleError(f"{wpath} lacks tensor {name} of shape {shape}; re-export the model")
        params = {k: jax.device_put(np.asarray(tensors[k], np.float32), device) for k in expected}
        return cls(folder, manifest, platform, device, params, exported)

    # ---------------------------------------------------------------- protocol

    @property
    def length(self) -> int:
        return self._length

    def _ids(self, ids, what: str) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            raise InvalidArgumentError(f"{what} takes a non-empty 1-D integer array of token ids; got shape "
                                       f"{a.shape} dtype {a.dtype}")
        if a.min() < 0 or a.max() >= self.vocab_size:
            raise InvalidArgumentError(f"token ids must be in [0, {self.vocab_size}); got min {a.min()} max {a.max()}")
        return a.astype(np.int32)

    def _put(self, x):
        import jax

        return jax.device_put(x, self.device)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        a = self._ids(ids, "prefill")
        n = a.size
        self.free()
        if self.is_encoder_decoder:
            E = max(self._encode)  # the longest prompt; the smallest bucket that holds this one runs
            if n > E:
                raise PromptTooLongError(
                    f"the prompt has {n} tokens but the T5 encoder was exported for at most {E}; shorten it or "
                    f"re-export with a larger --max-source-length (e.g. --max-source-length {max(n, 2 * E)})", "prompt")
            size = min(b for b in self._encode if b >= n)
            buf = np.zeros(size, np.int32)
            buf[:n] = a
            self._cross, self._kv = self._encode[size](self._params, self._put(buf), np.int32(n))
            self._enc_len = np.int32(n)
            self._length = 0
            return self._run(np.array([self.decoder_start_token_id], np.int32))[0]
        if n > self.max_length:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but the XLA artifacts hold at most {self.max_length} "
                f"(static KV buffers); shorten it or re-export with a larger --max-length "
                f"(e.g. --max-length {max(n + 64, 2 * self.max_length)})", "prompt")
        bucket = next((b for b in self.prefill_buckets if b >= n), self.prefill_buckets[-1])
        head = min(n, bucket)
        buf = np.zeros(bucket, np.int32)
        buf[:head] = a[:head]
        logits, self._kv = self._prefill[bucket](self._params, self._put(buf), np.int32(head))
        self._length = head
        if head < n:  # prompt longer than the largest bucket: extend the rest in chunks
            rows = self._run(a[head:])
            return rows[-1]
        return np.asarray(logits, dtype=np.float32)

    def extend(self, ids: np.ndarray) -> np.ndarray:
        if self._kv is None:
            raise InvalidArgumentError("extend() before prefill(): call prefill(prompt) first")
        a = self._ids(ids, "extend")
        if a.size > self.verify_width:
            raise InvalidArgumentError(
                f"extend() got {a.size} tokens but the XLA artifacts were exported for blocks of at most "
                f"verify_width={self.verify_width} (gamma <= {self.verify_width - 1}); lower gamma/max_gamma or "
                f"re-export with --verify-width {a.size}")
        return self._run(a)

    def _run(self, a: np.ndarray) -> np.ndarray:
        k = a.size
        if self._length + k > self.max_length:
            raise PromptTooLongError(
                f"extending {self._length} cached tokens by {k} exceeds the {self.max_length}-token XLA buffers; "
                f"stop earlier (lower max_new_tokens) or re-export with a larger --max-length")
        try:
            return self._run_chunks(a)
        except BaseException:
            # A failed call may have consumed the KV buffer it was given (donated), and earlier
            # chunks have moved the length: the cache is gone, and the next prefill starts afresh.
            self.free()
            raise

    def _run_chunks(self, a: np.ndarray) -> np.ndarray:
        k = a.size
        out = []
        i = 0
        while i < k:
            rem = k - i
            pos = self._length
            fits = [w for w in self.widths if pos + w <= self.max_length]
            wider = [w for w in fits if w >= rem]
            w = wider[0] if wider else max(w for w in fits if w <= rem)
            take = min(w, rem)
            buf = np.zeros(w, np.int32)
            buf[:take] = a[i:i + take]
            if self.is_encoder_decoder:
                logits, self._kv = self._extend[w](self._params, self._kv, self._cross, self._enc_len,
                                                   self._put(buf), np.int32(pos))
            else:
                logits, self._kv = self._extend[w](self._params, self._kv, self._put(buf), np.int32(pos))
            out.append(np.asarray(logits, dtype=np.float32)[:take])
            self._length += take
            i += take
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def rewind_to(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._length:
            raise InvalidArgumentError(f"rewind_to(n) needs 0 <= n <= length={self._length}; got {n!r}")
        self._length = int(n)

    def free(self) -> None:
        self._kv = None
        self._cross = None
        self._enc_len = None
        self._length = 0

    def warmup(self) -> None:
        """Compile every artifact now (the first call of each otherwise compiles it)."""
        for b in sorted(self._encode):  # T5: every encoder bucket (a prompt of b tokens runs bucket b)
            self.prefill(np.zeros(b, np.int64))
        for b in self.prefill_buckets:
            self.prefill(np.zeros(min(b, self.max_length), np.int64))
        for w in self.widths:
            self.rewind_to(min(self._length, self.max_length - w))
            self.extend(np.zeros(w, np.int64))
        self.free()

    def __repr__(self) -> str:
        return (f"XlaBackend({self.model_type}, platform={self.platform}, max_length={self.max_length}, "
                f"verify_width={self.verify_width}, length={self._length})")
