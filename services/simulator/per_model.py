"""Several models on one fleet: each request names its model (`Step.model`, by default the
workload's), each pool serves one (`PoolSpec.model`), the router places a request only on its
model's workers, and a model with no decode worker serving holds (then rejects) only its own
requests (lifecycle.py). What a run measures, it measures per model too (`ModelFigures`, the
result's `by_model`), and the autoscaler observes each model's own traffic (replicas.py).

This layer keeps the figures of a request's first token and completion for its model: its
traffic window (which lifecycle.py's `_prefilled` and `_complete` add to through `self._window`,
set here to the request's model's), completions, SLO attainment and first-token latency."""

from __future__ import annotations

from services.simulator.batch import BatchFlow
from services.simulator.records import _RequestRun, completion_counted
from services.simulator.worker import Seq, SimWorker


class PerModel(BatchFlow):
    """Each request's first token and completion counted in its model's figures."""

    def _prefilled(self, worker: SimWorker, req: _RequestRun, seq: Seq, now: float) -> None:
        self._window = self.by_model[req.model].window
        super()._prefilled(worker, req, seq, now)

    def _complete(self, req: _RequestRun, now: float) -> None:
        figures = self.by_model[req.model]
        self._window = figures.window
        with completion_counted(figures, req, now, self):
            super()._complete(req, now)
