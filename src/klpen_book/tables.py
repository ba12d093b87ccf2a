"""Plain-text tables with rounded numbers: stable output for notebooks under nbval."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[object]], headers: Sequence[str], digits: int = 3) -> str:
    """Format rows as an aligned plain-text table, floats rounded to ``digits`` decimals.

    Example:
        >>> print(format_table([["k1", 0.12345], ["k3", 1.0]], ["estimator", "bias"]))
        estimator   bias
        ---------  -----
        k1         0.123
        k3         1.000
    """

    def cell(v: object) -> str:
        if isinstance(v, float):
            text = f"{v:.{digits}f}"
            # "-0.000" reads as a sign error; it is a rounded zero.
            return text[1:] if text.startswith("-") and float(text) == 0 else text
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = []
        for i, c in enumerate(cells):
            numeric = i > 0 and c.replace(".", "", 1).lstrip("-+").replace("e", "").isdigit()
            parts.append(
                c.rjust(widths[i]) if numeric or (i > 0 and c == headers[i]) else c.ljust(widths[i])
            )
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), "  ".join("-" * w for w in widths), *map(line, body)])
