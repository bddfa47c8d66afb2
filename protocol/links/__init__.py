"""Links between the daemon and its boards: one interface, three transports.

``base`` defines the interface (``Link``, ``Transport``, the membership events);
``inproc``, ``mqtt`` and ``serial`` implement it. Import the transport you need from its
module; this package re-exports only the interface so importing it stays cheap.
"""

from qsched.protocol.links.base import (
    BoardAppeared,
    BoardGone,
    Link,
    LinkClosedError,
    LinkError,
    LinkEvent,
    MessageTooLargeError,
    MultiTransport,
    SendTimeoutError,
    Transport,
)

__all__ = [
    "BoardAppeared",
    "BoardGone",
    "Link",
    "LinkClosedError",
    "LinkError",
    "LinkEvent",
    "MessageTooLargeError",
    "MultiTransport",
    "SendTimeoutError",
    "Transport",
]
