"""Settings of the two wire transports, shared by the daemon, the bridge and the boards.

The daemon reads them as sections of its TOML configuration (``daemon/config.py``); a
virtual board or ``qsched ctl`` builds them from its command line. ``parse_host_port`` is
the one reading of a ``--mqtt HOST:PORT`` option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["ConfigSection", "MqttConfig", "SerialConfig", "TlsConfig", "parse_host_port"]


class ConfigSection(BaseModel):
    """One section of settings: unknown keys are errors, values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsConfig(ConfigSection):
    """TLS towards the broker (off unless ``enabled``)."""

    enabled: bool = False
    ca_file: Path | None = Field(default=None, description="CA bundle; system CAs when unset")
    cert_file: Path | None = Field(default=None, description="client certificate (mutual TLS)")
    key_file: Path | None = Field(default=None, description="client key (mutual TLS)")
    insecure: bool = Field(default=False, description="skip host name verification (testing only)")


class MqttConfig(ConfigSection):
    """The MQTT broker and how to stay connected to it."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    username: str | None = None
    password: SecretStr | None = None
    tls: TlsConfig = Field(default_factory=TlsConfig)
    protocol: Literal["3.1.1", "5"] = Field(
        default="5", description="5 gives control replies a response topic"
    )
    keepalive_s: int = Field(default=30, ge=5, le=3600)
    prefix: str = "qsched/v1"
    reconnect_min_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)
    send_timeout_s: float = Field(
        default=10.0, gt=0, description="how long a send waits for a reconnect"
    )
    connect_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="how long one connection attempt (CONNECT, birth message, SUBSCRIBEs) "
        "waits for the broker before it is dropped and retried",
    )


class SerialConfig(ConfigSection):
    """USB serial boards attached to this host."""

    devices: list[str] = Field(
        default_factory=list, description="port paths, e.g. /dev/qsched/stlink-*"
    )
    baudrate: int = Field(default=921600, gt=0)
    reopen_interval_s: float = Field(default=1.0, gt=0)


def parse_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:1883"`` -> ``("127.0.0.1", 1883)``; an IPv6 host goes in brackets.

    Args:
        text: ``HOST:PORT``, as a ``--mqtt`` option gives it.

    Returns:
        The host (brackets removed) and the port.

    Raises:
        ValueError: no host, or no port in 1..65535; the message names ``HOST:PORT``.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"want HOST:PORT with a port in 1..65535, got {text!r}")
    return host.strip("[]"), int(port)
