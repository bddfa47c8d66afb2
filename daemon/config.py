"""The daemon's configuration: a TOML file, then environment overrides, validated.

Every setting has a default, so no file is needed. Precedence, highest first:
environment (``QSCHED_<SECTION>_<KEY>``, e.g. ``QSCHED_MQTT_HOST``,
``QSCHED_MQTT_TLS_CA_FILE``, ``QSCHED_SERIAL_DEVICES=/dev/ttyACM0,/dev/ttyACM1``), the file
(``--config``, else ``$QSCHED_CONFIG``), the defaults below. ``systemd/qsched.example.toml``
documents every key.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from qsched.daemon.errors import ConfigError
from qsched.protocol.links.config import ConfigSection, MqttConfig, SerialConfig, TlsConfig

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "DaemonConfig",
    "MqttConfig",
    "SerialConfig",
    "TlsConfig",
    "env_overrides",
    "load_config",
]

ENV_PREFIX = "QSCHED_"


class DaemonConfig(ConfigSection):
    """Everything ``qsched daemon`` reads at start."""

    fleet: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    state_dir: Path | None = Field(
        default=None, description="default: $STATE_DIRECTORY or ~/.local/state/qsched"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    step_deadline_s: float = Field(
        default=5.0, gt=0, description="answers later than this are reassigned"
    )
    split_batches: bool = Field(
        default=True,
        description="INT8 jobs may split a key's batch over boards when that is faster",
    )
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_misses: int = Field(
        default=3, ge=1, description="missed heartbeats before a board is gone"
    )
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    serial: SerialConfig = Field(default_factory=SerialConfig)


def _leaves(
    model: type[BaseModel], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaves(annotation, (*path, name))
        else:
            yield (*path, name), annotation


def _env_value(raw: str, annotation: Any) -> Any:
    if "list[" in str(annotation):
        text = raw.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    if raw == "" and "None" in str(annotation):
        return None
    return raw  # pydantic coerces "8883", "true", "0.5"


def _check_section_names(environ: Mapping[str, str]) -> None:
    # Only the sections' prefixes: other QSCHED_* variables (QSCHED_CONFIG, QSCHED_NATIVE)
    # belong to other parts. A misspelt QSCHED_MQTT_PASWORD must not be ignored silently.
    known = {ENV_PREFIX + "_".join(path).upper() for path, _ in _leaves(DaemonConfig)}
    sections = tuple(
        f"{ENV_PREFIX}{name.upper()}_"
        for name, field in DaemonConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    )
    for name in sorted(environ):
        if name.startswith(sections) and name not in known:
            raise ConfigError(name, "no such setting (see qsched.example.toml)")


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings given as ``QSCHED_*`` environment variables, as nested data.

    Args:
        environ: the environment (``os.environ``).

    Returns:
        A nested mapping to merge over the file's settings.

    Raises:
        ConfigError: a list value is not valid JSON, or a variable of a section
            (``QSCHED_MQTT_*``, ``QSCHED_SERIAL_*``) names no setting, e.g. a typo.
    """
    _check_section_names(environ)
    out: dict[str, Any] = {}
    for path, annotation in _leaves(DaemonConfig):
        name = ENV_PREFIX + "_".join(path).upper()
        if name not in environ:
            continue
        try:
            value = _env_value(environ[name], annotation)
        except ValueError as exc:
            raise ConfigError(name, f"not a valid list: {exc}") from exc
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "no such file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from exc


def load_config(
    path: Path | str | None = None, environ: Mapping[str, str] | None = None
) -> DaemonConfig:
    """Read the configuration: defaults, then the TOML file, then the environment.

    Args:
        path: the TOML file; ``$QSCHED_CONFIG`` when ``None``; no file when neither is set.
        environ: the environment to read overrides from (``os.environ`` by default).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: the file is missing or invalid, or a setting fails validation
            (the message names the setting).
    """
    env = os.environ if environ is None else environ
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    data = _read_toml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "configuration"
    try:
        return DaemonConfig.model_validate(_merge(data, env_overrides(env)))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(source, problems) from exc
