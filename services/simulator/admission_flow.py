"""The glue between requests and admission: each new request's `AdmissionRequest` and
`services.admission.policy.decide`, the router's prediction of its first token, deferred requests
drained on admission's ticks and routed or rejected, concurrency leases given back, and the
fleet's load as admission sees it."""

from __future__ import annotations

from schemas.events import WorkflowSpend
from services.admission import policy as admission_policy
from services.admission.policy import (
    AdmissionRequest,
    Admit,
    Defer,
    Prediction,
    Reject,
    workflow_standing,
)
from services.router import policy as router_policy
from services.simulator.lifecycle import Requests
from services.simulator.records import _RequestRun, _TenantFigures
from services.simulator.state import _ADMISSION


class AdmissionFlow(Requests):
    """Admission's decisions on the requests, through `services.admission.policy`."""

    def _count_issued(self, req: _RequestRun) -> None:
        task = req.task_run.task
        figures = self.by_tenant.get(task.tenant)
        if figures is None:
            figures = self.by_tenant[task.tenant] = _TenantFigures()
        figures.requests += 1
        self.slo_by_priority.setdefault(task.priority, [0, 0])[1] += 1

    def _admit(self, req: _RequestRun, now: float, *, counted: bool = False) -> bool:
        """Admission's decision on a new request (`counted`: already counted as issued, when it
        was held for a replica): True when it goes on to the router now."""
        task = req.task_run.task
        if not counted:
            self._count_issued(req)
        if self.admission.fleet is None:
            self._observe_fleet(now)
        self._admitting[req.rid] = req
        decision = admission_policy.decide(
            self.admission,
            request=self._admission_request(req),
            quota=self._quotas.get(task.tenant),
            limits=self.admission_limits,
            now=now,
            predict=self._predict,
            lazy=True,
        )
        if isinstance(decision, Defer):
            self.deferred += 1
            self._schedule_admission(decision.due)
        else:
            del self._admitting[req.rid]
        go = isinstance(decision, Admit)
        if go:
            self._admitted(req, 0.0)
        elif isinstance(decision, Reject):
            self._reject(req, "admission", decision.reason, now)
        self._admission_outcomes(now)
        return go

    def _admission_request(self, req: _RequestRun) -> AdmissionRequest:
        task_run = req.task_run
        task, spec = task_run.task, req.spec
        # The ledger's running total, as WORKFLOW_SPEND would hold it for the workflow.
        spend = (
            WorkflowSpend(
                workflow_id=task.task_id,
                tenant=task.tenant,
                spend_usd=task_run.spend,
                gpu_seconds=task_run.gpu_s,
                steps_completed=task_run.max_completed_step,
                steps=task.steps,
                status="running",
                first_event_at=task.arrival_s,
                last_event_at=req.arrival,
                updated_at=req.arrival,
            )
            if task.workflow and req.index > 1
            else None
        )
        return AdmissionRequest(
            request_id=req.rid,
            tenant=task.tenant,
            priority=task.priority,
            input_tokens=spec.prompt_tokens,
            output_tokens=spec.output_tokens,
            submitted_at=req.arrival,
            deadline_at=req.deadline_at,
            workflow_id=task.task_id if task.workflow else None,
            workflow_step=req.index if task.workflow else None,
            workflow_standing=workflow_standing(req.index if task.workflow else None, spend),
            workflow_spent_usd=task_run.spend,
            # About what the mesh holds for a deferred request: its RequestPrepared, JSON.
            size_bytes=600 + 6 * spec.prompt_tokens + 20 * len(spec.block_hashes),
            service_class=task.service_class,
        )

    def _predict(self, request: AdmissionRequest) -> Prediction | None:
        """The router's prediction of the request's first token (earliest_ttft over the live
        placements), and of its last at the time per token the fleet gives now."""
        now = self.now
        self.prefix.now = now
        route = self._route_request(self._admitting[request.request_id])
        first = router_policy.earliest_first_token(self.router_state, route, self.prefix, now)
        return admission_policy.prediction(first, request, self.admission)

    def _admitted(self, req: _RequestRun, waited_s: float) -> None:
        figures = self.by_tenant[req.task_run.task.tenant]
        figures.admitted += 1
        figures.admitted_tokens += req.spec.prompt_tokens + req.spec.output_tokens
        if waited_s > 0:
            self.deferral.add(waited_s)

    def _admission_outcomes(self, now: float) -> None:
        """Route or reject the deferred requests admission has decided."""
        for outcome in admission_policy.take_outcomes(self.admission):
            req = self._admitting.pop(outcome.request.request_id)
            decision = outcome.decision
            if isinstance(decision, Admit):
                self._admitted(req, decision.waited_s)
                self._route(req, now, decision.waited_s)
            else:
                self._reject(req, "admission", decision.reason, now)

    def _schedule_admission(self, at: float) -> None:
        if self._admission_tick_at is None or at < self._admission_tick_at:
            self._admission_tick_at = at
            self._push(at, _ADMISSION, None, late=1)

    def _admission_tick(self, now: float) -> None:
        self._admission_tick_at = None
        admission_policy.drain(self.admission, self.admission_limits, now, self._predict)
        self._admission_outcomes(now)
        due = admission_policy.next_due(self.admission)
        if due is not None:
            self._schedule_admission(due)

    def _observe_fleet(self, now: float) -> None:
        """The workers' heartbeats, as admission sees them (the router's view of them)."""
        admission_policy.observe_fleet(
            self.admission, admission_policy.fleet_load(self.router_state.workers.values(), now)
        )
        if self.admission.deferred:
            self._schedule_admission(now)

    def _ended(self, req: _RequestRun, now: float, *, admitted: bool, slo_met: bool = False) -> None:
        """A request ended: its concurrency lease goes back; one admitted frees the fleet."""
        task = req.task_run.task
        self.in_flight -= 1
        self.by_model[req.model].in_flight -= 1
        self._deadlines.pop(req.rid, None)
        admission_policy.release(self.admission, task.tenant, req.rid)
        if slo_met:
            self.slo_by_priority[task.priority][0] += 1
            self.by_tenant[task.tenant].slo_met += 1
        if admitted:
            batch = 1 if task.service_class == "batch" else 0
            admission_policy.note_finished(self.admission, batch=batch)
            if self.admission.deferred:
                self._schedule_admission(now)
