"""The MQTT topic map: names, QoS, retain flags and Wills, as data. No I/O.

Every topic lives under ``<prefix>/<fleet>/`` (default ``qsched/v1/default/``); the
``v1`` changes only when the topic layout does. Data-plane payloads are the binary
codec bytes (no COBS on MQTT); everything else is JSON validated by
``qsched.protocol.control``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "DEFAULT_FLEET",
    "DEFAULT_PREFIX",
    "RULES",
    "TopicKind",
    "TopicMap",
    "TopicRule",
    "publish_topic_problem",
]

DEFAULT_PREFIX: Final = "qsched/v1"
DEFAULT_FLEET: Final = "default"
# One topic level: no wildcards, no separators, nothing MQTT would treat specially.
_LEVEL: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# MQTT's own limit on a topic name (a 16-bit length prefix).
MAX_TOPIC_BYTES: Final = 65535


def publish_topic_problem(topic: str) -> str | None:
    """Why a client-given topic (an MQTT 5 response topic) cannot be published to.

    Args:
        topic: the topic name.

    Returns:
        None when it can be published to, else a sentence: MQTT refuses an empty topic,
        the wildcards ``+`` and ``#``, NUL, text that is not UTF-8 and more than 65,535
        bytes; topics starting with ``$`` belong to the broker.
    """
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        return "the response topic is not valid UTF-8"
    if size == 0:
        return "the response topic is empty"
    if size > MAX_TOPIC_BYTES:
        return f"the response topic has {size} bytes, more than MQTT's {MAX_TOPIC_BYTES}"
    if "+" in topic or "#" in topic:
        return "the response topic contains a wildcard (+ or #); one cannot publish to it"
    if "\0" in topic:
        return "the response topic contains NUL"
    if topic.startswith("$"):
        return "topics starting with $ belong to the broker"
    return None


TopicKind = Literal[
    "board_in",
    "board_out",
    "board_presence",
    "fleet_in",
    "host_out",
    "daemon_state",
    "control_request",
    "control_reply",
    "events",
]


@dataclass(frozen=True)
class TopicRule:
    """How one kind of topic is used.

    Attributes:
        kind: the topic kind.
        publisher: who publishes ("board", "daemon", "client").
        qos: MQTT QoS of every publish.
        retain: whether publishes are retained.
        payload: "binary" (data-plane codec) or "json" (control models).
        will: True if this topic also carries the publisher's Last Will (retained).
    """

    kind: TopicKind
    publisher: Literal["board", "daemon", "client"]
    qos: Literal[0, 1, 2]
    retain: bool
    payload: Literal["binary", "json"]
    will: bool = False


RULES: Final[dict[TopicKind, TopicRule]] = {
    rule.kind: rule
    for rule in (
        # Data plane at QoS 1: duplicates are harmless (results are deterministic,
        # the board filters stale job ids and steps), loss is not.
        TopicRule("board_in", "daemon", 1, False, "binary"),
        TopicRule("board_out", "board", 1, False, "binary"),
        TopicRule("board_presence", "board", 1, True, "json", will=True),
        # One publish for every board: the step's StepOrder (SPEC 6.9).
        TopicRule("fleet_in", "daemon", 1, False, "binary"),
        # Many boards' messages in one publish (protocol/batch.py).
        TopicRule("host_out", "board", 1, False, "binary"),
        TopicRule("daemon_state", "daemon", 1, True, "json", will=True),
        TopicRule("control_request", "client", 1, False, "json"),
        TopicRule("control_reply", "daemon", 1, False, "json"),
        # Events are a live feed: a reader that was away reads the metrics log instead.
        TopicRule("events", "daemon", 0, False, "json"),
    )
}


def _level(name: str, value: str) -> str:
    if not _LEVEL.fullmatch(value):
        raise ValueError(f"{name} {value!r} is not a valid topic level ([A-Za-z0-9_.-]{{1,64}})")
    return value


@dataclass(frozen=True)
class TopicMap:
    """Topic names of one fleet.

    Args:
        prefix: versioned prefix, e.g. ``qsched/v1`` (levels as for ``fleet``).
        fleet: the fleet name, one topic level.
    """

    prefix: str = DEFAULT_PREFIX
    fleet: str = DEFAULT_FLEET

    def __post_init__(self) -> None:
        for part in self.prefix.split("/"):
            _level("prefix level", part)
        _level("fleet", self.fleet)

    @property
    def base(self) -> str:
        """``<prefix>/<fleet>``."""
        return f"{self.prefix}/{self.fleet}"

    def board_in(self, board_id: str) -> str:
        """Daemon -> board data-plane messages."""
        return f"{self.base}/boards/{_level('board id', board_id)}/in"

    def board_out(self, board_id: str) -> str:
        """Board -> daemon data-plane messages (Hello first, as the birth message)."""
        return f"{self.base}/boards/{_level('board id', board_id)}/out"

    def board_presence(self, board_id: str) -> str:
        """Retained ``BoardPresence`` JSON; the board's Will sets it offline."""
        return f"{self.base}/boards/{_level('board id', board_id)}/presence"

    def fleet_in(self) -> str:
        """Daemon -> every board: ``StepOrder`` messages, one publish per step."""
        return f"{self.base}/fleet/in"

    def host_out(self, host: str) -> str:
        """A host's boards -> daemon: batches of their messages (``protocol/batch.py``)."""
        return f"{self.base}/hosts/{_level('host', host)}/out"

    def all_host_out(self) -> str:
        """Subscription filter for every host's batches."""
        return f"{self.base}/hosts/+/out"

    def all_board_out(self) -> str:
        """Subscription filter for every board's out topic."""
        return f"{self.base}/boards/+/out"

    def all_board_presence(self) -> str:
        """Subscription filter for every board's presence topic."""
        return f"{self.base}/boards/+/presence"

    def daemon_state(self) -> str:
        """Retained ``DaemonPresence`` JSON; the daemon's Will sets it offline."""
        return f"{self.base}/daemon/state"

    def control_request(self) -> str:
        """Commands from users (JSON)."""
        return f"{self.base}/control/request"

    def control_reply(self) -> str:
        """Default reply topic, for clients that give no MQTT 5 response topic."""
        return f"{self.base}/control/reply"

    def events(self) -> str:
        """Job and fleet events (JSON)."""
        return f"{self.base}/events"

    def rule(self, kind: TopicKind) -> TopicRule:
        """QoS, retain and Will of a topic kind."""
        return RULES[kind]

    def parse_board_topic(self, topic: str) -> tuple[str, Literal["in", "out", "presence"]] | None:
        """(board id, direction) of a per-board topic of this fleet, else None."""
        head = f"{self.base}/boards/"
        if not topic.startswith(head):
            return None
        parts = topic[len(head) :].split("/")
        if len(parts) != 2 or not _LEVEL.fullmatch(parts[0]):
            return None
        board_id, kind = parts
        if kind == "in":
            return board_id, "in"
        if kind == "out":
            return board_id, "out"
        if kind == "presence":
            return board_id, "presence"
        return None
