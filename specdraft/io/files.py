"""Writes that a kill cannot leave half done."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> Path:
    """Write `text` to a sibling scratch file, then move it over `path`: a reader sees the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_folder_atomically(final: Path, write) -> Path:
    """Call write(tmp) on a fresh sibling folder, then move it into place as `final` (replacing it). A kill at any
    moment leaves `final` as the old folder, the new one or (between two renames) absent, never a part of either:
    the old one is renamed aside whole and deleted only once the new one is in place (deleting it where it stood
    could leave half of it there, which a reader would take for whole)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    aside = tmp.with_name(tmp.name + ".old")  # unique as tmp is, hidden like it
    try:
        write(tmp)
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not final.exists():  # the new one failed to land: the old one goes back
            os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return final
