"""Markdown pieces of the benchmark report: numbers, tables, verdicts, prose templates, plots
(``render_section`` of each benchmark; prose in ``templates/<name>.md``, filled by ``fill``)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "templates"


def fmt(value: Any, spec: str = ".3f") -> str:
    """A number in ``spec``; '-' for None; anything else as str."""
    if value is None:
        return "-"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return format(value, spec) if number else str(value)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table and the blank line after it."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("**PASS**" if ok else "**MISS**")


def fill(name: str, data: dict | None = None, **values: Any) -> list[str]:
    """The lines of ``templates/<name>.md`` with its placeholders filled from ``values``,
    else from the same keys of ``data`` (a benchmark's JSON; ``$notes``: its notes, each a
    paragraph); a KeyError names a placeholder left without a value."""
    text = string.Template((TEMPLATES / f"{name}.md").read_text())
    notes = "".join(f"\n{note}\n" for note in (data or {}).get("notes", []))
    filled = {k: str(v) for k, v in {**(data or {}), "notes": notes, **values}.items()}
    return text.substitute(filled).rstrip().splitlines() + [""]


class Targets:
    """Collects (target, measured, limit, verdict, source) rows for the summary."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(self, target: str, value: Any, limit: str, ok: bool | None, source: str) -> None:
        self.rows.append([target, fmt(value), limit, verdict(ok), source])


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, plt: Any, path: Path, rect: tuple | None = None) -> bool:
    """Write ``fig`` to ``path`` (``rect``: the figure's part the axes may fill)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def chunk_axis(ax: Any, sizes_kib: list[float]) -> None:
    """Log2 x axis labelled with the chunk sizes actually measured."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes_kib))
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("chunk size (KiB)")
