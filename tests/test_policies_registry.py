"""The policy registry: built-in names, entry-point plugins, clear errors."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qsched.policies import (
    PolicyContext,
    PolicyError,
    QSchedulerPolicy,
    StepReport,
    available_policies,
    create_policy,
    policy_config_schema,
)
from qsched.policies.registry import BUILTIN_POLICIES
from qsched.protocol.jobspec import PolicySpec

CONTEXT = PolicyContext(total_steps=100, steps_per_epoch=10.0, eval_every=10)

PLUGIN_MODULE = '''
"""A third-party policy: q doubles after every step, up to a cap."""
from typing import ClassVar

from pydantic import Field

from qsched.policies import PolicyConfig, QPolicy, StepReport


class DoublerConfig(PolicyConfig):
    start: int = Field(default=1, ge=1)
    cap: int = Field(default=8, ge=1)


class DoublerPolicy(QPolicy):
    name: ClassVar[str] = "doubler"
    Config: ClassVar[type[PolicyConfig]] = DoublerConfig

    def initial_q(self) -> int:
        return self.config.start

    def on_step(self, report: StepReport) -> int:
        self._q = min(2 * self._q, self.config.cap)
        return self._q


class NotAPolicy:
    pass
'''


def install_plugin(root: Path, entries: dict[str, str]) -> None:
    """Write a module and an installed distribution's metadata declaring entry points."""
    (root / "qsched_doubler.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    info = root / "qsched_doubler-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qsched-doubler\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[qsched.policies]\n{lines}")


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path where a test installs a plugin distribution."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("qsched_doubler", None)
    importlib.invalidate_caches()


def test_registry_lists_builtins() -> None:
    """All five built-in policies are available under their names."""
    names = set(available_policies())
    assert {"fixed", "qscheduler", "linear", "power", "variance"} <= names
    assert available_policies()["qscheduler"] is QSchedulerPolicy


def test_registry_default_spec_builds_qscheduler() -> None:
    """The job spec's default policy is the q scheduler with its defaults."""
    policy = create_policy(PolicySpec(), CONTEXT)
    assert isinstance(policy, QSchedulerPolicy)
    assert policy.q == 1


def test_registry_unknown_name_lists_choices() -> None:
    """An unknown name is a PolicyError listing the names there are."""
    with pytest.raises(
        PolicyError,
        match=r"unknown policy 'qschedular'.*fixed, linear, power, qscheduler, variance",
    ):
        create_policy(PolicySpec(name="qschedular"), CONTEXT)


@pytest.mark.parametrize(
    ("name", "config", "fragment"),
    [
        ("qscheduler", {"patience": 0}, "patience: Input should be greater than or equal to 1"),
        ("qscheduler", {"pateince": 3}, "pateince: Extra inputs are not permitted"),
        ("qscheduler", {"allowed": [1, 8, 4]}, "allowed: .*sorted and unique"),
        ("qscheduler", {"q0": 2, "allowed": [1, 4]}, "allowed: .*contain q0=2"),
        ("qscheduler", {"metric": "accuracy"}, "metric: Input should be"),
        ("variance", {"window": 2}, "window: Input should be greater than or equal to 3"),
        ("linear", {"allowed": [1, 64]}, "allowed: .*<= qmax=32"),
        ("power", {"alpha": -1}, "alpha: Input should be greater than 0"),
        ("fixed", {"q": "many"}, "q: Input should be a valid integer"),
    ],
)
def test_registry_bad_config_names_parameter(
    name: str, config: dict[str, object], fragment: str
) -> None:
    """A bad parameter is a PolicyError naming it, the problem and the accepted parameters."""
    with pytest.raises(PolicyError, match=fragment) as info:
        create_policy(PolicySpec(name=name, config=config), CONTEXT)
    assert "its parameters are: " in str(info.value)
    assert isinstance(info.value, ValueError)


def test_registry_config_schema() -> None:
    """Each policy publishes a JSON Schema of its config with defaults."""
    schema = policy_config_schema("qscheduler")
    assert schema["properties"]["patience"]["default"] == 2
    assert schema["additionalProperties"] is False
    with pytest.raises(PolicyError, match="unknown policy"):
        policy_config_schema("nope")


def test_registry_loads_entry_point_plugin(plugin_dir: Path) -> None:
    """A distribution declaring a qsched.policies entry point is created by name."""
    install_plugin(plugin_dir, {"doubler": "qsched_doubler:DoublerPolicy"})
    assert "doubler" in available_policies()
    policy = create_policy(PolicySpec(name="doubler", config={"start": 2, "cap": 16}), CONTEXT)
    assert policy.q == 2
    qs = [policy.on_step(StepReport(t, policy.q, 1.0, np.zeros(policy.q), t)) for t in range(4)]
    assert qs == [4, 8, 16, 16]
    with pytest.raises(PolicyError, match="cap: Input should be greater than or equal to 1"):
        create_policy(PolicySpec(name="doubler", config={"cap": 0}), CONTEXT)


def test_registry_plugin_not_a_policy(plugin_dir: Path) -> None:
    """An entry point that is not a QPolicy subclass is a clear PolicyError."""
    install_plugin(plugin_dir, {"broken": "qsched_doubler:NotAPolicy"})
    with pytest.raises(PolicyError, match=r"'broken'.*not a QPolicy subclass"):
        available_policies()


def test_registry_plugin_cannot_shadow_builtin(plugin_dir: Path) -> None:
    """A plugin may not take a built-in name."""
    install_plugin(plugin_dir, {"fixed": "qsched_doubler:DoublerPolicy"})
    with pytest.raises(PolicyError, match="reuses the taken name 'fixed'"):
        available_policies()
    assert BUILTIN_POLICIES["fixed"].name == "fixed"


def test_registry_plugin_import_error(plugin_dir: Path) -> None:
    """A plugin whose module does not import is a PolicyError naming it."""
    install_plugin(plugin_dir, {"ghost": "qsched_missing_module:Ghost"})
    with pytest.raises(PolicyError, match=r"'ghost'.*failed to load"):
        available_policies()


@pytest.mark.parametrize(
    ("total", "per_epoch", "every"),
    [(0, 10.0, 5), (10, 0.0, 5), (10, float("nan"), 5), (10, 1.0, 0)],
)
def test_registry_context_checked(total: int, per_epoch: float, every: int) -> None:
    """A context with no steps, no epoch length or no evaluation period is refused."""
    with pytest.raises(PolicyError, match="policy context needs"):
        PolicyContext(total_steps=total, steps_per_epoch=per_epoch, eval_every=every)
