"""Headless Chromium for report tests: a screenshot, the console messages, and where each chart sits."""

from __future__ import annotations

import html as html_module
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.programs import requires_program

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--force-device-scale-factor=1",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
)
WIDTH = 1100

# Skipped on a developer machine without chromium; under CI a missing browser fails the test instead.
requires_chromium = requires_program(
    CHROMIUM if Path(CHROMIUM).exists() else None, "chromium is not installed (Debian package chromium)"
)

# Appended to a copy of the page (without its Content-Security-Policy, which forbids scripts) to read
# the layout; the screenshot is taken of the page itself.
_MEASURE = """<script>
const charts = [...document.querySelectorAll("figure.chart")].map(f => {
  const r = f.querySelector("svg").getBoundingClientRect();
  return {key: f.dataset.chart, x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height};
});
const out = document.createElement("pre");
out.id = "measure";
out.textContent = JSON.stringify({height: document.documentElement.scrollHeight, charts});
document.body.appendChild(out);
</script>"""


@dataclass(frozen=True)
class Box:
    key: str
    x: int
    y: int
    w: int
    h: int


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=300,  # a hang guard, not a performance check
            check=False,
        )


def console_messages(stderr: str) -> list[str]:
    """What the page logged to its console (script errors included)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def probe(page: Path, script: str) -> Any:
    """What ``script`` (a JavaScript expression) evaluates to in Chromium on a copy of ``page`` (without its
    Content-Security-Policy, which forbids scripts), as JSON data."""
    html = page.read_text(encoding="utf-8")
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    copy = page.with_name(page.stem + ".probe.html")
    measure = (
        '<script>const out = document.createElement("pre"); out.id = "measure"; '
        f"out.textContent = JSON.stringify({script}); document.body.appendChild(out);</script>"
    )
    copy.write_text(html.replace("</body>", measure + "</body>"), encoding="utf-8")
    result = _chromium(f"--window-size={WIDTH},1000", "--dump-dom", copy.as_uri())
    match = re.search(r'<pre id="measure">(.*?)</pre>', result.stdout, re.S)
    assert match, f"nothing measured: {result.stderr[-2000:]}"
    return json.loads(html_module.unescape(match.group(1)))


def chart_boxes(page: Path) -> tuple[int, list[Box]]:
    """The page height and the box of every chart's SVG, in CSS pixels."""
    html = page.read_text(encoding="utf-8")
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    probe = page.with_name(page.stem + ".measure.html")
    probe.write_text(html.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    result = _chromium(f"--window-size={WIDTH},1000", "--dump-dom", probe.as_uri())
    match = re.search(r'<pre id="measure">(.*?)</pre>', result.stdout, re.S)
    assert match, f"no layout measured: {result.stderr[-2000:]}"
    data = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    boxes = [Box(c["key"], round(c["x"]), round(c["y"]), round(c["w"]), round(c["h"])) for c in data["charts"]]
    return int(data["height"]), boxes


def screenshot(page: Path, out: Path, height: int) -> list[str]:
    """Take a full-page screenshot of ``page`` into ``out``; returns the console messages."""
    result = _chromium(f"--window-size={WIDTH},{height}", f"--screenshot={out}", page.as_uri())
    assert out.is_file(), f"no screenshot: {result.stderr[-2000:]}"
    return console_messages(result.stderr)
