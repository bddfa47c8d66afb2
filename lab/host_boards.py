"""Virtual boards of one host behind one aggregator, on MQTT (the fleet benchmark).

    python -m qsched.lab.host_boards --mqtt 127.0.0.1:1883 --fleet bench --name host-0 \\
        --count 32 --model-latency mobilenetv2-0.35-128

What ``qsched bridge --aggregate`` does for serial boards, for virtual ones: ``--count``
boards in this process, each on an in-process link, presented to the daemon as the one
board ``--name`` (``qsched.daemon.aggregate.HostAggregator``). The benchmark compares
it with ``qsched board --count`` (every board its own MQTT client) without serial lines
or relays in the way. Runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "serve_host"]

HELLO_TIMEOUT_S = 30.0


async def serve_host(
    mqtt: str,
    fleet: str,
    name: str,
    count: int,
    model_latency: str,
    id_prefix: str,
    timeline: Path | None = None,
) -> str:
    """Run ``count`` virtual boards as the aggregated board ``name`` until cancelled;
    with ``timeline``, the host's step timeline is written there when it stops.

    Returns:
        Why the aggregate stopped (``"closed"`` or ``"members gone"``).
    """
    from qsched.daemon.aggregate import HostAggregator, await_members
    from qsched.daemon.heap import settle_heap
    from qsched.daemon.host_timeline import HostTimeline
    from qsched.firmware.virtual.board import BoardAgent, LatencyProfile, serve_link
    from qsched.protocol.links.config import MqttConfig, parse_host_port
    from qsched.protocol.links.inproc import InProcTransport
    from qsched.protocol.links.mqtt import MqttEndpoint
    from qsched.protocol.topics import TopicMap

    host, port = parse_host_port(mqtt)
    cfg = MqttConfig(host=host, port=port)
    latency = LatencyProfile.named(model_latency)
    width = max(2, len(str(count - 1)))
    agents = [BoardAgent(f"{id_prefix}-{i:0{width}d}", latency=latency) for i in range(count)]
    async with InProcTransport() as local, asyncio.TaskGroup() as tasks:
        ends = [local.attach(agent.board_id) for agent in agents]
        boards = [tasks.create_task(serve_link(a, e)) for a, e in zip(agents, ends, strict=True)]
        links = []
        async for event in local.events():
            links.append(event.link)  # type: ignore[union-attr]  # only BoardAppeared here
            if len(links) == count:
                break
        marks = HostTimeline() if timeline is not None else None
        members = await await_members(links, HELLO_TIMEOUT_S)
        aggregator = HostAggregator(name, members, timeline=marks)
        settle_heap()  # as the qsched command does: what exists now lives as long as the process
        try:
            async with MqttEndpoint(cfg, TopicMap(fleet=fleet), name) as endpoint:
                await endpoint.wait_connected()
                return await aggregator.serve(endpoint, lambda: endpoint.connection.connects)
        finally:
            for board in boards:
                board.cancel()
            if marks is not None and timeline is not None:
                try:
                    marks.write(timeline)
                except OSError as exc:  # the run is over: say so, without a traceback
                    print(f"timeline not written to {timeline}: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until a signal; 2 on bad options."""
    p = argparse.ArgumentParser(prog="python -m qsched.lab.host_boards")
    p.add_argument("--mqtt", required=True, metavar="HOST:PORT")
    p.add_argument("--fleet", default="default")
    p.add_argument("--name", required=True, help="the board id the daemon sees")
    p.add_argument("--count", type=int, default=1, help="virtual boards behind it")
    p.add_argument("--model-latency", default="mobilenetv2-0.35-128")
    p.add_argument("--id-prefix", default="member", help="the members' own ids (logs)")
    p.add_argument(
        "--timeline", type=Path, help="write the host's step timeline here when it stops"
    )
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.count < 1:
        print("--count must be at least 1", file=sys.stderr)
        return 2

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        await serve_host(
            args.mqtt,
            args.fleet,
            args.name,
            args.count,
            args.model_latency,
            args.id_prefix,
            args.timeline,
        )

    from qsched.firmware.virtual.clock import run_precise

    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        run_precise(run(), descriptors=1)  # one MQTT connection; the members are in-process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
