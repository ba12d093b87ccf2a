"""The built book, as a reader's browser shows it.

Every document of _toc.yml is opened in headless Chromium from a local server, with every
request to anything but that server aborted (the book must read offline), and checked:
its title, its math typeset by the bundled MathJax, its figures decoded, the klpen source
listings of its chapters, its launch button, and that nothing it loads is missing or remote.
One full-page screenshot per document goes to _build/screenshots/.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def toc_files() -> list[str]:
    """Every document of _toc.yml (root first), as paths relative to the repository root."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part.get("chapters", [])]
    return files


PAGES = toc_files()
CHAPTERS = [page for page in PAGES if (ROOT / page).with_suffix(".ipynb").is_file()]

# Everything the checks need, gathered in the page in one pass once MathJax has finished.
COLLECT_JS = """
async () => {
  // Images may be lazy: ask for all of them now, then wait until each is decoded or failed.
  await Promise.all([...document.images].map(img => {
    img.loading = "eager";
    return img.decode().catch(() => null);
  }));
  let mathjax = null;
  if (window.MathJax && window.MathJax.startup) {
    await window.MathJax.startup.promise;
    mathjax = window.MathJax.version;
  }
  const article = document.querySelector("article.bd-article") || document.body;
  const h1 = article.querySelector("h1");
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, mjx-container, .highlight")
       .forEach(node => node.remove());
  const maths = [...article.querySelectorAll(".math")];
  return {
    title: document.title,
    h1: h1 ? h1.textContent.replace(/#$/, "").trim() : null,
    h1_visible: h1 ? h1.getBoundingClientRect().height > 0 : false,
    mathjax: mathjax,
    math_elements: maths.length,
    math_typeset: maths.filter(m => m.querySelector("mjx-container")).length,
    math_errors: article.querySelectorAll("mjx-merror").length,
    prose: prose.innerText,
    images: [...document.images].map(img => ({
      src: img.currentSrc || img.src, width: img.naturalWidth, complete: img.complete})),
    outputs: [...article.querySelectorAll(".cell_output pre")].map(pre => pre.textContent),
    signatures: [...article.querySelectorAll("dl.py > dt[id]")].map(dt => dt.id),
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
  };
}
"""


@dataclass
class PageReport:
    name: str
    url: str
    data: dict[str, Any]
    requests: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


_REPORTS: dict[str, PageReport] = {}


@pytest.fixture
def report(
    request: pytest.FixtureRequest, site: str, browser: Any, screenshots: Path
) -> PageReport:
    """Open a document of the book once, collect what the checks need, take its screenshot."""
    page_name: str = request.param
    if page_name in _REPORTS:
        return _REPORTS[page_name]
    url = site + page_name + ".html"
    local = urlsplit(site).netloc
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    rep = PageReport(name=page_name, url=url, data={})

    def route(route: Any) -> None:
        request_url = route.request.url
        if urlsplit(request_url).netloc == local or request_url.startswith("data:"):
            route.continue_()
        else:
            rep.blocked.append(request_url)
            route.abort()

    context.route("**/*", route)
    page.on("request", lambda req: rep.requests.append(req.url))
    page.on("requestfailed", lambda req: rep.failed.append(f"{req.url} ({req.failure})"))

    def response(res: Any) -> None:
        if res.status >= 400:
            rep.failed.append(f"{res.url} (HTTP {res.status})")

    page.on("response", response)
    page.on("pageerror", lambda exc: rep.errors.append(str(exc)))
    page.goto(url, wait_until="load")
    rep.data = page.evaluate(COLLECT_JS)
    page.screenshot(path=str(screenshots / (page_name.replace("/", "__") + ".png")), full_page=True)
    context.close()
    _REPORTS[page_name] = rep
    return rep


def pages(names: list[str]) -> Any:
    return pytest.mark.parametrize("report", names, indirect=True, ids=names)


def source_title(page_name: str) -> str:
    """The H1 of a document, read from its source (the first markdown cell of a notebook)."""
    notebook = (ROOT / page_name).with_suffix(".ipynb")
    if notebook.is_file():
        cells = json.loads(notebook.read_text())["cells"]
        text = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
    else:
        text = (ROOT / page_name).with_suffix(".md").read_text()
    match = re.search(r"^# (.+)$", text, flags=re.MULTILINE)
    assert match, f"{page_name}: no '# Title' line in its source"
    return match.group(1).strip()


def test_toc_lists_every_chapter_and_the_reference() -> None:
    assert PAGES[0] == "book/intro"
    for name in ("book/api", "book/references"):
        assert name in PAGES
    assert all((ROOT / p).with_suffix(".md").is_file() or p in CHAPTERS for p in PAGES)


@pages(PAGES)
def test_page_shows_its_title(report: PageReport) -> None:
    data = report.data
    assert data["h1"] == source_title(report.name)
    assert data["h1_visible"]
    assert data["title"].startswith(data["h1"])


@pages(PAGES)
def test_nothing_remote_nothing_missing(report: PageReport) -> None:
    assert report.requests, "the page made no request at all"
    assert report.blocked == [], "the page tried to load from outside the book"
    assert report.failed == []
    assert report.errors == [], "uncaught JavaScript errors"


@pages(PAGES)
def test_math_is_typeset(report: PageReport) -> None:
    data = report.data
    if data["math_elements"]:
        assert data["mathjax"], "the page has math but MathJax did not start"
        assert data["mathjax"].startswith("3.")
    assert data["math_typeset"] == data["math_elements"]
    assert data["math_errors"] == 0, "TeX errors in the page's math"
    # Any $...$, $$, \( or \[ left in the prose is math that the parser did not see.
    raw = re.findall(r"\$\$|\$[^$\s][^$\n]*\$|\\\(|\\\[", data["prose"])
    assert raw == []


@pages(PAGES)
def test_images_load(report: PageReport) -> None:
    broken = [img["src"] for img in report.data["images"] if not img["width"]]
    assert broken == []


@pages(CHAPTERS)
def test_chapter_shows_klpen_source(report: PageReport) -> None:
    # klpen_book.show_source prints "# klpen.module.name" and then the code.
    listings = [o for o in report.data["outputs"] if o.startswith(("# klpen.", "# klpen_book."))]
    assert listings, "no klpen source listing in the chapter"
    assert any(re.search(r"^(def|class) ", o, flags=re.MULTILINE) for o in listings)


@pages(CHAPTERS)
def test_launch_button_opens_this_notebook_in_binder(report: PageReport) -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]
    org_repo = urlsplit(repo["url"]).path.strip("/")
    notebook = report.name + ".ipynb"
    path = (repo.get("path_to_book") or "").strip("/")
    path = f"{path}/{notebook}" if path else notebook
    assert (ROOT / path).is_file()
    prefix = {"classic": "tree", "jupyterlab": "lab/tree"}[
        config["launch_buttons"]["notebook_interface"]
    ]
    binder = config["launch_buttons"]["binderhub_url"].rstrip("/")
    expected = f"{binder}/v2/gh/{org_repo}/{repo['branch']}?urlpath={prefix}/{path}"
    assert expected in report.data["links"]


@pages(["book/api"])
def test_api_page_documents_every_public_name(report: PageReport) -> None:
    import klpen

    documented = set(report.data["signatures"])
    public = {f"klpen.{name}" for name in klpen.__all__ if name != "__version__"}
    import klpen.distributed

    public |= {f"klpen.distributed.{name}" for name in klpen.distributed.__all__}
    assert public - documented == set()
    assert "Example" in report.data["prose"]
