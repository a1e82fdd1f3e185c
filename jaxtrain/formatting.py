"""Plain-text tables and byte counts for reports."""

from __future__ import annotations


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, the first row a header underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def fmt_bytes(n: float) -> str:
    """'512 B', '1.5 KiB', '2.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
