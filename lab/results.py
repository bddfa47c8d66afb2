"""``results.json``, typed: the one place an experiment's results are read and written.

``qsched experiment`` writes the document, ``qsched experiment-merge`` reads several and
writes one, the plots and tables are drawn from it. Every read and every write goes
through :class:`ResultsDocument`, so a truncated, hand-edited or older file is refused
with the file and the field named, and nothing writes a document its readers refuse.
The setting, environment, baseline and comparisons stay open mappings (their fields
follow the setting); the configurations, which every reader walks, are typed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from qsched.lab.errors import ResultsError

__all__ = [
    "SCHEMA",
    "ConfigResult",
    "Curve",
    "QTrajectory",
    "ResultsDocument",
    "ResultsError",
    "RunEntry",
    "Stats",
    "read_results",
    "write_results_json",
]

SCHEMA: Final = "qsched.experiment/1"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Stats(_Model):
    """A statistic over seeds: mean, sample standard deviation, the values by seed."""

    mean: float
    std: float
    values: list[float]


class Curve(_Model):
    """Validation accuracy over steps, mean and std over seeds, and the passes spent."""

    step: list[int]
    val_accuracy_mean: list[float]
    val_accuracy_std: list[float]
    forward_passes_mean: list[float]


class QTrajectory(_Model):
    """One seed's q changes: ``[step, q]`` pairs from step 0."""

    seed: int
    changes: list[tuple[int, int]]


class RunEntry(_Model):
    """One run (configuration x seed): what the aggregates are rebuilt from."""

    seed: int
    final_accuracy: float
    best_accuracy: float
    forward_passes: float
    wall_s: float
    val_accuracy: list[float]
    val_loss: list[float]
    # INT8 with recalibration: how many channels end with exponent 0, 1, 2, ...
    scale_doublings: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Runs without recalibration leave the key out, as documents before it did.
        data: dict[str, Any] = handler(self)
        if data.get("scale_doublings") is None:
            data.pop("scale_doublings", None)
        return data


class PolicyEntry(_Model):
    """The policy a configuration ran (as in a job spec)."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class ConfigResult(_Model):
    """One configuration (policy x numerics) over all seeds."""

    key: str
    label: str
    policy: PolicyEntry
    numerics: str
    accumulator: str
    numerics_token: str
    seeds: list[int]
    steps: int
    final_accuracy: Stats
    best_accuracy: Stats
    forward_passes: Stats
    wall_s: Stats
    mean_q: float
    curve: Curve
    q_trajectory: list[QTrajectory]
    runs: list[RunEntry]


class ResultsDocument(_Model):
    """Everything ``results.json`` holds."""

    schema_: Literal["qsched.experiment/1"] = Field(alias="schema")
    command: str
    setting: dict[str, Any]
    environment: dict[str, Any]
    configs: list[ConfigResult]
    baseline: dict[str, Any] | None
    comparisons: list[dict[str, Any]]
    floors: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        """The document as plain JSON data (what the file holds)."""
        return self.model_dump(mode="json", by_alias=True)


def read_results(path: Path) -> ResultsDocument:
    """Read and validate a ``results.json`` (or the one inside a result folder).

    Args:
        path: the file, or a folder holding ``results.json``.

    Returns:
        The document.

    Raises:
        ResultsError: no such file, not JSON, another schema, or a field missing or of
            the wrong type (the message names the file and the field).
    """
    file = path / "results.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ResultsError(f"{file}: cannot be read ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise ResultsError(f"{file}: not valid JSON ({exc})") from exc
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA:
        raise ResultsError(f"{file}: not a {SCHEMA} results.json (schema {schema!r})")
    try:
        return ResultsDocument.model_validate(data)
    except ValidationError as exc:
        raise ResultsError(f"{file}: {_first_problem(exc)}") from exc


def write_results_json(data: dict[str, Any], path: Path) -> ResultsDocument:
    """Validate ``data`` as a results document and write it to ``path``.

    Args:
        data: the document as JSON data.
        path: the file to write.

    Returns:
        The validated document.

    Raises:
        ResultsError: ``data`` is not a valid document (a bug of the writer).
    """
    try:
        doc = ResultsDocument.model_validate(data)
    except ValidationError as exc:
        raise ResultsError(f"refusing to write {path}: {_first_problem(exc)}") from exc
    path.write_text(json.dumps(doc.as_dict(), indent=1) + "\n")
    return doc


def _first_problem(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "document"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"field {where}: {first['msg']}{more}"
