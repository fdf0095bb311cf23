"""A worker's lifecycle state, from its engine's probes: starting, ready, degraded, draining.

`next_state` says what one probe alone shows. `Lifecycle` adds the memory that keeps the
state from flapping with the engine: a `ready` worker is forgiven an odd failed probe (a
busy vLLM on few cores sometimes answers /metrics late once) but turns `degraded` once
failures pile up within a window of probes, and a `degraded` worker is `ready` again only
after several good probes in a row, so that an engine whose /health flaps is not
advertised as ready most of the time. It also says why a worker is not ready: every
transition is logged, and so are the errors of a worker that stays `starting` and the
failures forgiven a `ready` one, at most once every LOG_EVERY_S.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine_metrics import RUNNING, WAITING, MetricsSample
from worker.probe import EngineVersion, ProbeResult, ServedModels
from worker.schema import LifecycleState

log = logging.getLogger(__name__)

# A line repeated for as long as a condition lasts (still starting, a forgiven failure)
# is logged once, then at most once every this many seconds.
LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class EngineView:
    """The latest known value of each part of the engine's state.

    A probe whose /v1/models or /version failed does not erase what an earlier one learned;
    the lifecycle state, not missing fields, is how a heartbeat reports a failing engine.
    `models_unconfirmed`: /health failed since `models` were listed, so the engine may
    have restarted since, to serve others. The heartbeat still names them, but they do
    not make the worker `ready` (next_state) until /v1/models answers again along with a
    good /health (a list from an engine failing /health may not outlive it); nor do the
    capacity and load of an earlier scrape, since `ready` needs this probe's /metrics.
    """

    metrics: MetricsSample | None = None
    models: ServedModels | None = None
    version: EngineVersion | None = None
    models_unconfirmed: bool = False

    def merge(self, probe: ProbeResult) -> EngineView:
        return EngineView(
            metrics=probe.metrics or self.metrics,
            models=probe.models or self.models,
            version=probe.version or self.version,
            models_unconfirmed=not probe.health_ok or (
                self.models_unconfirmed and probe.models is None),
        )


def next_state(
    current: LifecycleState,
    probe: ProbeResult,
    view: EngineView,
    *,
    draining: bool,
    engine_down: bool = False,
    stuck: bool = False,
) -> LifecycleState:
    """`starting` until the engine is first healthy, measurable and lists its models; then
    `ready` while /health and /metrics answer (and the models were listed since /health
    last failed), `degraded` while they do not, while a supervised engine process is
    down (crashed, or past its start deadline), or while the engine is `stuck` (it holds
    requests and runs no step: worker.progress), whatever an earlier answer said;
    `draining` once a drain has begun, whatever the engine does."""
    if draining:
        return LifecycleState.DRAINING
    if engine_down or (stuck and current is not LifecycleState.STARTING):
        return LifecycleState.DEGRADED
    if probe.engine_ok and view.models is not None and not view.models_unconfirmed:
        return LifecycleState.READY
    if current is LifecycleState.STARTING:
        return LifecycleState.STARTING
    return LifecycleState.DEGRADED


class Throttle:
    """Says `due()` the first time, then at most once every `period_s`; counts the calls
    that were not due in between (`skipped`), for the line that is logged next."""

    def __init__(self, period_s: float, monotonic: Callable[[], float]) -> None:
        self._period_s = period_s
        self._monotonic = monotonic
        self._last: float | None = None
        self.skipped = 0

    def due(self) -> bool:
        now = self._monotonic()
        if self._last is not None and now - self._last < self._period_s:
            self.skipped += 1
            return False
        self._last = now
        return True

    def reset(self) -> None:
        """The condition ended: the next occurrence is logged at once."""
        self._last = None
        self.skipped = 0


class Lifecycle:
    """The state heartbeats publish, one probe at a time (`advance`).

    A `ready` worker turns `degraded` once `failures_to_degrade` of its last `window`
    probes failed; a `degraded` one is `ready` again after `goods_to_recover` good probes
    in a row. A supervised engine process that is down, or an engine that is stuck,
    degrades the worker at once, and a drain wins over everything, as in `next_state`.
    """

    def __init__(self, worker_id: str, *, failures_to_degrade: int, window: int,
                 goods_to_recover: int, monotonic: Callable[[], float]) -> None:
        self._worker_id = worker_id
        self._failures_to_degrade = failures_to_degrade
        self._goods_to_recover = goods_to_recover
        self._recent: deque[bool] = deque(maxlen=max(window, failures_to_degrade))
        self._good_in_a_row = 0
        self._forgiven = Throttle(LOG_EVERY_S, monotonic)
        self._starting = Throttle(LOG_EVERY_S, monotonic)
        self.state = LifecycleState.STARTING

    def advance(self, probe: ProbeResult, view: EngineView, *, draining: bool,
                engine_down: bool, stuck_for_s: float | None = None,
                stuck_engines: tuple[str, ...] = ()) -> LifecycleState:
        """The state after `probe`; logs a transition, and why a worker is still starting.
        `stuck_for_s`: how long the engine has held requests without a step, once it is
        stuck (worker.progress.ProgressWatch), else None; `stuck_engines`: which of a
        data-parallel server's engines (their `engine` labels) are."""
        stuck = stuck_for_s is not None
        state = next_state(self.state, probe, view, draining=draining,
                           engine_down=engine_down, stuck=stuck)
        if not (draining or engine_down or (stuck and state is LifecycleState.DEGRADED)):
            state = self._settled(state, probe)
        if state is not self.state:
            self._log_transition(state, probe, view, engine_down=engine_down,
                                 stuck_for_s=stuck_for_s, stuck_engines=stuck_engines)
            self._recent.clear()
            self._recent.append(state is LifecycleState.READY)
            self._good_in_a_row = 0
            self._forgiven.reset()
        elif state is LifecycleState.STARTING and self._starting.due():
            log.info("worker %s: still starting (%s)", self._worker_id,
                     "; ".join(probe.errors) or "no models listed yet")
        self.state = state
        return state

    def _settled(self, state: LifecycleState, probe: ProbeResult) -> LifecycleState:
        """`state` as one probe shows it, held back by the hysteresis in either direction."""
        if self.state is LifecycleState.READY:
            self._recent.append(state is LifecycleState.READY)
            failed = self._recent.count(False)
            if state is LifecycleState.READY or failed >= self._failures_to_degrade:
                return state
            if self._forgiven.due():
                more = self._forgiven.skipped
                self._forgiven.skipped = 0
                log.info("worker %s: probe failed (%s); still ready until %d of the last %d "
                         "probes fail%s", self._worker_id, "; ".join(probe.errors),
                         self._failures_to_degrade, self._recent.maxlen,
                         f" ({more} more forgiven since the last such line)" if more else "")
            return LifecycleState.READY
        if self.state is LifecycleState.DEGRADED:
            self._good_in_a_row = self._good_in_a_row + 1 if state is LifecycleState.READY else 0
            if state is LifecycleState.READY and self._good_in_a_row < self._goods_to_recover:
                return LifecycleState.DEGRADED
        return state

    def _log_transition(self, state: LifecycleState, probe: ProbeResult, view: EngineView,
                        *, engine_down: bool, stuck_for_s: float | None,
                        stuck_engines: tuple[str, ...] = ()) -> None:
        if state is LifecycleState.READY:
            served = ", ".join(view.models.models) if view.models else ""
            version = view.version
            engine = "version unknown" if version is None else (
                f"{'simulator' if version.simulator else 'version'} {version.version}"
            )
            detail = f"models {served}; engine {engine}"
        else:
            detail = "; ".join(probe.errors)
            if engine_down:
                detail = "; ".join(filter(None, ("the engine process is down", detail)))
            elif stuck_for_s is not None and view.metrics is not None:
                detail = "; ".join(filter(None, (
                    stuck_detail(stuck_for_s, view.metrics, stuck_engines), detail)))
        level = logging.WARNING if state is LifecycleState.DEGRADED else logging.INFO
        log.log(level, "worker %s: %s -> %s%s", self._worker_id,
                self.state.value, state.value, f" ({detail})" if detail else "")


def stuck_detail(stuck_for_s: float, metrics: MetricsSample,
                 engines: tuple[str, ...] = ()) -> str:
    """Why a stuck engine's worker is `degraded`, for logs and the status page; `engines`:
    which of a data-parallel server's engines are stuck (named with what each holds)."""
    held = [(engine, metrics.engines[engine]) for engine in engines
            if engine in metrics.engines]
    if metrics.engine_count > 1 and held:
        each = "; ".join(f"engine {engine}: {totals.get(RUNNING, 0.0):.0f} running, "
                         f"{totals.get(WAITING, 0.0):.0f} waiting" for engine, totals in held)
        return (f"{len(held)} of its {metrics.engine_count} engines have run no step for "
                f"{stuck_for_s:.0f} s while holding requests ({each}; a wedged "
                "accelerator?)")
    return (f"the engine has run no step for {stuck_for_s:.0f} s while holding "
            f"{metrics.running} running and {metrics.waiting} waiting requests (a wedged "
            "accelerator?)")
