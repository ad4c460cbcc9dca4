"""The fleet simulator: replay real traces and synthetic agent workloads through the project's own
policies and the sim engine's scheduling on a virtual clock, and compare routing policies by cost
per successful task. See docs/simulator.md."""

from services.simulator.autoscaling import AUTOSCALER_NAMES
from services.simulator.core import SimOptions, Simulator, run_simulation
from services.simulator.fleet import FleetSpec, PoolSpec, parse_fleet
from services.simulator.metrics import SimResult
from services.simulator.policies import POLICY_NAMES
from services.simulator.recorded import WorkflowTrace
from services.simulator.workload import (
    AgenticWorkload,
    AzureTrace,
    CodingAgentWorkload,
    MooncakeTrace,
    RagChatWorkload,
    Workload,
    load_workload,
)

__all__ = [
    "AUTOSCALER_NAMES",
    "POLICY_NAMES",
    "AgenticWorkload",
    "AzureTrace",
    "CodingAgentWorkload",
    "FleetSpec",
    "MooncakeTrace",
    "PoolSpec",
    "RagChatWorkload",
    "SimOptions",
    "SimResult",
    "Simulator",
    "WorkflowTrace",
    "Workload",
    "load_workload",
    "parse_fleet",
    "run_simulation",
]
