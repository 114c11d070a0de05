"""Markdown-style tables for the benchmarks' printed reports."""

from __future__ import annotations


def render_table(table: list[tuple[str, ...]]) -> str:
    """The first row is the header; the first column is left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = []
    for j, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("| " + " | ".join(cells) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
