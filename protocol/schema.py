"""JSON Schema of the control plane, generated from the models in ``control.py``.

``qsched schema`` (and ``python -m qsched.protocol.schema``) writes it; the file
``protocol/control.schema.json`` is committed and a test fails when it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Final

from qsched.protocol.control import ControlMessageAdapter
from qsched.protocol.messages import PROTOCOL_VERSION

__all__ = ["SCHEMA_PATH", "control_schema", "main", "render"]

SCHEMA_PATH: Final = Path(__file__).with_name("control.schema.json")
SCHEMA_ID: Final = f"https://qsched.invalid/schema/control-v{PROTOCOL_VERSION}.json"


def control_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every control-plane document.

    Returns:
        A dict: a ``oneOf`` over commands, replies, events, status and presence,
        discriminated by ``type``.
    """
    schema = ControlMessageAdapter.json_schema(ref_template="#/$defs/{model}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"qsched control plane, protocol version {PROTOCOL_VERSION}",
        **schema,
    }


def render() -> str:
    """The schema as the committed file holds it (sorted keys, 2-space indent)."""
    return json.dumps(control_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or check) the control-plane JSON Schema.

    Args:
        argv: command-line arguments; ``-o PATH`` (``-`` for stdout), ``--check``.

    Returns:
        The exit status: 0, or 1 when ``--check`` finds the file stale.
    """
    description = "Write the control plane's JSON Schema (generated from qsched.protocol.control)."
    parser = argparse.ArgumentParser(prog="qsched schema", description=description)
    parser.add_argument(
        "-o",
        "--output",
        default=str(SCHEMA_PATH),
        help="file to write, - for stdout (default: the committed %(default)s)",
    )
    parser.add_argument("--check", action="store_true", help="only compare with the file")
    args = parser.parse_args(argv)
    if args.check and args.output == "-":
        parser.error("--check compares with a file, not with stdout")
    text = render()
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.output)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `qsched schema`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
