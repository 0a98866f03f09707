"""Plain-text formatting shared by every printed table: byte counts and aligned tables."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence


def human_bytes(n: float | int, digits: int = 2) -> str:
    """`n` bytes in binary units, up to TiB: `human_bytes(1.5 * 2**20) == "1.50 MiB"`.

    **Arguments:**

    - `n`: a number of bytes.
    - `digits`: decimals after the point (whole bytes print without any).

    **Returns:**

    The text, e.g. `"512 B"`, `"3.00 KiB"`, `"5.00 TiB"`.
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def text_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    total: Sequence[str] | None = None,
    *,
    width: int | None = None,
) -> str:
    """Left-aligned columns two spaces apart: the header, a rule, the rows, and optionally
    a rule and a total row (trailing spaces stripped).

    **Arguments:**

    - `header`, `rows`, `total`: the cells, as text.
    - `width`: the most columns a line may take (`None`: no limit). The widest columns
      are narrowed, down to their header's width, and their cells wrapped onto
      continuation lines (the other columns blank there).

    **Returns:**

    The table as a string.
    """
    everything = [header, *rows, *([total] if total is not None else [])]
    widths = [max(len(r[i]) for r in everything) for i in range(len(header))]
    if width is not None:
        widths = _fit(widths, [max(len(h), 8) for h in header], width)

    def lines(row: Sequence[str]) -> list[str]:
        cells = [_wrap(cell, w) for cell, w in zip(row, widths)]
        return [
            "  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip()
            for k in range(max(map(len, cells)))
        ]

    rule = "  ".join("-" * w for w in widths)
    out = [*lines(header), rule, *(line for row in rows for line in lines(row))]
    if total is not None:
        out += [rule, *lines(total)]
    return "\n".join(out)


def _fit(widths: list[int], floors: list[int], width: int) -> list[int]:
    """Narrow the widest column, one character at a time, until the table fits `width`
    or no column is above its floor."""
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > width:
        wider = [i for i, w in enumerate(widths) if w > floors[i]]
        if not wider:
            break
        widths[max(wider, key=lambda i: widths[i])] -= 1
    return widths


def _wrap(cell: str, width: int) -> list[str]:
    """A cell as lines of at most `width` characters (broken at spaces where it can)."""
    if len(cell) <= width:
        return [cell]
    return textwrap.wrap(cell, width, break_on_hyphens=False) or [""]


def fill(text: str, width: int | None) -> str:
    """`text` wrapped at spaces to `width` columns (unchanged for `None`), continuation
    lines indented by two spaces."""
    if width is None or len(text) <= width:
        return text
    return textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False)


def first_line(err: BaseException, limit: int = 300) -> str:
    """`"TypeError: <the first line of its message>"`, cut to `limit` characters."""
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= limit else line[:limit] + "..."
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
