"""A request's life: a task's arrival and its steps issued (each naming its model, by default the
workload's), held for a replica where its model has no decode worker serving (released when one
is ready, rejected when none is in time), the router's placement on its model's workers and the
hand-off to them, prefill, the KV hand-off to a decode worker, completion (latencies, SLOs, the
task's next step or its end), rejection, failure and the client's deadline; each request logged
once (`RequestRecord`) when its GPU time is all charged."""

from __future__ import annotations

from services.engines.scheduling import class_rank
from services.router.policy import NoPlacement, RouteRequest
from services.simulator.records import RequestRecord, _RequestRun, _TaskRun
from services.simulator.replicas import Fleet
from services.simulator.state import _DEADLINE, _HOLD, _NEXT_STEP, _STEP
from services.simulator.worker import CANCELLED, DONE, FINISHED, PREFILLED, Seq, SimWorker
from services.simulator.workload import Step, Task


class Requests(Fleet):
    """Tasks' and requests' lives, from arrival to their end."""

    # Admission's side of a request (admission_flow.py, `AdmissionFlow`).

    def _admit(self, req: _RequestRun, now: float, *, counted: bool = False) -> bool:
        """Admission's decision on a new request: True when it goes on to the router now."""
        raise NotImplementedError

    def _count_issued(self, req: _RequestRun) -> None:
        """The request counts as issued in its tenant's and its priority's figures."""
        raise NotImplementedError

    def _observe_fleet(self, now: float) -> None:
        """Admission sees the fleet as the workers' last heartbeats tell it."""
        raise NotImplementedError

    def _ended(self, req: _RequestRun, now: float, *, admitted: bool, slo_met: bool = False) -> None:
        """A request ended: its concurrency lease goes back; one admitted frees the fleet."""
        raise NotImplementedError

    def _arrival(self, task: Task, now: float) -> None:
        self._pull_task()
        if self.first_arrival is None:
            self.first_arrival = now
        self.tasks += 1
        self.active_tasks += 1
        counts = self.by_priority.setdefault(task.priority, [0, 0])
        counts[1] += 1
        self._issue(_TaskRun(task), task.step(1), now)

    def _issue(self, task_run: _TaskRun, spec: Step, now: float) -> None:
        task = task_run.task
        index = task_run.step_index = task_run.step_index + 1
        rid = f"{task.task_id}-{index}" if task.workflow else task.task_id
        model = spec.model or self.workload.model
        if task_run.model is None:
            task_run.model = model
        req = _RequestRun(task_run, index, rid, spec, now, model)
        self.requests += 1
        self.in_flight += 1
        self._arrivals_since_sample += 1
        figures = self._figures_of(model)
        figures.requests += 1
        figures.in_flight += 1
        figures.tasks += index == 1
        window = self._window = figures.window
        window.arrivals += 1
        window.prompt_tokens += spec.prompt_tokens
        if not self._decode_live.get(model):
            self._count_issued(req)
            self._hold(req, now, admitted=False)
        elif self._admit(req, now):
            self._route(req, now)

    @staticmethod
    def _first_token_deadline(req: _RequestRun) -> float | None:
        """When the client gives up on a first token (a workflow trace's `deadline_ms`)."""
        wait = req.spec.first_token_deadline_s
        return req.arrival + wait if wait is not None else None

    def _give_up_at(self, req: _RequestRun) -> float | None:
        """The first of the request's deadlines: for its first token and for its last."""
        deadlines = (self._first_token_deadline(req), req.deadline_at)
        return min((d for d in deadlines if d is not None), default=None)

    def _hold(self, req: _RequestRun, now: float, *, admitted: bool) -> None:
        """No decode worker serves the request's model: the request waits for one, until its
        first deadline or, without one, `hold_limit_s`; the model's first held asks the
        autoscaler for a plan now."""
        self._held[req.rid] = (req, admitted)
        self.held_requests += 1
        figures = self.by_model[req.model]
        figures.held += 1
        figures.holding += 1
        give_up = self._give_up_at(req)
        until = give_up if give_up is not None else now + self.fleet.hold_limit_s
        self._push(max(now, until), _HOLD, req.rid)
        if figures.holding == 1:
            self._plan_soon(now)

    def _hold_expired(self, rid: str, now: float) -> None:
        entry = self._held.pop(rid, None)
        if entry is not None:
            req, admitted = entry
            self.by_model[req.model].holding -= 1
            self._reject(req, "router" if admitted else "admission", "no_capacity_in_time", now)

    def _release_held(self, now: float) -> None:
        """A decode worker is ready: the requests held for a model that now has one go on, in
        the order they came, to admission (those not admitted yet) and the router; the other
        models' stay held."""
        live = self._decode_live
        ready = [rid for rid, (req, _) in self._held.items() if live.get(req.model)]
        if not ready:
            return
        self._observe_fleet(now)
        held = [self._held.pop(rid) for rid in ready]
        for req, _ in held:
            self.by_model[req.model].holding -= 1
        for req, admitted in held:
            if admitted or self._admit(req, now, counted=True):
                self._route(req, now)

    def _route_request(self, req: _RequestRun, admission_wait_s: float = 0.0) -> RouteRequest:
        """The request as the router sees it (and admission's prediction of its first token): built
        once, again only if the workflow's spend or admission's hold on it changed since (the
        fields that move)."""
        task_run = req.task_run
        built = req.route_request
        if (
            built is not None
            and built.workflow_spent_usd == task_run.spend
            and built.admission_wait_s == admission_wait_s
        ):
            return built
        task, spec = task_run.task, req.spec
        built = req.route_request = RouteRequest(
            request_id=req.rid,
            tenant=task.tenant,
            model=req.model,
            block_size=self.block_size,
            block_hashes=spec.block_hashes,
            prompt_tokens=spec.prompt_tokens,
            max_tokens=spec.output_tokens,
            priority=task.priority,
            deadline_at=req.deadline_at,
            workflow_id=task.task_id if task.workflow else None,
            workflow_step=req.index if task.workflow else None,
            workflow_steps=task.steps if task.workflow else None,
            workflow_spent_usd=task_run.spend,
            admission_wait_s=admission_wait_s,
        )
        return built

    def _route(self, req: _RequestRun, now: float, admission_wait_s: float = 0.0) -> None:
        """Place an admitted request (held back `admission_wait_s` by admission) and hand it to
        its workers."""
        spec, rid = req.spec, req.rid
        if not self._decode_live.get(req.model):
            self._hold(req, now, admitted=True)
            return
        prompt, output = spec.prompt_tokens, spec.output_tokens
        self.prefix.now = now
        placement = self.router(self.router_state, self._route_request(req, admission_wait_s), now)
        if isinstance(placement, NoPlacement):
            self._reject(req, "router", placement.reason, now)
            return
        prefill_worker = self.serving.get(placement.prefill_worker)
        decode_worker = self.serving.get(placement.decode_worker)
        if prefill_worker is None or decode_worker is None:
            self._reject(req, "router", "no_workers", now)
            return
        for worker in {
            prefill_worker.worker_id: prefill_worker,
            decode_worker.worker_id: decode_worker,
        }.values():
            verdict = worker.check(prompt, output)
            if verdict is not None:
                self._fail(req, "engine", verdict[0], now)
                return
        req.upper_bound = self._upper_bound(spec)
        if placement.predicted_completion_s > 0.0:
            views = self.router_state.workers
            decode_view = views.get(placement.decode_worker)
            prefill_view = views.get(placement.prefill_worker)
            if decode_view is not None and prefill_view is not None:
                req.predicted = (
                    decode_view.gpu_type,
                    prefill_view.gpu_type,
                    now,
                    placement.predicted_completion_s,
                    placement.indexed_cached_tokens,
                )
        # Its workers schedule it by its service class (services/engines/scheduling.py).
        rank = class_rank(req.task_run.task.service_class)
        seq = Seq(rid, prompt, spec.block_hashes, output, req, kv_import=False, rank=rank)
        req.placed = (prefill_worker.worker_id, decode_worker.worker_id)
        req.workers[seq] = prefill_worker
        self._touch(prefill_worker, now)
        prefill_worker.submit(seq, now)
        if decode_worker is not prefill_worker:
            decode_worker.reserved += 1
            req.reserved = decode_worker
        self._kick(prefill_worker, now)
        give_up = self._give_up_at(req)
        if give_up is not None and self.options.abandon_past_deadline:
            # The event names the request; the request itself is let go of when it ends. A first-
            # token deadline admission could not see may have passed while it deferred: now, then.
            self._deadlines[req.rid] = req
            self._push(max(now, give_up), _DEADLINE, req.rid)

    def _release(self, req: _RequestRun, seq: Seq) -> None:
        worker = req.workers.pop(seq)
        self._touch(worker, self.now)
        worker.release(seq)
        self._charge(req, worker, seq)
        if req.outcome is not None and not req.workers:
            self._log(req, *req.outcome)

    def _step_end(self, worker: SimWorker, now: float) -> None:
        if worker.in_chunk:
            exact = worker.chunk_due(now)
            if exact is not None:  # woken a hair early: the chunk's last step ends at `exact`
                worker.step_version += 1
                self._push(exact, _STEP, (worker, worker.step_version))
                return
        handoffs = worker.end_step(now)
        # The engine schedules its next step before the coroutines its step woke run (which
        # change the worker: no chunk of steps is timed ahead then).
        self._start(worker, now, coast=not handoffs)
        for kind, seq in handoffs:
            req: _RequestRun = seq.owner
            if kind == FINISHED:
                self._release(req, seq)
                self._complete(req, now)
            elif kind == PREFILLED:
                self._prefilled(worker, req, seq, now)
            elif kind == CANCELLED:
                self._release(req, seq)
        if not worker.busy:
            self._start(worker, now)

    def _prefilled(self, worker: SimWorker, req: _RequestRun, seq: Seq, now: float) -> None:
        req.first_token_at = now
        req.cached = seq.cached_tokens
        if req.predicted is not None:
            self.router_state.observe_cached(req.predicted[1], req.predicted[4], seq.cached_tokens)
        req.queue_s = seq.admitted_at - seq.enqueued_at
        window = self._window
        window.cached_tokens += seq.cached_tokens
        uncached = max(0, seq.prompt_len - seq.cached_tokens)
        window.prefilled += 1
        window.uncached_tokens += uncached
        window.uncached_tokens_sq += float(uncached) ** 2
        window.ttfts.append(now - req.arrival)
        # Prefix-cache accounting over the requests whose prefill ran.
        self.prompt_tokens += seq.prompt_len
        self.cached_tokens += seq.cached_tokens
        self.upper_bound_tokens += req.upper_bound
        decode_worker = req.reserved
        if decode_worker is None:  # aggregated: decode() on the same engine
            self._touch(worker, now)
            if worker.start_decode(seq):
                self._release(req, seq)
                self._complete(req, now)
            return
        # Disaggregated: the prefill worker lets go of the sequence; the decode worker imports it.
        self._release(req, seq)
        req.reserved = None
        decode_worker.reserved -= 1
        imported = Seq(
            req.rid, seq.prompt_len, seq.hashes, seq.max_tokens, req, kv_import=True, rank=seq.rank
        )
        req.workers[imported] = decode_worker
        self._touch(decode_worker, now)
        decode_worker.submit_import(imported, now)
        self._kick(decode_worker, now)

    def _import_done(self, worker: SimWorker, seq: Seq, now: float) -> None:
        self._touch(worker, now)
        if not worker.import_done(seq):
            return  # released meanwhile (its request was abandoned)
        req: _RequestRun = seq.owner
        self._touch(worker, now)
        if worker.start_decode(seq):
            self._release(req, seq)
            self._complete(req, now)
        else:
            self._kick(worker, now)

    def _complete(self, req: _RequestRun, now: float) -> None:
        req.done = True
        self._observe_completion(req, now)
        self.requests_completed += 1
        spec = req.spec
        first = req.first_token_at if req.first_token_at is not None else now
        ttft = first - req.arrival
        self.ttft.add(ttft)
        tpot = (now - first) / (spec.output_tokens - 1) if spec.output_tokens > 1 else None
        window = self._window
        window.output_tokens += spec.output_tokens
        window.completed += 1
        if tpot is not None:
            self.tpot.add(tpot)
            window.itls.append(tpot)
        self.e2e.add(now - req.arrival)
        if req.queue_s is not None:
            self.queue.add(req.queue_s)
        if self.request_log is not None:
            self._log(req, "completed", now)
        ttft_ok = ttft <= self.options.slo_ttft_s
        tpot_ok = tpot is None or tpot <= self.options.slo_tpot_s
        self.slo_ttft_met += ttft_ok
        self.slo_tpot_met += tpot_ok
        self.slo_met += ttft_ok and tpot_ok
        self._ended(req, now, admitted=True, slo_met=ttft_ok and tpot_ok)
        task_run = req.task_run
        task_run.max_completed_step = max(task_run.max_completed_step, req.index)
        first_deadline = self._first_token_deadline(req)
        if (req.deadline_at is not None and now > req.deadline_at) or (
            first_deadline is not None and first > first_deadline
        ):
            task_run.deadline_misses += 1
        if req.index >= task_run.task.steps:
            task_run.final_completed_at = now
        status, reason = self._task_status(task_run, now)
        if status != "running":
            self._end_task(task_run, reason, now)
        elif spec.fails:
            # The agent cannot use this step's result and stops: the ledger rules the workflow
            # abandoned once it has been quiet for the task timeout.
            status, reason = self._task_status(task_run, now, later=self.task_timeout_s + 1.0)
            self._end_task(task_run, reason if status == "failed" else None, now)
        else:
            following = task_run.task.step(req.index + 1)
            self._push(now + following.think_s, _NEXT_STEP, (task_run, following))

    def _step_failed(self, req: _RequestRun, now: float) -> None:
        task_run = req.task_run
        task_run.max_failed_step = max(task_run.max_failed_step, req.index)
        status, reason = self._task_status(task_run, now)
        self._end_task(task_run, reason if status == "failed" else None, now)

    def _log(self, req: _RequestRun, outcome: str, now: float) -> None:
        if self.request_log is None:
            return
        req.outcome = None
        self.request_log(
            RequestRecord(
                request_id=req.rid,
                tenant=req.task_run.task.tenant,
                arrival=req.arrival,
                first_token_at=req.first_token_at,
                finished_at=now,
                outcome=outcome,
                prompt_tokens=req.spec.prompt_tokens,
                output_tokens=req.spec.output_tokens,
                cached_tokens=req.cached,
                gpu_seconds=req.gpu_s,
                workers=req.placed,
                model=req.model,
            )
        )

    def _reject(self, req: _RequestRun, stage: str, reason: str, now: float) -> None:
        key = f"{stage}:{reason}"
        self.rejections[key] = self.rejections.get(key, 0) + 1
        self.by_model[req.model].rejected += 1
        if self.request_log is not None:
            self._log(req, key, now)
        req.done = True
        self._ended(req, now, admitted=stage != "admission")
        self._step_failed(req, now)

    def _fail(self, req: _RequestRun, stage: str, reason: str, now: float) -> None:
        key = f"{stage}:{reason}"
        self.failures[key] = self.failures.get(key, 0) + 1
        self.by_model[req.model].failed += 1
        if self.request_log is not None:
            if req.workers:  # a step in flight still holds it: logged when it lets go
                req.outcome = (key, now)
            else:
                self._log(req, key, now)
        req.done = True
        self._ended(req, now, admitted=True)
        self._step_failed(req, now)

    def _deadline(self, req: _RequestRun, now: float) -> None:
        if req.done:
            return
        first_deadline = self._first_token_deadline(req)
        if first_deadline is not None and now >= first_deadline and req.first_token_at is None:
            reason = "first_token_deadline"
        elif req.deadline_at is not None and now >= req.deadline_at:
            reason = "deadline"
        else:  # the first token came in time: the client waits on, to its deadline for the last
            if req.deadline_at is not None:
                self._deadlines[req.rid] = req
                self._push(req.deadline_at, _DEADLINE, req.rid)
            return
        # The client gives up: its request is cancelled wherever it is.
        for seq in list(req.workers):
            worker = req.workers[seq]
            if seq.state == DONE:
                continue
            self._touch(worker, now)
            if worker.cancel(seq):
                self._release_cancelled(req, seq, worker)
        if req.reserved is not None:
            req.reserved.reserved -= 1
            req.reserved = None
        self._observe_completion(req, now)  # at least this long: a miss the calibration sees
        self._fail(req, "client", reason, now)

    def _observe_completion(self, req: _RequestRun, now: float) -> None:
        """The router's calibration hears how its completion-time prediction turned out."""
        if req.predicted is not None:
            gpu_type, _, decided_at, predicted_s, _ = req.predicted
            self.router_state.observe_completion(gpu_type, predicted_s, now - decided_at)
            req.predicted = None

    def _release_cancelled(self, req: _RequestRun, seq: Seq, worker: SimWorker) -> None:
        req.workers.pop(seq, None)
        self._charge(req, worker, seq)
