"""A short forecast of one model's traffic: arrival rate with a trend and, where the history
shows one, a seasonal term; the request mix (prompt, output, cache hit) as moving averages. Pure.

The rate is Holt's linear exponential smoothing (a level and a trend per second) over the rate
seen in each planning window. Where `season_s` is set (a daily shape, say), each slot of the
season (one window long) keeps a moving average of the rate seen in it, and once the history
covers two seasons the forecast is at least the slot's average: capacity is ready for the
morning's rise before it shows in the level. The trend is
damped (Gardner and McKenzie's damped Holt): projected `phi` less each window ahead, so a step
in the load is not extrapolated into a ramp over a replica's whole start-up time. The factors
are not fitted to a workload: alpha 0.5, beta 0.2 and phi 0.8 are common textbook choices for a
level that follows a step within two or three windows and a trend that ignores one noisy window
and counts for about four windows ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class ForecastSettings:
    alpha: float = 0.5  # level
    beta: float = 0.2  # trend
    gamma: float = 0.3  # seasonal slots
    mix_alpha: float = 0.3  # the request mix's moving averages
    phi: float = 0.8  # the trend's damping per window ahead
    season_s: float | None = None  # e.g. 86400 for a daily shape

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "mix_alpha", "phi"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.season_s is not None and self.season_s <= 0:
            raise ValueError("season_s must be > 0")


@dataclass(frozen=True, slots=True)
class Window:
    """One model's traffic over one planning window."""

    start: float
    end: float
    arrivals: int = 0
    prompt_tokens: int = 0  # of the requests prefilled in the window (0: of those arrived)
    cached_tokens: int = 0
    output_tokens: int = 0
    completed: int = 0
    prefilled: int = 0  # requests whose prompt_tokens these are (0: the arrivals)
    # What the arrivals asked for (their prompts, their max_tokens): the mix before anything has
    # been prefilled or completed, as on a cold start (an output's max_tokens is its upper bound).
    arrived_prompt_tokens: int = 0
    requested_output_tokens: int = 0
    # The prompts prefilled in the window, their uncached tokens (prompt less cached) and the sum
    # of those tokens' squares: the spread of a prompt's prefill time (capacity.py). 0 where not
    # measured (an older producer): no spread is assumed.
    uncached_prefills: int = 0
    uncached_tokens: int = 0
    uncached_tokens_sq: float = 0.0

    @property
    def rate(self) -> float:
        return self.arrivals / max(1e-9, self.end - self.start)


@dataclass(frozen=True, slots=True)
class ModelForecast:
    level: float = 0.0  # requests per second
    trend: float = 0.0  # change of the rate per second
    updated_at: float | None = None
    window_s: float = 1.0  # the last window's length: the step the trend is damped by
    first_at: float | None = None
    seasonal: tuple[float, ...] = field(default=())
    mean_prompt: float = 0.0
    mean_output: float = 0.0
    hit_rate: float = 0.0
    mixed: bool = False  # prompts have been measured at least once
    outputs_seen: bool = False  # outputs too (until then: what the arrivals asked for)
    # Moving averages of a prefilled prompt's uncached tokens and of their square (0: not
    # measured), for the spread of the prefill service time (`uncached_cv2`).
    uncached_mean: float = 0.0
    uncached_mean_sq: float = 0.0

    @property
    def uncached_cv2(self) -> float:
        """The squared coefficient of variation of a prompt's uncached tokens, E[u^2] / E[u]^2 - 1
        over the moving averages (the windows' own spread and the spread between windows); 0
        until measured."""
        if self.uncached_mean <= 0 or self.uncached_mean_sq <= 0:
            return 0.0
        return max(0.0, self.uncached_mean_sq / self.uncached_mean**2 - 1.0)

    def observe(self, window: Window, settings: ForecastSettings) -> ModelForecast:
        """The forecast after one more window (an older or empty-length window changes nothing)."""
        if self.updated_at is not None and window.end <= self.updated_at:
            return self
        rate = window.rate
        if self.updated_at is None:
            level, trend = rate, 0.0
        else:
            dt = max(1e-9, window.end - self.updated_at)
            expected = self.level + self.trend * dt
            level = settings.alpha * rate + (1 - settings.alpha) * max(0.0, expected)
            trend = settings.beta * (level - self.level) / dt + (1 - settings.beta) * self.trend
        seasonal = self._learn_season(window, rate, settings)
        mix = self._mix(window, settings)
        return replace(
            mix,
            level=max(0.0, level),
            trend=trend,
            updated_at=window.end,
            window_s=max(1e-9, window.end - window.start),
            first_at=self.first_at if self.first_at is not None else window.start,
            seasonal=seasonal,
        )

    def predict(self, at: float, settings: ForecastSettings) -> float:
        """The rate expected at `at` (requests per second, never negative)."""
        if self.updated_at is None:
            return 0.0
        steps = max(0.0, at - self.updated_at) / self.window_s
        phi = settings.phi
        damped_steps = steps if phi >= 1.0 else phi * (1.0 - phi**steps) / (1.0 - phi)
        holt = self.level + self.trend * self.window_s * damped_steps
        return max(0.0, holt, self._season_at(at, settings))

    def _slots(self, settings: ForecastSettings, window_s: float) -> int:
        assert settings.season_s is not None
        return max(1, round(settings.season_s / max(window_s, 1e-9)))

    def _season_at(self, at: float, settings: ForecastSettings) -> float:
        if settings.season_s is None or not self.seasonal or self.first_at is None:
            return 0.0
        if at - self.first_at < 2 * settings.season_s:
            return 0.0  # not two seasons of history yet: no seasonal claim
        slots = len(self.seasonal)
        return self.seasonal[int((at % settings.season_s) / settings.season_s * slots) % slots]

    def _learn_season(self, window: Window, rate: float, settings: ForecastSettings) -> tuple[float, ...]:
        if settings.season_s is None:
            return self.seasonal
        slots = self._slots(settings, window.end - window.start)
        seasonal = list(self.seasonal) if len(self.seasonal) == slots else [0.0] * slots
        slot = int((window.end % settings.season_s) / settings.season_s * slots) % slots
        seasonal[slot] = settings.gamma * rate + (1 - settings.gamma) * seasonal[slot]
        return tuple(seasonal)

    def _mix(self, window: Window, settings: ForecastSettings) -> ModelForecast:
        if (
            window.arrivals == 0
            and window.completed == 0
            and window.prefilled == 0
            and window.uncached_prefills == 0
        ):
            return self
        a = settings.mix_alpha if self.mixed else 1.0
        mean_prompt, hit_rate, mean_output = self.mean_prompt, self.hit_rate, self.mean_output
        prompts = window.prefilled or window.arrivals
        if prompts and window.prompt_tokens:
            mean_prompt = a * window.prompt_tokens / prompts + (1 - a) * mean_prompt
            hit = min(1.0, window.cached_tokens / window.prompt_tokens)
            hit_rate = a * hit + (1 - a) * hit_rate
        elif not self.mixed and window.arrivals and window.arrived_prompt_tokens:
            mean_prompt = window.arrived_prompt_tokens / window.arrivals
        if window.completed:
            b = settings.mix_alpha if self.outputs_seen else 1.0
            mean_output = b * window.output_tokens / window.completed + (1 - b) * mean_output
        elif not self.outputs_seen and window.arrivals and window.requested_output_tokens:
            mean_output = max(mean_output, window.requested_output_tokens / window.arrivals)
        uncached_mean, uncached_mean_sq = self.uncached_mean, self.uncached_mean_sq
        if window.uncached_prefills:
            c = settings.mix_alpha if self.uncached_mean_sq > 0 else 1.0
            n = window.uncached_prefills
            uncached_mean = c * window.uncached_tokens / n + (1 - c) * uncached_mean
            uncached_mean_sq = c * window.uncached_tokens_sq / n + (1 - c) * uncached_mean_sq
        return replace(
            self,
            mean_prompt=mean_prompt,
            mean_output=mean_output,
            hit_rate=hit_rate,
            uncached_mean=uncached_mean,
            uncached_mean_sq=uncached_mean_sq,
            mixed=self.mixed or bool(prompts and window.prompt_tokens),
            outputs_seen=self.outputs_seen or bool(window.completed),
        )
