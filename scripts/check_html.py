"""Open HTML reports in headless Chromium as a reader would: every <img> must load (natural width
> 0) and the page must not scroll sideways at 1280 px; a screenshot is saved beside each report.

    python scripts/check_html.py REPORT.html [...] [--width 1280] [--shots DIR]

Exit 0 when every page passes, 1 when one fails (each problem on its own line), 3 when no Chromium
is installed (scripts/check_html.sh installs Debian's ``chromium`` first where it can).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
#: appended to a copy of the page: after load, the page writes what it found into <body> attributes
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const broken = imgs.filter((i) => !i.complete || i.naturalWidth === 0).map((i) => i.alt || i.src.slice(0, 60));
  const wide = document.documentElement.scrollWidth - window.innerWidth;
  const b = document.body;
  b.setAttribute("data-kvb-images", String(imgs.length));
  b.setAttribute("data-kvb-broken", JSON.stringify(broken));
  b.setAttribute("data-kvb-overflow", String(Math.max(0, wide)));
});
</script>"""


def browser() -> str | None:
    return next((p for p in (shutil.which(b) for b in BROWSERS) if p), None)


def _chromium(exe: str, width: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage",
           f"--window-size={width},1000", "--virtual-time-budget=10000", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def check(page: Path, width: int = 1280, shot: Path | None = None, exe: str | None = None) -> list[str]:
    """The problems a reader of ``page`` would see ([] when none)."""
    exe = exe or browser()
    if exe is None:
        raise FileNotFoundError("no chromium installed")
    html = page.read_text(encoding="utf-8")
    probed = html.replace("</body>", PROBE + "</body>") if "</body>" in html else html + PROBE
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(probed, encoding="utf-8")
        for img in re.findall(r'<img[^>]+src="(?!data:)([^"]+)"', html):  # relative images travel along
            src = page.parent / img
            if src.is_file():
                (Path(tmp) / img).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, Path(tmp) / img)
        dom = _chromium(exe, width, "--dump-dom", copy.as_uri())
        if shot is not None:
            _chromium(exe, width, f"--screenshot={shot}", page.resolve().as_uri())
    m = re.search(r"<body[^>]*data-kvb-images=\"(\d+)\"[^>]*>", dom.stdout)
    if not m:
        return [f"{page}: the page did not finish loading in headless Chromium ({dom.stderr.strip()[-200:]})"]
    tag = m.group(0)
    broken = re.search(r'data-kvb-broken="([^"]*)"', tag).group(1).replace("&quot;", '"')
    overflow = int(re.search(r'data-kvb-overflow="(\d+)"', tag).group(1))
    problems = []
    if broken not in ("[]", ""):
        problems.append(f"{page}: images that did not load: {broken}")
    if overflow > 0:
        problems.append(f"{page}: the page is {overflow} px wider than a {width} px window (horizontal scrolling)")
    if shot is not None and not (shot.exists() and shot.stat().st_size > 0):
        problems.append(f"{page}: no screenshot was written")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--shots", type=Path, default=None, help="folder for the screenshots (default: beside each page)")
    args = ap.parse_args(argv)
    exe = browser()
    if exe is None:
        print("skipped: no Chromium installed (scripts/check_html.sh installs Debian's chromium)", file=sys.stderr)
        return 3
    failed = False
    for page in args.pages:
        shot = (args.shots or page.parent) / f"{page.stem}.screenshot.png"
        problems = check(page, args.width, shot, exe)
        for p in problems:
            print(p, file=sys.stderr)
        failed |= bool(problems)
        print(f"{page}: {'FAIL' if problems else 'ok'} (screenshot {shot})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
