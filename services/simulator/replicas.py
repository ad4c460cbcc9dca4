"""The fleet: its workers (`SimWorker`s) coming up, serving, draining and going; what their
heartbeats tell the router (`WorkerView`); starting, cutting and waking their steps on the event
heap; KV hand-offs into a decode worker; and the autoscaler: every `autoscale_interval_s` (and
at once when a request is held for a model with no replica, where the autoscaler plans so) the
pools, their replicas and the traffic since the last plan go to the autoscaler (autoscaling.py),
and the autoscaled pools act on its plan."""

from __future__ import annotations

import itertools

from services.autoscaler.capacity import EngineProfile
from services.autoscaler.forecast import Window
from services.autoscaler.policy import Observation, Plan, Pool, Replica, ReplicaState
from services.autoscaler.traffic import p90
from services.ledger import pricing
from services.router.policy import WorkerView
from services.router.speed import worker_speed
from services.simulator.accounting import Accounting
from services.simulator.autoscaling import TrafficWindow
from services.simulator.fleet import PoolSpec
from services.simulator.metrics import FleetSample, PlanRecord, PoolPlanRecord
from services.simulator.state import _AUTOSCALE, _IMPORT, _KICK, _PLAN, _READY, _STEP
from services.simulator.worker import Seq, SimWorker


class Fleet(Accounting):
    """The workers' lives on the fleet, their steps on the event heap, and the autoscaler."""

    def _new_worker(self, pool: PoolSpec, index: int, now: float) -> SimWorker:
        label = pool.label(index)
        counter = self._pool_counter.setdefault(label, itertools.count())
        worker_id = f"{label}-{next(counter)}"
        model = pool.model or self.workload.model
        engine = pool.engine(model=model, block_size=self.block_size)
        worker = SimWorker(
            worker_id,
            engine,
            pool=label,
            role=pool.role,
            tensor_parallel=pool.tensor_parallel,
            on_import_admitted=self._import_admitted,
            on_first_block=self.prefix.stored_first_block,
        )
        worker.provisioned_at = now
        self._pool_of[worker_id] = pool
        self.all_workers.append(worker)
        return worker

    def _serve(self, worker: SimWorker, now: float) -> None:
        worker.ready_at = now
        self.serving[worker.worker_id] = worker
        if worker.role == "decode":
            self._decode_live[worker.model] = self._decode_live.get(worker.model, 0) + 1
        self.prefix.changed()
        self._observe(worker, now)

    def _drain(self, worker: SimWorker, now: float) -> None:
        """The worker takes no new work; it goes once its work is done (`_heartbeat`)."""
        if worker.draining:
            return
        worker.draining = True
        if worker.role == "decode":
            self._decode_live[worker.model] -= 1
        if worker.idle and worker.reserved == 0:
            self._remove(worker, now)
        else:
            self._observe(worker, now)

    def _observe(self, worker: SimWorker, now: float) -> None:
        blocks = worker.blocks
        speed = self._speeds.get(worker.worker_id)
        if speed is None:
            speed = self._speeds[worker.worker_id] = worker_speed(
                worker.perf, max_batch_tokens=worker.max_batch_tokens, max_running=worker.max_running
            )
        self.router_state.observe(
            WorkerView(
                worker_id=worker.worker_id,
                role=worker.role,  # type: ignore[arg-type]
                model=worker.model,
                block_size=worker.block_size,
                queue_depth=len(worker.waiting),
                running=len(worker.running) + len(worker.ready),
                kv_blocks_total=blocks.total_blocks,
                kv_blocks_used=blocks.used_blocks,
                heartbeat_at=now,
                draining=worker.draining,
                gpu_type=worker.gpu_type,
                price_per_hour=self.prices.get(worker.gpu_type, 0.0) * worker.tensor_parallel,
                speed=speed,
                kv_blocks_free=blocks.free_blocks,
                queued_tokens=self._queued_tokens(worker, now),
                context_tokens=worker.context_tokens(),
            )
        )

    def _queued_tokens(self, worker: SimWorker, now: float) -> int:
        """The prompt tokens the worker has yet to prefill (what a heartbeat reports): the rest of
        the prompts in its batch, and the uncached part of those waiting."""
        total = sum(seq.prompt_len + seq.generated - seq.computed for seq in worker.prefilling)
        if not worker.waiting:
            return total
        self.prefix.now = now
        size = worker.block_size
        for seq in worker.waiting:
            if not seq.kv_import:
                cached = self.prefix.overlap(worker.worker_id, seq.hashes) * size
                total += max(1, seq.prompt_len + seq.generated - cached)
        return total

    def _remove(self, worker: SimWorker, now: float) -> None:
        worker.removed_at = now
        if self.serving.pop(worker.worker_id, None) is not None and worker.role == "decode":
            if not worker.draining:
                self._decode_live[worker.model] -= 1
        self.prefix.changed()
        self.starting.pop(worker.worker_id, None)
        self.router_state.forget(worker.worker_id)

    def _kick(self, worker: SimWorker, now: float) -> None:
        """The worker may start a step now, after the other events of this instant (the engine's
        loop wakes after the coroutines that woke it)."""
        if not worker.busy and not worker.kick_pending:
            worker.kick_pending = True
            self._push(now, _KICK, worker, late=1)

    def _start(self, worker: SimWorker, now: float, *, coast: bool = True) -> None:
        if worker.busy:
            return
        end = worker.schedule(now, coast=coast)
        if end is not None:
            worker.step_version += 1
            self._push(end, _STEP, (worker, worker.step_version))

    def _touch(self, worker: SimWorker, now: float) -> None:
        """The worker is about to change at `now`: a chunk of timed-ahead steps stops after the
        step in flight (whose end becomes the worker's step event)."""
        if worker.busy:
            end = worker.interrupt(now)
            if end is not None:
                worker.step_version += 1
                self._push(end, _STEP, (worker, worker.step_version))

    def _import_admitted(self, worker: SimWorker, seq: Seq, now: float) -> None:
        moved = (seq.prompt_len - seq.cached_tokens) * worker.kv_bytes_per_token
        usd = pricing.price_kv_transfer(moved, self.kv_usd_per_gb)
        self.kv_transfer_bytes += moved
        self.kv_transfer_usd += usd
        self.by_model[seq.owner.model].kv_transfer_usd += usd
        self._spend(seq.owner.task_run, usd)
        self._push(now + worker.kv_transfer_seconds(seq), _IMPORT, (worker, seq))

    # ------------------------------------------------------------ the autoscaler

    def _autoscale(self, now: float) -> None:
        """The autoscaler's tick: plan where its interval is due, sample the fleet."""
        if now + 1e-9 >= self._next_plan_at:
            self._next_plan_at = now + self.autoscaler.interval_s
            self._plan(now, "interval")
        self._sample(now)
        if self._work_left():
            self._push(now + self.fleet.autoscale_interval_s, _AUTOSCALE, None)

    def _plan_soon(self, now: float) -> None:
        """A request is held: an autoscaler that plans on it plans now (after this instant's
        other events), not at its next interval."""
        if self.autoscaler.plans_on_hold and not self._plan_pending:
            self._plan_pending = True
            self._push(now, _PLAN, None, late=1)

    def _held_plan(self, now: float) -> None:
        self._plan_pending = False
        if self._held and self._planned_at != now:
            self._plan(now, "held")

    def _plan(self, now: float, trigger: str) -> None:
        """Observe the pools and the traffic since the last plan, plan, and act on the plan.

        A plan woken by a held request (`trigger` "held"), or one whose window would be shorter
        than half an interval (the first, at 0 s), is shown the last interval's window again,
        which the policy's forecast has seen (`ModelForecast.observe` ignores it), and the
        traffic since goes on accumulating for the next plan: a window of a fraction of a second
        would otherwise enter the forecast as a rate (one request in a microsecond is a million
        a second) and, over so short a time, a steep trend (docs/simulator.md, autoscaling)."""
        pools, members, queued = self._pools_view(now)
        replicas = [r for group in members.values() for r, _ in group]
        fresh = trigger != "held" and now - self._window_start >= 0.5 * self.autoscaler.interval_s
        observations = self._observations(pools, now, fresh=fresh)
        plan = self.autoscaler.plan(observations, pools, replicas, queued, now)
        self._planned_at = now
        if fresh:
            self._last_windows = {o.model: o.window for o in observations}
            self._window = TrafficWindow()
            for figures in self.by_model.values():
                figures.window = TrafficWindow()
            self._window_start = now
        by_name = {d.pool: d for d in plan.pools}
        for index, spec in enumerate(self.fleet.pools):
            label = spec.label(index)
            decision = by_name.get(label)
            if decision is None:
                continue
            if spec.autoscale:
                self._act(spec, index, decision.add, decision.remove, members[label], now)
                self._desired[label] = decision.desired
            else:
                self._desired[label] = decision.desired
        self._record(plan, trigger)

    def _profile(self, spec: PoolSpec, label: str) -> EngineProfile:
        """The pool's replicas as the capacity model sees them: its sim engine's own PerfModel."""
        profile = self._profiles.get(label)
        if profile is None:
            engine = spec.engine(model=spec.model or self.workload.model, block_size=self.block_size)
            profile = self._profiles[label] = EngineProfile(
                perf=engine.perf,
                kv_capacity_tokens=engine.blocks.total_blocks * engine.info.block_size,
                max_batch_tokens=engine.max_batch_tokens,
                max_running=engine.max_running,
            )
        return profile

    def _pools_view(
        self, now: float
    ) -> tuple[list[Pool], dict[str, list[tuple[Replica, SimWorker]]], dict[str, int]]:
        """The pools (fixed ones at their size), each pool's replicas in the order they started,
        and the sequences waiting on each serving replica."""
        pools: list[Pool] = []
        members: dict[str, list[tuple[Replica, SimWorker]]] = {}
        for index, spec in enumerate(self.fleet.pools):
            label = spec.label(index)
            members[label] = []
            low, high = (spec.min_replicas, spec.high) if spec.autoscale else (spec.replicas, spec.replicas)
            pools.append(
                Pool(
                    name=label,
                    model=spec.model or self.workload.model,
                    role=spec.role,
                    gpu_type=spec.gpu,
                    price_per_hour=self.prices.get(spec.gpu, 0.0) * spec.tensor_parallel,
                    profile=self._profile(spec, label),
                    min_replicas=low,
                    max_replicas=high,
                    startup_s=spec.startup_s,
                )
            )
        queued: dict[str, int] = {}
        for worker in self.starting.values():
            members[worker.pool].append((Replica(worker.worker_id, worker.pool, "warming"), worker))
        for worker in self.serving.values():
            worker.advance(now)
            state: ReplicaState = "draining" if worker.draining else "serving"
            replica = Replica(
                worker.worker_id,
                worker.pool,
                state,
                cached_blocks=worker.blocks.cached_blocks,
                running=len(worker.running) + len(worker.ready),
            )
            members[worker.pool].append((replica, worker))
            queued[worker.worker_id] = len(worker.waiting)
        for group in members.values():
            group.sort(key=lambda pair: _serial(pair[0].replica_id))
        return pools, members, queued

    def _observations(self, pools: list[Pool], now: float, *, fresh: bool = True) -> list[Observation]:
        """The traffic since the last plan (not `fresh`: the last plan's window again), per
        model (each request's, counted in its model's figures), and what the fleet holds now."""
        observations = []
        for model in sorted({p.model for p in pools}):
            figures = self.by_model.get(model)
            traffic = figures.window if figures is not None else TrafficWindow()
            window = Window(
                start=self._window_start,
                end=now,
                arrivals=traffic.arrivals,
                prompt_tokens=traffic.prompt_tokens,
                cached_tokens=traffic.cached_tokens,
                output_tokens=traffic.output_tokens,
                completed=traffic.completed,
                uncached_prefills=traffic.prefilled,
                uncached_tokens=traffic.uncached_tokens,
                uncached_tokens_sq=traffic.uncached_tokens_sq,
            )
            ttft, itl = p90(traffic.ttfts), p90(traffic.itls)
            if not fresh:
                window = self._last_windows.get(model, Window(start=now, end=now))
                ttft = itl = None
            queued_tokens = sum(
                self._queued_tokens(w, now) for w in self.serving.values() if w.model == model
            )
            observations.append(
                Observation(
                    model=model,
                    window=window,
                    ttft_p90_s=ttft,
                    itl_p90_s=itl,
                    queued_prompt_tokens=queued_tokens,
                    held=figures.holding if figures is not None else 0,
                    in_flight=figures.in_flight if figures is not None else 0,
                )
            )
        return observations

    def _act(
        self,
        pool: PoolSpec,
        index: int,
        add: int,
        remove: tuple[str, ...],
        members: list[tuple[Replica, SimWorker]],
        now: float,
    ) -> None:
        """Start `add` replicas (billed now, serving after `startup_s`) and let `remove` go:
        warming ones at once, serving ones by draining."""
        for _ in range(add):
            worker = self._new_worker(pool, index, now)
            self.starting[worker.worker_id] = worker
            self._push(now + pool.startup_s, _READY, worker)
        gone = set(remove)
        for replica, worker in members:
            if replica.replica_id not in gone:
                continue
            if replica.state == "warming":
                self._remove(worker, now)
            elif replica.state == "serving":
                self._drain(worker, now)

    def _record(self, plan: Plan, trigger: str) -> None:
        self.plans.append(
            PlanRecord(
                t=plan.at,
                trigger=trigger,
                cost_per_hour=plan.cost_per_hour,
                pools=[
                    PoolPlanRecord(
                        d.pool, d.serving, d.warming, d.draining, d.desired, d.add, list(d.remove), d.reason
                    )
                    for d in plan.pools
                ],
            )
        )

    def _sample(self, now: float) -> None:
        serving = queued = running = used = blocks = 0
        for w in self.serving.values():
            w.advance(now)
            serving += not w.draining
            queued += len(w.waiting)
            running += len(w.running) + len(w.ready)
            used += w.blocks.used_blocks
            blocks += w.blocks.total_blocks
        self.timeline.append(
            FleetSample(
                t=now,
                serving=serving,
                provisioned=len(self.serving) + len(self.starting),
                desired=sum(self._desired.values()),
                queued=queued,
                running=running,
                kv_utilisation=round(used / blocks, 4) if blocks else 0.0,
                arrivals=self._arrivals_since_sample,
                held=len(self._held),
            )
        )
        self._arrivals_since_sample = 0


def _serial(worker_id: str) -> int:
    """A worker's number in its pool (`<pool>-<n>`, counted from 0 as they are made)."""
    return int(worker_id.rpartition("-")[2])
