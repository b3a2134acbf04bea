"""``course site``: every page loads in a real headless Chromium, its images are there, and the chapter links work."""

import os
from pathlib import Path

import pytest

import conftest
from browser import CHROMIUM, Browser
from conftest import OUT, PROFILE, notebook_claims
from course_lib.tools import runner, site

if CHROMIUM is None and os.environ.get("CI") != "true":  # CI installs it (.ci/run) and must run this test
    pytest.skip("Chromium is not installed (Debian: apt-get install chromium)", allow_module_level=True)

IMAGES_OK = "Array.from(document.images).map(i => [i.currentSrc.slice(0, 60), i.complete && i.naturalWidth > 0])"
LINKS = "Array.from(document.querySelectorAll('a')).map(a => a.href).filter(h => h.startsWith('file:'))"


@pytest.fixture(scope="module")
def built_site():
    for prefix in ("00", "01"):  # executed once per session, shared with test_nb_00/01
        notebook_claims(prefix)
    runs = [conftest._cache[k] for k in sorted(conftest._cache)]
    runner.write_report(runs, PROFILE, OUT)
    return site.build_site(OUT)


def test_every_page_loads_with_images_and_links(built_site, tmp_path):
    site_dir = built_site.parent
    pages = sorted(site_dir.glob("*.html"))
    assert len(pages) >= 3  # index + two chapters
    browser = Browser()
    try:
        seen_links = set()
        for page in pages:
            shot = OUT / "screenshots" / f"{page.stem}.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            images = browser.visit(page.as_uri(), IMAGES_OK, screenshot=shot)
            assert shot.stat().st_size > 10_000, f"{page.name}: the screenshot is blank"
            broken = [src for src, ok in images if not ok]
            assert not broken, f"{page.name}: images did not load: {broken}"
            if page.name != "index.html":
                assert images, f"{page.name} shows no image (its plots should be embedded)"
            seen_links.update(browser.visit(page.as_uri(), LINKS))
        chapter_links = {Path(link.split("#")[0].removeprefix("file://")) for link in seen_links}
        for target in chapter_links:
            assert target.exists(), f"a link points to a missing page: {target}"
        assert {p.name for p in pages} <= {t.name for t in chapter_links}, "some page is not linked from any page"
    finally:
        browser.close()
