"""Output files (exports, plots): never written over an existing file unless forced, and an OS error while
writing is one message naming the path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path


def _file_above(path: Path) -> Path | None:
    """The nearest existing folder above `path` when it is a file instead (nothing can be made under it)."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OS error while writing `path` (or making its folder) is one message naming it: the bare errno text
    names no path (`--out /proc/version --force`: "[Errno 5] Input/output error"), or only a parent."""
    try:
        yield
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from None


def refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    """Refuse before writing anything when a path to be written exists (a measured table is easily lost by
    re-running an export): `force` overwrites files, never a folder that stands where a file should go; and
    a file where a folder above the path should be refuses it, forced or not."""
    for path in paths:
        above = _file_above(path)
        if above is not None:
            raise NotADirectoryError(f"cannot write {path}: {above} is a file, not a folder")
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder: give --out a file path")
        if path.exists() and not force:
            raise FileExistsError(f"{path} exists: pass --force to overwrite it, or give another --out")


def write_files(content: str | bytes | dict[str, str], out: Path, force: bool) -> list[Path]:
    """Write one file's content to `out`, or {relative name: text} under the folder `out`; nothing is written
    when one of the files would be refused (see refuse_overwrite)."""
    files: dict[Path, str | bytes] = (
        {out / name: text for name, text in content.items()} if isinstance(content, dict) else {out: content})
    refuse_overwrite(list(files), force)
    for path, data in files.items():
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
    return list(files)
