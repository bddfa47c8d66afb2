"""Finding policies by name: the built-in ones and plugins from the ``qsched.policies``
entry points.

``create_policy`` is the one way the rest of qsched builds a policy, so a plugin that
registers an entry point, e.g. in its ``pyproject.toml``::

    [project.entry-points."qsched.policies"]
    mypolicy = "mypackage.mymodule:MyPolicy"

can be named in a job spec like any built-in policy.
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from qsched.protocol.jobspec import PolicySpec

from .base import PolicyConfig, PolicyContext, QPolicy
from .errors import PolicyError
from .fixed import FixedPolicy
from .linear import LinearPolicy
from .power import PowerPolicy
from .qscheduler import QSchedulerPolicy
from .variance import VariancePolicy

__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "available_policies",
    "create_policy",
    "policy_class",
    "policy_config_schema",
    "validate_policy_config",
]

ENTRY_POINT_GROUP = "qsched.policies"

BUILTIN_POLICIES: dict[str, type[QPolicy]] = {
    cls.name: cls
    for cls in (FixedPolicy, QSchedulerPolicy, LinearPolicy, PowerPolicy, VariancePolicy)
}


def _load_plugins() -> dict[str, type[QPolicy]]:
    found: dict[str, type[QPolicy]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in BUILTIN_POLICIES or point.name in found:
            raise PolicyError(f"policy plugin {point.value!r} reuses the taken name {point.name!r}")
        try:
            loaded = point.load()
        except Exception as exc:
            raise PolicyError(
                f"policy plugin {point.name!r} ({point.value}) failed to load: {exc}"
            ) from exc
        if not (isinstance(loaded, type) and issubclass(loaded, QPolicy)):
            raise PolicyError(
                f"policy plugin {point.name!r} ({point.value}) is not a QPolicy subclass"
            )
        found[point.name] = loaded
    return found


def available_policies() -> dict[str, type[QPolicy]]:
    """All policies by name: built-in first, then entry-point plugins.

    Returns:
        A new dict from name to policy class.

    Raises:
        PolicyError: a plugin fails to load, is no QPolicy or reuses a taken name.
    """
    return {**BUILTIN_POLICIES, **_load_plugins()}


def policy_class(name: str) -> type[QPolicy]:
    """Look up one policy class by name.

    Args:
        name: a built-in or plugin policy name.

    Returns:
        The policy class.

    Raises:
        PolicyError: no such policy; the message lists the names there are.
    """
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    policies = available_policies()
    if name not in policies:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(sorted(policies))}")
    return policies[name]


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "config"
        parts.append(f"{where}: {error['msg']} (got {error.get('input')!r})")
    return "; ".join(parts)


def validate_policy_config(name: str, config: dict[str, Any]) -> PolicyConfig:
    """Validate a policy's configuration without building the policy.

    Args:
        name: the policy name.
        config: its parameters.

    Returns:
        The validated config model.

    Raises:
        PolicyError: unknown name, or a bad parameter; the message names the parameter,
            what was wrong and the parameters the policy accepts.
    """
    cls = policy_class(name)
    try:
        # As JSON: a config arrives as JSON (a job spec, a control command), and strict
        # JSON validation takes an array for a tuple but no "8" for an 8.
        document = json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"bad config for policy {name!r}: not JSON data ({exc})") from exc
    try:
        return cls.Config.model_validate_json(document)
    except ValidationError as exc:
        allowed = ", ".join(cls.Config.model_fields)
        raise PolicyError(
            f"bad config for policy {name!r}: {_describe(exc)}; its parameters are: {allowed}"
        ) from exc


def create_policy(spec: PolicySpec, context: PolicyContext) -> QPolicy:
    """Build the policy a job spec names - the one way policies are constructed.

    Args:
        spec: the policy's name and config.
        context: facts about the job.

    Returns:
        A fresh policy, ready for ``initial_q``.

    Raises:
        PolicyError: unknown name or bad config.
    """
    config = validate_policy_config(spec.name, spec.config)
    return policy_class(spec.name)(config, context)


def policy_config_schema(name: str) -> dict[str, Any]:
    """JSON Schema of a policy's config (for the control API and documentation).

    Args:
        name: the policy name.

    Returns:
        The schema as a dict.

    Raises:
        PolicyError: unknown name.
    """
    return policy_class(name).Config.model_json_schema()
