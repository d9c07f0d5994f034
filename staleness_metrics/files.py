"""Files replaced whole: a temp file beside the target, renamed over it once written."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class _Output(io.BufferedWriter):
    """An output whose failed writes name it: a full disk says which of the outputs it filled."""

    def __init__(self, file: int | str, mode: str, path: Path) -> None:
        super().__init__(io.FileIO(file, mode))
        self.path = str(path)

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as error:
            raise self.named(error) from None

    def flush(self) -> None:  # (close flushes through it too)
        try:
            super().flush()
        except OSError as error:
            raise self.named(error) from None

    def named(self, error: OSError) -> OSError:
        error.filename = error.filename or self.path
        return error


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[IO[bytes]]:
    """A temp file beside ``path`` (binary), replacing it only if the block succeeds, with the mode
    of the file it replaces, else ``0o666`` less the umask (not mkstemp's 0o600). A symlink's target
    is replaced; a device or FIFO is streamed in place, and /dev/stdout through our own stdout."""
    if (path.exists() and not path.is_file()) or path.absolute().parts[1] in ("dev", "proc"):
        stdout = str(path) == "/dev/stdout"
        with _Output(os.dup(1) if stdout else str(path), "wb" if stdout else "ab", path) as handle:
            yield handle
        return
    given, path = path, Path(os.path.realpath(path))
    os.umask(umask := os.umask(0o022))  # (read, and put back)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~umask
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with _Output(fd, "wb", given) as handle:
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
