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
    """Call write(tmp) on a fresh sibling folder, then move it into place as `final` (replacing it)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
