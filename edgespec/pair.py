"""``edgespec train-pair``: a seeded recipe (deterministic kernels; bit-identical on one machine,
torch version and thread count) for a Llama target and a Llama draft that share
one byte-level BPE tokenizer, trained on a corpus every machine has offline (the Python standard
library sources of the running interpreter) or on the user's own text files.

Layout of a finished pair folder::

    <pair>/target/   config.json, generation_config.json, model.safetensors, tokenizer.json, ...
    <pair>/draft/    the same files
    <pair>/pair.json recipe, seed, corpus description, steps, validation losses, alpha, time taken

The folder only ever appears complete: everything is built in ``<pair>.work`` (which also holds
the resumable training state) and renamed into place after pair.json is written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from . import contract
from .corpus import BOS, EOS, MIN_VOCAB, PAD, bar_options, load_corpus, load_documents  # noqa: F401  (load_corpus re-exported)
from .errors import CheckpointError, EdgeSpecError, InvalidArgumentError, OutputExistsError, TrainingError
from .cli import _Terminated, at_least, folder
from .report import write_json
from .outputs import PAIR_FILES, check_output_folder, check_swap, check_writable, swap_into_place, usual_permissions

FORMAT_VERSION = 1


# ----------------------------------------------------------------------------- presets

def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}; got {value!r}")


SEED_LIMIT = 1 << 32  # seeds derived from it (seed * 100 + k) must fit torch.manual_seed's 64 bits


def _check_seed(seed) -> None:
    """A training seed (a seed near 2**58 made torch.manual_seed raise a bare ValueError after the
    tokenizer had trained: a review's find)."""
    _check_int("seed", seed, 0)
    if seed >= SEED_LIMIT:
        raise InvalidArgumentError(f"seed (CLI --seed) must be below 2**32 = {SEED_LIMIT}; got {seed}")


@dataclass(frozen=True)
class ModelSize:
    """The shape of one Llama model. ``kv_heads=None`` means as many as ``heads`` (no GQA)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    kv_heads: int | None = None

    def validate(self, role: str) -> None:
        for name in ("hidden", "layers", "heads", "intermediate"):
            _check_int(f"{role} {name}", getattr(self, name))
        if self.hidden % self.heads:
            # head counts that divide hidden into an even head size (rotary embeddings, below)
            fits = [h for h in range(1, self.hidden + 1) if self.hidden % h == 0 and (self.hidden // h) % 2 == 0][:12]
            raise InvalidArgumentError(
                f"{role}: {self.heads} attention heads do not divide hidden size {self.hidden}; " +
                (f"pick heads among {fits}" if fits else "pick an even hidden size (each head's size must be even)"))
        if (self.hidden // self.heads) % 2:
            raise InvalidArgumentError(
                f"{role}: head size hidden/heads = {self.hidden // self.heads} is odd, but rotary embeddings need an even head size; "
                "change hidden or heads"
            )
        kv = self.heads if self.kv_heads is None else self.kv_heads
        _check_int(f"{role} kv_heads", kv)
        if self.heads % kv:
            raise InvalidArgumentError(f"{role}: kv_heads {kv} must divide heads {self.heads}")

    def llama_config(self, vocab_size: int, context: int, **extra):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads if self.kv_heads is None else self.kv_heads,
            max_position_embeddings=context, rope_theta=10000.0, rms_norm_eps=1e-5,
            attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.02,
            **extra,
        )


@dataclass(frozen=True)
class PairPreset:
    """Everything the recipe needs besides the corpus and the seed."""

    name: str
    vocab_size: int
    context: int
    target: ModelSize
    draft: ModelSize
    target_steps: int
    draft_steps: int
    batch_size: int
    target_lr: float
    draft_lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    checkpoint_every: int = 50  # steps between resumable training-state saves
    eval_windows: int = 64  # held-out windows of `context` tokens for validation loss and alpha
    # After its corpus steps, the draft is distilled on the target for this many steps (0: not at
    # all): see _distill_draft. Alpha is a property of the pair, not of either model's fit to the
    # corpus (section 3.1): a draft that imitates the target is kept more often than one that
    # imitates the text both were trained on.
    draft_distill_steps: int = 0
    draft_distill_pool: int = 256  # target continuations the distillation batches draw from

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ "):
            raise InvalidArgumentError(f"preset name must be a non-empty word without slashes or spaces; got {self.name!r}")
        _check_int("vocab_size", self.vocab_size, MIN_VOCAB)
        _check_int("context", self.context, 2)
        for name in ("target_steps", "draft_steps", "batch_size", "checkpoint_every", "eval_windows"):
            _check_int(name, getattr(self, name))
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_int("draft_distill_steps", self.draft_distill_steps, 0)
        _check_int("draft_distill_pool", self.draft_distill_pool)
        for name in ("target_lr", "draft_lr", "weight_decay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and name != "weight_decay"):
                raise InvalidArgumentError(f"{name} must be a finite positive number; got {v!r}")
        self.target.validate("target")
        self.draft.validate("draft")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.draft_distill_steps:  # (the recipes from before distillation keep their identity)
            del d["draft_distill_steps"], d["draft_distill_pool"]
        return d

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:8]


PRESETS: dict[str, PairPreset] = {
    # For tests: trains in seconds on a small corpus.
    "tiny": PairPreset(
        name="tiny", vocab_size=320, context=32,
        target=ModelSize(hidden=32, layers=2, heads=2, intermediate=64),
        draft=ModelSize(hidden=16, layers=1, heads=1, intermediate=32),
        target_steps=24, draft_steps=24, batch_size=8, target_lr=3e-3, draft_lr=3e-3,
        warmup_steps=4, checkpoint_every=5, eval_windows=8,
    ),
    # For the demo: both models in a few minutes on 2 CPU cores.
    "quick": PairPreset(
        name="quick", vocab_size=2048, context=256,
        target=ModelSize(hidden=256, layers=4, heads=4, intermediate=688),
        draft=ModelSize(hidden=96, layers=1, heads=2, intermediate=256),
        target_steps=280, draft_steps=300, batch_size=16, target_lr=2.5e-3, draft_lr=3e-3,
        warmup_steps=20, checkpoint_every=40, eval_windows=64, draft_distill_steps=150,
    ),
    # For published benchmarks: a ~23M target (one target step then costs far more than the
    # draft's fixed per-call overhead) with the quick draft's size; about 40 min on 2 cores.
    "bench": PairPreset(
        name="bench", vocab_size=2048, context=256,
        target=ModelSize(hidden=512, layers=7, heads=8, intermediate=1376),
        draft=ModelSize(hidden=96, layers=1, heads=2, intermediate=256),
        target_steps=800, draft_steps=300, batch_size=16, target_lr=1.5e-3, draft_lr=3e-3,
        warmup_steps=40, checkpoint_every=50, eval_windows=64,
    ),
}


def get_preset(preset: str | PairPreset) -> PairPreset:
    if isinstance(preset, PairPreset):
        return preset
    try:
        return PRESETS[preset]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}") from None


# ----------------------------------------------------------------------------- folders

def refuse_bundle_as_pair(folder: Path, flag: str = "--pair") -> None:
    """A script that takes a trained pair (its target/ and draft/ checkpoints) was given an exported
    bundle, whose target/ also holds a config.json: say so, before anything is exported from it."""
    if (Path(folder) / contract.MANIFEST_NAME).is_file():
        hint = (f" (this bundle's pair is {str(Path(folder).parent)!r})"
                if (Path(folder).parent / "pair.json").is_file() else "")
        raise InvalidArgumentError(f"{flag} {str(folder)!r} is an exported bundle, not a trained pair; pass the pair's "
                                   f"folder, which holds target/ and draft/ checkpoints{hint}")


def cache_root() -> Path:
    """``$EDGESPEC_CACHE``, else ``$XDG_CACHE_HOME/edgespec``, else ``~/.cache/edgespec``."""
    if os.environ.get("EDGESPEC_CACHE"):
        return Path(os.environ["EDGESPEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "edgespec"
    return Path.home() / ".cache" / "edgespec"


def _pair_dir_name(preset: PairPreset, corpus_sha: str, seed: int) -> str:
    name = preset.name
    if PRESETS.get(preset.name) != preset:  # a custom preset: never collide with a built-in one
        name += "-custom" + preset.fingerprint()
    elif preset.draft_distill_steps:  # (not the folder of the same preset's pair from before distillation)
        name += "-distilled"
    name += f"-{corpus_sha[:12]}"
    if seed:
        name += f"-seed{seed}"
    return name


def default_pair_dir(preset: str | PairPreset = "quick", corpus: Sequence[os.PathLike | str] | None = None,
                     seed: int = 0) -> Path:
    """Where ``train_pair`` caches this pair: ``<cache>/pairs/<preset>[-distilled]-<corpus hash>``.

    Reads the corpus (to hash it); a complete pair is there when ``pair.json`` is.
    """
    p = get_preset(preset)
    return cache_root() / "pairs" / _pair_dir_name(p, load_documents(corpus).sha256, seed)


def is_complete(pair_dir: Path) -> bool:
    return (Path(pair_dir) / "pair.json").is_file()


def _damage(pair_dir: Path) -> str | None:
    """What is missing or unreadable in a finished pair's checkpoints (None: nothing), before it is
    reused: a deleted draft/ or a truncated model.safetensors was reused, and failed only later."""
    from .export.checkpoint import check_safetensors

    for role in ("target", "draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (pair_dir / role / name).is_file():
                return f"{role}/{name} is missing"
        try:
            check_safetensors([pair_dir / role / "model.safetensors"], role)
        except CheckpointError:
            return f"{role}/model.safetensors is truncated or corrupt"
    return None


# ----------------------------------------------------------------------------- training

def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _batch(ids, step: int, seed: int, salt: int, batch_size: int, context: int):
    """The training windows of one step: a pure function of (seed, salt, step), so resuming is exact."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + salt * 7919 + step) % (2**63))
    starts = torch.randint(0, len(ids) - context - 1 + 1, (batch_size,), generator=g)
    return torch.stack([ids[s:s + context + 1] for s in starts.tolist()])


def heldout_windows(ids, context: int, max_windows: int):
    """Non-overlapping held-out windows of ``context`` tokens (at most ``max_windows``, evenly spread)."""
    import torch

    n = len(ids) // context
    if n == 0:
        return ids.new_zeros((0, context))
    take = sorted({int(i * n / max_windows) for i in range(max_windows)}) if n > max_windows else range(n)
    return torch.stack([ids[i * context:(i + 1) * context] for i in take])


def validation_loss(model, windows, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over held-out windows."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x = windows[i:i + batch_size]
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    return total / max(1, count)


def new_llama(config):
    """A freshly initialised ``LlamaForCausalLM`` whose residual-branch output projections (``o_proj``,
    ``down_proj``) start at zero, so every layer starts as the identity. On these small budgets that
    makes a 4-layer model learn as fast per step as a 1-layer one (instead of idling on the unigram
    plateau); the global torch RNG must be seeded by the caller."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                param.zero_()
    return model


def _atomic_torch_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(model, hf_tok, folder: Path) -> None:
    """Write an HF checkpoint (safetensors only) into ``folder.tmp`` and rename it to ``folder``."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def restore_training(state: dict, model, opt) -> None:
    """Put a saved training state's weights, optimizer moments and torch RNG back (the states
    train-pair and `edgespec distill` save: "model", "optimizer", "rng", "step", "elapsed" in seconds)."""
    import torch

    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])


def optimizer_step(model, opt, loss, diverged) -> None:
    """One clipped optimizer step; a non-finite loss stops training with the message ``diverged()``
    (a callable, so the message is only formatted when it is needed)."""
    import torch

    if not torch.isfinite(loss):
        raise TrainingError(diverged())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
    opt.step()


def _train_one(role: str, size: ModelSize, preset: PairPreset, steps: int, lr: float, train_ids, val_windows,
               vocab_size: int, special_ids: dict, seed: int, work: Path, hf_tok, progress: bool,
               callback: Callable[[str, int], None] | None) -> dict:
    """Train one model (resuming from ``work/<role>.state.pt``) and save ``work/<role>``."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm
    final = work / role
    info_path = work / f"{role}.json"
    if final.is_dir() and info_path.is_file():  # finished in an earlier (interrupted) run
        return json.loads(info_path.read_text())

    salt = {"target": 1, "draft": 2, "draft-corpus": 2}[role]
    config = size.llama_config(vocab_size, preset.context, **special_ids)

    def fresh():
        torch.manual_seed(seed * 100 + salt)
        m = new_llama(config)
        m.generation_config.pad_token_id = special_ids["pad_token_id"]
        decay = [p for p in m.parameters() if p.ndim >= 2]
        no_decay = [p for p in m.parameters() if p.ndim < 2]
        o = torch.optim.AdamW([{"params": decay, "weight_decay": preset.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), foreach=False)
        return m, o

    model, opt = fresh()
    state_path = work / f"{role}.state.pt"
    step, elapsed, last_loss = 0, 0.0, float("nan")
    if state_path.is_file():
        try:
            state = torch.load(state_path, weights_only=True)
            restore_training(state, model, opt)
            step, elapsed, last_loss = int(state["step"]), float(state["elapsed"]), float(state["loss"])
            if progress:
                print(f"edgespec: resuming {role} training at step {step}/{steps}", file=sys.stderr)
        except Exception as exc:  # a corrupt state file: start this model over
            print(f"edgespec: ignoring unreadable training state {state_path} ({exc}); training {role} from the start",
                  file=sys.stderr)
            model, opt = fresh()
            step, elapsed, last_loss = 0, 0.0, float("nan")
    n_params = sum(p.numel() for p in model.parameters())

    def save_state() -> None:
        _atomic_torch_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                            "step": step, "elapsed": elapsed, "loss": last_loss}, state_path)

    model.train()
    t0 = time.perf_counter()
    with tqdm(total=steps, initial=step, desc=f"train {role.replace('-corpus', ' on the corpus')} ({n_params / 1e6:.2f}M params)", unit="step",
              dynamic_ncols=True, **bar_options(progress)) as bar:
        while step < steps:
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, steps, lr, preset.warmup_steps)
            x = _batch(train_ids, step, seed, salt, preset.batch_size, preset.context)
            logits = model(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            optimizer_step(model, opt, loss, lambda: f"{role} training diverged (loss {float(loss)}) at step "
                                                     f"{step}; lower the learning rate")
            step += 1
            last_loss = float(loss.detach())
            bar.set_postfix(loss=f"{last_loss:.3f}", refresh=False)  # update() draws, at its own pace
            bar.update(1)
            if step % preset.checkpoint_every == 0 and step < steps:
                elapsed_now = elapsed + time.perf_counter() - t0
                elapsed, t0 = elapsed_now, time.perf_counter()
                save_state()
            if callback is not None:
                callback(role, step)
    elapsed += time.perf_counter() - t0
    val = validation_loss(model, val_windows)
    model.eval()
    save_checkpoint(model, hf_tok, final)
    info = {"params": n_params, "config": {"hidden": size.hidden, "layers": size.layers, "heads": size.heads,
                                           "kv_heads": size.kv_heads or size.heads, "intermediate": size.intermediate},
            "steps": steps, "batch_size": preset.batch_size, "tokens_seen": steps * preset.batch_size * preset.context,
            "peak_lr": lr, "final_train_loss": last_loss, "val_loss": val, "train_seconds": round(elapsed, 2)}
    write_json(info_path, info)
    state_path.unlink(missing_ok=True)
    return info


# Distillation of the pair's draft: the fraction of each batch taken from the target's own
# continuations (half greedy, half sampled at T=1: the text decoding verifies, repetition loops
# included, which corpus windows never show), and the loss (forward KL + total variation; 1 - TV
# is the acceptance rate beta of section 3.1).
DISTILL_GENERATED = 0.5
DISTILL_MODE = "mix"


def _distill_draft(p: PairPreset, target, corpus_info: dict, train_ids, val_windows, special_ids: dict, seed: int,
                   work: Path, hf_tok, progress: bool, callback: Callable[[str, int], None] | None) -> dict:
    """Distil the corpus-trained draft (``work/draft-corpus``) on ``target`` into ``work/draft``,
    resuming an interrupted distillation from its saved state (``work/draft-distill.state.pt``)."""
    final, info_path = work / "draft", work / "draft.json"
    if final.is_dir() and info_path.is_file():  # finished in an earlier (interrupted) run
        return json.loads(info_path.read_text())
    from transformers import LlamaForCausalLM

    from .distill import saved_seconds, saved_state, target_pool, train_draft

    t0 = time.perf_counter()
    state = work / "draft-distill.state.pt"  # (the work folder is this recipe's, seed and corpus included)
    settings = {"steps": p.draft_distill_steps, "pool": p.draft_distill_pool, "seed": seed}
    resume = saved_state(state, settings)
    earlier = saved_seconds(resume)
    draft = LlamaForCausalLM.from_pretrained(work / "draft-corpus", use_safetensors=True)
    pool = target_pool(target, train_ids, p.draft_distill_pool, p.context, seed, progress=progress)  # [pool, context + 1]
    draft = train_draft(target, train_ids, p.draft, vocab_size=int(target.config.vocab_size), context=p.context,
                        steps=p.draft_distill_steps, batch_size=p.batch_size, lr=p.draft_lr, mode=DISTILL_MODE,
                        seed=seed, special_ids=special_ids, generated=DISTILL_GENERATED, pool=pool, init=draft,
                        progress=progress, desc="distill draft on the target",
                        on_step=None if callback is None else (lambda step: callback("draft", step)),
                        state_path=state, checkpoint_every=p.checkpoint_every, settings=settings, resume=resume)
    seconds = time.perf_counter() - t0 + earlier  # (an interrupted run's training seconds included)
    val = validation_loss(draft, val_windows)
    save_checkpoint(draft, hf_tok, final)
    info = {**corpus_info, "val_loss": val, "train_seconds": round(corpus_info["train_seconds"] + seconds, 2),
            "distilled": {"steps": p.draft_distill_steps, "mode": DISTILL_MODE, "generated_fraction": DISTILL_GENERATED,
                          "pool_size": p.draft_distill_pool, "peak_lr": p.draft_lr,
                          "val_loss_before": corpus_info["val_loss"], "seconds": round(seconds, 2)}}
    write_json(info_path, info)
    state.unlink(missing_ok=True)
    return info


@contextlib.contextmanager
def _lock(work: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fh = open(work / ".lock", "w")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise TrainingError(
                f"another edgespec process is training into {work}; wait for it to finish "
                "(or, if no such process is running, delete that folder)"
            ) from None
        yield
    finally:
        fh.close()


def _identity(preset: PairPreset, seed: int, corpus_desc: dict) -> dict:
    return {"format": FORMAT_VERSION, "preset": preset.to_dict(), "seed": seed, "corpus_sha256": corpus_desc["sha256"]}


def train_pair(preset: str | PairPreset = "quick", corpus: Sequence[os.PathLike | str] | None = None,
               out: os.PathLike | str | None = None, seed: int = 0, progress: bool = True, *,
               overwrite: bool = False, callback: Callable[[str, int], None] | None = None) -> Path:
    """Train (or reuse) a target/draft pair and return its folder.

    ``out=None`` caches the pair at :func:`default_pair_dir` and returns it at once when it is
    already complete. An explicit ``out`` holding a pair of the same recipe is reused likewise;
    anything else there is an error unless ``overwrite`` (which retrains). An interrupted run
    resumes from ``<out>.work``. ``callback(role, step)`` runs after every training step (tests use
    it to interrupt a run).
    """
    t_start = time.perf_counter()
    p = get_preset(preset)
    _check_seed(seed)
    c = load_documents(corpus)
    ident = _identity(p, seed, c.description)

    def reused(dest: Path, fix: str) -> bool:
        """A complete pair of this recipe is at dest (reuse it); one of another recipe is an error."""
        try:
            if not is_complete(dest):
                return False
        except OSError as exc:  # (an unreadable folder: a typed error, as check_output_folder gives)
            raise OutputExistsError(f"{dest} cannot be read ({exc.strerror or exc}); choose another folder") from None
        try:
            meta = json.loads((dest / "pair.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            meta = exc
        if not isinstance(meta, dict):
            raise OutputExistsError(f"{dest / 'pair.json'} is not a pair's manifest ({str(meta)[:80]}); {fix}")
        if meta.get("identity") != ident:
            raise OutputExistsError(f"{dest} holds a pair trained with a different recipe (preset, corpus or seed); {fix}")
        damage = _damage(dest)
        if damage:
            raise OutputExistsError(f"{dest} holds a damaged pair ({damage}); "
                                    + (f"delete it to retrain it, or retrain it there: edgespec train-pair --out "
                                       f"{shlex.quote(str(dest))} --overwrite (and the same --preset/--corpus/--seed)"
                                       if out is None else "pass --overwrite to retrain it"))
        if progress:
            print(f"edgespec: reusing the trained pair in {dest}", file=sys.stderr)
        return True

    if out is None:
        dest = (cache_root() / "pairs" / _pair_dir_name(p, c.sha256, seed)).absolute()
        if reused(dest, "delete it to retrain"):
            return dest
        if dest.exists():
            raise OutputExistsError(f"{dest} exists but is not a complete pair (no pair.json); delete it to retrain")
    else:
        dest = Path(out).expanduser()
        if dest.exists() and not dest.is_dir():
            raise OutputExistsError(f"--out {str(dest)!r} is a file; give a folder for the pair (a new one, or an "
                                    "earlier pair with --overwrite)")
        # the same command run again reuses its pair, as the cache does (scripts rerun it with --print-path)
        if not overwrite and dest.is_dir() and reused(dest, "choose another --out, or pass --overwrite to retrain it"):
            return dest.absolute()
        check_output_folder(dest, overwrite, "pair.json", "a trained pair", owned=PAIR_FILES)
    if out is not None:
        check_writable(dest)
    else:
        check_writable(dest, "pair folder in the cache", "set EDGESPEC_CACHE to a writable folder (or pass --out DIR)")
    dest = dest.absolute()
    work = dest.with_name(dest.name + ".work")
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _train_pair_locked(p, c, dest, work, ident, seed, progress, callback, t_start, overwrite,
                                  "delete it" if out is None else "pass --overwrite to discard it and train this one")
    except (KeyboardInterrupt, _Terminated):  # Ctrl-C or SIGTERM: the state is saved the same way
        if _has_saved_training(work):
            print(f"edgespec: training so far is saved in {work}; run the same command again to resume from it "
                  "(delete that folder to start over)", file=sys.stderr)
        raise
    except EdgeSpecError:
        # a bad input found before any training state was saved: leave nothing behind
        if created and work.is_dir() and not _has_saved_training(work):
            shutil.rmtree(work, ignore_errors=True)
        raise


def _has_saved_training(work: Path) -> bool:
    """The work folder holds training a rerun resumes from (a saved state or a finished model)."""
    return work.is_dir() and (any(work.glob("*.state.pt")) or any(work.glob("*/config.json")))


def _train_pair_locked(p: PairPreset, c, dest: Path, work: Path, ident: dict, seed: int, progress: bool,
                       callback, t_start: float, overwrite: bool = False, discard_fix: str = "delete it") -> Path:
    import numpy as np
    import torch

    with _lock(work):
        if _finished(work, ident):  # trained, then stopped while being moved into place: move it now
            if progress:
                print(f"edgespec: {work} holds this recipe's finished pair; moving it to {dest}", file=sys.stderr)
            return _move_into_place(work, dest, overwrite)
        ident_path = work / "identity.json"
        if ident_path.is_file():
            try:
                same = json.loads(ident_path.read_text()) == ident
            except ValueError:
                same = False
            if not same:
                if _has_saved_training(work) and not overwrite:  # (hours of another run: never discarded unasked)
                    raise OutputExistsError(
                        f"{work} holds the saved training of an interrupted run of another recipe (preset, corpus or "
                        f"seed); run that command again to resume it, or {discard_fix}")
                if progress:
                    print(f"edgespec: discarding stale work folder {work} (different recipe)", file=sys.stderr)
                for child in work.iterdir():
                    if child.name != ".lock":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
            elif progress:
                print(f"edgespec: resuming from {work}", file=sys.stderr)
        elif any(ch.name != ".lock" for ch in work.iterdir()):
            raise OutputExistsError(f"{work} exists and is not an edgespec work folder; delete or move it")
        write_json(ident_path, ident)

        torch_threads = torch.get_num_threads()
        with _deterministic():
            from tokenizers import Tokenizer

            from .corpus import encode_docs, hf_tokenizer, train_tokenizer

            tok_path = work / "tokenizer.json"
            if tok_path.is_file():
                tok = Tokenizer.from_file(str(tok_path))
            else:
                if progress:
                    print(f"edgespec: training a {p.vocab_size}-token byte-level BPE tokenizer on "
                          f"{c.description['train_files']} files ({c.description['train_bytes'] / 1e6:.1f} MB)", file=sys.stderr)
                # the line above is the progress: the tokenizers library's own bar leaves blank lines
                # behind on a terminal shared with our tqdm bars (and the training takes seconds)
                tok = train_tokenizer(c.train_docs, p.vocab_size)
                tmp = tok_path.with_name("tokenizer.json.tmp")
                tok.save(str(tmp))
                os.replace(tmp, tok_path)
            hf_tok = hf_tokenizer(tok, p.context)
            vocab = tok.get_vocab_size()
            bos, eos, pad = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD)
            train_ids = torch.from_numpy(encode_docs(tok, c.train_docs, bos_id=bos, eos_id=eos, progress=progress,
                                                     desc="tokenize train"))
            held_ids = torch.from_numpy(encode_docs(tok, c.heldout_docs, bos_id=bos, eos_id=eos, progress=progress,
                                                    desc="tokenize held-out"))
            if len(train_ids) < 4 * (p.context + 1):
                raise TrainingError(
                    f"the corpus is too small for preset {p.name!r}: {len(train_ids)} training tokens, but context "
                    f"{p.context} needs at least {4 * (p.context + 1)}; pass more text with --corpus"
                    + ("" if p.name == "tiny" else " or pick a smaller preset (tiny)")
                )
            if len(held_ids) < p.context:
                raise TrainingError(
                    f"the corpus is too small: its held-out part ({c.description['heldout_files']} file(s), {len(held_ids)} "
                    f"tokens) is shorter than one context of {p.context} tokens; pass more (or larger) files with --corpus"
                )
            val_windows = heldout_windows(held_ids, p.context, p.eval_windows)
            special = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
            infos = {}
            distilled = p.draft_distill_steps > 0
            for role, size, steps, lr in (("target", p.target, p.target_steps, p.target_lr),
                                          ("draft-corpus" if distilled else "draft", p.draft, p.draft_steps, p.draft_lr)):
                infos[role] = _train_one(role, size, p, steps, lr, train_ids, val_windows, vocab, special, seed, work,
                                         hf_tok, progress, callback)
            from transformers import LlamaForCausalLM

            from .distill import measure_alpha

            tm = LlamaForCausalLM.from_pretrained(work / "target", use_safetensors=True)
            if distilled:
                infos["draft"] = _distill_draft(p, tm, infos.pop("draft-corpus"), train_ids, val_windows, special, seed,
                                                work, hf_tok, progress, callback)
            dm = LlamaForCausalLM.from_pretrained(work / "draft", use_safetensors=True)
            alpha = {f"T{t:g}": round(measure_alpha(tm, dm, val_windows, t), 4) for t in (0.0, 1.0)}
        prior = [json.loads((work / f"{r}.json").read_text()).get("train_seconds", 0) for r in ("target", "draft")]
        meta = {
            "format": FORMAT_VERSION,
            "identity": ident,
            "recipe": p.to_dict(),
            "seed": seed,
            "corpus": c.description,
            "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab, "bos": BOS, "eos": EOS, "pad": PAD,
                          "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids))},
            "target": infos["target"],
            "draft": infos["draft"],
            "validation": {"windows": int(len(val_windows)), "context": p.context,
                           "target_loss": infos["target"]["val_loss"], "draft_loss": infos["draft"]["val_loss"],
                           "alpha": alpha},
            "seconds": {"this_run": round(time.perf_counter() - t_start, 2), "training_total": round(sum(prior), 2)},
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": __import__("transformers").__version__,
                         "tokenizers": __import__("tokenizers").__version__, "numpy": np.__version__,
                         "torch_threads": torch_threads},
        }
        check_swap(dest, overwrite, "pair.json", "a trained pair", owned=PAIR_FILES)  # refused now: the work folder still resumes
        for name in ("identity.json", "tokenizer.json", "target.json", "draft.json", "target.state.pt", "draft.state.pt",
                     "draft-corpus.json", "draft-corpus.state.pt", "draft-distill.state.pt"):
            (work / name).unlink(missing_ok=True)
        if (work / "draft-corpus").is_dir():  # (the distilled draft's start, in draft/ now)
            shutil.rmtree(work / "draft-corpus")
        # From here the work folder is a finished pair (pair.json names its recipe): stopped before the
        # rename, the same command moves it into place (it was refused as "not a work folder").
        write_json(work / "pair.json", meta)
        return _move_into_place(work, dest, overwrite)


def _finished(work: Path, ident: dict) -> bool:
    """The work folder holds a finished, undamaged pair of this recipe (stopped as it was moved)."""
    try:
        meta = json.loads((work / "pair.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("identity") == ident and _damage(work) is None


def _move_into_place(work: Path, dest: Path, overwrite: bool) -> Path:
    # (swap_into_place checks dest again itself; a refused rename leaves a folder _finished moves later)
    (work / ".lock").unlink(missing_ok=True)
    usual_permissions(work, recursive=True)  # safetensors writes the weights 0600
    swap_into_place(work, dest, overwrite, "pair.json", "a trained pair", owned=PAIR_FILES)  # --overwrite: the old one goes
    return dest


@contextlib.contextmanager
def _deterministic():
    """Deterministic kernels for the duration (restoring the caller's setting)."""
    import torch

    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def load_pair(pair_dir: os.PathLike | str):
    """``(target, draft, tokenizer, meta)`` from a finished pair folder (safetensors only)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    d = Path(pair_dir)
    if not is_complete(d):
        raise CheckpointError(f"{d} is not a complete pair (no pair.json); train it with `edgespec train-pair`")
    target = LlamaForCausalLM.from_pretrained(d / "target", use_safetensors=True)
    draft = LlamaForCausalLM.from_pretrained(d / "draft", use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(d / "target")
    return target, draft, tok, json.loads((d / "pair.json").read_text())


# ----------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="quick", choices=sorted(PRESETS),
                        help="model sizes and steps: quick (minutes on a laptop CPU; its draft is then distilled on the target), "
                             "bench (about 40 minutes on 2 cores), tiny (tests)")
    parser.add_argument("--corpus", nargs="+", metavar="FILE", type=Path, default=None,
                        help="text files or folders to train on (default: this Python's standard library sources)")
    parser.add_argument("--out", type=folder, default=None,
                        help="output folder (default: the cache, $EDGESPEC_CACHE/pairs/<preset>[-distilled]-<corpus hash>); a pair of the same recipe already there is reused")
    parser.add_argument("--seed", type=at_least(0), default=0, help="random seed of the initial weights and batches (the same seed gives the same weights on the "
                             "same machine, torch version and thread count; elsewhere they may differ slightly)")
    parser.add_argument("--overwrite", action="store_true", help="retrain and replace an earlier pair at --out (only a pair folder that holds nothing else)")
    parser.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true", help="no progress bars or messages on stderr")
    parser.add_argument("--print-path", action="store_true",
                        help="print only the pair folder on stdout (train or reuse it first), for scripts; "
                             "progress stays on stderr (add --no-progress to silence it)")


def run(args: argparse.Namespace) -> int:
    if args.overwrite and args.out is None:
        raise InvalidArgumentError("--overwrite replaces an --out folder; the cached pair (no --out) is reused while it "
                                   "matches the recipe: add --out FOLDER, or delete the cached pair to retrain it")
    path = train_pair(args.preset, args.corpus, args.out, seed=args.seed,
                      progress=not args.no_progress, overwrite=args.overwrite)
    if args.print_path:
        print(path)
        return 0
    meta = json.loads((path / "pair.json").read_text())
    v = meta["validation"]
    print(f"pair: {path}")
    print(f"  target: {meta['target']['params'] / 1e6:.2f}M params, validation loss {v['target_loss']:.3f}")
    print(f"  draft:  {meta['draft']['params'] / 1e6:.2f}M params, validation loss {v['draft_loss']:.3f}")
    print(f"  alpha on held-out text: T=0 {v['alpha']['T0']:.3f}, T=1 {v['alpha']['T1']:.3f}")
    return 0
