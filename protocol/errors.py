"""The one error type every decoder in ``qsched.protocol`` raises on bad input."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ERROR_KINDS", "ErrorKind", "ProtocolError"]

ErrorKind = Literal[
    "truncated",  # fewer bytes than the layout needs
    "oversized",  # more bytes than a buffer or limit allows
    "trailing_bytes",  # bytes left over after a complete message
    "bad_magic",  # the header does not start with the magic bytes
    "unsupported_version",  # a protocol version this side does not speak
    "unknown_type",  # a message type code that is not defined
    "bad_crc",  # a frame whose CRC-32 does not match
    "bad_framing",  # a COBS encoding error or a frame too short to hold its header
    "invalid_field",  # a field value outside its range (the message decoded structurally)
    "invalid_command",  # a control-plane JSON document that is not a valid command
]

ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)


class ProtocolError(ValueError):
    """Bad input on the wire: raised (or, by ``FrameReader``, returned) by every decoder.

    Attributes:
        kind: what went wrong, from the closed set ``ErrorKind``.
        detail: a human sentence.
        msg_type: the binary message type code, when the header got that far.
        version: the protocol version found in the header, when it was read.
        request_id: the control command's ``request_id``, when one could be recovered
            from a malformed command (so the error reply can echo it).
    """

    def __init__(
        self,
        kind: ErrorKind,
        detail: str,
        *,
        msg_type: int | None = None,
        version: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind: ErrorKind = kind
        self.detail = detail
        self.msg_type = msg_type
        self.version = version
        self.request_id = request_id

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the error picklable (process pools, multiprocessing queues).
        return (_rebuild, (self.kind, self.detail, self.msg_type, self.version, self.request_id))


def _rebuild(
    kind: ErrorKind, detail: str, msg_type: int | None, version: int | None, request_id: str | None
) -> ProtocolError:
    return ProtocolError(kind, detail, msg_type=msg_type, version=version, request_id=request_id)
