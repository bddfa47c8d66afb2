"""settle_heap: garbage collected first, the rest exempt from later collections."""

from __future__ import annotations

import gc
import weakref

from qsched.daemon.heap import settle_heap


class _Node:
    other: object = None


def _cycle(tag: str, finalized: list[str]) -> _Node:
    node = _Node()
    node.other = node  # only the collector can free it
    weakref.finalize(node, finalized.append, tag)
    return node


def test_settle_heap_collects_then_exempts_what_is_left() -> None:
    """A cycle that is garbage at the call is collected; one that becomes garbage after
    it is left alone by collections (frozen) until the next call takes the frozen
    objects back and collects it."""
    finalized: list[str] = []
    _cycle("garbage before", finalized)
    kept = _cycle("garbage later", finalized)
    try:
        settle_heap()
        assert finalized == ["garbage before"]
        assert gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert finalized == ["garbage before"]  # frozen: no collection looks at it
        settle_heap()
        assert finalized == ["garbage before", "garbage later"]
    finally:
        gc.unfreeze()
