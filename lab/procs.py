"""``qsched`` subcommands as child processes that fault tests and campaigns can kill.

Every child runs in a process group of its own (``start_new_session``), so a kill takes
whatever the child started too, and its output goes to ``<folder>/<name>.log``. The
fault campaign (``qsched chaos``) and the resume tests share this one helper.
``sigterm_as_interrupt`` is the other side: a command whose own children must not
outlive it when it is terminated.

    with Processes(folder) as procs:
        daemon = procs.qsched("daemon", "daemon", "--state-dir", str(state), ...)
        procs.kill(daemon)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["Processes", "qsched_argv", "sigterm_as_interrupt", "wait_for"]

Child = subprocess.Popen[bytes]


def qsched_argv(*args: str, log_level: str = "info") -> list[str]:
    """The command line of ``qsched ARGS...`` run by this interpreter."""
    return [sys.executable, "-m", "qsched.daemon.cli", "--log-level", log_level, *args]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so cleanup runs as after Ctrl-C (board
    processes are stopped, worker pools terminated) instead of leaving them orphaned."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll ``predicate`` every 50 ms until it is true.

    Returns:
        The seconds it took.

    Raises:
        TimeoutError: it stayed false for ``timeout`` seconds (the message names ``what``).
    """
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


class Processes:
    """Child processes of one test or campaign, all killed on exit whatever happens.

    Args:
        folder: where each child's log goes.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.children: list[Child] = []

    def qsched(self, log: str, *args: str) -> Child:
        """Start ``qsched ARGS...`` (info logging, unbuffered) with output in ``log``.log."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = qsched_argv(*args)
        with open(self.folder / f"{log}.log", "ab") as out:  # the child keeps its own copy
            child = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.children.append(child)
        return child

    def log(self, name: str) -> bytes:
        """What the child logging to ``name``.log has written so far."""
        path = self.folder / f"{name}.log"
        return path.read_bytes() if path.exists() else b""

    @staticmethod
    def signal(child: Child, signum: int) -> None:
        """Send ``signum`` to the child's whole process group (gone already: nothing)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signum)

    def kill(self, child: Child) -> None:
        """SIGKILL the child's process group and reap it."""
        self.signal(child, signal.SIGCONT)  # a stopped group dies on SIGKILL too; be explicit
        self.signal(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)

    def terminate(self, child: Child, timeout: float = 30.0) -> int | None:
        """SIGTERM the child's group, wait up to ``timeout`` s, then SIGKILL.

        Returns:
            The child's exit status when it ended on SIGTERM, else None.
        """
        self.signal(child, signal.SIGCONT)
        self.signal(child, signal.SIGTERM)
        try:
            return child.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(child)
            return None

    def close(self) -> None:
        """Kill every child started here."""
        for child in self.children:
            self.kill(child)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
