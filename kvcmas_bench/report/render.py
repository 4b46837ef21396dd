"""Markdown and self-contained HTML renderings of a report document (tables and figures).

The HTML page embeds every figure as a base64 PNG (one file to mail or attach to CI); the
Markdown version links the PNG files and their SVG twins relative to the report directory.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

from .columns import Column, cell
from .plots import Figure
from .tables import MARK_ALPHA

_RULE = f"significantly higher than every sharing method below it: exact McNemar p < {MARK_ALPHA:g} against each"
#: how the best / second-best accuracy among the sharing methods is marked (the rule:
#: :func:`kvcmas_bench.report.tables.mark_best`)
MARK_NOTE = {
    "md": f"**bold**: best accuracy among the sharing methods; _italic_: second best ({_RULE}).",
    "html": f"<b>bold</b>: best accuracy among the sharing methods; <u>underlined</u>: second best ({_RULE}).",
    "console": f"¹ / ²: best / second-best accuracy among the sharing methods (McNemar p < {MARK_ALPHA:g}).",
}
#: the marks that emphasise a cell (``tied`` / ``tied-second`` are named in the section's notes)
SHOWN_MARKS = ("best", "second")


@dataclass
class Section:
    """One table of the report: rows are dicts keyed by the columns' keys; ``marks`` (per row,
    ``best``/``second``, or ``tied``/``tied-second``/``""`` shown plainly) mark the ``accuracy`` cell."""

    title: str
    columns: list[Column]
    rows: list[dict]
    marks: list[str] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Document:
    title: str
    intro: list[str]
    sections: list[Section]
    figures: list[Figure]
    definitions: list[str] = field(default_factory=list)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_WRAP = {"md": {"best": "**{}**", "second": "_{}_"}, "html": {"best": "<b>{}</b>", "second": "<u>{}</u>"}}


def _marked(text: str, c: Column, mark: str, style: str) -> str:
    """``text`` of an accuracy cell wrapped in the best / second-best mark of ``style``."""
    return _WRAP[style][mark].format(text) if c.key == "accuracy" and mark in SHOWN_MARKS else text


def _marked_any(s: Section) -> bool:
    return any(m in SHOWN_MARKS for m in s.marks or [])


def markdown(doc: Document, base: Path) -> str:
    """The report as Markdown; figure links relative to ``base``."""
    out = [f"# {doc.title}", ""]
    out += [f"- {line}" for line in doc.intro] + [""]
    for s in doc.sections:
        out += [f"## {s.title}", ""]
        out.append("| " + " | ".join(_md_cell(c.header) for c in s.columns) + " |")
        out.append("|" + "|".join("---" if c.justify == "left" else "---:" for c in s.columns) + "|")
        for i, row in enumerate(s.rows):
            mark = s.marks[i] if s.marks else ""
            cells = [_marked(_md_cell(cell(row.get(c.key), c.kind)), c, mark, "md") for c in s.columns]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        if _marked_any(s):
            out += [MARK_NOTE["md"], ""]
        out += [f"{n}  " for n in s.notes] + ([""] if s.notes else [])
    if doc.figures:
        out += ["## Figures", ""]
        for f in doc.figures:
            png, svg = f.png.relative_to(base).as_posix(), f.svg.relative_to(base).as_posix()
            out += [f"### {f.caption}", "", f"![{f.caption}]({png})", "", f"[SVG]({svg})", ""]
    if doc.definitions:
        out += ["## Definitions", ""] + [f"- {d}" for d in doc.definitions] + [""]
    return "\n".join(out)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { padding: 0.25em 0.6em; border-bottom: 1px solid #ddd; }
th { background: #f4f4f4; } td.r, th.r { text-align: right; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; } .note { color: #555; font-size: 0.9em; }
"""


def _html_table(s: Section) -> str:
    cls = ["" if c.justify == "left" else ' class="r"' for c in s.columns]
    head = "".join(f"<th{k}>{html.escape(c.header)}</th>" for c, k in zip(s.columns, cls))
    body = []
    for i, row in enumerate(s.rows):
        mark = s.marks[i] if s.marks else ""
        cells = [
            f"<td{k}>{_marked(html.escape(cell(row.get(c.key), c.kind)), c, mark, 'html')}</td>"
            for c, k in zip(s.columns, cls)
        ]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def to_html(doc: Document) -> str:
    """The report as one self-contained HTML page (figures inline as base64 PNG)."""
    parts = [
        "<!DOCTYPE html>",
        f'<html><head><meta charset="utf-8"><title>{html.escape(doc.title)}</title><style>{_CSS}</style></head><body>',
        f"<h1>{html.escape(doc.title)}</h1>",
        "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in doc.intro) + "</ul>",
    ]
    for s in doc.sections:
        parts += [f"<h2>{html.escape(s.title)}</h2>", _html_table(s)]
        if _marked_any(s):
            parts.append(f'<p class="note">{MARK_NOTE["html"]}</p>')
        parts += [f'<p class="note">{html.escape(n)}</p>' for n in s.notes]
    if doc.figures:
        parts.append("<h2>Figures</h2>")
    for f in doc.figures:
        data = base64.b64encode(f.png.read_bytes()).decode("ascii")
        cap = html.escape(f.caption)
        parts.append(
            f'<figure><img alt="{cap}" src="data:image/png;base64,{data}"><figcaption>{cap}</figcaption></figure>'
        )
    if doc.definitions:
        parts.append("<h2>Definitions</h2><ul>" + "".join(f"<li>{html.escape(d)}</li>" for d in doc.definitions))
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
