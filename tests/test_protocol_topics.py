"""The MQTT topic map: names under a versioned prefix and fleet, and the rules per topic."""

from __future__ import annotations

import pytest

from qsched.protocol import TopicMap
from qsched.protocol.topics import RULES


def test_topics_default_names() -> None:
    """Default topics live under qsched/v1/default/."""
    topics = TopicMap()
    assert topics.board_in("n6-01") == "qsched/v1/default/boards/n6-01/in"
    assert topics.board_out("n6-01") == "qsched/v1/default/boards/n6-01/out"
    assert topics.board_presence("n6-01") == "qsched/v1/default/boards/n6-01/presence"
    assert topics.daemon_state() == "qsched/v1/default/daemon/state"
    assert topics.control_request() == "qsched/v1/default/control/request"
    assert topics.control_reply() == "qsched/v1/default/control/reply"
    assert topics.events() == "qsched/v1/default/events"
    assert topics.all_board_out() == "qsched/v1/default/boards/+/out"


def test_topics_fleets_do_not_overlap() -> None:
    """Two fleets on one broker share no topic."""
    lab, farm = TopicMap(fleet="lab"), TopicMap(fleet="farm")
    assert lab.board_in("b1") != farm.board_in("b1")
    assert lab.parse_board_topic(farm.board_out("b1")) is None


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "x" * 65, "sp ace"])
def test_topics_refuse_unsafe_levels(bad: str) -> None:
    """Board ids and fleet names with wildcards, separators or odd characters are refused."""
    with pytest.raises(ValueError):
        TopicMap().board_in(bad)
    with pytest.raises(ValueError):
        TopicMap(fleet=bad)


def test_topics_parse_board_topic() -> None:
    """A per-board topic parses back to (board id, direction); others give None."""
    topics = TopicMap(prefix="lab/v1", fleet="f")
    assert topics.parse_board_topic(topics.board_out("b-7")) == ("b-7", "out")
    assert topics.parse_board_topic(topics.board_presence("b-7")) == ("b-7", "presence")
    assert topics.parse_board_topic("lab/v1/f/boards/b-7/other") is None
    assert topics.parse_board_topic("lab/v1/f/boards/b-7/out/x") is None
    assert topics.parse_board_topic(topics.events()) is None


def test_topics_rules_presence_and_state_are_retained_wills() -> None:
    """Presence and daemon state are retained and carry Wills; the data plane is binary QoS 1."""
    topics = TopicMap()
    for kind in ("board_presence", "daemon_state"):
        rule = topics.rule(kind)
        assert rule.retain and rule.will and rule.payload == "json"
    for kind in ("board_in", "board_out"):
        rule = topics.rule(kind)
        assert (rule.qos, rule.retain, rule.payload) == (1, False, "binary")
    assert not any(rule.retain for kind, rule in RULES.items() if kind.startswith("control"))


def test_topics_refuse_a_trailing_newline() -> None:
    """A board id or fleet ending in a newline is no topic level (``$`` alone would pass it)."""
    with pytest.raises(ValueError):
        TopicMap().board_in("abc\n")
    with pytest.raises(ValueError):
        TopicMap(fleet="f\n")
    assert TopicMap().parse_board_topic("qsched/v1/default/boards/abc\n/out") is None
