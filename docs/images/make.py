"""Regenerate the report pictures of the docs: the demo's run, its HTML report, screenshots by headless Chromium.

    python docs/images/make.py            # writes docs/images/report-*.png (about two minutes)

Needs the package installed (``pip install -e '.[docs]'``: Pillow crops the screenshots) and Debian's
``chromium``. The demo is seeded, so the pictures change only when the demo or the report does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

HERE = Path(__file__).resolve().parent
WIDTH = 1100
# picture -> the element of the report it shows (a CSS selector), and the most of it kept (CSS pixels)
PICTURES = {
    "report-overview.png": ("body", 1080),
    "report-costs.png": ("#what-staleness-costs", 940),
    "report-bound.png": ("#choosing-the-bound", 1500),
}
MARGIN = 16  # CSS pixels kept above a section
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--force-device-scale-factor=1", "--hide-scrollbars",
)  # fmt: skip


def chromium(*args: str) -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("make.py: chromium is not installed (Debian package chromium)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return done.stdout


def boxes(page: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The page height and the (top, height) of each picture's element, measured in a copy of the page
    without its Content-Security-Policy (which forbids scripts)."""
    selectors = json.dumps({name: selector for name, (selector, _) in PICTURES.items()})
    script = (
        f"<script>const s = {selectors}; const out = {{}};"
        "for (const [k, q] of Object.entries(s)) { const r = document.querySelector(q).getBoundingClientRect();"
        " out[k] = [Math.round(r.top + scrollY), Math.round(r.height)]; }"
        "const pre = document.createElement('pre'); pre.id = 'measure';"
        "pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight, boxes: out});"
        "document.body.appendChild(pre);</script>"
    )
    html = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text(encoding="utf-8"))
    probe = page.with_name("probe.html")
    probe.write_text(html.replace("</body>", script + "</body>"), encoding="utf-8")
    dom = chromium(f"--window-size={WIDTH},1000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="measure">(.*?)</pre>', dom, re.S)
    assert found, "nothing measured"
    data = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return int(data["height"]), {k: (int(v[0]), int(v[1])) for k, v in data["boxes"].items()}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="staleness-docs-") as tmp:
        work = Path(tmp)
        cli = [sys.executable, "-m", "staleness_metrics.cli"]
        subprocess.run([*cli, "demo", "--speed", "0", "--no-wandb", "--prometheus-port", "0"],
                       cwd=work, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run([*cli, "report", "staleness-demo", "-o", "report.html"], cwd=work, check=True)
        page = work / "report.html"
        height, measured = boxes(page)
        full = work / "full.png"
        chromium(f"--window-size={WIDTH},{height}", f"--screenshot={full}", page.as_uri())
        with Image.open(full) as image:
            for name, (_, most) in PICTURES.items():
                top, tall = measured[name]
                top = max(top - MARGIN, 0)
                crop = image.crop((0, top, WIDTH, top + min(tall + MARGIN, most))).convert("RGB")
                crop.quantize(colors=128).save(HERE / name, optimize=True)
                print(f"wrote {HERE / name} ({crop.height} px)")


if __name__ == "__main__":
    main()
