"""Integer softmax cross-entropy: accuracy, exactness, the shared test vectors."""

from __future__ import annotations

import math
from importlib import resources

import numpy as np
import pytest

from qsched.zo import intloss


def _float64_ce(logits: np.ndarray, labels: np.ndarray, scale: float) -> np.ndarray:
    real = float(np.float32(scale)) * logits.astype(np.float64)
    top = real.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(real - top).sum(axis=-1)) + top[..., 0]
    return lse - np.take_along_axis(real, labels[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("scale", [0.01, 0.0625, 0.2, 0.9])
def test_intloss_close_to_float(scale: float) -> None:
    """Integer loss is within 1e-4 of the float64 cross-entropy of the dequantised logits."""
    rng = np.random.default_rng(1)
    logits = rng.integers(-128, 128, size=(500, 10)).astype(np.int8)
    labels = rng.integers(0, 10, size=500)
    got = (
        intloss.loss_q16(logits, labels, intloss.exp_table(scale), intloss.scale_q24(scale))
        / 65536.0
    )
    assert np.abs(got - _float64_ce(logits, labels, scale)).max() < 1e-4


def test_intloss_exp_table_matches_float() -> None:
    """The integer exp table equals round(2**24 exp(-s d)) computed in float64 (away from ties)."""
    for scale in (0.003, 0.05, 0.3, 7.0):
        s = float(np.float32(scale))
        expected = [math.floor(2**24 * math.exp(-s * d) + 0.5) for d in range(256)]
        table = intloss.exp_table(scale)
        assert int(table[0]) == 1 << 24
        assert np.abs(table.astype(np.int64) - np.asarray(expected)).max() <= 1


def test_intloss_scale_q24_rounds_exactly() -> None:
    """S = round(s * 2**24) half up, from the float32 bits."""
    assert intloss.scale_q24(0.25) == 1 << 22
    assert intloss.scale_q24(2.0**-26) == 0
    assert intloss.scale_q24(2.0**-25) == 1  # exactly half: rounds up
    assert intloss.scale_q24(3.0 * 2.0**-26) == 1  # 0.75 rounds to 1
    for bad in (0.0, -0.1, 16.0, float("nan")):
        with pytest.raises(intloss.IntLossError):
            intloss.scale_q24(bad)


def test_intloss_ilog2_against_float() -> None:
    """ilog2_q24 is within 2**-22 of log2 and exact on powers of two."""
    values = np.array(
        [1, 2, 3, 1 << 24, (1 << 24) + 12345, 10 << 24, 2**40 - 1, 2**61], dtype=np.uint64
    )
    got = intloss.ilog2_q24(values).astype(np.float64) / 2**24
    assert np.abs(got - np.log2(values.astype(np.float64))).max() < 2**-22
    assert int(intloss.ilog2_q24(np.array([1 << 30], dtype=np.uint64))[0]) == 30 << 24


def test_intloss_monotone_in_label_logit() -> None:
    """Raising the true class's logit never raises the loss; all-equal logits give ln C."""
    scale = 0.1
    table, s_q24 = intloss.exp_table(scale), intloss.scale_q24(scale)
    base = np.zeros((256, 10), dtype=np.int8)
    base[:, 0] = np.arange(-128, 128)
    losses = intloss.loss_q16(base, np.zeros(256, dtype=np.int64), table, s_q24)
    assert np.all(np.diff(losses.astype(np.int64)) <= 0)
    equal = intloss.loss_q16(np.zeros((1, 10), dtype=np.int8), np.array([3]), table, s_q24)
    assert abs(int(equal[0]) / 65536 - math.log(10)) < 2e-5


def test_intloss_batch_mean_floor() -> None:
    """Batch loss is floor(sum / B) in integers, and its float32 value is exact."""
    per = np.array([[3, 4], [65536, 65537]], dtype=np.int32)
    assert intloss.batch_loss_q16(per).tolist() == [3, 65536]
    assert intloss.q16_to_float(98304) == np.float32(1.5)


def test_intloss_rejects_bad_inputs() -> None:
    """Labels out of range, float logits, a wrong table are typed errors."""
    table, s = intloss.exp_table(0.1), intloss.scale_q24(0.1)
    with pytest.raises(intloss.IntLossError, match="labels"):
        intloss.loss_q16(np.zeros((1, 3), np.int8), np.array([3]), table, s)
    with pytest.raises(intloss.IntLossError, match="int8"):
        intloss.loss_q16(np.zeros((1, 3), np.float32), np.array([0]), table, s)  # type: ignore[arg-type]
    with pytest.raises(intloss.IntLossError, match="table"):
        intloss.loss_q16(np.zeros((1, 3), np.int8), np.array([0]), table[:10], s)


def test_intloss_vectors_file_is_current() -> None:
    """protocol/vectors/intloss.txt equals what the reference implementation generates."""
    text = resources.files("qsched.protocol").joinpath("vectors/intloss.txt").read_text()
    assert text == intloss.format_vectors()


def test_intloss_vectors_replay() -> None:
    """Every loss line of the vectors file replays from its own table line."""
    text = resources.files("qsched.protocol").joinpath("vectors/intloss.txt").read_text()
    tables: dict[str, tuple[np.ndarray, int]] = {}
    checked = 0
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "table":
            words = np.array([int(w, 16) for w in fields[3:]], dtype=np.uint32)
            tables[fields[1]] = (words, int(fields[2]))
        elif fields and fields[0] == "loss":
            table, s_q24 = tables[fields[1]]
            logits = np.frombuffer(bytes.fromhex(fields[2]), dtype=np.int8)[None, :]
            got = intloss.loss_q16(logits, np.array([int(fields[3])]), table, s_q24)
            assert int(got[0]) == int(fields[4])
            checked += 1
    assert checked >= 50


def test_sliced_batch_losses_round_as_float32_of_the_floored_mean() -> None:
    """The losses folded from slice sums are float32(floor(sum / B) / 65536), several
    keys at once with the bits of one at a time: on random sums, on values whose
    quotient by 65536 needs more than float32's 24 bits (ties round to even), and at
    zero."""
    rng = np.random.default_rng(5)
    cases: list[tuple[list[int], int]] = [([0], 1), ([0, 0, 0], 3)]
    for _ in range(2000):
        parts = int(rng.integers(1, 5))
        top = 1 << int(rng.choice([8, 24, 31, 40, 52]))
        cases.append(([int(v) for v in rng.integers(0, top, parts)], int(rng.integers(1, 9))))
    # 2^25 + 1 and 2^25 + 3 over 65536 lie halfway between float32 neighbours.
    cases += [([(1 << 25) + 1], 1), ([(1 << 25) + 3], 1), ([(1 << 41) + 1], 1)]
    for batch in range(1, 9):
        chunk = [sums for sums, b in cases if b == batch]
        got = intloss.sliced_batch_losses(chunk, batch)
        want = [np.float32((sum(sums) // batch) / 65536.0) for sums in chunk]
        assert [np.float32(v).tobytes() for v in got] == [w.tobytes() for w in want]
        assert all(float(np.float32(v)) == v for v in got)  # already float32 values
    assert intloss.sliced_batch_loss([6, 2], 4) == np.float32(2 / 65536)
    with pytest.raises(Exception, match="empty batch"):
        intloss.sliced_batch_losses([[1]], 0)
