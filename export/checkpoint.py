"""Checks on a source checkpoint folder, done before anything is loaded or written."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgespec import contract
from edgespec.errors import CheckpointError, UnsafeFileError, UnsupportedArchitectureError

# model_type -> kind. gpt2, llama and t5 are exported, validated and generated from in the test
# suite; the others were exported, validated (1e-7 level) and run through the ONNX backend
# (rewind/extend consistency, greedy generation) from tiny configs by hand with
# optimum-onnx 0.1.0 / transformers 4.57.6.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "gpt2": contract.KIND_DECODER,
    "llama": contract.KIND_DECODER,
    "t5": contract.KIND_SEQ2SEQ,
    "mistral": contract.KIND_DECODER,
    "qwen2": contract.KIND_DECODER,
    "qwen3": contract.KIND_DECODER,
    "gpt_neox": contract.KIND_DECODER,
    "opt": contract.KIND_DECODER,
    "phi3": contract.KIND_DECODER,
    "gemma": contract.KIND_DECODER,
}

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt", "tf_model.h5", "flax_model.msgpack")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict
    model_type: str
    kind: str

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else self.model_type


def inspect_checkpoint(path: str | Path, role: str) -> Checkpoint:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{role} checkpoint folder {str(folder)!r} does not exist; pass a local Hugging Face model folder")
    if not folder.is_dir():
        raise CheckpointError(f"{role} checkpoint {str(folder)!r} is not a folder; pass the folder holding config.json")
    cfg_path = folder / contract.CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{role} checkpoint {str(folder)!r} has no config.json; copy the model's config.json into it "
            "(a complete Hugging Face checkpoint folder has config.json, *.safetensors and tokenizer.json)"
        )
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({exc}); restore the model's config.json") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} holds a JSON {type(config).__name__}, not an object of settings; restore "
                              "the model's config.json (save_pretrained writes it)")
    model_type = config.get("model_type")
    if model_type is None:  # (it was called an unsupported architecture, None)
        raise CheckpointError(f"{cfg_path} names no model_type; a Hugging Face config.json does (e.g. \"model_type\": "
                              "\"llama\"): save the checkpoint with save_pretrained, or restore its config.json")
    if not isinstance(model_type, str):  # (a list raised a TypeError in the lookup below)
        raise CheckpointError(f"{cfg_path} has model_type {model_type!r}, not a string (e.g. \"model_type\": \"llama\"); "
                              "restore the model's config.json")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{role} checkpoint {str(folder)!r} has model_type {model_type!r}; edgespec export supports "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}: pick a checkpoint of one of these architectures"
        )
    seq2seq = SUPPORTED_ARCHITECTURES[model_type] == contract.KIND_SEQ2SEQ
    for key in ("bos_token_id", "pad_token_id", *(("decoder_start_token_id",) if seq2seq else ())):
        # one id or null (a negative bos/pad means none: old Llama configs write pad_token_id -1)
        v, lowest = config.get(key), 0 if key == "decoder_start_token_id" else -(2**31)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lowest <= v < 2**31):
            raise CheckpointError(f"{cfg_path}: {key} {v!r:.60} is not a token id; set it to one id, or null")
    if not (folder / contract.TOKENIZER_FILE).is_file():
        raise CheckpointError(
            f"{role} checkpoint {str(folder)!r} has no tokenizer.json (the runtime reads it with the `tokenizers` "
            "library); save a fast tokenizer into the folder: AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
        )
    safetensors = sorted(folder.glob("*.safetensors"))
    if not safetensors:
        pickled = [n for n in PICKLE_WEIGHTS if (folder / n).exists()] + [p.name for p in folder.glob("pytorch_model-*.bin")]
        if pickled:
            raise UnsafeFileError(
                f"{role} checkpoint {str(folder)!r} has only pickle weights ({', '.join(pickled)}); edgespec never "
                "unpickles checkpoints. Convert them to safetensors in a trusted environment "
                "(model.save_pretrained(folder, safe_serialization=True)) and export again"
            )
        raise CheckpointError(f"{role} checkpoint {str(folder)!r} has no *.safetensors weights; {no_weights_fix(folder)}")
    check_safetensors(safetensors, role)
    return Checkpoint(path=folder, config=config, model_type=model_type, kind=SUPPORTED_ARCHITECTURES[model_type])


def no_weights_fix(folder: Path) -> str:
    """The fix for a checkpoint folder without safetensors: a bundle's model folder (ONNX graphs) is
    no checkpoint at all (saving it again, the advice it got, was no help)."""
    if any(folder.glob("*.onnx")):
        return ("it holds exported ONNX graphs (a bundle's model folder): pass the Hugging Face checkpoint they were "
                "exported from")
    return "save the model with safe_serialization=True"


def check_safetensors(files: list[Path], role: str) -> None:
    """Each weights file must be a complete safetensors file (its header is read, no tensor is):
    a truncated copy or a Git LFS pointer fails here, before any export work, not halfway through."""
    from safetensors import safe_open

    for f in files:
        try:
            with open(f, "rb") as fh:
                head = fh.read(64)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            # a dangling link (a hub cache cleaned under a --local-dir download), or a folder
            raise CheckpointError(f"{role} weights {str(f)!r} cannot be opened ({exc.strerror}: a dangling link or not a "
                                  "file); restore the file, or download or save the checkpoint again") from exc
        if head.startswith(b"version https://git-lfs"):
            raise CheckpointError(f"{role} weights {str(f)!r} are a Git LFS pointer, not the file; run `git lfs pull`")
        try:
            with safe_open(str(f), framework="np") as h:
                h.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError)
            raise CheckpointError(f"{role} weights {str(f)!r} cannot be read ({str(exc)[:160]}): the file is truncated "
                                  "or corrupt; copy or save the checkpoint again") from exc
