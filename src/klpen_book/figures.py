"""Figure sizes for the book's column.

The HTML book's text column is about 690 px wide at a 1280 px window and about 360 px on a
390 px phone. A figure drawn :data:`FIGURE_WIDTH` inches wide at :data:`FIGURE_DPI` is 640 px
wide: shown at its natural size on a desktop (so that Matplotlib's 10-point text is about
14 px high) and at more than half its size on a phone. Figures have at most two panels a row.

Every figure cell of a chapter carries the MyST-NB cell metadata
``{"mystnb": {"figure": {"caption": ..., "name": "fig-NN-slug"}, "image": {"alt": ...}}}``,
which renders it as a numbered figure with a caption and alt text (checked by
``tests/test_chapter_apparatus.py``).
"""

from __future__ import annotations

from typing import Any

FIGURE_DPI = 100
"""Dots per inch of every figure of the book (the inline backend draws at ``fig.dpi``)."""

FIGURE_WIDTH = 6.4
"""Width in inches of every figure of the book: 640 px at :data:`FIGURE_DPI`."""

FIGURE_SIZE = (FIGURE_WIDTH, 3.6)
"""Width and height in inches of a one-row figure."""

__all__ = [
    "FIGURE_DPI",
    "FIGURE_SIZE",
    "FIGURE_WIDTH",
    "layout_problems",
    "placement_diagram",
    "size_ticks",
]


def layout_problems(fig: Any) -> list[str]:
    """What breaks the book's figure rules in ``fig``; an empty list when nothing does.

    The rules: :data:`FIGURE_WIDTH` inches at :data:`FIGURE_DPI`, at most two panels a row,
    a y label on every panel of the first column and an x label on every panel of the last row.

    Args:
        fig: a :class:`matplotlib.figure.Figure`.

    Example:
        >>> from matplotlib.figure import Figure
        >>> fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
        >>> ax = fig.add_subplot()
        >>> layout_problems(fig)
        ['panel 0 has no y label', 'panel 0 has no x label']
        >>> _ = ax.set_xlabel("n"), ax.set_ylabel("KL")
        >>> layout_problems(fig)
        []
    """
    problems = []
    if fig.get_figwidth() != FIGURE_WIDTH or fig.dpi != FIGURE_DPI:
        problems.append(f"size {fig.get_figwidth()} in at {fig.dpi} dpi")
    positions = [ax.get_position() for ax in fig.axes]
    rows = [round(p.y0, 3) for p in positions]
    columns = [round(p.x0, 3) for p in positions]
    if rows and max(rows.count(row) for row in rows) > 2:
        problems.append("more than two panels in a row")
    for index, ax in enumerate(fig.axes):
        if columns[index] == min(columns) and not ax.get_ylabel():
            problems.append(f"panel {index} has no y label")
        if rows[index] == min(rows) and not ax.get_xlabel():
            problems.append(f"panel {index} has no x label")
    return problems


def size_ticks(ax: Any, sizes: list[int]) -> None:
    """Label a logarithmic x axis at exactly ``sizes``, as ``64`` or ``128k``, no minor ticks.

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = Figure().add_subplot()
        >>> ax.set_xscale("log")
        >>> size_ticks(ax, [64, 4000, 128_256])
        >>> [t.get_text() for t in ax.get_xticklabels()]
        ['64', '4k', '128k']
    """
    ax.set_xticks(sizes, [str(n) if n < 1000 else f"{n / 1000:.0f}k" for n in sizes])
    ax.xaxis.set_minor_locator(_null_locator())


def _null_locator() -> Any:
    from matplotlib.ticker import NullLocator

    return NullLocator()


#: The two placements of chapter 7's diagram: title, what the trainer adds, what it descends.
PLACEMENTS = (
    (
        "KL in the reward (PPO-style RLHF)",
        "each token's reward gets  −β·k1,\nthe score is added at the last token",
        "policy gradient of  E[s] − β·KL(π‖π_ref)\nthe reverse KL, unbiased in expectation",
    ),
    (
        "KL in the loss (GRPO-style)",
        "loss  +=  β·k(ρ) per token,\ndifferentiated through ρ = log π − log π_ref",
        "k2, k1+, k3+:  reverse KL, per position\nk3: forward KL     k1: zero on average",
    ),
)


def placement_diagram() -> Any:
    """Chapter 7's diagram: where the penalty goes, and which gradient each placement gives.

    Two rows, one per placement, each a box for what the trainer does and a box for the
    gradient it follows, drawn large enough to read on a 390 px phone (text of 16 points
    at :data:`FIGURE_WIDTH` inches).

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Example:
        >>> fig = placement_diagram()
        >>> len(fig.axes), float(fig.get_figwidth())
        (1, 6.4)
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    fig = Figure(figsize=(FIGURE_WIDTH, 6.2), dpi=FIGURE_DPI)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("placement")
    ax.set_ylabel("gradient")
    ax.axis("off")
    colours = ("#d6e6f5", "#fbe3c8")
    for row, ((title, does, gives), colour) in enumerate(zip(PLACEMENTS, colours, strict=True)):
        top = 0.97 - 0.5 * row
        ax.text(0.03, top, title, fontsize=17, fontweight="bold", va="top")
        for k, (text, y) in enumerate(((does, top - 0.09), (gives, top - 0.30))):
            box = FancyBboxPatch(
                (0.03, y - 0.15), 0.94, 0.14, boxstyle="round,pad=0.01",
                facecolor=colour if k == 0 else "white", edgecolor="#444444",
            )  # fmt: skip
            ax.add_patch(box)
            ax.text(0.05, y - 0.08, text, fontsize=16, va="center")
        ax.annotate(
            "", xy=(0.5, top - 0.285), xytext=(0.5, top - 0.245),
            arrowprops={"arrowstyle": "-|>", "color": "#444444", "lw": 2},
        )  # fmt: skip
    return fig
