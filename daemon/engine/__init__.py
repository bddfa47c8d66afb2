"""The step engine: one job's ZO steps, sharded across the fleet, split by concern.

``job`` holds ``StepEngine`` (the job's lifecycle and the order of a step), ``sync``
brings boards up to date, ``collect`` gathers a step's losses with audits, ``update``
sends the update (pipelined with the next step's requests), ``validate`` runs the
validation slices; ``context`` is what they share, the job's task group included.
"""

from qsched.daemon.engine.context import EngineConfig, JobError, JobResult
from qsched.daemon.engine.job import StepEngine, fleet_event

__all__ = ["EngineConfig", "JobError", "JobResult", "StepEngine", "fleet_event"]
