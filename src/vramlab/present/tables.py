"""Tables a reader compares: an HTML table in the book and in Jupyter/Colab (`_repr_html_`), the same
table as aligned text in a terminal (`str`). Standard library only.

    Table(["setup", "predicted", "measured", "error"],
          [["ZeRO-1", "1.20 GiB", "1.19 GiB", "+0.8 %"], ...],
          caption="gpt2, 2 ranks", notes=["torch 2.13.0, 2026-11-20; command: ..."])

Cells are shown as given (format numbers before); a column whose cells all read as numbers (a
leading sign, digits, a unit after them) is right-aligned, unless `align` says otherwise ("l", "r",
"c" per column). `groups` (optional) puts a spanning header row above the column names:
[("", 1), ("GiB", 2)] spans the first column with nothing and the next two with "GiB".
A cell may be a `Cell(text, cls)` to mark it (cls "good", "bad", "dim", "strong")."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

_NUMERIC = re.compile(r"^\s*[-+−±~≈<>≤≥]?\s*[$]?\d[\d,._]*(\s*[eE][-+]?\d+)?\s*(%|[a-zA-Z/µ°×x·]+)?\s*[*°†‡]*\s*$")
CLASSES = ("good", "bad", "dim", "strong")


@dataclass(frozen=True)
class Cell:
    """A cell with a mark: `cls` one of CLASSES (styled by the book's CSS)."""
    text: str
    cls: str = ""

    def __post_init__(self):
        if self.cls and self.cls not in CLASSES:
            raise ValueError(f"Cell cls must be one of {', '.join(CLASSES)}, got {self.cls!r}")

    def __str__(self) -> str:
        return str(self.text)


def _text(cell) -> str:
    if cell is None:
        return ""
    return str(cell)


def _is_number(cell) -> bool:
    t = _text(cell)
    return t in ("", "—", "-", "n/a") or bool(_NUMERIC.match(t))


class Table:
    """Rows under named columns, shown as HTML (`_repr_html_`) or aligned text (`str`)."""

    def __init__(self, columns: Sequence[str], rows: Iterable[Sequence], *, caption: str = "",
                 notes: Sequence[str] | str = (), align: str | None = None,
                 groups: Sequence[tuple[str, int]] | None = None):
        self.columns = [str(c) for c in columns]
        if not self.columns:
            raise ValueError("a table needs at least one column")
        self.rows = [list(r) for r in rows]
        for i, r in enumerate(self.rows):
            if len(r) != len(self.columns):
                raise ValueError(f"row {i} has {len(r)} cells for {len(self.columns)} columns")
        self.caption = caption
        self.notes = [notes] if isinstance(notes, str) else list(notes)
        if align is None:
            align = "".join("r" if self.rows and all(_is_number(r[j]) for r in self.rows) and
                            any(_text(r[j]) for r in self.rows) else "l" for j in range(len(self.columns)))
        if len(align) != len(self.columns) or set(align) - set("lrc"):
            raise ValueError(f"align must give one of l, r, c for each of the {len(self.columns)} columns, got {align!r}")
        self.align = align
        if groups is not None and sum(n for _, n in groups) != len(self.columns):
            raise ValueError(f"groups must span the {len(self.columns)} columns, got {sum(n for _, n in groups)}")
        self.groups = list(groups) if groups else None

    def _repr_html_(self) -> str:
        esc = html.escape
        side = {"l": "left", "r": "right", "c": "center"}
        out = ['<div class="vl-table-wrap"><table class="vl-table">']
        if self.caption:
            out.append(f"<caption>{esc(self.caption)}</caption>")
        out.append("<thead>")
        if self.groups:
            out.append("<tr>" + "".join(f'<th colspan="{n}" class="vl-group">{esc(g)}</th>' for g, n in self.groups)
                       + "</tr>")
        out.append("<tr>" + "".join(f'<th style="text-align:{side[a]}">{esc(c)}</th>'
                                    for c, a in zip(self.columns, self.align)) + "</tr></thead><tbody>")
        for r in self.rows:
            cells = []
            for cell, a in zip(r, self.align):
                cls = f' class="vl-{cell.cls}"' if isinstance(cell, Cell) and cell.cls else ""
                cells.append(f'<td style="text-align:{side[a]}"{cls}>{esc(_text(cell))}</td>')
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
        for n in self.notes:
            out.append(f'<p class="vl-table-note">{esc(n)}</p>')
        out.append("</div>")
        return "".join(out)

    def __str__(self) -> str:
        cells = [self.columns] + [[_text(c) for c in r] for r in self.rows]
        widths = [max(len(row[j]) for row in cells) for j in range(len(self.columns))]

        def line(row):
            return "  ".join(t.rjust(w) if a == "r" else t.center(w) if a == "c" else t.ljust(w)
                             for t, w, a in zip(row, widths, self.align)).rstrip()
        out = [self.caption] if self.caption else []
        out += [line(self.columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
        return "\n".join(out + self.notes)

    __repr__ = __str__
