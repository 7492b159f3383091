"""Writes that a kill cannot leave half done."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
