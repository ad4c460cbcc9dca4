"""The fleet: its workers (`SimWorker`s) coming up, serving, draining and going; what their
heartbeats tell the router (`WorkerView`); starting, cutting and waking their steps on the event
heap; KV hand-offs into a decode worker; and the autoscaler's plan per pool, acted on."""

from __future__ import annotations

import itertools

from services.autoscaler import policy as autoscaler_policy
from services.autoscaler.policy import WorkerLoad
from services.ledger import pricing
from services.router.policy import WorkerView
from services.router.speed import worker_speed
from services.simulator.accounting import Accounting
from services.simulator.fleet import PoolSpec
from services.simulator.metrics import FleetSample
from services.simulator.state import _AUTOSCALE, _IMPORT, _KICK, _READY, _STEP
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
        self.prefix.changed()
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
        self.serving.pop(worker.worker_id, None)
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
        self._spend(seq.owner.task_run, usd)
        self._push(now + worker.kv_transfer_seconds(seq), _IMPORT, (worker, seq))

    def _autoscale(self, now: float) -> None:
        serving_total = provisioned = desired_total = queued = running = used = blocks = 0
        for index, pool in enumerate(self.fleet.pools):
            label = pool.label(index)
            members = [w for w in self.serving.values() if w.pool == label]
            for w in members:
                w.advance(now)
            active = [w for w in members if not w.draining]
            loads = [
                WorkerLoad(
                    w.worker_id,
                    w.pool,
                    w.role,  # type: ignore[arg-type]
                    w.gpu_type,
                    len(w.waiting),
                    len(w.running) + len(w.ready),
                    w.blocks.used_blocks,
                    w.blocks.total_blocks,
                    now,
                )
                for w in active
            ]
            plans = autoscaler_policy.plan(loads, self.fleet.targets(pool), now)
            starting = [w for w in self.starting.values() if w.pool == label]
            current = len(active) + len(starting)
            desired = plans[0].desired_replicas if plans else current
            if pool.autoscale:
                high = pool.max_replicas or max(pool.replicas, pool.min_replicas)
                desired = max(pool.min_replicas, min(high, desired))
                self._act(pool, index, label, desired, current, active, starting, now)
            self._desired[label] = desired
            serving_total += len(active)
            provisioned += len(members) + len(starting)
            desired_total += desired
            for w in members:
                queued += len(w.waiting)
                running += len(w.running) + len(w.ready)
                used += w.blocks.used_blocks
                blocks += w.blocks.total_blocks
        self.timeline.append(
            FleetSample(
                t=now,
                serving=serving_total,
                provisioned=provisioned,
                desired=desired_total,
                queued=queued,
                running=running,
                kv_utilisation=round(used / blocks, 4) if blocks else 0.0,
            )
        )
        if self._work_left():
            self._push(now + self.fleet.autoscale_interval_s, _AUTOSCALE, None)

    def _act(
        self,
        pool: PoolSpec,
        index: int,
        label: str,
        desired: int,
        current: int,
        active: list[SimWorker],
        starting: list[SimWorker],
        now: float,
    ) -> None:
        if desired > current:
            self._below_since.pop(label, None)
            for _ in range(desired - current):
                worker = self._new_worker(pool, index, now)
                self.starting[worker.worker_id] = worker
                self._push(now + pool.startup_s, _READY, worker)
            return
        if desired == current:
            self._below_since.pop(label, None)
            return
        since = self._below_since.setdefault(label, now)
        if now - since < self.fleet.scale_down_delay_s:
            return
        self._below_since.pop(label, None)
        surplus = current - desired
        for worker in reversed(starting):  # the newest first: replicas not serving yet
            if surplus == 0:
                break
            self._remove(worker, now)
            surplus -= 1
        for worker in reversed(active):
            if surplus == 0:
                break
            worker.draining = True
            self._observe(worker, now)
            surplus -= 1
