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


def current_umask() -> int:
    """The process's umask (reading it means setting it; set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, somebody else's
        pass
    return True


def _clear_leftovers(final: Path) -> None:
    """Remove the scratch folders that killed writers of `final` left beside it (named .NAME-PID-*); if one was
    killed between its two renames, `final` is absent and its old folder, renamed aside whole, goes back first."""
    for left in sorted(final.parent.glob(f".{final.name}-*")):
        pid = left.name[len(final.name) + 2 :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue  # not ours to judge, or a writer still at work
        if left.name.endswith(".old") and not final.exists():
            os.replace(left, final)
        else:
            shutil.rmtree(left, ignore_errors=True)


def move_into_place(new: Path, final: Path) -> Path:
    """Rename the complete folder `new` to `final`, replacing it: the old one is renamed aside whole and deleted
    only once the new one is in place (deleting it where it stood could leave half of it there, which a reader
    would take for whole); a failed rename puts the old one back."""
    new, final = Path(new), Path(final)
    _clear_leftovers(final)
    aside = final.with_name(f".{final.name}-{os.getpid()}-{new.name.lstrip('.')}.old")
    try:
        if final.exists():
            os.replace(final, aside)
        os.replace(new, final)
    except BaseException:
        if aside.exists() and not final.exists():  # the new one failed to land: the old one goes back
            os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return final


def write_folder_atomically(final: Path, write) -> Path:
    """Call write(tmp) on a fresh sibling folder, then move it into place as `final` (replacing it). A kill at any
    moment leaves `final` as the old folder, the new one or (between two renames) absent, never a part of either;
    the next move clears what a killed writer left beside it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-{os.getpid()}-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; a plain output folder gets mkdir's mode
    try:
        write(tmp)
        move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
