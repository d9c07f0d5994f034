"""Files replaced whole: a temp file beside the target, renamed over it once written."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[IO[bytes]]:
    """A temp file beside ``path`` (binary), replacing it only if the block succeeds, with the mode
    of the file it replaces, else ``0o666`` less the umask (not mkstemp's 0o600). A symlink's target
    is replaced; a device or FIFO is streamed in place, and /dev/stdout through our own stdout."""
    if (path.exists() and not path.is_file()) or path.absolute().parts[1] in ("dev", "proc"):
        with open(os.dup(1), "wb") if str(path) == "/dev/stdout" else path.open("ab") as handle:
            yield handle
        return
    path = Path(os.path.realpath(path))
    os.umask(umask := os.umask(0o022))  # (read, and put back)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~umask
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(fd, mode)
            yield handle
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_whole(path: Path, text: str) -> None:
    """``path`` holding ``text`` (UTF-8), or as it was if the write fails."""
    with atomic_output(path) as handle:
        handle.write(text.encode("utf-8"))
