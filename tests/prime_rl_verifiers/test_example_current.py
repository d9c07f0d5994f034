"""The committed example run in prime-rl's current layout is what the writer writes today."""

from __future__ import annotations

from pathlib import Path

import pyzstd

from tests.support.prime_rl_example import EXAMPLE_DIR, write_example


def _contents(root: Path) -> dict[str, bytes]:
    """Every file by path, sealed chunks decompressed (zstd's bytes may differ between library builds)."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        out[str(path.relative_to(root))] = pyzstd.decompress(data) if path.suffix == ".zst" else data
    return out


def test_the_example_is_up_to_date(tmp_path: Path) -> None:
    write_example(tmp_path / "run")
    fresh, committed = _contents(tmp_path / "run"), _contents(EXAMPLE_DIR)
    assert sorted(fresh) == sorted(committed), "regenerate with: python -m tests.support.prime_rl_example"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"{stale} differ; regenerate with: python -m tests.support.prime_rl_example"


def test_the_example_is_small_and_sealed() -> None:
    files = [p for p in EXAMPLE_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1 << 20
    chunks = sorted(p.name for p in (EXAMPLE_DIR / "monitors/file/traces/stream").iterdir())
    assert len(chunks) > 1 and all(name.endswith(".jsonl.zst") for name in chunks)
