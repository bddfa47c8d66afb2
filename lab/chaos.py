"""``qsched chaos``: a fault campaign against a real daemon, real boards and a real broker.

The daemon and its boards run as processes of their own on a private Mosquitto, two of
the boards on serial lines that can garble bytes (``chaos_fleet``). The campaign first
fuzzes the live daemon with control documents and data-plane messages
(``chaos_fuzz``), then runs its trials on the same daemon (``chaos_trials``): daemon
and board SIGKILLs, broker restarts, a hung board, a lying board and noisy serial
lines, one short job per trial, each compared bit for bit with the single-process
trainer. It prints one table (``chaos_report``) and exits 0 only when every checked job
was exact, every document answered and nothing crashed.

The default campaign (10,000 + 10,000 documents, 20 + 20 + 20 kills and restarts, 5 of
each other trial) takes about 15 minutes on 2 cores; ``--trials N`` and smaller
``--control``/``--data`` make a short one.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from qsched.lab.chaos_fleet import open_fleet
from qsched.lab.chaos_fuzz import run_fuzz
from qsched.lab.chaos_report import ChaosRow, format_table, row_passed
from qsched.lab.chaos_trials import DEFAULT_TRIALS, TRIAL_FAULTS, run_trials

__all__ = ["FAULTS", "main"]

FAULTS: Final = ("fuzz", *TRIAL_FAULTS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsched chaos",
        description="Throw faults at a real daemon, boards and broker; print what survived.",
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated, run in this order: {', '.join(FAULTS)} (default: all)",
    )
    parser.add_argument(
        "--trials", type=int, help="trials of every kind (default: 20 kills and restarts, 5 others)"
    )
    parser.add_argument("--control", type=int, default=10_000, help="control documents")
    parser.add_argument("--data", type=int, default=10_000, help="data-plane messages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for logs (default: a temporary one)")
    return parser


def _campaign(args: argparse.Namespace, wanted: list[str], folder: Path) -> list[ChaosRow]:
    trials = wanted[1:] if wanted[:1] == ["fuzz"] else wanted
    counts = {k: DEFAULT_TRIALS[k] if args.trials is None else args.trials for k in trials}

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    with open_fleet(folder, args.seed) as fleet:
        rows = run_fuzz(fleet, args.control, args.data, args.seed) if "fuzz" in wanted else []
        return rows + run_trials(fleet, counts, args.seed, progress)


def main(argv: list[str]) -> int:
    """``qsched chaos``.

    Returns:
        0 when every row passed (``row_passed``), 1 otherwise, 2 for an unknown fault
        kind or bad arguments.
    """
    args = _parser().parse_args(argv)
    wanted = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in FAULTS]
    if unknown or not wanted or ("fuzz" in wanted and wanted[0] != "fuzz"):
        print(
            f"qsched chaos: faults must be some of {', '.join(FAULTS)} (fuzz first); "
            f"got {args.faults!r}",
            file=sys.stderr,
        )
        return 2
    if args.trials is not None and args.trials < 0:
        print("qsched chaos: --trials must be 0 or more", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        folder = args.out or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="qsched-chaos-"))
        )
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        rows = _campaign(args, wanted, folder)
        print(format_table(rows))
        where = f"; logs in {folder}" if args.out else ""
        print(f"\n{time.perf_counter() - started:.0f} s{where}")
    return 0 if all(row_passed(row) for row in rows) else 1
