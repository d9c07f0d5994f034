"""files.atomic_output: a regular file is replaced whole; a symlink is followed, and a device or a FIFO
is written in place (never replaced by a regular file: ``--metrics-out /dev/null`` as root replaced it)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from staleness_metrics.files import atomic_output, write_whole


def _read_in_background(path: Path) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(path.read_bytes()), daemon=True)  # (blocks until a writer)
    reader.start()
    return reader, got


def test_a_fifo_is_written_in_place_for_its_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader, got = _read_in_background(fifo)
    with atomic_output(fifo) as handle:
        handle.write(b"one\ntwo\n")
    reader.join(timeout=30)
    assert got == [b"one\ntwo\n"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo"]  # no temp file beside it


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_is_written_not_replaced(tmp_path: Path) -> None:
    null = tmp_path / "null"  # (the null device, made here: never the machine's /dev/null)
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_whole(null, "gone\n")
    assert stat.S_ISCHR(null.lstat().st_mode) and null.read_bytes() == b""


def test_a_symlink_is_followed_and_its_target_replaced_whole(tmp_path: Path) -> None:
    target, link = tmp_path / "page.html", tmp_path / "link.html"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target.name)
    write_whole(link, "new")
    assert link.is_symlink() and link.readlink() == Path("page.html")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_link_to_a_pipe_like_dev_stdout_writes_into_the_pipe(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{write_end}")  # what /dev/stdout is when stdout is a pipe
    try:
        write_whole(link, "a line\n")
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == b"a line\n" and link.is_symlink()


def test_dev_stdout_onto_a_file_is_appended_to_not_replaced(tmp_path: Path) -> None:
    """``replay --metrics-out /dev/stdout >> all.jsonl``: written into what the shell opened (docs/replay.md:
    "a device ... is written as it goes"); it replaced the file, so its lines and later output were lost."""
    log = tmp_path / "all.jsonl"
    log.write_bytes(b"kept\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)  # a command's stdout under `>> all.jsonl`
    try:
        write_whole(Path(f"/proc/self/fd/{fd}"), "new\n")  # (/dev/stdout is /proc/self/fd/1)
        os.write(fd, b"after\n")  # the shell's later output, through the same descriptor
    finally:
        os.close(fd)
    assert log.read_bytes() == b"kept\nnew\nafter\n"


@pytest.mark.parametrize("redirect", ["wb", "ab"], ids=[">", ">>"])
def test_dev_stdout_is_written_through_the_commands_own_stdout(tmp_path: Path, redirect: str) -> None:
    """``( replay --metrics-out /dev/stdout; echo after ) > log``: the lines go where the shell's stdout stands,
    and what comes after follows them (a file of its own open at the end was overwritten by it)."""
    out = tmp_path / "log"
    with out.open(redirect) as log:
        log.write(b"kept\n")
        log.flush()
        code = "from pathlib import Path; from staleness_metrics import files; "
        code += "files.write_whole(Path('/dev/stdout'), 'new\\n')"
        subprocess.run([sys.executable, "-c", code], stdout=log, check=True, cwd=Path(__file__).resolve().parents[1])
        log.write(b"after\n")
    assert out.read_bytes() == b"kept\nnew\nafter\n"


_FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from staleness_metrics.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX file size limits")
def test_a_full_output_is_named_among_several(tmp_path: Path) -> None:
    """A disk that fills (here: the file size limit, EFBIG) names the output it filled, not a bare
    ``[Errno 27]``: replay writes two outputs, and the one that failed is not replaced."""
    events = tmp_path / "events.jsonl"
    lines = [f'{{"type": "rollout", "rollout": {{"id": "r{i}", "dispatch_version": 0, "samples": '
             f'[{{"mask": {[1] * 200}}}]}}}}' for i in range(20)]  # fmt: skip
    events.write_text("\n".join([*lines, '{"type": "ship", "step": 1}']) + "\n")
    small, big = tmp_path / "metrics.jsonl", tmp_path / "batches.jsonl"
    args = ["replay", str(events), "--metrics-out", str(small), "--batches-out", str(big), "--no-progress"]
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMITED, *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert f"File too large: '{big}'" in done.stderr, done.stderr
    assert not big.exists() and not small.exists()


def test_a_full_device_is_named(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with pytest.raises(OSError, match="No space left on device: '/dev/full'"), atomic_output(Path("/dev/full")) as out:
        out.write(b"x" * 100_000)
