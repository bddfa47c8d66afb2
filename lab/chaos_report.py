"""The table ``qsched chaos`` prints: one row per fault, what survived it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChaosRow", "format_table", "row_passed"]


@dataclass(frozen=True)
class ChaosRow:
    """One line of the campaign's table.

    Attributes:
        fault: what was done.
        trials: how many times (documents, for the fuzz).
        exact: trials whose job ended bit-identical to the single-process run.
        checked: trials whose job was checked (the fuzz checks one job afterwards).
        lost_steps: steps computed twice (a resumed daemon redoes those after its last
            checkpoint); None where it does not apply.
        worst_recovery_s: longest time from a fault to the next step recorded.
        replies: answered / sent control documents (the control fuzz only).
        crashes: daemon processes that died on their own.
        memory: the daemon's resident memory before and after.
        notes: what the fault did (bytes garbled, lies caught, ...).
    """

    fault: str
    trials: int
    exact: int
    checked: int
    lost_steps: int | None = None
    worst_recovery_s: float | None = None
    replies: tuple[int, int] | None = None
    crashes: int = 0
    memory: str = "-"
    notes: str = ""


def row_passed(row: ChaosRow) -> bool:
    """Every checked job exact, no crash, every document answered."""
    answered = row.replies is None or row.replies[0] == row.replies[1]
    return row.exact == row.checked and row.crashes == 0 and answered


def _cells(row: ChaosRow) -> list[str]:
    return [
        row.fault,
        str(row.trials),
        f"{row.exact}/{row.checked}",
        "-" if row.lost_steps is None else str(row.lost_steps),
        "-" if row.worst_recovery_s is None else f"{row.worst_recovery_s:.1f} s",
        "-" if row.replies is None else f"{row.replies[0]}/{row.replies[1]}",
        str(row.crashes),
        row.memory,
        row.notes,
    ]


def format_table(rows: list[ChaosRow]) -> str:
    """The campaign's table (Markdown)."""
    head = [
        "fault",
        "trials",
        "bit-identical",
        "lost steps",
        "worst recovery",
        "replies",
        "crashes",
        "daemon memory",
        "notes",
    ]
    align = ["---", *["---:"] * 6, "---", "---"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)
