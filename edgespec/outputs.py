"""Output folders and files: may a command write or replace them, and with which permissions."""
from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path

from .errors import OutputExistsError, OutputPathError


def usual_permissions(path: str | os.PathLike, recursive: bool = False) -> None:
    """Give a file or folder the permissions a plain ``open`` or ``mkdir`` would have given it under
    the current umask. ``tempfile`` makes its files 0600 and folders 0700, and onnx and safetensors
    write weights as 0600: without this, another user of a shared bundle could not read it."""
    mask = os.umask(0o022)  # reading the umask means setting it: restore it at once
    os.umask(mask)
    paths = [Path(path)]
    if recursive and paths[0].is_dir():
        paths += [p for p in paths[0].rglob("*") if not p.is_symlink()]
    for p in paths:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


class OwnedNames:
    """The names a command writes in its output folder (exact names and glob patterns), and for the
    subfolders it writes, the names it writes in them (``folders``): --overwrite replaces such a folder
    only if it holds nothing else, at any depth (drafts distilled into a pair's folder, bundles
    exported there, notes, a user's file put in a bundle's target/)."""

    def __init__(self, names=(), patterns=(), folders=None):
        self.names, self.patterns = frozenset(names), tuple(patterns)
        self.folders: dict[str, OwnedNames] = dict(folders or {})

    def __contains__(self, name: str) -> bool:
        return name in self.names or name in self.folders or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def __or__(self, names) -> "OwnedNames":
        return OwnedNames(self.names | set(names), self.patterns, self.folders)

    def with_tree(self, folder: Path) -> "OwnedNames":
        """These names and everything ``folder`` holds (a command's new output, about to replace its
        old one: what it wrote now is its own, also where the old output holds the same names)."""
        folders = dict(self.folders)
        for name, owned in self.folders.items():
            if (folder / name).is_dir() and not (folder / name).is_symlink():
                folders[name] = owned.with_tree(folder / name)
        return OwnedNames(self.names | set(os.listdir(folder)), self.patterns, folders)


# The tokenizer's files as save_pretrained writes them (distill's and the pair's drafts, optimum's
# copy beside an exported graph); a Hugging Face model folder (sharded weights too) adds these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.txt")
HF_MODEL_FILES = OwnedNames({"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                             *TOKENIZER_FILES}, ("model-*-of-*.safetensors",))
DRAFT_FILES = HF_MODEL_FILES | {"distill.json"}
# export.xla's artifacts (its xla/ folder: export --xla, or the XLA exporter alone)
XLA_FILES = OwnedNames({"xla.json", "weights.safetensors", "config.json"}, ("encode_*.bin", "extend_*.bin", "prefill_*.bin"))
# a bundle's target/ or draft/: ONNX graphs and their external data, the source's config and tokenizer
ROLE_FILES = OwnedNames({"config.json", "generation_config.json", *TOKENIZER_FILES},
                        ("*.onnx", "*.onnx.data", "*.onnx_data"), {"xla": XLA_FILES})
BUNDLE_FILES = OwnedNames({"edgespec.json"}, folders={"target": ROLE_FILES, "draft": ROLE_FILES})
PAIR_FILES = OwnedNames({"pair.json"}, folders={"target": HF_MODEL_FILES, "draft": HF_MODEL_FILES,
                                                "bundle": BUNDLE_FILES})  # bundle: edgespec demo's export of the pair


def foreign_names(folder: Path, owned: OwnedNames) -> list[str]:
    """The entries of ``folder`` that are not among the ``owned`` names, at any depth of the owned
    subfolders (as relative paths: ``target/notes.txt``), sorted. A symbolic link is judged by its
    name: replacing the folder removes the link, never what it points to."""
    out = []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        if name not in owned:
            out.append(name)
        elif name in owned.folders and path.is_dir() and not path.is_symlink():
            out += [f"{name}/{inner}" for inner in foreign_names(path, owned.folders[name])]
    return out


def check_replaceable(dest: Path, marker: str, what: str, flag: str = "--out",
                      owned: OwnedNames | None = None) -> None:
    """``--overwrite`` replaces only an earlier output of the same command (a folder holding
    ``marker``, and nothing but the ``owned`` names where given) or an empty folder, never a folder of
    the user's files nor a file."""
    if dest.exists() and not dest.is_dir():
        raise OutputExistsError(f"{flag} {str(dest)!r} exists and is not a folder; --overwrite replaces only {what}: "
                                f"choose another {flag}")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / marker).exists():
        raise OutputExistsError(
            f"{flag} {str(dest)!r} exists, is not empty and is not {what} (no {marker}); --overwrite replaces only "
            f"{what}: choose another {flag} or empty the folder yourself")
    extra = foreign_names(dest, owned) if owned is not None and dest.is_dir() else []
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise OutputExistsError(
            f"{flag} {str(dest)!r} is {what} but also holds what this command did not write ({shown}); --overwrite "
            f"would delete that too: move it out of the folder, or choose another {flag}")


def _vacant(dest: Path) -> bool:
    """Nothing at ``dest``, or an empty folder that is not a symbolic link: writing there replaces nothing."""
    return not os.path.lexists(dest) or (dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()))


def check_output_folder(dest: Path, overwrite: bool, marker: str, what: str, flag: str = "--out",
                        owned: OwnedNames | None = None) -> None:
    """May a command write ``dest``? A new or empty folder, yes; an earlier output of the same
    command that holds nothing else, with ``overwrite`` (:func:`check_replaceable`). Without it the
    message says whether --overwrite would help (it used to suggest it for folders it then refused)."""
    if dest.is_symlink():  # (the rename at the end would refuse it, after all the work: swap_into_place)
        raise OutputExistsError(f"{flag} {str(dest)!r} is a symbolic link; give the folder it points to, or a new path")
    try:
        if _vacant(dest):
            return
    except OSError as exc:
        raise OutputExistsError(f"{flag} {str(dest)!r} exists and cannot be read ({exc.strerror or exc}); choose "
                                f"another {flag}") from None
    check_replaceable(dest, marker, what, flag, owned)
    if not overwrite:
        raise OutputExistsError(f"{flag} {str(dest)!r} holds {what} already; choose another {flag}, or pass --overwrite "
                                "to replace it")


def check_swap(dest: Path, overwrite: bool, marker: str, what: str, flag: str = "--out",
               owned: OwnedNames | None = None) -> None:
    """Would :func:`swap_into_place` refuse ``dest`` now? (A command that must tidy its work
    folder first asks before it does: a refused rename must leave a resumable run.)"""
    if _vacant(dest):
        return
    if not overwrite:
        raise OutputExistsError(f"{flag} {str(dest)!r} appeared while this command ran (another run with the same "
                                f"{flag}?); nothing was replaced: choose another {flag} or pass --overwrite")
    check_replaceable(dest, marker, what, flag, owned)


def swap_into_place(new: Path, dest: Path, overwrite: bool, marker: str, what: str, flag: str = "--out",
                    owned: OwnedNames | None = None) -> None:
    """Rename the finished folder ``new`` to ``dest``. The rules checked before the work are
    checked again here, at the rename (``dest`` may have changed meanwhile: another run writing the
    same output, a user's file): nothing there (or an empty folder) is an atomic rename that fails
    if anything appeared; an existing output is replaced only with ``overwrite`` and only if it is
    still ``what`` (holds ``marker``). It is moved aside first and removed after, so ``dest`` is
    never a half-replaced mix; if the second rename fails or is interrupted, it is put back."""
    if _vacant(dest):
        try:
            if os.path.lexists(dest):
                os.rmdir(dest)  # an empty folder (Windows cannot rename onto one); fails if it filled meanwhile
            os.rename(new, dest)  # fails if anything appeared at dest meanwhile
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputExistsError(f"{flag} {str(dest)!r} was written by something else while this command ran "
                                    f"(another run with the same {flag}?); nothing was replaced: choose another "
                                    f"{flag} and run again") from None
        return
    check_swap(dest, overwrite, marker, what, flag, owned if owned is None else owned.with_tree(new))
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.replace(dest, old / dest.name)
    try:
        os.replace(new, dest)
    except BaseException:  # an error or Ctrl-C between the two renames: the previous output goes back
        os.replace(old / dest.name, dest)
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_report_folder(out: Path, flag: str = "--out") -> None:
    """Before a measurement: ``out`` (a folder that reports are written into, made if missing) is no
    file and can be written (a run that measured for minutes, then failed to write, lost it all)."""
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{flag} {str(out)!r} is a file; give a folder for the results")
    check_writable(out / "results.json", flag, shown=out)  # (a file in it: out itself may exist)


def check_writable(dest: Path, flag: str = "--out", fix: str = "choose another path", shown: Path | None = None) -> None:
    """A folder can be made in the nearest existing folder above ``dest`` (tried, before any work:
    permission bits do not tell about read-only or virtual file systems, nor about root). The
    message names ``shown`` (default ``dest``): the path the user gave."""
    parent = Path(os.path.abspath(dest)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    reason = "not a folder"
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".edgespec-probe-", dir=parent))
            return
        except OSError as exc:
            # e.g. /proc answers ENOENT: say what was tried, not only the errno's words
            reason = f"creating a folder in it failed: {exc.strerror or exc}"
    elif parent.is_dir():
        reason = "no write permission"
    raise OutputPathError(f"cannot write {flag} {str(shown or dest)!r}: {str(parent)!r} is not a writable folder ({reason}); "
                          f"{fix}")
