"""``qsched bench fleet`` on a tiny configuration: the command runs and its figures add up
(no timing assertions: timings belong to the machine, not to the code)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from qsched.lab.bench_fleet import (
    DEFAULT_BATCHES,
    BenchRow,
    BrokerMeter,
    ByteCounter,
    CountingTransport,
    _config,
    _parser,
    floor_verdicts,
    main,
)
from qsched.protocol.codec import encode
from qsched.protocol.links.base import BoardAppeared
from qsched.protocol.links.inproc import InProcTransport
from qsched.protocol.messages import (
    ApplyUpdate,
    EvalRequest,
    Heartbeat,
    Shard,
    StepOrder,
    UpdateAck,
)

Q = 8


def _size(msg: object) -> int:
    return len(encode(msg))  # type: ignore[arg-type]


def test_bench_fleet_tiny_run_prints_and_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 and 2 boards over a private Mosquitto and over ptys: a table, notes, and exact byte
    counts."""
    out = tmp_path / "bench.json"
    status = main(
        [
            "--boards",
            "1,2",
            "--q",
            str(Q),
            "--seconds",
            "0.1",
            "--min-steps",
            "2",
            "--warmup",
            "1",
            "--batch",
            "2",
            "--json",
            str(out),
            "--log",
            str(tmp_path / "daemon.log"),
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out

    assert "board joined" not in captured.err + printed  # the daemon's log went to its file
    assert "board joined" in (tmp_path / "daemon.log").read_text()
    assert "batch 2:" in printed and "ms of NPU time per forward pass" in printed

    assert status == 0
    rows = json.loads(out.read_text())
    assert [(r["link"], r["boards"]) for r in rows] == [
        ("mqtt", 1),
        ("mqtt", 2),
        ("serial", 1),
        ("serial", 2),
    ]
    # The board processes and the broker worked (per row, a 0.1 s window may be under one
    # clock tick of theirs).
    assert sum(r["others_cpu_s_per_step"] for r in rows) > 0
    update = _size(ApplyUpdate(job_id=1, step=0, ks=tuple(range(Q)), coefficients=(0.5,) * Q))
    ack = _size(UpdateAck(job_id=1, step=0, checksum=0))
    for row in rows:
        boards, by_type = row["boards"], row["bytes_by_type"]
        assert row["steps"] >= 2 and row["step_s"] > 0 and row["forward_passes_per_s"] > 0
        assert sum(row["work"].values()) == Q * (1 + row["steps"])  # no audits: every key once
        assert by_type["update_ack"] == boards * ack
        shards = {
            b: tuple(range(i * Q // boards, (i + 1) * Q // boards))
            for i, b in enumerate(sorted(row["work"]))
        }
        shard = _size(
            EvalRequest(
                job_id=1,
                step=0,
                batch_size=1,
                eps=1.0,
                estimator="two_sided",
                ks=tuple(range(Q // boards)),
            )
        )
        if row["link"] == "mqtt":  # one step order for the fleet instead of 2 messages each
            order = StepOrder(
                job_id=1,
                step=0,
                ks=tuple(range(Q)),
                coefficients=(0.5,) * Q,
                batch_size=1,
                eps=1.0,
                estimator="two_sided",
                shards=tuple(Shard(board_id=b, ks=ks) for b, ks in shards.items()),
            )
            assert by_type["step_order"] == _size(order)
            assert "apply_update" not in by_type and "eval_request" not in by_type
            assert row["messages_per_step"] == 1 + 2 * boards
        else:
            assert by_type["apply_update"] == boards * update
            assert by_type["eval_request"] == boards * shard
            assert row["messages_per_step"] == 4 * boards
        assert row["daemon_cpu_s_per_step"] > 0
        assert row["others_cpu_s_per_step"] >= 0
        assert row["board_message_us"] > 0  # the machine's yardstick, taken per row
        marks = row["timeline_ms"]  # medians after the update went out, in order
        assert 0 < marks["first ack"] <= marks["last ack"] < marks["next step"]
        assert marks["first result"] <= marks["last result"] < marks["next step"]
        assert row["payload_bytes_per_step"] == sum(v for k, v in by_type.items() if k != "other")
        assert row["efficiency"] == (
            1.0
            if boards == 1
            else pytest.approx(
                row["forward_passes_per_s"]
                / (
                    2
                    * next(r for r in rows if r["link"] == row["link"] and r["boards"] == 1)[
                        "forward_passes_per_s"
                    ]
                )
            )
        )
    lines = printed.splitlines()
    assert "the host CPU is not the bottleneck" in printed
    assert sum(1 for line in lines if line.startswith(("mqtt ", "serial "))) == 4
    assert "grad B: shipping fp32 gradients instead" in printed
    assert "ref us: this machine's time for one board's messages" in printed
    for row in rows:  # the yardstick column ends each row's line
        line = next(x for x in lines if x.split()[:2] == [row["link"], str(row["boards"])])
        assert line.split()[-1] == f"{row['board_message_us']:.1f}"
    assert "floor:" not in printed  # no 8-board MQTT row, so no verdict


def test_bench_fleet_aggregated_mqtt_hosts(tmp_path: Path) -> None:
    """Four virtual boards in two processes, each process one aggregated MQTT board."""
    out = tmp_path / "hosts.json"
    argv = ["--links", "mqtt", "--boards", "4", "--board-processes", "2", "--aggregate"]
    argv += ["--q", str(Q), "--seconds", "0.1", "--min-steps", "2", "--warmup", "1"]
    argv += ["--batch", "2", "--json", str(out), "--log", str(tmp_path / "daemon.log")]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert set(row["work"]) == {"bench-host-0", "bench-host-1"}
    _every_key_evaluated(row)
    assert row["messages_per_step"] == 1 + 2 * 2  # one order, an ack and a result per host
    # Each host wrote its own timeline, read on the daemon's clock after each update.
    marks = row["host_timeline_ms"]
    assert list(marks) == ["order in", "shares out", "answers in", "result out"]
    assert 0 < marks["order in"] <= marks["shares out"] <= marks["answers in"]
    assert marks["answers in"] <= marks["result out"] < row["timeline_ms"]["last result"]


@pytest.mark.parametrize("aggregate", [False, True])
def test_bench_fleet_bridge_link(tmp_path: Path, aggregate: bool) -> None:
    """Serial boards behind two bridges, the daemon on MQTT: four boards, or two
    aggregated hosts the daemon sees as boards."""
    out = tmp_path / "bridge.json"
    argv = ["--links", "bridge", "--boards", "4", "--bridges", "2", "--q", str(Q)]
    argv += ["--seconds", "0.1", "--min-steps", "2", "--warmup", "1", "--batch", "2"]
    argv += ["--json", str(out), "--log", str(tmp_path / "daemon.log")]
    assert main([*argv, *(["--aggregate"] if aggregate else [])]) == 0
    (row,) = json.loads(out.read_text())
    assert row["link"] == "bridge" and row["boards"] == 4
    workers = set(row["work"])
    assert workers == ({"bench-host-0", "bench-host-1"} if aggregate else workers)
    assert len(workers) == (2 if aggregate else 4)
    _every_key_evaluated(row)


def _every_key_evaluated(row: dict[str, Any]) -> None:
    """Each step's Q keys were evaluated: once each, or once per slice where the planner
    split a batch over boards (work counts a key on a slice as one)."""
    keys = Q * (1 + row["steps"])
    assert keys <= sum(row["work"].values()) <= keys * len(row["work"])


async def test_bench_counting_transport_counts_by_type() -> None:
    """Links of a counting view add each message's bytes under its type, only while active."""
    counter = ByteCounter()
    async with InProcTransport() as inner:
        endpoint = inner.attach("b0")
        events = CountingTransport(inner, counter).events()
        appeared = await asyncio.wait_for(anext(events), 5)
        assert isinstance(appeared, BoardAppeared)
        ack = encode(UpdateAck(job_id=1, step=3, checksum=7))
        beat = encode(Heartbeat(uptime_ms=1, state="idle"))
        incoming = appeared.link.incoming()
        await endpoint.send(beat)
        await asyncio.wait_for(anext(incoming), 5)  # received while inactive: not counted
        counter.active = True
        await endpoint.send(ack)
        await endpoint.send(beat)
        for _ in range(2):
            await asyncio.wait_for(anext(incoming), 5)
        await appeared.link.send(ack)  # the daemon's sends count too
        await endpoint.close()
    assert counter.bytes == {"update_ack": 2 * len(ack), "other": len(beat)}


def test_bench_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A zero q, or fewer most than fewest steps, is a usage error; an unknown link is
    refused by the parser."""
    assert main(["--q", "0"]) == 2
    assert main(["--min-steps", "5", "--max-steps", "4"]) == 2
    with pytest.raises(SystemExit):
        main(["--links", "carrier-pigeon"])
    assert "qsched bench fleet" in capsys.readouterr().err


def test_bench_measures_at_most_max_steps() -> None:
    """--max-steps caps the measured steps, within the --seconds window; by default 200
    steps, so that a 128-board row's steps of about 30 ms fill the 5 s window the broker's
    rate needs."""
    config = _config(_parser().parse_args([]))
    assert (config.window_s, config.max_steps) == (5.0, 200)
    assert config.max_steps * 0.030 >= config.window_s
    assert _config(_parser().parse_args(["--max-steps", "300"])).max_steps == 300


def test_broker_rate_is_the_counters_growth_between_readings_inside_the_window() -> None:
    """The rate adds received and sent: each counter's growth between its first and last
    reading inside the window, over their time apart; fewer than two inside give none."""
    meter = BrokerMeter("127.0.0.1:1883")
    meter.readings = {
        "received": [(0.5, 10), (1.0, 100), (2.5, 400), (4.0, 700), (9.0, 5000)],
        "sent": [(1.2, 200), (2.7, 800), (4.2, 1400)],
    }
    assert meter.rate(0.9, 4.5) == pytest.approx(600 / 3.0 + 1200 / 3.0)
    assert meter.rate(0.9, 2.6) is None  # one reading of "sent" inside
    assert meter.rate(5.0, 8.0) is None


def test_bench_default_batches_minibatch_then_worst_case() -> None:
    """By default the bench runs a 4-sample minibatch per pass, then the 1-sample worst case."""
    assert _parser().parse_args([]).batch == DEFAULT_BATCHES == (4, 1)
    assert _parser().parse_args(["--batch", "8"]).batch == (8,)


def _row(link: str, boards: int, efficiency: float, daemon_cpu_s: float) -> BenchRow:
    return BenchRow(
        link=link,
        boards=boards,
        steps=10,
        step_s=0.1,
        ideal_step_s=0.1 * efficiency,
        forward_passes_per_s=1.0,
        payload_bytes_per_step=0.0,
        efficiency=efficiency,
        daemon_cpu_s_per_step=daemon_cpu_s,
    )


def test_floor_verdicts_judge_each_measured_fleet_target() -> None:
    """Every target the rows measure gets a verdict from its own row; bridges do not count."""
    rows = [
        _row("mqtt", 8, 0.97, 0.005),
        _row("mqtt", 32, 0.91, 0.005),
        _row("mqtt", 128, 0.64, 0.011),
        _row("bridge", 32, 0.99, 0.001),
    ]
    assert floor_verdicts(rows) == [
        "floor: efficiency >= 0.9 at 8 boards over MQTT: met (0.970)",
        "floor: efficiency >= 0.9 at 32 boards over MQTT: met (0.910)",
        "floor: efficiency >= 0.8 at 128 boards over MQTT: NOT met (0.640)",
        "floor: daemon CPU per step at 128 boards <= 2 x that at 8: NOT met (2.20 x)",
    ]
    assert floor_verdicts([_row("mqtt", 32, 0.85, 0.005)]) == [
        "floor: efficiency >= 0.9 at 32 boards over MQTT: NOT met (0.850)"
    ]
