"""``edgespec distill``: train a small Llama draft to match a target's distributions.

Speculative decoding accepts a drafted token with probability ``beta = sum_x min(p(x), q(x))``
(Leviathan et al. 2023, section 3.3), and ``1 - beta`` is exactly the total variation distance
between the target's p and the draft's q. The ``tv`` loss minimises that directly; ``kl`` is the
forward KL(p || q), smoother from a random start; ``mix`` (default) adds both. The targets are the
target model's full distributions on corpus windows and, optionally (``--generated``), on
continuations the target writes itself (greedy and sampled): the draft is judged on the target's own
output at decode time, so that is where matching it pays (on-policy distillation, as in DistillSpec,
Zhou et al. 2024).

``measure_alpha`` is the reusable metric: the mean of beta over held-out positions of the
processed distributions (temperature 0: one-hot argmax; otherwise softmax(logits / T)).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from . import contract
from .corpus import bar_options
from .errors import CheckpointError, InvalidArgumentError, OutputExistsError, TrainingError, warn
from .cli import at_least, folder
from .report import write_json
from .outputs import DRAFT_FILES, TOKENIZER_FILES, check_output_folder, check_writable, swap_into_place, usual_permissions

MODES = ("mix", "kl", "tv")


# ----------------------------------------------------------------------------- alpha

def _processed_probs(logits, temperature: float):
    import torch

    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def beta_per_position(p_logits, q_logits, temperature: float):
    """``sum_x min(p(x), q(x))`` at every position (the acceptance probability of a drafted token)."""
    import torch

    return torch.minimum(_processed_probs(p_logits, temperature), _processed_probs(q_logits, temperature)).sum(-1)


def measure_alpha(target_model, draft_model, token_ids, temperature: float, *, batch_size: int = 8,
                  start: int = 0) -> float:
    """Mean acceptance rate alpha of ``draft_model`` for ``target_model`` on ``token_ids``.

    ``token_ids``: a LongTensor ``[n, length]`` (or ``[length]``), or a list of token-id lists; every
    position ``>= start`` of every row counts (``start`` skips a prompt whose continuation is judged).
    Temperature 0 compares argmaxes (beta is 1 or 0); a temperature ``T > 0`` compares
    ``softmax(logits / T)``. Both models run in eval mode without gradients.
    """
    import torch

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise InvalidArgumentError(f"temperature must be a finite number >= 0; got {temperature!r}")
    if isinstance(token_ids, torch.Tensor):
        rows = [token_ids.long()] if token_ids.ndim == 1 else list(token_ids.long())
        groups = [torch.stack(rows)] if rows and token_ids.ndim == 2 else [r[None] for r in rows]
    else:
        groups = [torch.as_tensor(list(r), dtype=torch.long)[None] for r in token_ids]
    groups = [g for g in groups if g.numel()]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidArgumentError(f"start must be an integer >= 0; got {start!r}")
    groups = [g for g in groups if g.shape[1] > start]
    if not groups:
        raise InvalidArgumentError("measure_alpha needs at least one token (at or after start)")
    tv, dv = _vocab(target_model), _vocab(draft_model)
    if tv != dv:
        raise InvalidArgumentError(f"target vocabulary {tv} != draft vocabulary {dv}; the models must share a tokenizer")
    was = (target_model.training, draft_model.training)
    target_model.eval()
    draft_model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for g in groups:
                for i in range(0, len(g), batch_size):
                    x = g[i:i + batch_size]
                    b = beta_per_position(target_model(input_ids=x).logits, draft_model(input_ids=x).logits,
                                          temperature)[:, start:]
                    total += float(b.double().sum())
                    count += b.numel()
    finally:
        target_model.train(was[0])
        draft_model.train(was[1])
    return total / count


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None \
        else int(model.config.vocab_size)


# ----------------------------------------------------------------------------- loading

def check_hf_folder(folder: Path, role: str = "target") -> str | None:
    """Typed errors for a folder that cannot be loaded safely as an HF checkpoint; its model_type."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"{role} folder {folder} {what}; pass a Hugging Face checkpoint folder")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{role} folder {folder} has no config.json; pass a Hugging Face checkpoint folder")
    has_st = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if not has_st:
        pickled = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        if pickled:
            raise CheckpointError(
                f"{role} folder {folder} has only pickle weights ({', '.join(sorted(pickled))}); edgespec never unpickles. "
                "Convert it once, in an environment you trust: "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True)"
            )
        from .export.checkpoint import no_weights_fix

        raise CheckpointError(f"{role} folder {folder} has no model.safetensors; {no_weights_fix(folder)}")
    from .export.checkpoint import SUPPORTED_ARCHITECTURES, check_safetensors

    check_safetensors(sorted(folder.glob("*.safetensors")), role)
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{folder / 'config.json'} is not a JSON object ({str(exc)[:100]}); restore the model's config.json") from exc
    if SUPPORTED_ARCHITECTURES.get(model_type, contract.KIND_DECODER) != contract.KIND_DECODER:
        decoders = sorted(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == contract.KIND_DECODER)
        raise CheckpointError(f"{role} folder {folder} holds a {model_type!r} model; distill trains drafts for "
                              f"decoder-only targets ({', '.join(decoders)})")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(
            f"{role} folder {folder} has no tokenizer (tokenizer.json); the draft must share the target's tokenizer. "
            "Save it next to the model: tokenizer.save_pretrained(DIR)"
        )
    return model_type


def load_target(folder: Path):
    """``(model, tokenizer)`` of a target folder: safetensors only, no remote code."""
    from transformers import AutoTokenizer

    from .export.onnx_export import load_torch_model_at

    check_hf_folder(folder, "target")
    try:
        if (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            # tokenizer.json alone, as the exporter and the runtime read it: AutoTokenizer would add
            # its class's default special tokens (<s>, </s>, <unk>) past the model's rows
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        else:
            tok = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {exc}; save a tokenizer.json with the target") from exc
    if not getattr(tok, "is_fast", False):
        raise CheckpointError(f"the tokenizer of {folder} is not a fast (tokenizer.json) tokenizer; save one with the target")
    model = load_torch_model_at(folder, seq2seq=False)  # refuses weights config.json does not describe
    return model, tok


# ----------------------------------------------------------------------------- sizes

@dataclass(frozen=True)
class DraftSize:
    layers: int
    hidden: int
    heads: int
    intermediate: int


SIZES = {
    "tiny": DraftSize(layers=1, hidden=64, heads=2, intermediate=172),
    "small": DraftSize(layers=1, hidden=96, heads=2, intermediate=256),
    "medium": DraftSize(layers=2, hidden=128, heads=2, intermediate=344),
    "large": DraftSize(layers=2, hidden=192, heads=3, intermediate=512),
}


def _named_size(size: str) -> DraftSize:
    if size not in SIZES:
        raise InvalidArgumentError(f"unknown draft size {size!r}; choose one of {', '.join(SIZES)} or give --layers/--hidden")
    return SIZES[size]


def resolve_size(size: str | None, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                 intermediate: int | None = None):
    """A :class:`edgespec.pair.ModelSize` from a named size, with any explicit field overriding it."""
    from .pair import ModelSize

    base = _named_size(size or "small")
    hidden = base.hidden if hidden is None else hidden
    if heads is None:
        heads = base.heads if hidden == base.hidden else max(1, hidden // 64)
        while hidden % heads or (hidden // heads) % 2:
            heads = heads - 1 if heads > 1 else 1
            if heads == 1:
                break
    if intermediate is None:
        intermediate = base.intermediate if hidden == base.hidden else int(round(hidden * 8 / 3 / 4)) * 4 or 4
    s = ModelSize(hidden=hidden, layers=base.layers if layers is None else layers, heads=heads, intermediate=intermediate)
    s.validate("draft")
    return s


def _init_shape(config, size, layers, hidden, heads, intermediate):
    """The draft's shape when training starts from ``--init`` (its ``config``): the checkpoint's own.
    Only ``layers`` may differ, upwards (see :func:`grow_layers`); other shape options must agree."""
    from .pair import ModelSize, _check_int

    c = config
    own = ModelSize(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                    intermediate=c.intermediate_size,
                    kv_heads=None if c.num_key_value_heads == c.num_attention_heads else c.num_key_value_heads)
    asked = {"hidden": hidden, "heads": heads, "intermediate": intermediate}
    if size is not None:
        named = _named_size(size)
        asked = {k: getattr(named, k) if v is None else v for k, v in asked.items()}
        if layers is None:
            asked["layers"] = named.layers
    wrong = [f"{k} {v} (the checkpoint has {getattr(own, k)})" for k, v in asked.items()
             if v is not None and v != getattr(own, k)]
    if wrong:
        raise InvalidArgumentError(f"--init keeps the checkpoint's shape, but the options ask for {', '.join(wrong)}; "
                                   "drop --size/--hidden/--heads/--intermediate (only --layers may grow a draft)")
    if layers is None:
        return own
    _check_int("layers", layers)
    if layers < own.layers:
        raise InvalidArgumentError(f"--layers {layers} is fewer than the --init checkpoint's {own.layers} layers; "
                                   f"a draft can only grow: pass --layers {own.layers} or more, or drop --layers")
    return replace(own, layers=layers)


def grow_layers(model, layers: int):
    """``model`` (a Llama draft) with layers appended up to ``layers``: the new layers' residual
    output projections are zero (:func:`edgespec.pair.new_llama`), so the grown draft computes
    exactly the same distributions at step 0 and training only adds to them. Seed torch first."""
    import copy

    import torch

    from .pair import new_llama

    old = model.config.num_hidden_layers
    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] = layers
    for key, value in cfg.items():  # per-layer settings (layer_types, ...): the new layers repeat the last
        if "layer" in key and isinstance(value, list) and len(value) == old:
            cfg[key] = value + [value[-1]] * (layers - old)
    grown = new_llama(type(model.config).from_dict(cfg))
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    new_layer = tuple(f"model.layers.{i}." for i in range(old, layers))
    if unexpected or not all(k.startswith(new_layer) for k in missing):
        raise TrainingError(f"cannot grow the draft from {old} to {layers} layers: parameters "
                            f"{sorted(unexpected) or sorted(k for k in missing if not k.startswith(new_layer))} do not match")
    grown.generation_config = copy.deepcopy(model.generation_config)
    grown.eval()
    x = torch.randint(0, _vocab(model), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same = torch.equal(model(input_ids=x).logits, grown(input_ids=x).logits)
    if not same:
        raise TrainingError(f"growing the draft from {old} to {layers} layers changed its outputs (its config has a "
                            "per-layer setting this does not extend); train the deeper draft without --init instead")
    return grown


# ----------------------------------------------------------------------------- training

def _losses(t_logits, d_logits, mode: str):
    import torch

    t_logp = torch.log_softmax(t_logits.float(), -1)
    d_logp = torch.log_softmax(d_logits.float(), -1)
    p = t_logp.exp()
    kl = (p * (t_logp - d_logp)).sum(-1).mean()
    tv = 0.5 * (p - d_logp.exp()).abs().sum(-1).mean()
    if mode == "kl":
        return kl, kl, tv
    if mode == "tv":
        return tv, kl, tv
    return kl + tv, kl, tv


def continuations(target, prefixes, length: int, temperatures: Sequence[float], seed: int, *, batch_size: int = 32,
                  progress: bool = False, desc: str = "target continuations"):
    """The target's own continuations of ``prefixes`` ``[n, P]`` up to ``length`` tokens: row i is
    decoded at ``temperatures[i % len(temperatures)]`` (0: greedy; T > 0: sampled at T, no top-k/top-p).
    Deterministic for a seed, whatever the batch size. Returns a LongTensor ``[n, length]``."""
    import torch
    from tqdm.auto import tqdm

    n, plen = prefixes.shape
    new = length - plen
    if new <= 0:
        return prefixes[:, :length].clone()
    out = torch.empty((n, length), dtype=torch.long)                        # [n, length]
    out[:, :plen] = prefixes
    jobs = [(t, [i for i in range(n) if i % len(temperatures) == k]) for k, t in enumerate(temperatures)]
    # A loop of our own, not the checkpoint's generate(): that one applies the checkpoint's
    # generation_config.json (a repetition penalty, no-repeat n-grams, ...), and the engine's output
    # is plain argmax / softmax(logits / T) sampling. Each row draws from its own generator, so a row's
    # text does not depend on which rows share its batch.
    with tqdm(total=n, desc=desc, unit="row", dynamic_ncols=True, **bar_options(progress)) as bar, \
            torch.no_grad():
        for temp, rows in jobs:
            for j in range(0, len(rows), batch_size):
                idx = rows[j:j + batch_size]
                gens = [torch.Generator().manual_seed(seed * 1_000_003 + 7919 * i) for i in idx]
                x, past = prefixes[idx], None                                   # [b, P]
                for step in range(new):
                    o = target(input_ids=x, past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    logits = o.logits[:, -1].double()                           # [b, V]
                    if temp > 0:  # inverse CDF of softmax(logits / T) at one uniform per row
                        cdf = torch.softmax(logits / float(temp), -1).cumsum(-1)  # [b, V]
                        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens])  # [b]
                        x = (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp_(max=logits.shape[1] - 1)[:, None]
                    else:
                        x = logits.argmax(-1, keepdim=True)                     # [b, 1]
                    out[idx, plen + step] = x[:, 0]
                bar.update(len(idx))
    return out


def prefix_length(context: int) -> int:
    """The prefixes the target continues: a quarter context (the target writes the rest)."""
    return max(1, context // 4)


def target_pool(target, train_ids, pool_size: int, context: int, seed: int, *, progress: bool = False):
    """The pool on-policy batches draw from: the target's continuations (half greedy, half at T=1)
    of ``pool_size`` corpus prefixes, ``[pool_size, context + 1]``."""
    from .pair import _batch

    prefixes = _batch(train_ids, 0, seed, 11, pool_size, context)[:, :prefix_length(context)]
    return continuations(target, prefixes, context + 1, (0.0, 1.0), seed, progress=progress, desc="target continuations")


def _generated_rows(batch_size: int, generated: float) -> int:
    """Rows of a batch taken from the target's continuations (the rest are corpus windows)."""
    return int(round(batch_size * generated))


def train_draft(target, train_ids, size, *, vocab_size: int, context: int, steps: int, batch_size: int, lr: float,
                mode: str | None, seed: int, special_ids: dict, generated: float = 0.0, pool=None, init=None,
                progress: bool = True, desc: str = "distill", on_step: Callable[[int], None] | None = None,
                state_path: Path | None = None, checkpoint_every: int = 0, settings: dict | None = None,
                resume: dict | None = None, what: str = "the distillation"):
    """Train a Llama draft. ``mode=None`` is the corpus-only baseline (cross-entropy on the same
    windows); otherwise the draft matches the target's distributions with the given loss. With
    ``generated > 0`` that fraction of each batch is rows of ``pool`` ``[N, context + 1]`` (the
    target's continuations, see :func:`continuations`). ``on_step(n)`` runs after the n-th step.
    With ``state_path``, the training state (weights, optimizer, step, ``settings``) is saved there
    every ``checkpoint_every`` steps and after the last one (the caller deletes it once the draft is
    written); ``resume`` is such a state, as :func:`saved_state` loads and checks it, to go on from."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    from .pair import _atomic_torch_save, _batch, _lr_at, new_llama, optimizer_step

    torch.manual_seed(seed * 100 + 3)
    if init is not None:
        draft = init
    else:
        draft = new_llama(size.llama_config(vocab_size, context, **special_ids))
    decay = [p for p in draft.parameters() if p.ndim >= 2]
    no_decay = [p for p in draft.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), foreach=False)
    warmup = max(1, steps // 20)
    n_gen = _generated_rows(batch_size, generated) if mode is not None else 0
    if n_gen and (pool is None or pool.shape[1] != context + 1):
        raise InvalidArgumentError(f"generated > 0 needs a pool of target continuations [N, {context + 1}]")
    earlier = saved_seconds(resume)  # (read before _resume empties the dict)
    first = 0 if resume is None else _resume(resume, draft, opt, steps, progress, state_path, what)
    t_start = time.perf_counter()
    draft.train()
    target.eval()
    history = []
    with tqdm(total=steps, initial=first, desc=desc, unit="step", dynamic_ncols=True, **bar_options(progress)) as bar:
        for step in range(first, steps):
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, steps, lr, warmup)
            x = _batch(train_ids, step, seed, 3, batch_size, context)
            if n_gen:
                g = torch.Generator().manual_seed((seed * 1_000_003 + 31 * step + 5) % (2**63))
                x = torch.cat([x[:batch_size - n_gen], pool[torch.randint(0, len(pool), (n_gen,), generator=g)]])
            inp = x[:, :-1]
            d_logits = draft(input_ids=inp).logits
            if mode is None:
                loss = F.cross_entropy(d_logits.reshape(-1, d_logits.shape[-1]), x[:, 1:].reshape(-1))
                post = {"ce": float(loss.detach())}
            else:
                with torch.no_grad():
                    t_logits = target(input_ids=inp).logits
                loss, kl, tv = _losses(t_logits, d_logits, mode)
                post = {"kl": float(kl.detach()), "tv": float(tv.detach())}
            optimizer_step(draft, opt, loss, lambda: f"draft training diverged at step {step}; lower --lr")
            bar.set_postfix({k: f"{v:.3f}" for k, v in post.items()}, refresh=False)  # update() draws, at its own pace
            bar.update(1)
            history.append(post)
            if state_path is not None and checkpoint_every and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                # Every batch is a function of (seed, step) and nothing else draws from an RNG, so a
                # resumed run computes the same steps as an uninterrupted one (bit for bit on one machine).
                # The last step's state too: a run stopped in what follows (the measurements, a
                # --baseline draft: minutes on a large target) then does not train again.
                _atomic_torch_save({"settings": settings, "step": step + 1, "model": draft.state_dict(),
                                    "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                                    "elapsed": earlier + time.perf_counter() - t_start}, state_path)
            if on_step is not None:
                on_step(step + 1)
    draft.eval()
    return draft


def _resume(state: dict, draft, opt, steps: int, progress: bool, where: Path | None, what: str) -> int:
    """Load a saved training state into ``draft`` and ``opt``; returns the step to go on from. The
    dict is emptied (the caller's reference no longer holds a copy of the weights and moments)."""
    from .pair import restore_training

    restore_training(state, draft, opt)
    step = int(state["step"])
    state.clear()
    if progress:
        print(f"edgespec: resuming {what} at step {step}/{steps} from {where}", file=sys.stderr)
    return step


def saved_seconds(state: dict | None) -> float:
    """The training seconds of the interrupted runs a saved state holds (0: none, or a state saved
    before it counted them)."""
    seconds = state.get("elapsed", 0.0) if state is not None else 0.0  # (the key train-pair's states use)
    return float(seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0 else 0.0


def saved_state(state_path: Path, settings: dict, what: str = "the distillation") -> dict | None:
    """The training state train_draft saved at ``state_path`` (None: none), checked to have been
    saved with ``settings``: another run's state is an error that names what differs."""
    import torch

    if not state_path.is_file():
        return None
    try:
        state = torch.load(state_path, weights_only=True)  # tensors and plain containers only: no code runs
        saved = state["settings"]
        if not isinstance(saved, dict):
            raise TypeError(f"settings are a {type(saved).__name__}")
    except Exception as exc:  # damaged (a crash mid-write leaves the previous state: the write is atomic)
        raise TrainingError(f"cannot read the saved state of {what} {state_path} ({exc}); delete it to start "
                            "over") from None
    if saved != settings:
        changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise InvalidArgumentError(
            f"{state_path} holds {what}, interrupted, with other settings ({', '.join(changed)}: "
            + "; ".join(f"{k} {saved.get(k)!r} there, {settings.get(k)!r} now" for k in changed[:3])
            + "); run it with its settings to resume it, or delete that file to start this one over")
    return state


def _check_training_args(mode, steps, batch_size, eval_windows, pool_size, seed, lr, generated) -> None:
    from .pair import _check_int, _check_seed

    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    for name, v in (("steps", steps), ("batch_size", batch_size), ("eval_windows", eval_windows),
                    ("pool_size", pool_size)):
        _check_int(name, v)
    _check_seed(seed)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise InvalidArgumentError(f"lr (CLI --lr) must be a finite positive number; got {lr!r}")
    if isinstance(generated, bool) or not isinstance(generated, (int, float)) or not 0 <= generated <= 1:
        raise InvalidArgumentError(f"generated (CLI --generated) must be a fraction in [0, 1]; got {generated!r}")
    if 0 < generated and _generated_rows(batch_size, generated) == 0:
        raise InvalidArgumentError(f"generated (CLI --generated) {generated:g} of a batch of {batch_size} rows is no row; "
                                   f"give at least {1 / batch_size:.3g} (one row) or a larger batch_size (--batch-size)")


def _special_ids(tok, config) -> dict[str, int | None]:
    # the tokenizer's special ids, else the model config's (a tokenizer.json alone declares none)
    special = {}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tok, k)
        v = getattr(config, k, None) if v is None else v
        special[k] = int(v) if isinstance(v, int) and v >= 0 else None
    if special["pad_token_id"] is None:
        special["pad_token_id"] = special["eos_token_id"] if special["eos_token_id"] is not None else 0
    return special


def _write_draft(draft, report: dict, target_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """The draft checkpoint, the target's tokenizer files and distill.json, swapped into ``out_dir`` whole."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        draft.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copyfile(target_dir / name, tmp / name)
        write_json(tmp / "distill.json", report)
        usual_permissions(tmp, recursive=True)  # safetensors writes the weights 0600
        swap_into_place(tmp, out_dir, overwrite, "distill.json", "a distilled draft", owned=DRAFT_FILES)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def distill(target: os.PathLike | str, out: os.PathLike | str, *, size: str | None = None, layers: int | None = None,
            hidden: int | None = None, heads: int | None = None, intermediate: int | None = None,
            corpus: Sequence[os.PathLike | str] | None = None, steps: int = 300, batch_size: int = 16,
            context: int | None = None, lr: float = 3e-3, mode: str = "mix", generated: float = 0.0,
            pool_size: int = 512, init: os.PathLike | str | None = None, baseline: bool = False,
            eval_windows: int = 64, seed: int = 0, overwrite: bool = False, progress: bool = True,
            checkpoint_every: int = 50) -> dict:
    """Distil a draft from ``target`` into ``out`` (an HF checkpoint with the target's tokenizer) and
    return the report (also written to ``out/distill.json``). ``generated`` is the fraction of each
    batch taken from a pool of ``pool_size`` continuations the target writes of corpus prefixes, half
    greedy, half sampled at T=1. ``baseline=True`` also trains a draft of the same size on the corpus
    alone, with the same steps and windows, and reports its alpha. Alpha is reported on held-out
    corpus windows and on the target's own continuations of held-out prefixes (what decoding sees).
    ``init`` continues a draft checkpoint in its own shape; ``layers`` above its count grows it first
    (:func:`grow_layers`). Every ``checkpoint_every`` steps (0: never) the training state is saved
    beside ``out`` (``.<name>.distill-state.pt``, and the baseline's ``.<name>.distill-baseline-state.pt``);
    the same call run again after an interruption resumes from it, and it is deleted once the draft is
    written."""
    from .corpus import encode_docs, load_documents
    from .pair import _check_int, heldout_windows, new_llama, validation_loss

    t0 = time.perf_counter()
    # (absolute and normalised: `--out .` has no name to put the temporary folder and the state beside)
    target_dir, out_dir = Path(target).expanduser(), Path(os.path.abspath(Path(out).expanduser()))
    _check_training_args(mode, steps, batch_size, eval_windows, pool_size, seed, lr, generated)
    check_output_folder(out_dir, overwrite, "distill.json", "a distilled draft", owned=DRAFT_FILES)
    check_writable(out_dir)
    try:
        if out_dir.resolve().is_relative_to(target_dir.resolve()):
            raise OutputExistsError(f"output folder {out_dir} lies inside the target folder {target_dir}; write elsewhere")
    except OSError:
        pass
    check_hf_folder(target_dir, "target")  # before the seconds torch and transformers take to import
    init = Path(init).expanduser() if init is not None else None
    init_type = check_hf_folder(init, "init draft") if init is not None else None
    c = load_documents(corpus)  # a missing or binary file is reported before the models load
    import torch

    from .export.onnx_export import load_torch_model_at

    if init is None:
        draft_size = resolve_size(size, layers, hidden, heads, intermediate)
    else:  # the checkpoint's shape, checked before the (larger) target is loaded
        if init_type != "llama":  # read as a Llama, another type's config gives Llama defaults (a 7 B model)
            raise InvalidArgumentError(f"--init {init} holds a {init_type!r} model; distill trains Llama drafts, so "
                                       "--init takes a Llama draft (one made by `edgespec distill`): drop --init to "
                                       "train a new draft")
        init_model = load_torch_model_at(init, seq2seq=False)
        init_layers = init_model.config.num_hidden_layers
        draft_size = _init_shape(init_model.config, size, layers, hidden, heads, intermediate)
    tmodel, tok = load_target(target_dir)
    vocab = int(tmodel.config.vocab_size)
    if len(tok) > vocab:
        raise CheckpointError(f"the target's tokenizer has {len(tok)} tokens but its model only {vocab} logits; "
                              "the target folder is inconsistent")
    max_pos = getattr(tmodel.config, "max_position_embeddings", None) or 256
    ctx = min(256, max_pos) if context is None else context
    _check_int("context", ctx, 2)
    if ctx > max_pos:
        raise InvalidArgumentError(f"context {ctx} exceeds the target's {max_pos} positions; lower --context")
    if init is None:
        init_model = None
    else:
        if _vocab(init_model) != vocab:  # the losses compare the two distributions row by row
            raise InvalidArgumentError(f"the --init draft has {_vocab(init_model)} output rows but the target {vocab}; "
                                       "distillation needs the target's rows: drop --init to train a new draft")
        if draft_size.layers > init_model.config.num_hidden_layers:
            torch.manual_seed(seed * 100 + 3)
            init_model = grow_layers(init_model, draft_size.layers)

    special = _special_ids(tok, tmodel.config)
    backend = tok.backend_tokenizer
    train_ids = torch.from_numpy(encode_docs(backend, c.train_docs, bos_id=special["bos_token_id"],
                                             eos_id=special["eos_token_id"], progress=progress, desc="tokenize train"))
    held_ids = torch.from_numpy(encode_docs(backend, c.heldout_docs, bos_id=special["bos_token_id"],
                                            eos_id=special["eos_token_id"], progress=progress, desc="tokenize held-out"))
    if len(train_ids) < 4 * (ctx + 1):
        raise TrainingError(f"the corpus has {len(train_ids)} training tokens, too few for context {ctx} "
                            f"(needs {4 * (ctx + 1)}); pass more text with --corpus or lower --context")
    if len(held_ids) < ctx:
        raise TrainingError(f"the held-out part of the corpus has {len(held_ids)} tokens, less than one context of {ctx}; "
                            "pass more (or larger) files with --corpus or lower --context")
    windows = heldout_windows(held_ids, ctx, eval_windows)
    # The target's own text: prefixes of a quarter context, continued to the full context (section 3.3:
    # alpha is an expectation over the prefixes decoding visits, which are the target's output).
    plen = prefix_length(ctx)
    n_eval = min(32, len(windows))
    # even windows for T=0, odd ones for T=1 (with a single window, it serves both)
    on_target = {t: continuations(tmodel, windows[k % n_eval:n_eval:2, :plen], ctx, (t,), seed + 1, progress=progress,
                                  desc=f"held-out continuations T={t:g}") for k, t in enumerate((0.0, 1.0))}

    def alphas(m):
        return {f"T{t:g}": round(measure_alpha(tmodel, m, windows, t), 4) for t in (0.0, 1.0)}

    def alphas_on_target(m):
        return {f"T{t:g}": round(measure_alpha(tmodel, m, on_target[t], t, start=plen - 1), 4) for t in (0.0, 1.0)}

    report: dict = {"target": str(target_dir.resolve()), "mode": mode, "steps": steps, "batch_size": batch_size, "context": ctx,
                    "lr": lr, "generated_fraction": generated,
                    "generated_rows_per_batch": _generated_rows(batch_size, generated), "pool_size": pool_size if generated else 0, "seed": seed,
                    "tokens_per_run": steps * batch_size * ctx, "corpus": c.description,
                    **({} if init is None else {"init": str(init.resolve()), "init_layers": init_layers}),
                    "draft_config": {"hidden": draft_size.hidden, "layers": draft_size.layers, "heads": draft_size.heads,
                                     "intermediate": draft_size.intermediate,
                                     **({} if draft_size.kv_heads is None else {"kv_heads": draft_size.kv_heads})}}
    report["target_val_loss"] = round(validation_loss(tmodel, windows), 4)
    state_path = out_dir.with_name(f".{out_dir.name}.distill-state.pt")
    settings = {k: report.get(k) for k in ("target", "mode", "steps", "batch_size", "context", "lr", "generated_fraction",
                                           "pool_size", "seed", "corpus", "init", "init_layers", "draft_config",
                                           "target_val_loss")}  # (the target's loss: other weights at the same path)
    resume = saved_state(state_path, settings)  # (loaded once; another run's state is refused before the minutes below)
    base_path = out_dir.with_name(f".{out_dir.name}.distill-baseline-state.pt")  # --baseline's draft, likewise
    # (checked now, read again before the baseline: not held through the distillation)
    earlier = saved_seconds(resume) + saved_seconds(saved_state(base_path, settings, "the baseline draft's training")
                                                    if baseline else None)
    common = dict(vocab_size=vocab, context=ctx, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                  special_ids=special, progress=progress)
    if init_model is None:
        torch.manual_seed(seed * 100 + 3)
        # The target's positions, not the training window: a draft with fewer positions than its
        # target would end speculation (plain decoding) past them. Rotary positions extrapolate;
        # a draft past its training length can only be kept less often, never change the output.
        before = new_llama(draft_size.llama_config(vocab, max_pos, **special))
    else:
        before = init_model
    n_draft, n_target = sum(p.numel() for p in before.parameters()), sum(p.numel() for p in tmodel.parameters())
    if n_draft * 2 >= n_target:
        # a draft step costs about its share of the target's weights (c), and Theorem 3.8's speedup
        # (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) is small once c is not far below 1
        warn(f"the draft has {n_draft / 1e6:.2f}M parameters, {n_draft / n_target:.0%} of the target's "
             f"{n_target / 1e6:.2f}M: each draft token will cost a large share of a target step, or more, and gain little or "
             "nothing; " + ("start from a smaller --init checkpoint (its shape is kept; only --layers may grow it)"
                            if init is not None else
                            "make it smaller with --hidden/--layers (--size tiny is the smallest named size)"))
    report["alpha_before"] = alphas(before)
    report["alpha_on_target_before"] = alphas_on_target(before)
    pool = None
    if generated > 0:
        pool = target_pool(tmodel, train_ids, pool_size, ctx, seed, progress=progress)
    import copy

    start = copy.deepcopy(before)
    with _saved_on_interrupt(state_path, "the distillation"):
        draft = train_draft(tmodel, train_ids, draft_size, mode=mode, generated=generated, pool=pool, init=start,
                            desc="distill", state_path=state_path, checkpoint_every=checkpoint_every,
                            settings=settings, resume=resume, **common)
    report["draft_params"] = sum(p.numel() for p in draft.parameters())
    report["alpha_after"] = alphas(draft)
    report["alpha_on_target_after"] = alphas_on_target(draft)
    report["draft_val_loss"] = round(validation_loss(draft, windows), 4)
    if baseline:
        what = "the baseline draft's training"
        with _saved_on_interrupt(base_path, what):
            base = train_draft(tmodel, train_ids, draft_size, mode=None, init=copy.deepcopy(before),
                               desc="baseline (corpus only)", state_path=base_path, checkpoint_every=checkpoint_every,
                               settings=settings, resume=saved_state(base_path, settings, what), what=what, **common)
        report["baseline"] = {"alpha": alphas(base), "alpha_on_target": alphas_on_target(base),
                              "val_loss": round(validation_loss(base, windows), 4)}
        report["alpha_gain_over_baseline"] = {k: round(report["alpha_after"][k] - report["baseline"]["alpha"][k], 4)
                                              for k in report["alpha_after"]}
    report["seconds"] = round(time.perf_counter() - t0 + earlier, 2)
    if earlier:  # an interrupted run's training, resumed here: its seconds are in "seconds" too
        report["seconds_in_earlier_runs"] = round(earlier, 2)

    draft.generation_config.pad_token_id = special["pad_token_id"]
    _write_draft(draft, report, target_dir, out_dir, overwrite)
    state_path.unlink(missing_ok=True)
    base_path.unlink(missing_ok=True)
    return report


@contextlib.contextmanager
def _saved_on_interrupt(state_path: Path, what: str):
    """On Ctrl-C, say where the training state is (when one was saved) and how to resume."""
    try:
        yield
    except KeyboardInterrupt:
        if state_path.is_file():
            print(f"edgespec: {what} so far is saved in {state_path}; run the same command again to resume "
                  "from it (delete that file to start over)", file=sys.stderr)
        raise


# ----------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, required=True, help="Hugging Face target folder (safetensors + tokenizer.json)")
    parser.add_argument("--out", type=folder, required=True, help="output folder for the draft checkpoint")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="draft size (default small, or the --init checkpoint's); --layers/--hidden/--heads/"
                             "--intermediate override it")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--corpus", nargs="+", metavar="FILE", type=Path, default=None,
                        help="text files or folders (default: this Python's standard library sources)")
    parser.add_argument("--steps", type=at_least(1), default=300, help="training steps (default 300)")
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="windows per step (default 16)")
    parser.add_argument("--context", type=int, default=None, help="window length (default: min(256, target positions))")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 0.003)")
    parser.add_argument("--mode", choices=MODES, default="mix",
                        help="loss: tv = total variation (1 - beta), kl = forward KL(p||q), mix = both (default)")
    parser.add_argument("--generated", type=float, default=0.0,
                        help="fraction of each batch taken from the target's own continuations of corpus prefixes, "
                             "half greedy, half sampled (on-policy distillation; default 0)")
    parser.add_argument("--pool-size", type=at_least(1), default=None,
                        help="how many target continuations --generated draws from (default 512)")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this draft checkpoint instead of random weights (its shape; --layers N "
                             "appends layers that start as the identity, so the draft starts where the checkpoint is)")
    parser.add_argument("--baseline", action="store_true",
                        help="also train a same-size draft on the corpus alone (same budget) and compare")
    parser.add_argument("--eval-windows", type=at_least(1), default=64,
                        help="held-out windows alpha and the validation loss are measured on (default 64)")
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--checkpoint-every", type=at_least(0), default=50, metavar="N",
                        help="save the training state every N steps beside --out (default 50; 0: never); the same "
                             "command run again after an interruption resumes from it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier distilled draft at --out (only one that holds nothing else)")
    parser.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true", help="no progress bars on stderr")


def run(args: argparse.Namespace) -> int:
    if args.pool_size is not None and not args.generated:
        raise InvalidArgumentError("--pool-size sizes the target's continuations that --generated mixes in; "
                                   "add --generated FRACTION or drop --pool-size")
    r = distill(args.target, args.out, size=args.size, layers=args.layers, hidden=args.hidden, heads=args.heads,
                intermediate=args.intermediate, corpus=args.corpus, steps=args.steps, batch_size=args.batch_size,
                context=args.context, lr=args.lr, mode=args.mode, generated=args.generated,
                pool_size=512 if args.pool_size is None else args.pool_size, init=args.init,
                baseline=args.baseline, eval_windows=args.eval_windows, seed=args.seed, overwrite=args.overwrite,
                progress=not args.no_progress, checkpoint_every=args.checkpoint_every)
    print(f"draft: {args.out} ({r['draft_params'] / 1e6:.2f}M params, {r['steps']} steps, mode {r['mode']})")
    print("  alpha on held-out corpus windows / on the target's own continuations of held-out prefixes:")
    for label in ("before", "after"):
        a, o = r[f"alpha_{label}"], r[f"alpha_on_target_{label}"]
        print(f"  {label:>8}: T=0 {a['T0']:.3f} / {o['T0']:.3f}  T=1 {a['T1']:.3f} / {o['T1']:.3f}")
    if "baseline" in r:
        b, o = r["baseline"]["alpha"], r["baseline"]["alpha_on_target"]
        print(f"  baseline (corpus only, same budget): T=0 {b['T0']:.3f} / {o['T0']:.3f}  T=1 {b['T1']:.3f} / {o['T1']:.3f}")
        g = r["alpha_gain_over_baseline"]
        print(f"  distilled - baseline: T=0 {g['T0']:+.3f}  T=1 {g['T1']:+.3f}")
    return 0
