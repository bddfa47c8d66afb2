"""The ``qsched`` command line: one entry point, subcommands dispatched by a table.

Each subcommand is a ``main(argv: list[str]) -> int`` function somewhere in the package,
named in ``COMMANDS`` as ``"module:function"`` and imported only when it runs, so
``qsched --help`` stays fast and a part that is not built yet fails alone, with a clear
message and exit status 2. Adding a command is one line in the table.

Exit statuses: 0 success, 1 failure at run time, 2 usage or configuration error (or a
command that is not built yet).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from qsched.daemon.config import ConfigError, load_config
from qsched.daemon.errors import NotBuiltError
from qsched.daemon.heap import settle_heap
from qsched.daemon.logging import LEVELS, configure_logging

__all__ = ["COMMANDS", "Command", "NotBuiltError", "main", "resolve"]

EXIT_USAGE = 2


class Command(NamedTuple):
    """One subcommand: where its ``main(argv) -> int`` lives, and a line of help."""

    target: str
    help: str


COMMANDS: dict[str, Command] = {
    "daemon": Command(
        "qsched.daemon.service:main", "run the fleet daemon (boards, jobs, control API)"
    ),
    "ctl": Command("qsched.daemon.ctl:main", "send a command to a running daemon"),
    "board": Command(
        "qsched.firmware.virtual.cli:main", "run virtual boards on MQTT or serial ports"
    ),
    "bridge": Command("qsched.daemon.bridge:main", "expose this host's serial boards on MQTT"),
    "demo": Command("qsched.lab.demo:main", "train on virtual boards with embedded defaults"),
    "train": Command("qsched.daemon.train:main", "train in this process, without boards"),
    "experiment": Command("qsched.lab.experiment:main", "compare q policies (the paper's grid)"),
    "experiment-merge": Command(
        "qsched.lab.experiment_merge:main", "pool result folders run on other seeds"
    ),
    "pretrain": Command(
        "qsched.lab.pretrain:main", "train a zoo backbone with backprop, write an int8 .tflite"
    ),
    "lr-defaults": Command(
        "qsched.lab.lr_defaults:main", "train with each INT8 learning-rate unit's default"
    ),
    "bench engine": Command("qsched.lab.bench_engine:main", "time the forward engine (FP32, INT8)"),
    "bench fleet": Command("qsched.lab.bench_fleet:main", "time steps on fleets of virtual boards"),
    "chaos": Command(
        "qsched.lab.chaos:main", "fault campaign: kills, restarts, noisy lines, fuzz, liars"
    ),
    "inspect": Command(
        "qsched.firmware.model_report:main", "a .tflite model's operators, layers, board memory"
    ),
    "zoo": Command("qsched.daemon.cli:zoo_main", "list the model zoo (parameters, MACs)"),
    "schema": Command("qsched.protocol.schema:main", "write the control-plane JSON Schema"),
    "config": Command("qsched.daemon.cli:config_main", "print the effective daemon configuration"),
}


def resolve(target: str) -> Callable[[list[str]], int | None]:
    """Import ``"module:function"``.

    Args:
        target: the dotted module path and the function name.

    Returns:
        The function.

    Raises:
        NotBuiltError: the module or the function is missing. Any other import
            failure (a bug inside a built module) propagates unchanged.
    """
    module_name, _, func_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise NotBuiltError(f"{module_name} is missing") from exc
        raise
    func = getattr(module, func_name, None)
    if not callable(func):
        raise NotBuiltError(f"{module_name} has no {func_name}()")
    return func


def _groups() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in COMMANDS:
        head, _, tail = name.partition(" ")
        groups.setdefault(head, []).append(tail)
    return groups


def _epilog() -> str:
    width = max(len(name) for name in COMMANDS) + 2
    lines = ["commands:"] + [f"  {name:<{width}}{cmd.help}" for name, cmd in COMMANDS.items()]
    lines.append("\nRun `qsched COMMAND --help` for a command's options.")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsched",
        description="Zeroth-order training on fleets of STM32N6 NPU boards.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--config", type=Path, help="daemon configuration (TOML); also $QSCHED_CONFIG"
    )
    parser.add_argument(
        "--log-level",
        choices=sorted(LEVELS),
        default=os.environ.get("QSCHED_LOG_LEVEL", "info").lower(),
    )
    parser.add_argument("command", metavar="COMMAND", choices=sorted(_groups()), help="see below")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qsched")
    except PackageNotFoundError:
        return "unknown"


def _split_command(command: str, rest: list[str]) -> tuple[str, list[str]] | str:
    subs = _groups()[command]
    if subs == [""]:
        return command, rest
    if not rest or rest[0] not in subs:
        return f"qsched {command}: choose one of {', '.join(subs)}"
    return f"{command} {rest[0]}", rest[1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qsched`` command line.

    Args:
        argv: the arguments after the program name (``sys.argv[1:]`` when None).

    Returns:
        The exit status.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    split = _split_command(args.command, list(args.args))
    if isinstance(split, str):
        print(split, file=sys.stderr)
        return EXIT_USAGE
    name, rest = split
    if args.config is not None:
        try:
            load_config(args.config)  # fail early, with the setting's name
        except ConfigError as exc:
            print(f"qsched: configuration error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        os.environ["QSCHED_CONFIG"] = str(args.config)  # the subcommand reads it from there
    configure_logging(args.log_level)
    try:
        func = resolve(COMMANDS[name].target)
    except NotBuiltError as exc:
        print(f"qsched {name}: not built yet ({exc})", file=sys.stderr)
        return EXIT_USAGE
    settle_heap()  # the imports are done: what exists now lives as long as the process
    try:
        status = func(rest)
    except NotBuiltError as exc:  # a command that needs a part not built yet
        print(f"qsched {name}: not built yet ({exc})", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"qsched {name}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return 0 if status is None else int(status)


# --- small commands that live here ------------------------------------------------


def config_main(argv: list[str]) -> int:
    """``qsched config``: print the effective configuration as JSON (secrets masked).

    Args:
        argv: ``[--config PATH]``.

    Returns:
        0, or 2 on a configuration error.
    """
    description = (
        "Print the effective daemon configuration as JSON: defaults, then the TOML file, "
        "then QSCHED_* environment variables; secrets are masked."
    )
    parser = argparse.ArgumentParser(prog="qsched config", description=description)
    parser.add_argument(
        "--config", type=Path, help="TOML file (default: $QSCHED_CONFIG, else none)"
    )
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    print(cfg.model_dump_json(indent=2))
    return 0


def zoo_main(argv: list[str]) -> int:
    """``qsched zoo``: the model zoo as a table.

    Args:
        argv: no options.

    Returns:
        0.
    """
    argparse.ArgumentParser(prog="qsched zoo", description="List the model zoo.").parse_args(argv)
    zoo_table = resolve("qsched.zo.zoo:zoo_table")
    print(zoo_table())  # type: ignore[call-arg]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
