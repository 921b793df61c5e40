"""Atomic output folders: written beside the target, renamed into place only when complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import SurgeryError


def check_output_path(out: Path, force: bool) -> None:
    """Refuse an existing output unless `force`, and an output whose parent cannot be written."""
    out = Path(out)
    if out.exists() and not force:
        raise SurgeryError(f"output {out} already exists (use --force to replace it)")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise SurgeryError(f"cannot write {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SurgeryError(f"cannot write {out}: folder {parent} is not writable")


def ordinary_permissions(folder: Path) -> None:
    """Files under `folder` readable as the umask allows (rw-r--r-- by default), as `open()` would have made them:
    some writers (safetensors' save_file, mkstemp) create -rw------- files."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` when the block completes.

    On any exception (Ctrl-C included) the temporary folder is removed and `out` is untouched.
    """
    out = Path(out)
    check_output_path(out, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.absolute().parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the output is an ordinary folder
    try:
        yield tmp
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.absolute().parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
