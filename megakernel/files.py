"""Files megakernel writes (the kernel cache, hang reports): only in folders that this user alone can
write, each file created exclusively under an unguessable name, so that another user can neither
plant a file where one is read nor redirect a write with a symlink."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import BackendError


def private_dir(path: Path) -> Path:
    """``path``, made if missing (mode 0700); refused unless it is a real folder of this user's that no
    one else can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise BackendError(f"{path} is not a folder that only this user can write (owner uid {info.st_uid}, mode "
                           f"{stat.filemode(info.st_mode)}): megakernel will not read or write files there; "
                           f"remove it, or point MEGAKERNEL_CACHE_DIR / TMPDIR elsewhere")
    return path


def write_new(folder: Path, prefix: str, suffix: str, data: str) -> Path:
    """A new file of ``folder`` holding ``data``, named ``prefix<random>suffix``, created exclusively."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    with os.fdopen(fd, "w") as file:
        file.write(data)
    return Path(name)


def replace_with(path: Path, data: str) -> None:
    """Write ``path`` whole or not at all: a new file of its folder, then renamed over it."""
    os.replace(write_new(path.parent, f".{path.name}.", ".tmp", data), path)


def reports_dir() -> Path:
    """Where hang reports go: a folder of this user's in the temp folder."""
    return private_dir(Path(tempfile.gettempdir()) / f"megakernel-{os.getuid()}")
