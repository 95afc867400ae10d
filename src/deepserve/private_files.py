"""Files only their owner may read: what a node keeps of its users (the
context registry with its prompts, the resolved config with its API keys)
and the health log operators tail (request ids, tenants, faults).

    write_private(path, data)   a unique temp file beside path (0600), written
                                whole, then renamed over path: a reader sees the
                                old file or the new one, never half of either, and
                                two writers never share a temp file
    open_private_append(path)   the file opened to append, created 0600, and an
                                existing one's mode narrowed to 0600

The process umask decides nothing here: with the usual 022 these files were
world-readable, and a temp file named by pid alone was shared by two
processes of the same pid in two containers over one state_dir.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

MODE = 0o600


def write_private(path: str | Path, data: bytes) -> None:
    """Replace path with data, owner-only; OSError if it cannot (nothing changed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp creates it 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_private_append(path: str | Path) -> BinaryIO:
    """path opened to append, unbuffered; created 0600, narrowed to 0600 if wider."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != MODE:
            os.fchmod(fd, MODE)
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise
