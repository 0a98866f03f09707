"""Plain-text formatting shared by every printed table: byte counts and aligned tables."""

from __future__ import annotations

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
    header: Sequence[str], rows: Sequence[Sequence[str]], total: Sequence[str] | None = None
) -> str:
    """Left-aligned columns two spaces apart: the header, a rule, the rows, and optionally
    a rule and a total row (trailing spaces stripped)."""
    everything = [header, *rows, *([total] if total is not None else [])]
    widths = [max(len(r[i]) for r in everything) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(header), rule, *map(line, rows)]
    if total is not None:
        out += [rule, line(total)]
    return "\n".join(out)


def first_line(err: BaseException, limit: int = 300) -> str:
    """`"TypeError: <the first line of its message>"`, cut to `limit` characters."""
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= limit else line[:limit] + "..."
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
