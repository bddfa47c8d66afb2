"""q policies: how many perturbation samples each ZO step uses, behind one interface.

Build policies with :func:`create_policy`; plugins register under the entry-point
group ``qsched.policies``. See ``README.md`` in this folder for the rules.
"""

from .base import (
    MAX_Q,
    EvalReport,
    PolicyConfig,
    PolicyContext,
    QPolicy,
    StepReport,
    checked_lr_scale,
    checked_q,
)
from .errors import PolicyError
from .fixed import FixedConfig, FixedPolicy
from .linear import LinearConfig, LinearPolicy
from .power import PowerConfig, PowerPolicy
from .qscheduler import QSchedulerConfig, QSchedulerPolicy
from .registry import (
    available_policies,
    create_policy,
    policy_config_schema,
    validate_policy_config,
)
from .variance import VarianceConfig, VariancePolicy

__all__ = [
    "MAX_Q",
    "EvalReport",
    "FixedConfig",
    "FixedPolicy",
    "LinearConfig",
    "LinearPolicy",
    "PolicyConfig",
    "PolicyContext",
    "PolicyError",
    "PowerConfig",
    "PowerPolicy",
    "QPolicy",
    "QSchedulerConfig",
    "QSchedulerPolicy",
    "StepReport",
    "VarianceConfig",
    "VariancePolicy",
    "available_policies",
    "checked_lr_scale",
    "checked_q",
    "create_policy",
    "policy_config_schema",
    "validate_policy_config",
]
