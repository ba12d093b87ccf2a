"""The book's layout at a desktop width (1280 px) and a phone width (390 px).

Issue 14, items 1, 3 and 5, on every document of _toc.yml at both widths:

- no display equation is wider than the column it sits in, nor than its own box, which a
  numbered equation shares with its equation number (a wide one would be cut off or scroll
  sideways: at 390 px the box of a numbered equation is some 65 px narrower than the column);
- no figure is displayed at less than half its natural width (a 2x image for sharp screens is
  fine; less means its text is too small to read), and every image has alt text;
- one header bar and one search control, not an empty second bar with a duplicate search box;
- no page is wider than the viewport (the API page was 627 px wide on a 390 px phone).

Issue 23: every numbered chapter shows at least one figure with alt text, inside the chapter's
own content (not the theme's logo or launch icons).
"""

from __future__ import annotations

from typing import Any

import pytest

from .test_book import CHAPTERS, PAGES

WIDTHS = (1280, 390)

LAYOUT_JS = """
async () => {
  await Promise.all([...document.images].map(img => {
    img.loading = "eager";
    return img.decode().catch(() => null);
  }));
  if (window.MathJax && window.MathJax.startup) await window.MathJax.startup.promise;
  const article = document.querySelector("article.bd-article") || document.body;
  const style = getComputedStyle(article);
  const column = article.clientWidth - parseFloat(style.paddingLeft)
                 - parseFloat(style.paddingRight);
  const visible = el => {
    const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== "hidden" && s.display !== "none";
  };
  const label = el => {
    const tex = el.querySelector("mjx-assistive-mml math");
    return (tex ? tex.getAttribute("alttext") || tex.textContent : el.textContent)
      .replace(/\\s+/g, " ").trim().slice(0, 70);
  };
  return {
    viewport: window.innerWidth,
    page_width: document.documentElement.scrollWidth,
    column: column,
    maths: [...article.querySelectorAll('mjx-container[display="true"]')].map(c => {
      const m = c.querySelector("mjx-math");
      // The box the equation may use: the container, less what a float (the equation number)
      // takes from it. A wider equation scrolls inside it, cut off at the box's edge.
      return {width: m ? m.getBoundingClientRect().width : 0, box: c.clientWidth,
              text: label(c)};
    }),
    images: [...article.querySelectorAll("img")].map(img => ({
      src: img.getAttribute("src"), alt: img.getAttribute("alt"),
      shown: img.getBoundingClientRect().width, natural: img.naturalWidth,
      // a figure of the chapter's own: a plot cell's output or a {figure} directive, not an icon
      content: !!img.closest(".cell_output, figure, .figure, .output")})),
    search_controls: [...document.querySelectorAll(
      ".search-button, .search-button-field, form.bd-search")].filter(visible).length,
    header_bars: [...document.querySelectorAll(".bd-header, .bd-header-article")]
      .filter(visible).map(el => el.className),
  };
}
"""

_LAYOUTS: dict[tuple[str, int], dict[str, Any]] = {}


@pytest.fixture
def layout(request: pytest.FixtureRequest, site: str, browser: Any) -> dict[str, Any]:
    """The layout measurements of one document at one viewport width (measured once)."""
    page_name, width = request.param
    key = (page_name, width)
    if key not in _LAYOUTS:
        context = browser.new_context(viewport={"width": width, "height": 900})
        page = context.new_page()
        page.goto(site + page_name + ".html", wait_until="load")
        _LAYOUTS[key] = page.evaluate(LAYOUT_JS)
        context.close()
    return _LAYOUTS[key]


CASES = [(page, width) for width in WIDTHS for page in PAGES]
IDS = [f"{page}@{width}px" for page, width in CASES]
each_page = pytest.mark.parametrize("layout", CASES, indirect=True, ids=IDS)


def too_wide_equations(layout: dict[str, Any]) -> list[str]:
    """The display equations wider than the column or than their own box, with their widths."""
    return [
        f"{math['width']:.0f} px: {math['text']}"
        for math in layout["maths"]
        if math["width"] > min(layout["column"], math["box"]) + 1
    ]


@each_page
def test_no_display_equation_is_wider_than_its_column(layout: dict[str, Any]) -> None:
    too_wide = too_wide_equations(layout)
    assert not too_wide, f"column {layout['column']:.0f} px; too wide: {too_wide}"


def test_the_equation_check_sees_the_equation_number() -> None:
    # At 390 px chapter 6's eq. 16 was 324 px wide in a 358 px column, but its box, the column
    # less the equation number, was 293 px: it scrolled, cut after `sd_π(`. The check must see it.
    numbered = {"column": 358.0, "maths": [{"width": 324.0, "box": 293.0, "text": "P(ρ<0)"}]}
    assert too_wide_equations(numbered) == ["324 px: P(ρ<0)"]
    unnumbered = {"column": 358.0, "maths": [{"width": 324.0, "box": 358.0, "text": "P(ρ<0)"}]}
    assert too_wide_equations(unnumbered) == []


@each_page
def test_no_figure_is_shrunk_below_half_its_width(layout: dict[str, Any]) -> None:
    shrunk = [
        f"{image['src']}: {image['shown']:.0f} of {image['natural']} px"
        for image in layout["images"]
        if image["natural"] and image["shown"] < image["natural"] / 2 - 1
    ]
    assert not shrunk, shrunk


def has_alt_text(image: dict[str, Any]) -> bool:
    """Alt text that describes: ten characters at least, and not MyST-NB's fallback file name."""
    alt = (image["alt"] or "").strip()
    return len(alt) >= 10 and not alt.lower().endswith((".png", ".svg", ".jpg"))


@each_page
def test_every_image_has_alt_text(layout: dict[str, Any]) -> None:
    # MyST-NB's fallback alt text is the image's file name: that is no description.
    missing = [image["src"] for image in layout["images"] if not has_alt_text(image)]
    assert not missing, f"images without alt text: {missing}"


@each_page
def test_one_header_bar_and_one_search_control(layout: dict[str, Any]) -> None:
    assert layout["search_controls"] == 1, layout
    assert len(layout["header_bars"]) == 1, layout["header_bars"]


@each_page
def test_page_is_not_wider_than_the_viewport(layout: dict[str, Any]) -> None:
    assert layout["page_width"] <= layout["viewport"], layout["page_width"]


CHAPTER_CASES = [(page, 390) for page in CHAPTERS]
CHAPTER_IDS = [f"{page}@390px" for page, _ in CHAPTER_CASES]


@pytest.mark.parametrize("layout", CHAPTER_CASES, indirect=True, ids=CHAPTER_IDS)
def test_every_numbered_chapter_shows_a_figure_with_alt_text(layout: dict[str, Any]) -> None:
    figures = [image for image in layout["images"] if image["content"] and image["natural"]]
    described = [image for image in figures if has_alt_text(image)]
    assert described, f"no figure with alt text in the chapter: {layout['images']}"
