"""rl.eta = "auto": the staleness bound, chosen again after every trainer step (docs/staleness.md).

More lag buys throughput only while the trainer waits for generation, and it costs accuracy as the
stale tokens' importance weights w = exp(prox - behav) spread (their std, `w_std`; docs/staleness.md).
After each step the rule estimates the spread that one version of lag adds, s, and the largest lag that
keeps the spread under the target, `afford` = floor(target / s), then:

    eta > afford                                   -> eta = afford   (at once: the price is accuracy)
    the trainer keeps waiting, eta < afford         -> eta + 1        (one at a time)
    otherwise                                      -> eta

"Keeps waiting": this step's share of wait in wait + training, and the median share over the last
WINDOW steps, are both over WAIT_FRAC. A lone slow batch must not buy lag, since nothing takes lag back
unless the spread is over its target (a rule that climbed on any waiting step drifted up on a few
noisy ones; see docs/staleness.md); a generator that is really too slow makes most steps wait.

always within [1, eta_max]: at eta 0 no token is stale and nothing would measure the spread again.
s is this step's w_std over the root mean square of its trained tokens' lags (w's std at lag k taken
as k * s, so a mix of lags 0 and 1 is not mistaken for a larger spread at lag 1), smoothed over steps.
w's std grows a little slower than the lag (measured in docs/staleness.md), so predicting larger lags
from smaller ones errs on the side of accuracy.
A signal that is not a finite number (a NaN w_std, a NaN or infinite wait) is no evidence: the spread
estimate stays as it was and the step counts as one that did not wait.
The runtime (hexrl/control/controller.py) and the simulator (hexrl/plan/simulate.py) both run it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

WAIT_FRAC = 0.05  # the trainer waited when the batch took more than this share of wait + training
WINDOW = 5  # steps whose median wait share decides (one slow step in five does not count)
SMOOTH = 0.2  # the newest step's weight in the spread per version (an average over about 5 steps)


@dataclass
class AutoEta:
    """The controller's state: the bound now, and the smoothed spread per version of lag."""

    eta_max: int
    target: float  # rl.eta_w_std_target: the w_std the stale tokens may reach
    eta: int = 1
    per_version: float | None = None  # None until a step trained stale tokens
    waits: list[float] = field(default_factory=list)  # the last WINDOW steps' wait shares

    def __post_init__(self):
        if not isinstance(self.eta_max, int) or self.eta_max < 1:
            raise ValueError(f"eta_max must be an int >= 1, got {self.eta_max!r}")
        if not self.target > 0:
            raise ValueError(f"target must be > 0, got {self.target!r}")
        self.eta = min(max(self.eta, 1), self.eta_max)

    def afford(self) -> int:
        """The largest bound in [1, eta_max] whose predicted spread (lag x spread per version) <= target."""
        if not self.per_version:
            return self.eta_max
        return max(1, min(self.eta_max, int(self.target / self.per_version)))

    def update(self, wait_s: float, busy_s: float, w_std: float | None, lag_hist: dict) -> int:
        """The bound for the next version, from this step: the trainer's wait for its batch and its
        wait + training seconds, the trained tokens' w_std and their lag histogram {lag: tokens}."""
        tokens = sum(lag_hist.values())
        lag = (sum(int(k) ** 2 * n for k, n in lag_hist.items()) / tokens) ** 0.5 if tokens else 0.0
        if w_std is not None and math.isfinite(w_std) and lag > 0:
            x = w_std / lag
            self.per_version = x if self.per_version is None else (1 - SMOOTH) * self.per_version + SMOOTH * x
        share = wait_s / busy_s if busy_s > 0 else 0.0
        share = share if math.isfinite(share) else 0.0
        self.waits = (self.waits + [share])[-WINDOW:]
        afford = self.afford()
        if self.eta > afford:
            self.eta = afford
        elif share > WAIT_FRAC and median(self.waits) > WAIT_FRAC and self.eta < afford:
            self.eta += 1
        return self.eta

    def state(self) -> dict:
        return {"eta": self.eta, "per_version": self.per_version, "waits": self.waits}

    def load_state(self, state: dict) -> None:
        self.eta, self.per_version = min(max(int(state["eta"]), 1), self.eta_max), state["per_version"]
        self.waits = [float(w) for w in state.get("waits", [])][-WINDOW:]
