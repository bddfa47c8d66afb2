"""Native INT8 kernels: bit for bit equal to the numpy kernels, and the numpy fallback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from qsched.zo import kernels_int8 as ki
from qsched.zo import native
from qsched.zo.graph import TensorQuant

IN = TensorQuant(scale=0.05, zero_point=-3)
OUT = TensorQuant(scale=0.1, zero_point=5)

needs_native = pytest.mark.skipif(
    not native.available(), reason="native kernels not built or disabled"
)


def _stage(
    rng: np.random.Generator, channels: int, activation: str, wide: bool = False
) -> ki.OutputStage:
    # wide: scales that give multipliers > 1 (left shifts) next to tiny ones.
    hi = 40.0 if wide else 0.02
    scales = rng.uniform(0.002, hi, channels).astype(np.float32)
    return ki.prepare_output_stage(IN, scales, OUT, activation)  # type: ignore[arg-type]


def _int8(rng: np.random.Generator, shape: tuple[int, ...], low: int = -128) -> np.ndarray:
    return rng.integers(low, 128, shape).astype(np.int8)


CONV_CASES = [
    # (x sets, w sets, stride, padding, groups, activation, kernel, channels, outputs)
    (1, 4, (1, 1), "same", 1, "none", 3, 3, 16),
    (3, 3, (2, 2), "same", 1, "relu", 3, 8, 16),
    (2, 1, (2, 1), "valid", 2, "relu6", 3, 6, 10),
    (1, 3, (1, 2), "same", 3, "none", 2, 9, 12),
    (2, 2, (1, 1), "valid", 1, "relu6", 1, 5, 7),
    (1, 1, (1, 1), "same", 1, "none", 1, 33, 40),
    (3, 1, (1, 1), "same", 1, "relu", 1, 16, 24),
    (1, 2, (1, 1), "valid", 1, "none", 1, 8, 48),
]


@needs_native
@pytest.mark.parametrize(
    ("sx", "sw", "stride", "padding", "groups", "act", "k", "c", "o"), CONV_CASES
)
@pytest.mark.parametrize("single", [False, True])
def test_native_conv2d_equals_numpy(sx, sw, stride, padding, groups, act, k, c, o, single) -> None:
    """Convolution: every stride, padding, group count and set broadcast, both roundings."""
    rng = np.random.default_rng([sx, sw, k, c, o, groups])
    x = _int8(rng, (sx, 3, 9, 7, c))
    w = _int8(rng, (sw, o, k, k, c // groups), -127)
    bias = rng.integers(-3000, 3000, (1, o)).astype(np.int64)
    stage = _stage(rng, o, act, wide=o in (7, 24))
    expected = ki.conv2d(x, w, bias, stage, stride, padding, groups, single)
    got = native.conv2d(x, w, bias, stage, stride, padding, groups, single)
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("sx", "sw", "stride", "padding"),
    [
        (1, 4, (1, 1), "same"),
        (3, 3, (2, 2), "same"),
        (2, 1, (2, 1), "valid"),
        (1, 2, (1, 2), "same"),
    ],
)
@needs_native
@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("c", [5, 16])
def test_native_depthwise_equals_numpy(sx, sw, stride, padding, mult, c) -> None:
    """Depthwise: strides, padding, depth multipliers, vector-width channels, set broadcasts."""
    rng = np.random.default_rng([sx, sw, stride[0], stride[1], mult, c])
    x = _int8(rng, (sx, 2, 8, 9, c))
    w = _int8(rng, (sw, 1, 3, 3, c * mult), -127)
    bias = rng.integers(-3000, 3000, (1, c * mult)).astype(np.int64)
    stage = _stage(rng, c * mult, "relu6", wide=mult == 2)
    expected = ki.depthwise_conv2d(x, w, bias, stage, stride, padding)
    got = native.depthwise_conv2d(x, w, bias, stage, stride, padding)
    np.testing.assert_array_equal(got, expected)


@needs_native
@pytest.mark.parametrize("single", [False, True])
def test_native_dense_equals_numpy(single: bool) -> None:
    """Dense with P weight sets against a shared input, odd feature count."""
    rng = np.random.default_rng(7)
    x = _int8(rng, (1, 5, 37))
    w = _int8(rng, (4, 10, 37), -127)
    bias = rng.integers(-3000, 3000, (1, 10)).astype(np.int64)
    stage = _stage(rng, 10, "none", wide=True)
    np.testing.assert_array_equal(
        native.dense(x, w, bias, stage, single), ki.dense(x, w, bias, stage, single)
    )


@needs_native
@pytest.mark.parametrize("single", [False, True])
def test_native_add_equals_numpy(single: bool) -> None:
    """Element-wise add, with one operand broadcast over the set axis."""
    rng = np.random.default_rng(8)
    p = ki.prepare_add(IN, TensorQuant(scale=0.07, zero_point=4), OUT, "relu")
    a = _int8(rng, (3, 4, 5, 6))
    b = _int8(rng, (1, 4, 5, 6))
    np.testing.assert_array_equal(native.add(a, b, p, single), ki.add(a, b, p, single))


@needs_native
def test_native_threads_do_not_change_bits() -> None:
    """Two threads (work split over samples) give the same bits as one (conv, depthwise)."""
    rng = np.random.default_rng(9)
    x = _int8(rng, (1, 7, 6, 6, 8))
    w = _int8(rng, (5, 12, 3, 3, 8), -127)
    bias = rng.integers(-3000, 3000, (1, 12)).astype(np.int64)
    wd = _int8(rng, (5, 1, 3, 3, 8), -127)
    stage, dstage = _stage(rng, 12, "relu"), _stage(rng, 8, "none")

    def both() -> tuple[np.ndarray, np.ndarray]:
        conv = native.conv2d(x, w, bias, stage, (1, 1), "same")
        return conv, native.depthwise_conv2d(x, wd, bias[:, :8], dstage, (2, 2), "same")

    one = both()
    native.set_threads(2)
    try:
        two = both()
    finally:
        native.set_threads(None)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)


@needs_native
def test_native_rejects_mismatched_sets() -> None:
    """Set axes that do not broadcast are refused before any C code runs."""
    rng = np.random.default_rng(10)
    x = _int8(rng, (2, 1, 4, 4, 2))
    w = _int8(rng, (3, 2, 1, 1, 2))
    with pytest.raises(ValueError, match="broadcast"):
        native.conv2d(x, w, np.zeros((1, 2), np.int64), _stage(rng, 2, "none"), (1, 1), "same")


def test_native_disabled_falls_back_to_numpy() -> None:
    """QSCHED_NATIVE=0: not available, kernels raise NativeError, the engine still runs."""
    code = (
        "import numpy as np\n"
        "from qsched.zo import native\n"
        "from qsched.zo.engine import run_int8\n"
        "from qsched.zo.quantize import quantize_model, quantize_input\n"
        "from qsched.zo.zoo import build_model\n"
        "assert not native.available() and native.build_info() == 'numpy'\n"
        "try:\n"
        "    native.add(np.zeros(2, np.int8), np.zeros(2, np.int8), None)\n"
        "except native.NativeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "m = build_model('cnn', input_shape=(8, 8, 1), seed=0)\n"
        "rng = np.random.default_rng(0)\n"
        "qm = quantize_model(m, rng.normal(size=(8, 8, 8, 1)).astype(np.float32))\n"
        "x = quantize_input(qm, rng.normal(size=(4, 8, 8, 1)).astype(np.float32))\n"
        "np.save(__import__('sys').stdout.buffer, run_int8(qm, x))\n"
    )
    env = {**os.environ, "QSCHED_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    import io

    from qsched.zo.engine import run_int8
    from qsched.zo.quantize import quantize_input, quantize_model
    from qsched.zo.zoo import build_model

    m = build_model("cnn", input_shape=(8, 8, 1), seed=0)
    rng = np.random.default_rng(0)
    qm = quantize_model(m, rng.normal(size=(8, 8, 8, 1)).astype(np.float32))
    x = quantize_input(qm, rng.normal(size=(4, 8, 8, 1)).astype(np.float32))
    np.testing.assert_array_equal(np.load(io.BytesIO(proc.stdout)), run_int8(qm, x))


def test_native_build_failure_logs_one_warning(tmp_path, monkeypatch, caplog) -> None:
    """A compiler that fails: available() is False, with exactly one logged warning."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho broken compiler >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.delenv("QSCHED_NATIVE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    saved = dict(native._state)
    native._state.update(lib=None, tried=False)
    try:
        with caplog.at_level(logging.WARNING, logger="qsched.zo.native"):
            assert not native.available()
            assert not native.available()
    finally:
        native._state.update(saved)
    warnings = [r for r in caplog.records if r.name == "qsched.zo.native"]
    assert len(warnings) == 1 and "broken compiler" in warnings[0].getMessage()


def _variant(tmp_path, flags: list[str]):
    """The kernels built with other flags (another SIMD path), loaded beside the default."""
    import ctypes
    import shutil

    cc = shutil.which(os.environ.get("CC", "gcc"))
    assert cc is not None
    lib = tmp_path / f"variant{len(flags)}.so"
    cmd = [
        cc,
        "-O2",
        *flags,
        "-ffp-contract=off",
        "-fno-strict-aliasing",
        "-fPIC",
        "-shared",
        "-pthread",
        str(native.SOURCE),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    handle = ctypes.CDLL(str(lib))
    native._declare(handle)
    return handle


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize(
    "flags", [["-mno-avx2"], ["-mavx2", "-mno-avx512f"]], ids=["portable", "avx2"]
)
def test_native_simd_paths_equal_numpy(tmp_path, flags: list[str]) -> None:
    """The portable and the AVX2 builds give the numpy kernels' bits too (conv, depthwise)."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86 SIMD flags")
    if "-mavx2" in flags and not _has_avx2():
        pytest.skip("CPU without AVX2")
    handle = _variant(tmp_path, flags)
    rng = np.random.default_rng(11)
    x = _int8(rng, (2, 3, 9, 9, 16))
    w = _int8(rng, (2, 24, 3, 3, 16), -127)
    wd = _int8(rng, (2, 1, 3, 3, 16), -127)
    bias = rng.integers(-3000, 3000, (1, 24)).astype(np.int64)
    stage, dstage = _stage(rng, 24, "relu"), _stage(rng, 16, "relu6")
    saved = dict(native._state)
    native._state.update(lib=handle, tried=True)
    try:
        assert native.build_info() == ("portable" if "-mno-avx2" in flags else "avx2")
        conv = native.conv2d(x, w, bias, stage, (2, 1), "same")
        dw = native.depthwise_conv2d(x, wd, bias[:, :16], dstage, (1, 1), "same")
    finally:
        native._state.update(saved)
    np.testing.assert_array_equal(conv, ki.conv2d(x, w, bias, stage, (2, 1), "same"))
    np.testing.assert_array_equal(
        dw, ki.depthwise_conv2d(x, wd, bias[:, :16], dstage, (1, 1), "same")
    )


@needs_native
def test_native_refuses_accumulator_overflow() -> None:
    """A bias that could push the int32 accumulator past its range is refused."""
    rng = np.random.default_rng(12)
    x = _int8(rng, (1, 1, 4, 4, 8))
    w = _int8(rng, (1, 2, 3, 3, 8))
    bias = np.array([[2**31 - 1000, 0]], np.int64)
    with pytest.raises(ValueError, match="overflow"):
        native.conv2d(x, w, bias, _stage(rng, 2, "none"), (1, 1), "same")
