"""Training text that exists offline on every machine, plus the shared byte-level BPE tokenizer.

The default corpus is the Python standard library source of the running interpreter
(``sysconfig.get_paths()['stdlib']``): every ``*.py`` file, sorted by relative path, with test
folders, ``site-packages`` and ``__pycache__`` left out. Users may pass their own text files (or
folders of text files) instead. Held-out text is split off *by file*, by a hash of each file's
content, so the split depends on nothing but the corpus itself.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .errors import TrainingError, warn

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens

HELDOUT_ONE_IN = 20  # about 5% of files (by count) are held out
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """Documents (one per file) split into train and held-out, with a description for pair.json."""

    train_docs: tuple[str, ...]
    heldout_docs: tuple[str, ...]
    description: dict = field(hash=False, compare=False)

    @property
    def sha256(self) -> str:
        return self.description["sha256"]


def stdlib_files() -> list[Path]:
    """The default corpus files: the running interpreter's standard library ``*.py`` sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise TrainingError(
            f"the Python standard library folder {root} does not exist, so there is no default corpus; "
            "pass your own text files with --corpus FILE ..."
        )
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _EXCLUDED_DIRS & set(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(p)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


def _expand(paths: Sequence[os.PathLike | str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise TrainingError(f"corpus file {p} does not exist; check the path passed with --corpus")
        if p.is_dir():
            inner = sorted((q for q in p.rglob("*") if q.is_file() and "__pycache__" not in q.parts),
                           key=lambda q: q.relative_to(p).as_posix())
            if not inner:
                raise TrainingError(f"corpus folder {p} holds no files; pass text files or a folder of text files")
            files.extend(inner)
        else:
            files.append(p)
    return files


def _read_text(p: Path, *, strict: bool, named: bool = False, mangled: list[Path] | None = None) -> str | None:
    """A file's text. ``named``: the user named this file (not found in a folder): it must be UTF-8.
    Otherwise invalid bytes decode as U+FFFD (the default stdlib corpus keeps its exact text, and
    with it its cached pairs' names) and such files are added to ``mangled``."""
    data = p.read_bytes()
    if b"\x00" in data:  # binary file
        if strict:
            raise TrainingError(f"corpus file {p} is binary (it contains NUL bytes); pass UTF-8 text files only")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if named:
            raise TrainingError(f"corpus file {p} is not UTF-8 text (byte {exc.start}); convert it (e.g. iconv -f "
                                "latin1 -t utf-8) or leave it out") from None
        if mangled is not None:
            mangled.append(p)
        text = data.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n")


def _content_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _split_tails(docs: list[str]) -> tuple[list[str], list[str]]:
    """Each document cut at the line break nearest below 95% of its length, if one lies within 5% of
    it (else at 95%): the heads to train on, the tails held out. (Any line break below 95% held out a
    header plus one long line almost whole: a review's find.)"""
    train, held = [], []
    for text in docs:
        cut = text.rfind("\n", int(len(text) * 0.90), int(len(text) * 0.95))
        if cut <= 0 or cut >= len(text) - 1:
            cut = int(len(text) * 0.95)
        if 0 < cut < len(text):
            train.append(text[:cut + 1])
            if text[cut + 1:]:
                held.append(text[cut + 1:])
        else:  # too short to cut: trained on whole
            train.append(text)
    if not train or not held:
        raise TrainingError("the corpus is too small to split off held-out text; pass more text with --corpus")
    return train, held


def load_documents(paths: Sequence[os.PathLike | str] | None = None) -> Corpus:
    """Read the corpus (default: the stdlib sources) and split it into train and held-out documents.

    A file is held out when the first 8 bytes of its content's SHA-256, read as an integer, are
    divisible by 20 (about 5% of files); at least one file goes each way. A corpus of a single file
    is split at the line boundary nearest to 95% of its length instead, and so is every document of
    a corpus whose held-out files would hold more than a third of its text (a few unequal files).
    """
    if paths is None:
        files = stdlib_files()
        source = "python-stdlib"
        explicit = False
    else:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if len(paths) == 0:
            raise TrainingError("the corpus is empty: pass at least one text file with --corpus FILE, or none for the default")
        files = _expand(paths)
        source = "files"
        explicit = True
    docs: list[str] = []
    named = {Path(raw).expanduser() for raw in paths if not Path(raw).expanduser().is_dir()} if explicit else set()
    mangled: list[Path] = []
    for p in files:
        # a binary file is refused where the user named it (or it is all there is), skipped in a folder
        text = _read_text(p, strict=explicit and (len(files) == 1 or p in named), named=p in named,
                          mangled=mangled if explicit else None)
        if text:  # skip empty and binary files
            docs.append(text)
    if mangled:
        warn(f"{len(mangled)} corpus file(s) found in the folders given are not UTF-8 text (first: "
             f"{mangled[0]}); their invalid bytes were read as U+FFFD: convert them to UTF-8 or leave them "
             "out")
    total = sum(len(d.encode("utf-8")) for d in docs)
    if not docs or total == 0:
        raise TrainingError(
            f"the corpus ({len(files)} file(s)) holds no text; pass non-empty UTF-8 text files with --corpus FILE ..."
        )
    hashes = [_content_hash(d) for d in docs]
    digest = hashlib.sha256()
    for d, h in zip(docs, hashes):
        digest.update(len(d.encode("utf-8")).to_bytes(8, "little"))
        digest.update(h)
    keys = [int.from_bytes(h[:8], "little") for h in hashes]
    rule = f"sha256(file content) % {HELDOUT_ONE_IN} == 0"
    if len(set(keys)) == 1:  # one document, or copies of one: split its lines
        train, held = _split_tails(docs[:1])
        rule = "the last 5% of the text (one distinct document)"
    else:
        # By content: identical files always land on the same side (a copy of a held-out file in
        # the training set would make held-out loss and alpha optimistic).
        is_held = [k % HELDOUT_ONE_IN == 0 for k in keys]
        if not any(is_held):
            is_held = [k == min(keys) for k in keys]
            rule = "the file(s) with the smallest sha256 (no file met sha256 % 20 == 0)"
        if all(is_held):
            is_held = [k != max(keys) for k in keys]
            rule += "; the file(s) with the largest sha256 kept for training"
        train = [d for d, h in zip(docs, is_held) if not h]
        held = [d for d, h in zip(docs, is_held) if h]
        held_bytes = sum(len(d.encode("utf-8")) for d in held)
        if 3 * held_bytes > total:
            # A corpus of a few files of unequal size: the file(s) the rule picked hold most of the
            # text, which training would never see. Hold out the tail of every distinct document
            # instead (a copy's tail is the same text, so it is held out with it: nothing leaks).
            train, held = _split_tails(list(dict.fromkeys(docs)))
            rule = (f"the last 5% of each distinct document ({rule} would have held out "
                    f"{100 * held_bytes / total:.0f}% of the text)")
    description = {
        "source": source,
        "root": str(Path(sysconfig.get_paths()["stdlib"])) if source == "python-stdlib" else None,
        "python": sys.version.split()[0] if source == "python-stdlib" else None,
        "files": len(docs),
        "bytes": total,
        "sha256": digest.hexdigest(),
        "train_files": len(train),
        "train_bytes": sum(len(d.encode("utf-8")) for d in train),
        "heldout_files": len(held),
        "heldout_bytes": sum(len(d.encode("utf-8")) for d in held),
        "heldout_rule": rule,
    }
    return Corpus(tuple(train), tuple(held), description)


def load_corpus(paths: Sequence[os.PathLike | str] | None = None) -> tuple[str, str, dict]:
    """``(train_text, heldout_text, description)``; documents are joined with a blank line."""
    c = load_documents(paths)
    return "\n\n".join(c.train_docs), "\n\n".join(c.heldout_docs), c.description


# ----------------------------------------------------------------------------- tokenizer

# The BPE trainer's time grows with the square of a pre-tokenized word's length and cannot be
# interrupted (it runs in Rust): one 200,000-character run took 20 s, a 5 MB line hung for good with
# Ctrl-C ignored. Longer runs of non-space (or space) are given to the trainer in pieces of this
# length (the tokenizer still encodes the whole text; the default corpus has no such run).
LONGEST_RUN = 20_000
_LONG_RUN = re.compile(r"\S{%d,}|\s{%d,}" % (LONGEST_RUN, LONGEST_RUN))


def _bounded_runs(docs: Iterable[str]) -> Iterator[str]:
    for doc in docs:
        start = 0
        for m in _LONG_RUN.finditer(doc) if len(doc) >= LONGEST_RUN else ():
            if m.start() > start:
                yield doc[start:m.start()]
            yield from (doc[i:min(i + LONGEST_RUN, m.end())] for i in range(m.start(), m.end(), LONGEST_RUN))
            start = m.end()
        yield doc[start:] if start else doc


def train_tokenizer(docs: Iterable[str], vocab_size: int, *, progress: bool = False):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` whose ``encode`` prepends ``<|bos|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise TrainingError(f"vocab_size {vocab_size} is below {MIN_VOCAB} (256 bytes + special tokens); raise it")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(_bounded_runs(docs), trainer=trainer, length=None)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def hf_tokenizer(tok, model_max_length: int):
    """Wrap a ``tokenizers.Tokenizer`` as a ``PreTrainedTokenizerFast`` (so AutoTokenizer loads it)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


class _FramesAsLines:
    """Off a terminal, tqdm's frames (each written as '\r' + frame, and cleared with '\r' + blanks)
    go to the log one line each, not as one long line of carriage returns."""

    def __init__(self, stream):
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None) or "utf-8"

    def write(self, s: str) -> None:
        for line in s.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar_options(progress: bool, leave: bool = True) -> dict:
    """tqdm options for edgespec's progress bars: on stderr; off a terminal (a CI log, a pipe) a frame
    at most every 30 s, not ten a second, since each frame is appended to the log, one per line, and
    the last frame always (``leave=False`` clears a bar from a terminal only: a log would end at 0%)."""
    on_terminal = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return {"disable": not progress, "file": sys.stderr if on_terminal else _FramesAsLines(sys.stderr),
            "mininterval": 0.1 if on_terminal else 30.0, "leave": leave or not on_terminal}


def encode_docs(tok, docs: Sequence[str], *, bos_id: int | None, eos_id: int | None,
                progress: bool = False, desc: str = "tokenize", chunk: int = 64):
    """Token ids of all documents as one int64 numpy stream: ``[bos] doc [eos]`` per document."""
    import numpy as np
    from tqdm.auto import tqdm

    parts = []
    with tqdm(total=len(docs), desc=desc, unit="file", **bar_options(progress, leave=False)) as bar:
        for i in range(0, len(docs), chunk):
            batch = list(docs[i:i + chunk])
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = enc.ids
                if bos_id is not None:
                    parts.append(np.asarray([bos_id], dtype=np.int64))
                parts.append(np.asarray(ids, dtype=np.int64))
                if eos_id is not None:
                    parts.append(np.asarray([eos_id], dtype=np.int64))
            bar.update(len(batch))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
