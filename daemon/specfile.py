"""A job spec as a user writes it: a JSON or TOML file, then ``--set KEY=VALUE`` overrides.

``qsched train``, ``qsched ctl start`` and ``qsched experiment`` read specs this one way.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["load_spec_data", "parse_value"]


def parse_value(text: str) -> Any:
    """An override's value: JSON when it parses (``4``, ``true``, ``[1,2]``), else the word."""
    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word such as fp32 or digits


def load_spec_data(path: Path | None, overrides: list[str]) -> dict[str, Any]:
    """The spec's data: the file's (if any), with each ``KEY=VALUE`` set on top.

    Args:
        path: a ``.toml`` or JSON file, or None for none.
        overrides: ``KEY=VALUE`` items; a dotted key (``policy.config.q``) sets a nested field.

    Returns:
        The data, to validate with ``JobSpec.model_validate``.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not valid JSON or TOML, or an override has no ``=``.
    """
    data: dict[str, Any] = {}
    if path is not None:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parse_value(value)
    return data
