"""Daemon configuration: defaults, TOML, environment overrides, errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from qsched.daemon.config import ConfigError, DaemonConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "systemd" / "qsched.example.toml"


def test_config_defaults_without_file() -> None:
    """No file and no environment gives the documented defaults."""
    cfg = load_config(None, environ={})
    assert cfg == DaemonConfig()
    assert cfg.mqtt.port == 1883 and cfg.serial.devices == []


def test_config_file_then_environment(tmp_path: Path) -> None:
    """Environment variables override the file, nested keys included."""
    path = tmp_path / "q.toml"
    path.write_text(
        'fleet = "lab"\n[mqtt]\nhost = "broker.lan"\nport = 8883\n[mqtt.tls]\nenabled = true\n'
        '[serial]\ndevices = ["/dev/ttyACM0"]\n'
    )
    env = {
        "QSCHED_MQTT_PORT": "1884",
        "QSCHED_MQTT_PASSWORD": "s3cret",
        "QSCHED_MQTT_TLS_CA_FILE": "/etc/ssl/ca.pem",
        "QSCHED_SERIAL_DEVICES": "/dev/ttyACM1, /dev/ttyACM2",
        "QSCHED_LOG_LEVEL": "debug",
    }
    cfg = load_config(path, environ=env)
    assert cfg.fleet == "lab" and cfg.mqtt.host == "broker.lan"
    assert cfg.mqtt.port == 1884
    assert cfg.mqtt.password is not None and cfg.mqtt.password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cfg)
    assert cfg.mqtt.tls.enabled and cfg.mqtt.tls.ca_file == Path("/etc/ssl/ca.pem")
    assert cfg.serial.devices == ["/dev/ttyACM1", "/dev/ttyACM2"]
    assert cfg.log_level == "debug"


def test_config_path_from_environment(tmp_path: Path) -> None:
    """$QSCHED_CONFIG names the file when no path is given."""
    path = tmp_path / "q.toml"
    path.write_text('fleet = "from-env"\n')
    assert load_config(None, environ={"QSCHED_CONFIG": str(path)}).fleet == "from-env"


def test_config_errors_name_the_setting(tmp_path: Path) -> None:
    """Invalid values, unknown keys, bad TOML and a missing file raise ConfigError."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt]\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"mqtt\.port"):
        load_config(bad, environ={})
    bad.write_text("[mqtt]\nhots = 'x'\n")
    with pytest.raises(ConfigError, match=r"mqtt\.hots"):
        load_config(bad, environ={})
    bad.write_text("fleet = \n")
    with pytest.raises(ConfigError, match="TOML"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml", environ={})
    with pytest.raises(ConfigError, match="QSCHED_SERIAL_DEVICES"):
        load_config(None, environ={"QSCHED_SERIAL_DEVICES": "[not json"})
    with pytest.raises(ConfigError, match="log_level"):
        load_config(None, environ={"QSCHED_LOG_LEVEL": "loud"})


def test_config_unknown_section_variable_is_an_error() -> None:
    """A misspelt QSCHED_MQTT_* variable is refused; other QSCHED_* names are left alone."""
    with pytest.raises(ConfigError, match="QSCHED_MQTT_PASWORD"):
        load_config(None, environ={"QSCHED_MQTT_PASWORD": "secret"})
    with pytest.raises(ConfigError, match="QSCHED_SERIAL_DEVICE"):
        load_config(None, environ={"QSCHED_SERIAL_DEVICE": "/dev/ttyACM0"})

    cfg = load_config(None, environ={"QSCHED_NATIVE": "0", "QSCHED_MQTT_TLS_CA_FILE": "/ca.pem"})

    assert str(cfg.mqtt.tls.ca_file) == "/ca.pem"


def test_config_example_file_matches_model() -> None:
    """systemd/qsched.example.toml validates and sets every key the model has."""
    data = tomllib.loads(EXAMPLE.read_text())
    cfg = load_config(EXAMPLE, environ={})
    assert cfg.fleet == data["fleet"]

    def keys(model: type, prefix: str = "") -> set[str]:
        out = set()
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                out |= keys(sub, f"{prefix}{name}.")
            else:
                out.add(prefix + name)
        return out

    def flat(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, value in node.items():
            out |= flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
        return out

    documented = flat(data) | _commented_keys(EXAMPLE.read_text())
    assert keys(DaemonConfig) <= documented


def _commented_keys(text: str) -> set[str]:
    """Keys shown commented out (``# key = value``) in the example, with their section."""
    section, out = "", set()
    for line in text.splitlines():
        stripped = line.strip().lstrip("#").strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1] + "."
        elif (
            "=" in stripped
            and line.lstrip().startswith("#")
            and stripped.split("=")[0].strip().isidentifier()
        ):
            out.add(section + stripped.split("=")[0].strip())
    return out
