"""The tiny grids the ``qsched experiment`` tests run: a few steps of the default job."""

from __future__ import annotations

from collections.abc import Sequence


def tiny_grid(
    *policies: str,
    numerics: Sequence[str] = ("fp32", "int8"),
    seeds: Sequence[int] = (0, 1),
    steps: int = 12,
) -> list[str]:
    """``qsched experiment`` arguments for ``policies`` on small batches, validating every
    4 steps (no ``--out``, workers or output options)."""
    return [
        "--grid",
        "custom",
        "--policies",
        *policies,
        "--numerics",
        *numerics,
        "--seeds",
        *(str(s) for s in seeds),
        "--steps",
        str(steps),
        "--set",
        "eval_every=4",
        "--set",
        "batch_size=16",
    ]
