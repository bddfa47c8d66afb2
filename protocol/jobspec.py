"""The job spec: everything that determines a training run, and nothing else.

A run is a pure function of its spec (the determinism contract), so the spec is the
one document the daemon stores, boards receive and users write.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["FP32_DEFAULTS", "INT8_STEP_DEFAULTS", "JobSpec", "PolicySpec"]

# Defaults of an FP32 job for the fields whose unit depends on the numerics.
FP32_DEFAULTS: dict[str, float] = {"lr": 0.02, "eps": 0.001}
# The learning rate of an INT8 job in int8 steps per unit gradient (lr_unit "int8_step",
# the only unit before weight units; the committed results of that time used it).
INT8_STEP_DEFAULTS: dict[str, float] = {"lr": 3000.0}

_LAST_N = re.compile(r"last:([1-9][0-9]*)")


class _Frozen(BaseModel):
    # Strict: "200" is not a step count nor "yes" a boolean; 1e400 and Infinity are no
    # learning rate. A document that says something else than it means is refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PolicySpec(_Frozen):
    """Which q policy decides q, and its configuration (validated by the policy)."""

    name: str = Field(default="qscheduler", min_length=1, max_length=64)
    config: dict[str, Any] = Field(default_factory=dict)


class JobSpec(_Frozen):
    """A training job. Field defaults are the embedded defaults of ``qsched demo``."""

    name: str = Field(default="job", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    dataset: str = Field(
        default="digits", description="built-in name, or a path understood by qsched.zo.datasets"
    )
    model: str = Field(default="mlp", description="model zoo name")
    model_options: dict[str, int | float | str] = Field(default_factory=dict)
    numerics: Literal["fp32", "int8"] = "int8"
    accumulator: Literal["fp16", "int8"] = Field(
        default="fp16",
        description="INT8 mode: FP16 buffer (default) or INT8 buffer with periodic rescaling",
    )
    estimator: Literal["two_sided", "one_sided"] = "two_sided"
    seed: int = Field(default=0, ge=0, lt=2**64)
    steps: int = Field(default=1000, gt=0, lt=2**32)
    batch_size: int = Field(default=64, ge=1, le=4096)
    lr: float = Field(
        default=0.05,
        gt=0,
        description="learning rate in the weights' real units (INT8 default 0.05, FP32 0.02); "
        "with lr_unit 'int8_step' in int8 steps per unit gradient (default 3000)",
    )
    lr_unit: Literal["weight", "int8_step"] = Field(
        default="weight",
        description="INT8: 'weight' converts lr per channel with the weight scale "
        "(one default for any scale); 'int8_step' applies it in int8 steps",
    )
    lr_decay: Literal["none", "linear"] = Field(
        default="none",
        description="'linear': the learning rate falls linearly over the job's steps, from "
        "lr at step 0 (or from lr_decay_start) toward lr * lr_end after the last (SPEC 4.1)",
    )
    lr_decay_start: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="with lr_decay 'linear': the fraction of the steps after which the "
        "decay begins (0: from step 0; 0.75: over the last quarter)",
    )
    lr_end: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="with lr_decay 'linear': the factor on lr the decay reaches after the "
        "last step (0: to zero)",
    )
    eps: float = Field(
        default=1.0,
        gt=0,
        description="perturbation size; INT8: whole int8 steps (default 1; FP32 default 0.001)",
    )
    trainable: Literal["all"] | str | list[str] = Field(
        default="all",
        description="'all', 'last:N' (last N parametrised layers) or a list of layer names",
    )
    backbone: str | None = Field(
        default=None, description="pretrained model to start from: an int8 .tflite file"
    )
    recalibrate_every: int = Field(
        default=0,
        ge=0,
        lt=2**32,
        description="INT8 with the FP16 buffer: every N steps, double the weight scale of "
        "each trainable channel whose weights reach the int8 clamp (0: scales stay fixed)",
    )
    policy: PolicySpec = Field(default_factory=PolicySpec)
    eval_every: int = Field(default=10, gt=0)
    checkpoint_every: int = Field(default=100, gt=0)

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> JobSpec:
        """A spec the daemon stored (complete: every field written). One stored before
        ``lr_unit`` existed ran its INT8 learning rate in int8 steps, and goes on so."""
        if data.get("numerics") == "int8" and "lr_unit" not in data:
            data = {**data, "lr_unit": "int8_step"}
        return cls.model_validate(data)

    @field_validator("trainable")
    @classmethod
    def _check_trainable(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("trainable layer list is empty")
            return value
        if value != "all" and not _LAST_N.fullmatch(value):
            raise ValueError(
                f"trainable must be 'all', 'last:N' or a list of layer names, got {value!r}"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _numerics_defaults(cls, data: Any) -> Any:
        # lr and eps are in int8 steps in INT8 mode and in real units in FP32 mode, so
        # an FP32 job that leaves them out gets FP32-sized defaults.
        if isinstance(data, dict) and data.get("numerics") == "fp32":
            data = {**FP32_DEFAULTS, **data}
        elif isinstance(data, dict) and data.get("lr_unit") == "int8_step":
            data = {**INT8_STEP_DEFAULTS, **data}
        return data

    @model_validator(mode="after")
    def _check_lr_unit(self) -> JobSpec:
        if self.numerics == "fp32" and self.lr_unit != "weight":
            raise ValueError("FP32 learning rates are in weight units: lr_unit must be 'weight'")
        return self

    @model_validator(mode="after")
    def _check_lr_decay_shape(self) -> JobSpec:
        if self.lr_decay == "none" and (self.lr_end or self.lr_decay_start):
            raise ValueError("lr_end and lr_decay_start shape a decay: they need lr_decay 'linear'")
        return self

    @model_validator(mode="after")
    def _check_recalibration(self) -> JobSpec:
        if self.recalibrate_every and (self.numerics != "int8" or self.accumulator != "fp16"):
            raise ValueError(
                "recalibrate_every needs INT8 numerics with the FP16 buffer "
                f"(numerics {self.numerics!r}, accumulator {self.accumulator!r})"
            )
        return self

    @model_validator(mode="after")
    def _check_int8_eps(self) -> JobSpec:
        if self.numerics == "int8" and not float(self.eps).is_integer():
            raise ValueError(
                f"INT8 perturbations are whole int8 steps: eps must be an integer, got {self.eps}"
            )
        return self
