"""Output folders and files: may a command write or replace them, and with which permissions."""
from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from . import contract
from .bundle import PARTIAL_MARKER, onnx_external_data_locations
from .errors import EdgeSpecError, OutputExistsError, OutputPathError


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
    """The names a command writes in its output folder, for --overwrite to replace that folder only
    if it holds nothing else, at any depth (drafts distilled into a pair's folder, bundles exported
    there, notes, a user's file put in a bundle's target/):

    - ``names`` and ``patterns``: files (a folder of such a name is not ours: ``target/model.onnx/``);
    - ``folders``: subfolders, with the names written in them;
    - ``listed``: reads, from the folder being checked, the names its own manifest lists (the graphs
      a bundle's edgespec.json lists and the external data they name, the artifacts xla.json lists):
      ``my-finetune.onnx`` beside them is not ours;
    - ``scratch``: patterns of a killed run's leftovers (work folders, markers), whatever they hold.
    """

    def __init__(self, names=(), patterns=(), folders=None, listed=None, scratch=()):
        self.names, self.patterns, self.scratch = frozenset(names), tuple(patterns), tuple(scratch)
        self.folders: dict[str, OwnedNames] = dict(folders or {})
        self.listed: Callable[[Path], Iterable[str]] | None = listed

    def _replace(self, **changes) -> "OwnedNames":
        fields = {"names": self.names, "patterns": self.patterns, "folders": self.folders, "listed": self.listed,
                  "scratch": self.scratch}
        return OwnedNames(**{**fields, **changes})

    def __or__(self, names) -> "OwnedNames":
        return self._replace(names=self.names | set(names))

    def at(self, folder: Path) -> "OwnedNames":
        """These names and those that ``folder``'s own manifest lists (none if it is unreadable:
        then only the fixed names are ours, and the rest is refused, never deleted)."""
        if self.listed is None:
            return self
        try:
            listed = set(self.listed(folder))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, EdgeSpecError):
            listed = set()
        return self._replace(names=self.names | listed)

    def owns(self, folder: Path, name: str) -> bool:
        """Is ``folder/name`` ours (a subfolder's contents aside: :func:`foreign_names`)? A symbolic
        link is judged by its name: replacing the folder removes the link, never what it points to."""
        path = folder / name
        if any(fnmatch.fnmatchcase(name, p) for p in self.scratch):
            return True
        real_dir = path.is_dir() and not path.is_symlink()
        if name in self.folders:
            return real_dir or path.is_symlink()
        return not real_dir and (name in self.names or any(fnmatch.fnmatchcase(name, p) for p in self.patterns))

    def with_tree(self, folder: Path) -> "OwnedNames":
        """These names and everything ``folder`` holds (a command's new output, about to replace its
        old one: what it wrote now is its own, also where the old output holds the same names)."""
        names, folders = set(self.names), dict(self.folders)
        for name in os.listdir(folder):
            path = folder / name
            if path.is_dir() and not path.is_symlink():
                folders[name] = folders.get(name, OwnedNames()).with_tree(path)
            else:
                names.add(name)
        return self._replace(names=names, folders=folders)


def _bundle_graphs(folder: Path) -> set[str]:
    """The graphs that the bundle's manifest (``../edgespec.json``) lists for this model folder, and
    the external-data files each of them names (any name: int8's ``model.onnx.int8.1.data``,
    optimum's ``model.onnx_data``); a graph that cannot be read names none. A decoder bundle's
    ``decoder_model.onnx`` is not the export's: its manifest does not list it."""
    manifest = json.loads((folder.parent / contract.MANIFEST_NAME).read_text(encoding="utf-8-sig"))
    graphs = {name for m in manifest["models"].values() if m["path"] == folder.name for name in m["files"].values()}
    owned = set(graphs)
    for name in graphs:
        try:
            owned.update(onnx_external_data_locations(folder / name))
        except (OSError, EdgeSpecError):
            # A graph missing or damaged (the bundle being re-exported to repair it) names no data:
            # its own are the files the exporter writes beside it under fixed names (static KV's
            # <graph>.data, int8's <graph>.int8[.N].data, optimum's <graph>_data); others are refused.
            made = (f"{name}.data", f"{name}.int8.data", f"{name}.int8.*.data", f"{name}_data")
            owned.update(n for n in os.listdir(folder) if any(fnmatch.fnmatchcase(n, p) for p in made))
    return owned


def _xla_artifacts(folder: Path) -> set[str]:
    """The artifact files ``xla.json`` lists (export.xla's manifest: kind -> size -> {"file": ...})."""
    manifest = json.loads((folder / "xla.json").read_text())
    return {entry["file"] for sizes in manifest["artifacts"].values() for entry in sizes.values()}


# The tokenizer's files as save_pretrained writes them (distill's and the pair's drafts, optimum's
# copy beside an exported graph); a Hugging Face model folder (sharded weights too) adds these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.txt")
# save_pretrained's folder of named chat templates (optimum copies the tokenizer beside a graph)
_CHAT_TEMPLATES = {"additional_chat_templates": OwnedNames(patterns=("*.jinja",))}
HF_MODEL_FILES = OwnedNames({"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                             *TOKENIZER_FILES}, ("model-*-of-*.safetensors",), _CHAT_TEMPLATES)
DRAFT_FILES = HF_MODEL_FILES | {"distill.json"}
# export.xla's artifacts (its xla/ folder: export --xla, or the XLA exporter alone)
XLA_FILES = OwnedNames({"xla.json", "weights.safetensors", "config.json"}, listed=_xla_artifacts)
# a bundle's target/ or draft/: the ONNX graphs its manifest lists and the external data they name,
# the source's config and tokenizer, export --xla's xla/ (and a killed XLA export's work folder)
ROLE_FILES = OwnedNames({"config.json", "generation_config.json", *TOKENIZER_FILES},
                        folders={"xla": XLA_FILES, **_CHAT_TEMPLATES}, listed=_bundle_graphs,
                        scratch=(".xla.partial-*", ".xla.old-*"))
BUNDLE_FILES = OwnedNames({"edgespec.json"}, folders={"target": ROLE_FILES, "draft": ROLE_FILES})
# bundle: edgespec demo's export of the pair (a killed one leaves its marker, or its work folder)
PAIR_FILES = OwnedNames({"pair.json"}, folders={"target": HF_MODEL_FILES, "draft": HF_MODEL_FILES,
                                                "bundle": BUNDLE_FILES | {PARTIAL_MARKER}},
                        scratch=(".bundle.partial-*", ".bundle.old-*"))


def foreign_names(folder: Path, owned: OwnedNames) -> list[str]:
    """The entries of ``folder`` that are not ``owned``, at any depth of the owned subfolders (as
    relative paths: ``target/notes.txt``), sorted."""
    owned = owned.at(folder)
    out = []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        if not owned.owns(folder, name):
            out.append(name)
        elif name in owned.folders and path.is_dir() and not path.is_symlink():
            out += [f"{name}/{inner}" for inner in foreign_names(path, owned.folders[name])]
    return out


def named(names: list[str]) -> str:
    """The first five of ``names`` for a message, and how many more there are."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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
        raise OutputExistsError(
            f"{flag} {str(dest)!r} is {what} but also holds what this command did not write ({named(extra)}); --overwrite "
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
    if os.path.ismount(dest):  # (the rename at the end failed, after all the work: EXDEV, EBUSY)
        raise _mount_point_error(dest, flag)
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
        empty = os.stat(dest) if os.path.lexists(dest) else None  # a folder the user made: keep its mode, group
        try:
            if empty is not None:
                os.rmdir(dest)  # an empty folder (Windows cannot rename onto one); fails if it filled meanwhile
            os.rename(new, dest)  # fails if anything appeared at dest meanwhile
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.EXDEV):  # (a mount point, made one while this command ran)
                raise _mount_point_error(dest, flag) from None
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputExistsError(f"{flag} {str(dest)!r} was written by something else while this command ran "
                                    f"(another run with the same {flag}?); nothing was replaced: choose another "
                                    f"{flag} and run again") from None
        if empty is not None:
            os.chmod(dest, empty.st_mode & 0o7777)
            try:
                os.chown(dest, -1, empty.st_gid)  # (a setgid folder's group; not ours to give: left as made)
            except (OSError, AttributeError):
                pass
        return
    check_swap(dest, overwrite, marker, what, flag, owned if owned is None else owned.with_tree(new))
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    try:
        os.replace(dest, old / dest.name)
    except OSError as exc:
        os.rmdir(old)
        if exc.errno in (errno.EBUSY, errno.EXDEV):
            raise _mount_point_error(dest, flag) from None
        raise
    try:
        os.replace(new, dest)
    except BaseException:  # an error or Ctrl-C between the two renames: the previous output goes back
        os.replace(old / dest.name, dest)
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _mount_point_error(dest: Path, flag: str) -> OutputPathError:
    # The output is written beside --out and renamed into place (nothing half-written), and a
    # rename cannot cross into a mounted file system, nor replace its mount point.
    return OutputPathError(f"{flag} {str(dest)!r} is a mount point; an output is renamed into place, which cannot "
                           f"replace a mount point: give a folder inside it ({str(dest / 'out')!r})")


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
        try:  # (a read-only mount was called a permission problem)
            read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
        except (OSError, AttributeError):
            read_only = False
        reason = "a read-only file system" if read_only else "no write permission"
    raise OutputPathError(f"cannot write {flag} {str(shown or dest)!r}: {str(parent)!r} is not a writable folder ({reason}); "
                          f"{fix}")
