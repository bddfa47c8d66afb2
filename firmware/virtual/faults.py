"""Faults a virtual board injects on demand: seeded, deterministic, one RNG per kind.

A fault is written ``kind:args`` on the command line (``qsched board --fault ...``):

| text | effect |
| --- | --- |
| ``drop:P`` | an answer is not sent, with probability P |
| ``delay:P:S`` | an answer is sent S seconds late, with probability P |
| ``crash-at-step:N`` | the board dies (process exit) when a request for step N or later arrives |
| ``corrupt:P`` | bits of an outgoing frame are flipped on the wire, with probability P |
| ``lie:P`` | an EvalResult carries wrong losses, with probability P |
| ``bad-checksum:P`` | an UpdateAck carries a wrong checksum, with probability P |

Every probability may instead be ``step=N`` (the fault hits exactly the answers about
step N), so ``--fault bad-checksum:step=5`` or ``--fault delay:step=3:2.0``. Each
board draws from its own generators, seeded by ``(plan seed, board id, fault kind)``,
so a run with the same seed and faults misbehaves identically, and adding one fault
does not change when another fires.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, get_args

from qsched.firmware.errors import FaultError
from qsched.protocol.messages import EvalResult, EvalSliceResult

__all__ = [
    "BAD_CHECKSUM_MASK",
    "CRASH_EXIT_CODE",
    "FAULT_KINDS",
    "LIE_OFFSET",
    "BoardFaults",
    "CorruptingStream",
    "Fault",
    "FaultError",
    "FaultKind",
    "FaultPlan",
    "flip_bits",
    "parse_fault",
    "replace_losses",
]

FaultKind = Literal["drop", "delay", "crash-at-step", "corrupt", "lie", "bad-checksum"]
FAULT_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)
# Exit status of a board process killed by crash-at-step (distinct from errors: 1, 2).
CRASH_EXIT_CODE: Final = 3
# What a lying board adds to every L+ it reports: large enough that a duplicate
# evaluation disagrees, exact in float32 and in the INT8 loss's Q16 grid.
LIE_OFFSET: Final = 0.25
# XOR mask of a wrong checksum: never 0, so the reported value always differs.
BAD_CHECKSUM_MASK: Final = 0x5A5A5A5A
_STEP: Final = re.compile(r"^step=([0-9]+)$")


@dataclass(frozen=True)
class Fault:
    """One fault. Exactly one of ``probability`` and ``step`` is set (crash: ``step``).

    Attributes:
        kind: what goes wrong.
        probability: chance per answer (or frame, for ``corrupt``).
        step: the step whose answers it hits (``crash-at-step``: the first step it dies at).
        seconds: the delay of ``delay``.
    """

    kind: FaultKind
    probability: float | None = None
    step: int | None = None
    seconds: float = 0.0


def _probability(text: str, spec: str) -> tuple[float | None, int | None]:
    match = _STEP.match(text)
    if match:
        return None, int(match.group(1))
    try:
        value = float(text)
    except ValueError:
        raise FaultError(f"fault {spec!r}: {text!r} is neither a probability nor step=N") from None
    if not 0.0 <= value <= 1.0:
        raise FaultError(f"fault {spec!r}: probability {value} outside [0, 1]")
    return value, None


def parse_fault(spec: str) -> Fault:
    """Parse one ``kind:args`` fault description (see the module docstring).

    Args:
        spec: e.g. ``"drop:0.1"``, ``"delay:0.05:2.0"``, ``"crash-at-step:7"``.

    Returns:
        The fault.

    Raises:
        FaultError: unknown kind or bad arguments.
    """
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    if kind not in FAULT_KINDS:
        raise FaultError(f"fault {spec!r}: unknown kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}")
    if kind == "crash-at-step":
        if len(args) != 1 or not args[0].isdigit():
            raise FaultError(f"fault {spec!r}: expected crash-at-step:N")
        return Fault("crash-at-step", step=int(args[0]))
    expected = 2 if kind == "delay" else 1
    if len(args) != expected:
        usage = "delay:P:SECONDS" if kind == "delay" else f"{kind}:P"
        raise FaultError(f"fault {spec!r}: expected {usage} (P a probability or step=N)")
    probability, step = _probability(args[0], spec)
    seconds = 0.0
    if kind == "delay":
        try:
            seconds = float(args[1])
        except ValueError:
            raise FaultError(
                f"fault {spec!r}: delay {args[1]!r} is not a number of seconds"
            ) from None
        if not 0.0 <= seconds <= 3600.0:
            raise FaultError(f"fault {spec!r}: delay {seconds} s outside [0, 3600]")
    return Fault(kind, probability, step, seconds)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FaultPlan:
    """The faults of a board process and the seed that makes them reproducible.

    Args:
        faults: the faults, any number of each kind.
        seed: seeds every board's generators (with the board id and fault kind).
    """

    faults: tuple[Fault, ...] = ()
    seed: int = 0

    @classmethod
    def parse(cls, specs: Sequence[str], seed: int = 0) -> FaultPlan:
        """A plan from ``--fault`` texts.

        Raises:
            FaultError: a text that does not parse.
        """
        return cls(tuple(parse_fault(s) for s in specs), seed)

    def for_board(self, board_id: str) -> BoardFaults:
        """The fault state of one board (its own generators)."""
        return BoardFaults(self, board_id)


@dataclass
class BoardFaults:
    """One board's faults: answers ``should this answer misbehave?`` deterministically."""

    plan: FaultPlan
    board_id: str
    _rngs: dict[str, random.Random] = field(default_factory=dict, init=False, repr=False)

    def _rng(self, kind: str) -> random.Random:
        rng = self._rngs.get(kind)
        if rng is None:
            # str seeds hash with SHA-512: the same sequence on every run and platform.
            rng = self._rngs[kind] = random.Random(f"{self.plan.seed}:{self.board_id}:{kind}")
        return rng

    def _hits(self, kind: FaultKind, step: int | None) -> list[Fault]:
        hits = []
        for fault in self.plan.faults:
            if fault.kind != kind:
                continue
            if fault.step is not None:
                if step is not None and step == fault.step:
                    hits.append(fault)
            elif fault.probability is not None and self._rng(kind).random() < fault.probability:
                hits.append(fault)
        return hits

    @property
    def active(self) -> bool:
        """Whether the plan holds any fault at all."""
        return bool(self.plan.faults)

    def drop(self, step: int | None) -> bool:
        """Whether to drop an answer (``step``: the step it is about, if any)."""
        return bool(self._hits("drop", step))

    def delay(self, step: int | None) -> float:
        """Seconds to hold an answer back (0: none)."""
        return sum(f.seconds for f in self._hits("delay", step))

    def crash(self, step: int) -> bool:
        """Whether a request for ``step`` kills the board."""
        return any(
            f.kind == "crash-at-step" and f.step is not None and step >= f.step
            for f in self.plan.faults
        )

    def corrupt(self, data: bytes) -> bytes:
        """``data`` with bits flipped, if a corrupt fault fires for this frame."""
        if not self._hits("corrupt", None):
            return data
        return flip_bits(data, self._rng("corrupt-bits"))

    def lie(self, result: EvalResult | EvalSliceResult) -> EvalResult | EvalSliceResult:
        """``result`` with wrong losses, if a lie fault fires for it."""
        if not self._hits("lie", result.step):
            return result
        return replace_losses(result)

    def checksum(self, step: int, checksum: int) -> int:
        """The checksum to report for ``step``: wrong if a bad-checksum fault fires."""
        if not self._hits("bad-checksum", step):
            return checksum
        return checksum ^ BAD_CHECKSUM_MASK


def replace_losses(result: EvalResult | EvalSliceResult) -> EvalResult | EvalSliceResult:
    """The same result with every L+ (or its slice sum) shifted by ``LIE_OFFSET``."""
    if isinstance(result, EvalSliceResult):
        shift = int(LIE_OFFSET * 65536)  # in Q16, the slice sums' unit
        return result.model_copy(update={"sum_plus": tuple(v + shift for v in result.sum_plus)})
    return result.model_copy(update={"loss_plus": tuple(v + LIE_OFFSET for v in result.loss_plus)})


def flip_bits(data: bytes, rng: random.Random, count: int = 1) -> bytes:
    """Flip ``count`` random bits of ``data`` outside its zero bytes (frame delimiters).

    Keeping delimiters intact means the frame stays one frame and only its CRC (or COBS
    structure) can tell: the check the receiver must make.

    Args:
        data: the bytes.
        rng: the generator.
        count: bits to flip.

    Returns:
        The corrupted bytes (``data`` unchanged if it has no non-zero byte).
    """
    out = bytearray(data)
    positions = [i for i, b in enumerate(out) if b]
    for _ in range(count if positions else 0):
        i = rng.choice(positions)
        flipped = out[i] ^ (1 << rng.randrange(8))
        out[i] = flipped or out[i] ^ 0x80 ^ (1 << rng.randrange(7))  # never create a delimiter
    return bytes(out)


class _Stream(Protocol):
    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class CorruptingStream:
    """A serial byte stream whose writes go through ``BoardFaults.corrupt``.

    Wraps the stream a ``SerialLink`` runs on, so corruption happens where the
    transport writes and the peer's frame CRC must catch it.

    Args:
        inner: the real stream (a pty, a serial port).
        faults: the board's faults.
    """

    def __init__(self, inner: _Stream, faults: BoardFaults) -> None:
        self._inner = inner
        self._faults = faults
        self.corrupted = 0

    async def read(self) -> bytes:
        """Bytes from the inner stream, untouched."""
        return await self._inner.read()

    async def write(self, data: bytes) -> None:
        """Write ``data``, possibly with bits flipped."""
        wire = self._faults.corrupt(data)
        if wire != data:
            self.corrupted += 1
        await self._inner.write(wire)

    async def close(self) -> None:
        """Close the inner stream."""
        await self._inner.close()
