"""The HTML reports in a real browser: headless Chromium loads a report page, every <img> decodes and
nothing scrolls sideways at 1280 px; a page with a broken image and a too-wide block fails (so the
check can fail). Skipped, with the reason, where no Chromium is installed (scripts/check_html.sh
installs Debian's chromium)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_html", ROOT / "scripts" / "check_html.py")
check_html = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_html)

pytestmark = pytest.mark.skipif(
    check_html.browser() is None, reason="no Chromium installed (scripts/check_html.sh installs Debian's chromium)"
)


def _report(tmp_path: Path) -> Path:
    """A report page as the harness writes it: a wide verdict table with long reasons and a figure."""
    import matplotlib

    matplotlib.use("Agg")
    from kvcmas_bench.report.columns import Column
    from kvcmas_bench.report.plots import Figure
    from kvcmas_bench.report.render import Document, Section, to_html

    fig_dir = tmp_path / "figures"
    fig_dir.mkdir()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 1, 2], [1, 3, 2])
    fig.savefig(fig_dir / "f.png")
    fig.savefig(fig_dir / "f.svg")
    plt.close(fig)
    long = "point shared=max,qps=max: inconclusive (2.4 [0, inf]: the 95% interval straddles ratio >= 2) " * 4
    rows = [{"claim": f"claim-{i}", "verdict": "inconclusive", "reason": long} for i in range(6)]
    cols = [Column("claim", "claim", "text", justify="left"), Column("verdict", "verdict", "text", justify="left"),
            Column("reason", "why", "text", justify="left")]  # fmt: skip
    doc = Document("report", ["intro " * 40], [Section("Verdicts", cols, rows)],
                   [Figure("f", "a figure", fig_dir / "f.png", fig_dir / "f.svg")])  # fmt: skip
    page = tmp_path / "report.html"
    page.write_text(to_html(doc))
    return page


def test_a_report_page_loads_every_image_and_fits_1280_px(tmp_path):
    page = _report(tmp_path)
    shot = tmp_path / "shot.png"
    assert check_html.check(page, 1280, shot) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_broken_image_and_a_wide_block_are_reported(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><img alt="missing" src="nowhere.png">'
        '<div style="width:3000px">wide</div></body></html>'
    )
    problems = check_html.check(page, 1280)
    assert any("did not load" in p and "missing" in p for p in problems)
    assert any("wider than a 1280 px window" in p for p in problems)


def test_the_reproduce_report_in_a_browser(tmp_path):
    """reproduce.html with every claim (long reasons, the paper's words) and a figure."""
    from kvcmas_bench.jobs import reproduce as job
    from kvcmas_bench.reproduce.claims import load_claims
    from kvcmas_bench.reproduce.plan import plan
    from kvcmas_bench.reproduce.rules import Verdict

    exps = plan("smoke")
    (tmp_path / "rank" / "figures").mkdir(parents=True)
    (tmp_path / "x").mkdir()
    _report(tmp_path / "x")  # for its figure
    (tmp_path / "x" / "figures" / "f.png").rename(tmp_path / "rank" / "figures" / "rank_mmlu.png")
    res = job.ReproduceResult(tmp_path, exps)
    why = "point shared=max,qps=max: inconclusive (2.4 [0, inf]: the 95% interval straddles ratio >= 2); " * 3
    res.outcomes = [job.Outcome(c, Verdict("inconclusive", 2.4, 0.0, float("inf"), 12, why)) for c in load_claims()]
    files = job.write_report(res, tmp_path, job.ReproduceOptions(output_path=str(tmp_path)))
    page = next(f for f in files if f.name == "reproduce.html")
    assert check_html.check(page, 1280, tmp_path / "shot.png") == []
