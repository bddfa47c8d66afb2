"""The STM32N6 port layer: a compile check against the core and stand-in vendor headers."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from qsched.firmware.native import FIRMWARE_DIR

_FLAGS = [
    "-fsyntax-only",
    "-DQS_TARGET_STM32N6",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-Icore",
    "-Istm32n6",
    "-Itests/stm32n6_standin",
]


def _check(compiler: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*compiler, *_FLAGS, "stm32n6/port_stm32n6.c"],
        cwd=FIRMWARE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_stm32n6_port_compiles_on_the_host_compiler() -> None:
    """port_stm32n6.c type-checks against core/port.h with gcc -Wall -Wextra -Werror."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    proc = _check(["gcc"])
    assert proc.returncode == 0, proc.stderr


def test_stm32n6_port_compiles_for_cortex_m55() -> None:
    """The same check with arm-none-eabi-gcc for the Cortex-M55, hard float."""
    if shutil.which("arm-none-eabi-gcc") is None:
        pytest.skip("arm-none-eabi-gcc not found (Debian: gcc-arm-none-eabi)")
    proc = _check(["arm-none-eabi-gcc", "-mcpu=cortex-m55", "-mthumb", "-mfloat-abi=hard"])
    assert proc.returncode == 0, proc.stderr


def test_stm32n6_port_check_sees_the_target_code() -> None:
    """The check compiles the target code: a port signature that differs from port.h fails."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    source = (FIRMWARE_DIR / "stm32n6" / "port_stm32n6.c").read_text()
    broken = source.replace("uint64_t qs_port_now_us(void)", "uint32_t qs_port_now_us(void)")
    assert broken != source
    proc = subprocess.run(
        ["gcc", *_FLAGS, "-x", "c", "-"],
        cwd=FIRMWARE_DIR,
        input=broken,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "qs_port_now_us" in proc.stderr
