"""Shared fixtures for the qsched test suite."""

from collections.abc import Iterator

import pytest

from qsched.daemon.broker import MosquittoBroker


@pytest.fixture
def mqtt_broker() -> Iterator[MosquittoBroker]:
    """A private Mosquitto on a free loopback port (never the system broker on 1883)."""
    with MosquittoBroker() as broker:
        yield broker
