"""Output folders and files: may a command write or replace them, and with which permissions."""
from __future__ import annotations

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


def check_replaceable(dest: Path, marker: str, what: str, flag: str = "--out") -> None:
    """``--overwrite`` replaces only an earlier output of the same command (a folder holding
    ``marker``) or an empty folder, never a folder of the user's files nor a file."""
    if dest.exists() and not dest.is_dir():
        raise OutputExistsError(f"{flag} {str(dest)!r} exists and is not a folder; --overwrite replaces only {what}: "
                                f"choose another {flag}")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / marker).exists():
        raise OutputExistsError(
            f"{flag} {str(dest)!r} exists, is not empty and is not {what} (no {marker}); --overwrite replaces only "
            f"{what}: choose another {flag} or empty the folder yourself")


def swap_into_place(new: Path, dest: Path) -> None:
    """Rename the finished folder ``new`` to ``dest``; an existing ``dest`` (``--overwrite``) is
    moved aside first and removed after, so ``dest`` is never a half-replaced mix."""
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
        os.replace(new, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, dest)


def check_writable(dest: Path, flag: str = "--out") -> None:
    """A folder can be made in the nearest existing folder above ``dest`` (tried, before any work:
    permission bits do not tell about read-only or virtual file systems, nor about root)."""
    parent = Path(os.path.abspath(dest)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    reason = "not a folder"
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".edgespec-probe-", dir=parent))
            return
        except OSError as exc:
            reason = exc.strerror or str(exc)
    elif parent.is_dir():
        reason = "no write permission"
    raise OutputPathError(f"cannot write {flag} {str(dest)!r}: {str(parent)!r} is not a writable folder ({reason}); "
                          "choose another path")
