"""The systemd unit and the udev rule: the settings the service depends on are there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"


def _unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_has_notify_watchdog_state_and_serial_access() -> None:
    """Type=notify with a watchdog, a state directory, restart on failure, ttyACM allowed."""
    settings = _unit_settings((SYSTEMD / "qsched.service").read_text())

    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["main"]
    assert int(settings["WatchdogSec"][0]) > 0
    assert settings["StateDirectory"] == ["qsched"] and settings["Restart"] == ["on-failure"]
    assert "char-ttyACM rw" in settings["DeviceAllow"] and settings["DevicePolicy"] == ["closed"]
    assert "PrivateDevices" not in settings  # it would hide the boards' serial ports
    assert "dialout" in settings["SupplementaryGroups"][0]
    assert " daemon " in settings["ExecStart"][0]
    # another daemon on the state directory (exit 3) is not restarted into the same refusal
    assert settings["RestartPreventExitStatus"] == ["3"]
    # the dynamic user reads the root-owned configuration directory as "other"
    assert int(settings["ConfigurationDirectoryMode"][0], 8) & 0o005 == 0o005


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the unit (its binary swapped for one that exists)."""
    analyze = shutil.which("systemd-analyze")
    true = shutil.which("true")
    if analyze is None or true is None:
        pytest.skip("systemd-analyze is not installed")
    text = (SYSTEMD / "qsched.service").read_text()
    unit = tmp_path / "qsched.service"
    unit.write_text(text.replace("/usr/local/bin/qsched", true))

    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert "qsched.service" not in done.stderr, done.stderr


def test_systemd_udev_rule_matches_stlink_positively() -> None:
    """The rule matches ST's vendor id with a product, never through a negated ATTRS."""
    rules = [
        line
        for line in (SYSTEMD / "99-qsched-stlink.rules").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]

    assert not [
        line
        for line in rules
        if "ATTRS{" in line and "!=" in line.split("ATTRS{", 1)[1].split(",")[0]
    ]
    match = [line for line in rules if 'ATTRS{idVendor}=="0483"' in line]
    assert len(match) == 1 and 'ATTRS{idProduct}=="' in match[0] and "374e" in match[0]
    links = [line for line in rules if 'SYMLINK+="qsched/stlink-' in line]
    # the interface number tells the two ports of a dual-VCP probe apart
    assert len(links) == 1 and "$env{ID_USB_INTERFACE_NUM}" in links[0]
