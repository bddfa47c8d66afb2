"""The C firmware core against the Python reference: PRNG, FP16, update, CRC, COBS, loss."""

from __future__ import annotations

import json
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cobs import cobs

from qsched.firmware.native import FIRMWARE_DIR, ToolProcess
from qsched.zo.prng import batch_indices, philox4x32
from qsched.zo.update import (
    apply_fp32,
    apply_int8_fp16,
    perturb_fp32,
    perturb_int8,
    to_fp16_saturating,
)

VECTORS = Path(__file__).resolve().parents[1] / "protocol" / "vectors"


@pytest.fixture(scope="module")
def tool() -> Iterator[ToolProcess]:
    """The sanitizer build of the C test tool, shared by the module's tests."""
    with ToolProcess(sanitized=True) as proc:
        yield proc


def _f32_bits(value: float) -> str:
    return struct.pack("<f", value)[::-1].hex()


def _pairs_args(pairs: list[tuple[int, float]]) -> str:
    return f"{len(pairs)} " + " ".join(f"{k} {_f32_bits(c)}" for k, c in pairs)


def test_core_protocol_vectors(tool: ToolProcess) -> None:
    """Every protocol vector file passes in C, and each kind is exercised."""
    files = sorted(VECTORS.glob("*.txt"))
    assert files, "protocol/vectors has no vector files"
    for path in files:
        answer = tool.ask(f"vectors {path}")
        assert answer.startswith("ok "), f"{path.name}: {answer}"
        assert "skipped=0" in answer, f"{path.name} has kinds the C runner does not know: {answer}"


def test_core_fp16_zero_remainder_is_positive(tool: ToolProcess, tmp_path: Path) -> None:
    """numeric.json's int8_fp16_zero updates (sums that round to -0.0) pass in C too."""
    numeric = json.loads((VECTORS / "numeric.json").read_text())
    lines = [
        f"int8_fp16.{key.removeprefix('int8_fp16_zero.')} {value}"
        for key, value in numeric.items()
        if key.startswith("int8_fp16_zero.")
    ]
    assert lines
    path = tmp_path / "zero.txt"
    path.write_text("\n".join(lines) + "\n")
    answer = tool.ask(f"vectors {path}")
    assert answer.startswith("ok ") and "skipped=0" in answer and "int8_fp16=1/0" in answer, answer


def test_core_decoder_verdicts_follow_the_spec(tool: ToolProcess) -> None:
    """Every wire.json decode case gets the same kind from the C decoder as from Python's:
    which check comes first when two faults compete (SPEC 6.4), text rules included."""
    wire = json.loads((VECTORS / "wire.json").read_text())
    cases = sorted({key.split(".")[1] for key in wire if key.startswith("decode.")})
    assert len(cases) >= 50
    verdicts = {case: tool.ask(f"decode {wire[f'decode.{case}.hex'] or '-'}") for case in cases}
    assert verdicts == {case: wire[f"decode.{case}.result"] for case in cases}


def test_core_philox_matches_python(tool: ToolProcess) -> None:
    """Philox4x32-10 gives the same words in C and numpy on random counters and keys."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=(40, 6), dtype=np.uint64)
    for row in words:
        key = (int(row[4]), int(row[5]))
        want = philox4x32(row[None, :4].astype(np.uint32), key)[0]
        got = tool.ask("philox " + " ".join(str(int(v)) for v in row))
        assert got == " ".join(f"{int(w):08x}" for w in want)


def test_core_batch_indices_match_python(tool: ToolProcess) -> None:
    """Minibatch indices agree, including batch sizes that are not a multiple of 4."""
    for seed, step, b, n in [(0, 0, 1, 1), (2**64 - 1, 7, 67, 1797), (12345, 2**32 - 1, 64, 50000)]:
        want = batch_indices(seed, step, b, n)
        got = tool.ask(f"batch {seed} {step} {b} {n}")
        assert [int(v) for v in got.split()] == want.tolist()


def test_core_fp16_rounding_matches_numpy(tool: ToolProcess) -> None:
    """float32 -> binary16 rounds to nearest even and saturates like numpy + clip."""
    rng = np.random.default_rng(2)
    specials = np.array(
        [
            0.0,
            -0.0,
            65504.0,
            65519.0,
            65520.0,
            1e9,
            -np.inf,
            np.inf,
            2**-25,
            2**-24,
            3 * 2**-26,
            6.1e-5,
            2**-14,
            -(2**-14) * 0.999,
            0.5 + 2**-12,
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
        ],
        dtype=np.float32,
    )
    randoms = rng.standard_normal(300).astype(np.float32) * np.float32(10.0) ** rng.integers(
        -8, 6, 300
    )
    for value in np.concatenate([specials, randoms.astype(np.float32)]):
        want = to_fp16_saturating(np.array([value], dtype=np.float32)).view(np.uint16)[0]
        got = tool.ask(f"f16 {_f32_bits(float(value))}")
        assert int(got, 16) == int(want), f"{value!r}"


def test_core_fp16_to_f32_is_exact(tool: ToolProcess) -> None:
    """binary16 -> float32 is exact for all finite values, subnormals included."""
    for half in [*range(0, 0x7C00, 37), 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x8001, 0xFBFF]:
        want = np.array([half], dtype=np.uint16).view(np.float16).astype(np.float32)[0]
        got = tool.ask(f"f32 {half:04x}")
        assert got == _f32_bits(float(want))


def test_core_crc32_matches_zlib(tool: ToolProcess) -> None:
    """CRC-32 equals zlib.crc32 on empty, short and long inputs."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 9, 63, 64, 65, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert int(tool.ask(f"crc32 {data.hex() or '-'}"), 16) == zlib.crc32(data)


def test_core_cobs_matches_python_cobs(tool: ToolProcess) -> None:
    """COBS encoding is canonical (as the cobs package) and decoding inverts it."""
    rng = np.random.default_rng(4)
    cases = [
        b"",
        b"\x00",
        b"\x00\x00",
        b"\x01" * 254,
        b"\x01" * 253 + b"\x00",
        b"\x01" * 255,
        b"\x01" * 508,
    ]
    cases += [rng.integers(0, 4, n, dtype=np.uint8).tobytes() for n in (10, 300, 600)]
    for data in cases:
        encoded = cobs.encode(data)
        assert tool.ask(f"cobs_enc {data.hex() or '-'}") == (encoded.hex() or "-")
        assert tool.ask(f"cobs_dec {encoded.hex()}") == (data.hex() or "-")


def test_core_cobs_rejects_malformed_frames(tool: ToolProcess) -> None:
    """A zero byte inside a frame or a code running past its end is a format error."""
    for bad in ("00", "0311", "05112233", "021100"):
        assert tool.ask(f"cobs_dec {bad}") == "err bad-format"


def test_core_perturb_int8_matches_python(tool: ToolProcess) -> None:
    """INT8 perturbations agree at any flat offset, both signs, saturating at +-127."""
    rng = np.random.default_rng(5)
    weights = rng.integers(-127, 128, 700, dtype=np.int8)
    full = np.concatenate([np.zeros(77, np.int8), weights])
    for eps, sign in ((1, 1), (3, -1), (127, 1)):
        want = perturb_int8(full, 99, 4, 11, eps, sign)[77:]
        got = tool.ask(f"perturb_i8 99 4 11 {eps} {sign} 77 {weights.tobytes().hex()}")
        assert got == want.tobytes().hex()


def test_core_perturb_int8_rejects_bad_eps(tool: ToolProcess) -> None:
    """eps outside 1..127 or a sign other than +-1 is refused with a status code."""
    assert tool.ask("perturb_i8 1 1 1 0 1 0 00") == "err bad-argument"
    assert tool.ask("perturb_i8 1 1 1 128 1 0 00") == "err bad-argument"
    assert tool.ask("perturb_i8 1 1 1 1 2 0 00") == "err bad-argument"


def test_core_perturb_fp32_matches_python(tool: ToolProcess) -> None:
    """FP32 perturbations are the same float32 bits."""
    theta = np.random.default_rng(6).standard_normal(300).astype(np.float32)
    for sign in (1, -1):
        want = perturb_fp32(theta, 3, 8, 2, 1e-3, sign)
        got = tool.ask(f"perturb_f32 3 8 2 {_f32_bits(1e-3)} {sign} 0 {theta.tobytes().hex()}")
        assert got == want.tobytes().hex()


def test_core_apply_fp32_matches_python(tool: ToolProcess) -> None:
    """An FP32 update with many coefficients gives identical bits at an offset."""
    rng = np.random.default_rng(7)
    full = rng.standard_normal(1000).astype(np.float32)
    pairs = [
        (int(k), float(np.float32(c)))
        for k, c in zip(range(0, 60, 3), rng.standard_normal(20), strict=True)
    ]
    want = apply_fp32(full, 2**40 + 5, 17, pairs)[130:]
    got = tool.ask(
        f"apply_f32 {2**40 + 5} 17 130 {_pairs_args(pairs)} {full[130:].tobytes().hex()}"
    )
    assert got == want.tobytes().hex()


def test_core_apply_int8_fp16_matches_python(tool: ToolProcess) -> None:
    """INT8 + FP16 buffer: weights and buffer bits agree over many steps."""
    rng = np.random.default_rng(8)
    weights = rng.integers(-127, 128, 517, dtype=np.int8)
    buffer = np.zeros(517, dtype=np.float16)
    for step in range(12):
        scale = 10.0 ** rng.integers(-4, 3)
        pairs = [
            (int(k), float(np.float32(c * scale))) for k, c in enumerate(rng.standard_normal(6))
        ]
        want_w, want_b = apply_int8_fp16(weights, buffer, 42, step, pairs)
        got = tool.ask(
            f"apply_i8 42 {step} 0 {_pairs_args(pairs)} "
            f"{weights.tobytes().hex()} {buffer.tobytes().hex()}"
        )
        assert got == f"{want_w.tobytes().hex()} {want_b.tobytes().hex()}", f"step {step}"
        weights, buffer = want_w, want_b


def test_core_apply_rejects_unsorted_pairs(tool: ToolProcess) -> None:
    """Pairs out of ascending k, or a repeated k, are a protocol error in C too."""
    one = _f32_bits(1.0)
    assert tool.ask(f"apply_f32 1 1 0 2 5 {one} 3 {one} 00000000") == "err bad-order"
    assert tool.ask(f"apply_i8 1 1 0 2 5 {one} 5 {one} 00 0000") == "err bad-order"


def test_core_build_skips_m55_without_toolchain() -> None:
    """Without arm-none-eabi-gcc the m55 part is skipped with a message, not an error."""
    proc = subprocess.run(
        ["make", "-C", str(FIRMWARE_DIR), "m55", "ARM_CC=arm-none-eabi-gcc-missing"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "arm-none-eabi-gcc-missing not found; skipping the Cortex-M55 images" in proc.stdout


def test_core_int8_accumulator_matches_python(tool: ToolProcess) -> None:
    """INT8 buffer with per-tensor shifts: 32 steps (a refining and a coarsening rescale)."""
    from qsched.zo import accum_int8

    rng = np.random.default_rng(12)
    sizes = [300, 7, 129]
    weights = rng.integers(-127, 128, sum(sizes), dtype=np.int8)
    state = accum_int8.initial_state(sizes)
    size_args = f"{len(sizes)} " + " ".join(map(str, sizes))
    shifts_seen = []
    for step in range(32):
        # Tiny updates first (the buffers stay small: shifts refine), then large (they saturate).
        scale = 1e-3 if step < 16 else 4.0
        pairs = [(k, float(np.float32(c * scale))) for k, c in enumerate(rng.standard_normal(5))]
        want_w, want_s = accum_int8.apply(weights, state, sizes, 77, step, pairs)
        got = tool.ask(
            f"apply_acc8 77 {step} {size_args} {_pairs_args(pairs)} "
            f"{weights.tobytes().hex()} {state.tobytes().hex()}"
        )
        assert got == f"{want_w.tobytes().hex()} {want_s.tobytes().hex()}", f"step {step}"
        weights, state = want_w, want_s
        shifts_seen.append(state[-3:].tolist())
    assert shifts_seen[15] == [8, 8, 8] and shifts_seen[31] == [7, 7, 7], shifts_seen


def test_core_recalibration_matches_python(tool: ToolProcess) -> None:
    """Scale recalibration of one tensor, channel-major and channel-minor, with channels at
    their exponent limit, a zero multiplier and odd weights carrying half steps."""
    from qsched.zo.recalibrate import ChannelLayout, recalibrate

    rng = np.random.default_rng(21)
    for case, minor in enumerate((False, True, False)):
        channels, per_channel = 6, 9
        count = channels * per_channel
        weights = rng.integers(-127, 128, count).astype(np.int8)
        buffer = rng.uniform(-0.999, 0.999, count).astype(np.float16)
        multipliers = rng.integers(1 << 30, 1 << 31, channels)
        multipliers[1] = 0
        shifts = rng.integers(-12, 0, channels)
        shifts[2] = 28
        exps = rng.integers(0, 3, channels).astype(np.int8)
        layout = ChannelLayout.of([(count, channels, minor)], multipliers, shifts)
        for _ in range(3):  # again and again: some channels reach their limit
            channel_of = layout.element_channel
            weights[channel_of == case] = 127 * np.sign(weights[channel_of == case] | 1)
            want = recalibrate(weights, buffer, exps, layout)
            got = tool.ask(
                f"recal {channels} {int(minor)} {' '.join(map(str, multipliers))} "
                f"{' '.join(map(str, shifts))} {weights.tobytes().hex()} "
                f"{buffer.astype('<f2').tobytes().hex()} {exps.tobytes().hex()}"
            )
            assert got == " ".join(
                [
                    want[0].tobytes().hex(),
                    want[1].astype("<f2").tobytes().hex(),
                    want[2].tobytes().hex(),
                ]
            ), (case, got)
            weights, buffer, exps = want


def test_core_recalibration_vectors(tool: ToolProcess) -> None:
    """numeric.json recal: the C recalibration gives the committed bits."""
    import json

    vectors = json.loads((VECTORS / "numeric.json").read_text(encoding="utf-8"))
    for i in range(3):
        f = {k.split(".")[-1]: v for k, v in vectors.items() if k.startswith(f"recal.{i}.")}
        got = tool.ask(
            f"recal {f['channels']} {f['channel_minor']} {f['multipliers'].replace(',', ' ')} "
            f"{f['shifts'].replace(',', ' ')} {f['weights']} {f['buffer']} {f['exps']}"
        )
        assert got == f"{f['expected_weights']} {f['expected_buffer']} {f['expected_exps']}", i
