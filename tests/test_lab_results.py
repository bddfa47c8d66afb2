"""results.json is read and written through one typed model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsched.lab.results import ResultsError, read_results, write_results_json

COMMITTED = sorted(
    (Path(__file__).resolve().parent.parent / "docs" / "results").glob("*/results.json")
)


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_results_committed_documents_read_back_unchanged(path: Path) -> None:
    """Every committed results.json validates and its data round-trips exactly; it holds
    ZO runs, or the first-order baseline alone (``--grid baseline``)."""
    doc = read_results(path)
    assert doc.as_dict() == json.loads(path.read_text())
    assert doc.configs or doc.baseline is not None
    assert all(len(c.runs) == len(c.seeds) for c in doc.configs)


def test_results_refusals_name_the_file_and_the_field(tmp_path: Path) -> None:
    """Missing file, bad JSON, another schema and a mistyped field: one line each, named."""
    good = json.loads(COMMITTED[0].read_text())
    cases = {
        "absent.json": None,
        "bad.json": "{not json",
        "other.json": json.dumps({"schema": "other/1"}),
        "typed.json": json.dumps({**good, "configs": [{**good["configs"][0], "steps": "many"}]}),
    }
    expected = {
        "absent.json": "cannot be read",
        "bad.json": "not valid JSON",
        "other.json": "schema 'other/1'",
        "typed.json": r"field configs\.0\.steps",
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ResultsError, match=expected[name]) as refused:
            read_results(tmp_path / name)
        assert name in str(refused.value)


def test_results_writer_refuses_what_readers_would(tmp_path: Path) -> None:
    """A document missing a configuration field is not written at all."""
    doc = json.loads(COMMITTED[0].read_text())
    del doc["configs"][0]["curve"]
    with pytest.raises(ResultsError, match=r"configs\.0\.curve"):
        write_results_json(doc, tmp_path / "results.json")
    assert not (tmp_path / "results.json").exists()
