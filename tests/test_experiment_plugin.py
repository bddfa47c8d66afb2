"""A third-party q policy, installed as a distribution with a ``qsched.policies`` entry point,
trains by name through the trainer and the experiment grid."""

from __future__ import annotations

import importlib
import io
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsched.lab import experiment
from qsched.protocol.jobspec import JobSpec, PolicySpec
from qsched.zo.trainer import train_zo

PLUGIN = '''
"""q = 1 for the first `warmup` steps, then `q`."""
from typing import ClassVar

from pydantic import Field

from qsched.policies import PolicyConfig, QPolicy, StepReport


class WarmupConfig(PolicyConfig):
    warmup: int = Field(default=3, ge=1)
    q: int = Field(default=4, ge=1)


class WarmupPolicy(QPolicy):
    name: ClassVar[str] = "warmup-q"
    Config: ClassVar[type[PolicyConfig]] = WarmupConfig

    def initial_q(self) -> int:
        return 1

    def on_step(self, report: StepReport) -> int:
        if report.step + 1 >= self.config.warmup:
            self._q = self.config.q
        return self._q
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Install the plugin module and its distribution metadata on sys.path."""
    (tmp_path / "qsched_warmup.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "qsched_warmup-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qsched-warmup\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[qsched.policies]\nwarmup-q = qsched_warmup:WarmupPolicy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop("qsched_warmup", None)
    importlib.invalidate_caches()


def test_plugin_trains_by_name(plugin: Path) -> None:
    """A job spec naming the plugin trains with its q sequence and its config."""
    del plugin
    spec = JobSpec(
        steps=6, batch_size=16, eval_every=3, policy=PolicySpec(name="warmup-q", config={"q": 3})
    )
    result = train_zo(spec)
    assert [s.q for s in result.steps] == [1, 1, 1, 3, 3, 3]
    assert result.forward_passes == 2 * (1 + 1 + 1 + 3 + 3 + 3)
    assert result.policy_state["policy"] == "warmup-q"


def test_plugin_in_experiment_grid(plugin: Path, tmp_path: Path) -> None:
    """`qsched experiment --policies warmup-q:{...}` runs the plugin next to the built-ins."""
    out = tmp_path / "out"
    stream = io.StringIO()
    argv = [
        "--grid",
        "custom",
        "--policies",
        "fixed:2",
        'warmup-q:{"warmup": 2, "q": 2}',
        "--numerics",
        "int8",
        "--seeds",
        "0",
        "--steps",
        "6",
        "--set",
        "eval_every=3",
        "--workers",
        "1",
        "--no-plots",
        "--no-baseline",
        "--quiet",
        "--out",
        str(out),
    ]
    assert experiment.main(argv, stream=stream) == 0, stream.getvalue()
    doc = json.loads((out / "results.json").read_text())
    plugged = doc["configs"][1]
    assert plugged["policy"]["name"] == "warmup-q"
    assert plugged["q_trajectory"][0]["changes"] == [[0, 1], [2, 2]]
    assert doc["comparisons"][0]["best_fixed"] == "fixed q=2@int8"
