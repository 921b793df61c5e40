"""Atomic output folders: written beside the target, renamed into place only when complete; where outputs may go.

Every temporary sibling the toolkit makes beside an output is named `.NAME.MARKER-PID-XXXX` (`temp_prefix`; PID:
the writing process, MARKER: one of TEMP_MARKERS), so a later run can tell a leftover of a killed run (its process
is gone: removed) from one still being written (reported, kept).

An output, and every folder a command writes and may delete (uptrain's --run-dir, a recipe's output), is checked
against the folders the command reads (`check_apart`): never one of them, never inside one, never holding one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import SurgeryError
from ..logs import get_logger


# The temporary names made beside an output: `tmp` (an output being written, a JSON file being written), `old` (the
# output being replaced), `calib` (a calibrated conversion's layer store). clean_stale_siblings knows exactly these.
TEMP_MARKERS = ("tmp", "old", "calib")


def temp_prefix(out: Path, marker: str) -> str:
    """The prefix (for mkdtemp/mkstemp) of a temporary sibling of `out`: `.NAME.MARKER-PID-`."""
    if marker not in TEMP_MARKERS:
        raise ValueError(f"unknown temporary marker {marker!r}")
    return f".{Path(out).name}.{marker}-{os.getpid()}-"


def _real(path: Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def local_inputs(name: str, specs) -> list[tuple[str, Path]]:
    """(name, path) for each of `specs` (texts as the user named them: paths, globs, hub names, None) that names
    files or folders of this machine, a glob as the files it matches: what `check_apart` keeps an output apart from."""
    import glob

    found = []
    for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
        if not isinstance(spec, (str, Path)) or str(spec) in ("", "pydoc", "stdlib", "general") or "://" in str(spec):
            continue  # (the built-in texts and URLs are no files of this machine, whatever folder shares the name)
        path = Path(spec).expanduser()
        if path.exists():
            found.append((name, path))
        elif any(c in str(spec) for c in "*?["):
            found.extend((name, Path(p)) for p in sorted(glob.glob(str(path), recursive=True)))
    return found


def check_apart(path: Path, what: str, inputs, option: str = "--out") -> None:
    """Refuse `path` (an output, or a folder a command writes and may delete; `what` names it) that is one of
    `inputs` ((name, path) pairs: the folders and files the command reads), contains one or lies inside one: --force
    must never delete what the user reads from, and nothing is written inside a source."""
    real = _real(path)
    for name, folder in inputs:
        if folder is None:
            continue
        src = _real(folder)
        kind = "file" if src.is_file() else "folder"
        if real == src:
            raise SurgeryError(f"{what} {path} is the {name} {kind}; choose another {option}")
        if real in src.parents:
            raise SurgeryError(f"{what} {path} contains the {name} {kind} {folder}; choose another {option}")
        if src in real.parents:
            raise SurgeryError(f"{what} {path} is inside the {name} folder {folder}; choose another {option}")


def check_output_path(out: Path, force: bool, source: Path | None = None, inputs=()) -> None:
    """Refuse an existing output unless `force`, an output whose parent cannot be written, and an output that is
    the `source` folder (or one of the other `inputs`, (name, folder) pairs), contains it or lies inside it."""
    out = Path(out)
    check_apart(out, "output", [("source", source), *inputs])
    if (out.exists() or out.is_symlink()) and not force:
        raise SurgeryError(f"output {out} already exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise SurgeryError(f"output {out} exists and is not a folder; --force replaces only folders")
    check_parent_can_be_made(out, str(out))


def check_output_file(path: Path | None, option: str) -> None:
    """A file output (`option`: --json, --plot) can be written: not a folder, its folder exists and is writable.
    Checked before the command's work, so a long run never ends on an output that cannot be written. '-' (stdout)
    and None (not asked for) pass."""
    if path is None or str(path) == "-":
        return
    path = Path(path)
    if path.is_dir():
        raise SurgeryError(f"{option} {path} is a folder; give a file name")
    check_writable_parent(path, f"{option} {path}")


def check_writable_parent(path: Path, what: str) -> None:
    """The folder `path` goes into exists and can be written; `what` names the output in the message."""
    parent = Path(path).absolute().parent
    if not parent.is_dir():
        raise SurgeryError(f"cannot write {what}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SurgeryError(f"cannot write {what}: folder {parent} is not writable")


def missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, the deepest first."""
    missing = []
    folder = Path(path).absolute().parent
    while not (folder.exists() or folder.is_symlink()) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def check_parent_can_be_made(path: Path, what: str) -> None:
    """The folder an output folder goes into exists and can be written, or its missing folders can be made (as
    `save_pretrained` makes them): the nearest one that exists is a writable folder."""
    missing = missing_parents(path)
    nearest = (missing[-1] if missing else Path(path).absolute()).parent
    if not nearest.is_dir():
        raise SurgeryError(f"cannot write {what}: {nearest} is not a folder")
    if not os.access(nearest, os.W_OK):
        raise SurgeryError(f"cannot write {what}: folder {nearest} is not writable")


@contextlib.contextmanager
def output_parents(out: Path) -> Iterator[None]:
    """Make the missing folders above the output `out` for the block; when the block fails (Ctrl-C included),
    remove again those it made and left empty: a refused or failed run leaves no folders behind."""
    made = missing_parents(out)
    try:
        for folder in reversed(made):
            folder.mkdir()
    except OSError as e:
        remove_empty(made)
        raise write_failure(out, e) from None
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; one that holds something (a kept run folder) stops it
        try:
            folder.rmdir()
        except OSError:
            if folder.exists():
                return


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def clean_stale_siblings(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` (`.NAME.MARKER-PID-*`, every marker of TEMP_MARKERS) whose process is
    gone; warn (one line on stderr) about the ones whose owner still runs or is unknown (older temp names carry no
    PID). Returns those left in place."""
    out = Path(out)
    parent = out.absolute().parent
    markers = "|".join(TEMP_MARKERS)
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.({markers})-(?:(\d+)-)?[^/]*$")
    kept = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return kept
    for p in entries:
        m = pattern.match(p.name)
        if not m or p.is_symlink() or not (p.is_dir() or p.is_file()):
            continue
        pid = int(m.group(2)) if m.group(2) else None
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        elif pid != os.getpid():
            kept.append(p)
    if kept:
        owner = "another running process or an older version" if len(kept) == 1 else "other processes"
        get_logger(__name__).warning(f"left in place {len(kept)} temporary folder(s) beside {out} ({owner}): "
                                     f"{', '.join(p.name for p in kept[:3])}")
    return kept


def ordinary_permissions(folder: Path) -> None:
    """Files under `folder` readable as the umask allows (rw-r--r-- by default), as `open()` would have made them:
    some writers (safetensors' save_file, mkstemp) create -rw------- files."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False, source: Path | None = None,
                      recovery: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` when the block completes.

    On any exception (Ctrl-C and SIGTERM included) the temporary folder is removed and `out` is untouched; an
    OSError inside the block (a full disk) becomes one line naming `out`, ending with `recovery` (how to finish
    the job) when given. `source`, when given, is the folder the output is made from: `out` may not be it,
    contain it or lie inside it.
    """
    out = Path(out)
    check_output_path(out, force, source)
    with output_parents(out):
        clean_stale_siblings(out)
        yield from _atomic_output_dir(out, recovery)


def _atomic_output_dir(out: Path, recovery: str | None) -> Iterator[Path]:
    parent = out.absolute().parent
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "tmp"), dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the output is an ordinary folder
    try:
        try:
            yield tmp
        except OSError as e:
            raise SurgeryError(_write_failure(out, e) + (f"; {recovery}" if recovery else "")) from None
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_failure(out: Path, e: OSError) -> SurgeryError:
    """The one-line error for a write into (or beside) `out` that failed with `e` (a full disk)."""
    return SurgeryError(_write_failure(out, e))


def _write_failure(out: Path, e: OSError) -> str:
    why = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e).splitlines()[0])
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return f"writing {out} failed: {why}{where}; nothing was written"


def write_json(value, path: Path, echo=print) -> None:
    """JSON to stdout ('-') or to a file, written beside it and renamed into place (never half-written). On stdout
    it is printed, not logged: a document asked for is the command's result (-q keeps it)."""
    import json

    text = json.dumps(value, indent=2)
    if str(path) == "-":
        echo(text)
        return
    write_text_atomic(Path(path), text + "\n", "--json")


def write_text_atomic(path: Path, text: str, what: str = "output") -> None:
    """`text` into the file `path`, written beside it and renamed into place (never half-written)."""
    write_bytes_atomic(path, text.encode(), what)


def write_bytes_atomic(path: Path, data: bytes, what: str = "output") -> None:
    """`data` into the file `path`, written beside it and renamed into place (never half-written)."""
    check_output_file(path, what)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), dir=path.absolute().parent)
    except OSError as e:
        raise SurgeryError(_write_failure(path, e)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:  # a full disk: one line, nothing left beside
        Path(tmp).unlink(missing_ok=True)
        raise SurgeryError(_write_failure(path, e)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
