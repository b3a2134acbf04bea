"""A static HTML version of the executed course (``course site``).

Reads the notebooks that ``course run`` executed into ``<build>/notebooks/``
and writes ``<build>/site/``: one page per chapter (outputs and plots
embedded), previous/next links between chapters, and an index with the
chapter list and the results report.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import mistune
import nbformat
from nbconvert import HTMLExporter

NAV_STYLE = ("<style>.course-nav{font:15px sans-serif;padding:10px 20px;background:#f4f4f4;border-bottom:1px solid #ddd}"
             ".course-nav a{margin-right:18px}</style>")


def _title(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if m:
                return m.group(1).strip()
    return fallback


def _nav(prev: tuple[str, str] | None, nxt: tuple[str, str] | None) -> str:
    links = ['<a href="index.html">Course index</a>']
    if prev:
        links.append(f'<a class="prev" href="{prev[0]}">&larr; {html.escape(prev[1])}</a>')
    if nxt:
        links.append(f'<a class="next" href="{nxt[0]}">{html.escape(nxt[1])} &rarr;</a>')
    return f'<nav class="course-nav">{"".join(links)}</nav>'


def build_site(build: str | Path = "build") -> Path:
    """Write ``<build>/site/index.html`` and one page per executed notebook; return the index path."""
    build = Path(build)
    executed = sorted((build / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not executed:
        raise FileNotFoundError(f"no executed notebooks under {build / 'notebooks'}: run `course run` first")
    site = build / "site"
    site.mkdir(parents=True, exist_ok=True)
    books = [nbformat.read(p, as_version=4) for p in executed]
    pages = [(p.stem + ".html", _title(nb, p.stem)) for p, nb in zip(executed, books)]
    exporter = HTMLExporter(template_name="lab")
    exporter.embed_images = True  # plots travel inside each page
    for i, nb in enumerate(books):
        body, _ = exporter.from_notebook_node(nb)
        nav = _nav(pages[i - 1] if i else None, pages[i + 1] if i + 1 < len(pages) else None)
        body = body.replace("<body", NAV_STYLE + "<body", 1)
        body = re.sub(r"(<body[^>]*>)", r"\1" + nav, body, count=1)
        body = body.replace("</body>", nav + "</body>", 1)
        (site / pages[i][0]).write_text(body)
    (site / "index.html").write_text(_index(build, pages))
    return site / "index.html"


def _index(build: Path, pages: list[tuple[str, str]]) -> str:
    results = json.loads((build / "results.json").read_text()) if (build / "results.json").exists() else {}
    chapters = "".join(f'<li><a href="{href}">{html.escape(title)}</a></li>' for href, title in pages)
    report_md = (build / "report.md").read_text() if (build / "report.md").exists() else "No report yet."
    # The report's images point into build/figures: make them relative to site/.
    report_md = re.sub(r"\]\((figures/[^)]+)\)", r"](../\1)", report_md)
    report_html = mistune.html(report_md)
    profile = html.escape(str(results.get("profile", "?")))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Training neural networks that do not fit"
            f"</title><style>body{{font:16px/1.5 sans-serif;max-width:960px;margin:2em auto;padding:0 1em}}"
            f"table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}img{{max-width:100%}}"
            f"</style></head><body><h1>Training neural networks that do not fit</h1>"
            f"<p>The executed course at profile <code>{profile}</code>.</p><h2>Chapters</h2><ul>{chapters}</ul>"
            f"<h2>Results</h2>{report_html}</body></html>")
