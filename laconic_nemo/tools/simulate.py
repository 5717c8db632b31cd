"""`laconic-nemo simulate`: the dual dynamics on a length-response model of the policy, to choose eta, Lambda
and the pid gains before a cluster run (beyond the paper).

Length-response model (one GRPO step t -> t + 1; lambda_t prices step t's rollout, the policy update at
step t moves the length seen at step t + 1 + delay - 1):

``L_{t+1} = L_t + (a - b * g(lambda_{t-delay}) - L_t) / tau``, measured as ``L_t + sigma * eps_t``,
``eps_t ~ N(0, 1)``, ``g(lambda) = scale * (1 - exp(-lambda / scale))`` (``g(lambda) = lambda`` for
``scale = inf``).

The policy's mean length L relaxes with time constant ``tau`` (steps) towards a target ``a - b * g(lambda)``
that falls with lambda (``a``: the length without a length penalty, ``b``: tokens per unit of lambda at
lambda = 0; a finite ``scale`` flattens the target out towards ``a - b * scale``, below which no lambda
brings it). The batch mean of sampled lengths scatters around the policy's mean with noise ``sigma``
(tokens); the dual step sees the measured value.

Fit to a run's ``metrics.jsonl`` (fields ``step``, ``lambda`` = the lambda used at the step,
``mean_response_length``), in open loop: the model driven by the run's own lambdas from its first length alone
(the free run) is fitted to the observed lengths by least squares over tau, a, b, the delay (0..3) and the
scale (a grid, inf included); sigma is the step-to-step scatter of the observed lengths around that path
(robust to a few sudden jumps). Closing the loop again, with the run's controller, predicts its response. The
dual step is the project's own :class:`~laconic_nemo.core.dual.DualController`.

Response measures (steps numbered from 1, as in metrics.jsonl): the settling step is the first step from
which the trailing 3-step moving average of L stays within +-5% of B to the end; the first step with
L <= B; the undershoot ``max(0, B - min L after that step) / B``; the final error: mean of L / B - 1 over
the last tenth of the steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from laconic_nemo.core.dual import DualController

__all__ = ["LengthModel", "fit_length_model", "simulate", "predict", "response_metrics", "read_trajectory",
           "register"]


@dataclass
class LengthModel:
    """``L_{t+1} = L_t + (a - b * g(lambda_{t-delay}) - L_t) / tau``, measured with noise sigma; ``l0`` = L_1."""

    tau: float
    a: float
    b: float
    sigma: float
    l0: float
    delay: int = 0
    scale: float = math.inf

    def __post_init__(self):
        self.tau, self.a, self.b, self.sigma, self.l0 = (float(v) for v in (self.tau, self.a, self.b, self.sigma,
                                                                            self.l0))
        self.delay, self.scale = int(self.delay), float(self.scale)

    def target(self, lam: float) -> float:
        """The length the policy relaxes towards under a constant lambda."""
        return self.a - self.b * _g(lam, self.scale)

    def equilibrium_lambda(self, budget: float) -> float:
        """The lambda at which the target equals B (inf when no lambda brings the target down to B)."""
        need = (self.a - budget) / self.b if self.b > 0 else math.inf
        if math.isinf(self.scale):
            return need
        return -self.scale * math.log1p(-need / self.scale) if need < self.scale else math.inf


def _g(lam, scale: float):
    """``scale * (1 - exp(-lam / scale))``, elementwise; lam itself for scale = inf."""
    if math.isinf(scale):
        return lam
    return -scale * np.expm1(-np.asarray(lam, dtype=np.float64) / scale)


SCALES = (math.inf, 3.0, 2.0, 1.5, 1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05)


def read_trajectory(path: str | Path) -> tuple[np.ndarray, np.ndarray, float]:
    """(lambda used [T], mean length [T], budget) from a metrics.jsonl, in step order (the last record of a
    step wins, as after a resume)."""
    rows: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[int(r["step"])] = r
    if len(rows) < 5:
        raise ValueError(f"{path}: need at least 5 steps of metrics to fit the length model, found {len(rows)}")
    steps = sorted(rows)
    lam = np.array([float(rows[s]["lambda"]) for s in steps])
    length = np.array([float(rows[s]["mean_response_length"]) for s in steps])
    return lam, length, float(rows[steps[0]]["budget"])


def fit_length_model(lam: Sequence[float], length: Sequence[float], max_delay: int = 3,
                     scales: Sequence[float] = SCALES, taus: Sequence[float] | None = None) -> LengthModel:
    """Fit the model to one trajectory in open loop: lam [T] (lambda used at each step), length [T].

    The model is driven by the run's own lambdas from its first length alone (the free run), and ``tau``,
    ``a``, ``b``, the delay and the scale are those whose free run is closest to the observed lengths (least
    squares): for each delay in 0..max_delay, scale in ``scales`` and tau on a geometric grid (``taus``,
    default 0.8 .. 80 steps), the free run is linear in (a, b), solved exactly. Fitting the free run rather
    than the one-step increments keeps the slow, lambda-driven part of the response (the one-step fit is
    dominated by the noise of consecutive lengths). sigma, the measurement noise, is estimated from the
    step-to-step part of the residual, robustly: ``1.4826 * MAD(diff(residual)) / sqrt(2)`` (white measurement
    noise doubles in variance under a difference, a slowly varying model error barely shows there, and the
    median absolute deviation ignores the few sudden jumps of a run, such as a policy switching to a shorter
    style within one step).

    Raises ValueError when lambda does not vary (nothing to identify b from) or no setting gives a target
    that falls with lambda.
    """
    lam, length = np.asarray(lam, dtype=np.float64), np.asarray(length, dtype=np.float64)
    if lam.shape != length.shape or lam.ndim != 1:
        raise ValueError(f"lam and length must be 1-D of the same length, got {lam.shape} and {length.shape}")
    if np.ptp(lam) == 0:
        raise ValueError("lambda is constant in this trajectory: the model's slope b cannot be fitted")
    tau_grid = np.geomspace(0.8, 80.0, 241) if taus is None else np.asarray(taus, dtype=np.float64)
    n = len(length)
    best = None
    for d, scale in itertools.product(range(max_delay + 1), scales):
        if n - d < 5:
            break
        glam = _g(lam, scale)
        drive = glam[np.maximum(np.arange(n - 1) - d, 0)]  # [T-1]: g(lambda_{t-d}) moves L_t to L_{t+1}
        # free run x = l0 * p0 + a * pa - b * pb, one column per tau: [T, K]
        alpha = 1.0 / tau_grid
        p0, pa, pb = (np.zeros((n, len(tau_grid))) for _ in range(3))
        p0[0] = 1.0
        for t in range(n - 1):
            p0[t + 1] = (1 - alpha) * p0[t]
            pa[t + 1] = (1 - alpha) * pa[t] + alpha
            pb[t + 1] = (1 - alpha) * pb[t] + alpha * drive[t]
        y = length[:, None] - length[0] * p0
        # least squares of y on [pa, -pb] for every tau at once (2x2 normal equations)
        saa, sbb, sab = (pa * pa).sum(0), (pb * pb).sum(0), (pa * pb).sum(0)
        sya, syb = (y * pa).sum(0), (y * pb).sum(0)
        det = saa * sbb - sab * sab
        ok = det > 1e-12 * np.maximum(saa * sbb, 1e-300)
        a = np.where(ok, (sya * sbb - syb * sab) / np.where(ok, det, 1.0), np.nan)
        b = np.where(ok, (sya * sab - syb * saa) / np.where(ok, det, 1.0), np.nan)
        sse = ((y - a * pa + b * pb) ** 2).sum(0)
        sse = np.where(ok & (b > 0), sse, np.inf)
        k = int(np.argmin(sse))
        if np.isfinite(sse[k]) and (best is None or sse[k] < best[0]):
            best = (float(sse[k]), d, scale, float(tau_grid[k]), float(a[k]), float(b[k]))
    if best is None:
        raise ValueError("no delay, scale and time constant gives a target that falls with lambda: the trajectory "
                         "does not relax towards a lambda-dependent target")
    _, d, scale, tau, a, b = best
    free = _free_run([a / tau, -b / tau, -1.0 / tau], d, _g(lam, scale), float(length[0]))
    step = np.diff(length - free)
    sigma = float(1.4826 * np.median(np.abs(step - np.median(step))) / math.sqrt(2.0))
    return LengthModel(tau=tau, a=a, b=b, sigma=sigma, l0=float(length[0]), delay=d, scale=scale)


def _free_run(coef, delay: int, lam: np.ndarray, l0: float) -> np.ndarray:
    c0, c_lam, c_len = (float(c) for c in coef)
    out = [l0]
    for t in range(len(lam) - 1):
        out.append(out[t] + c0 + c_lam * lam[max(t - delay, 0)] + c_len * out[t])
    return np.array(out)


def simulate(model: LengthModel, dual: DualController, steps: int, seed: int | None = 0) -> tuple[np.ndarray,
                                                                                                  np.ndarray]:
    """Run ``steps`` GRPO steps of the model under ``dual`` (updated in place); returns (lambda used [steps],
    measured mean length [steps]). The noise is measurement noise: the dual step and the returned lengths see
    ``L_t + sigma * eps_t`` (a batch mean of sampled lengths), the policy's own mean ``L_t`` follows the
    recursion without it. ``seed=None``: no noise."""
    rng = np.random.default_rng(seed)
    lam_hist = [dual.value]
    state = model.l0
    measured = []
    for t in range(steps):
        noise = 0.0 if seed is None or t == 0 else model.sigma * float(rng.standard_normal())
        measured.append(max(state + noise, 0.0))
        if t == steps - 1:
            break
        dual.update(measured[t])
        lam_hist.append(dual.value)
        state = state + (model.target(lam_hist[max(t - model.delay, 0)]) - state) / model.tau
    return np.array(lam_hist), np.array(measured)


def response_metrics(length: Sequence[float], budget: float, window: int = 3, tol: float = 0.05) -> dict:
    """Settling step, first step at or below B, undershoot and final error of a length trajectory [T]."""
    L = np.asarray(length, dtype=np.float64)
    T = len(L)
    ma = np.convolve(L, np.ones(window) / window, mode="valid")  # ma[i] = mean of steps i+1 .. i+window
    inside = np.abs(ma / budget - 1.0) <= tol
    settle = None
    if inside[-1]:
        last_out = np.flatnonzero(~inside)
        settle = (int(last_out[-1]) + 1 if len(last_out) else 0) + window  # 1-based step of that window's end
    below = np.flatnonzero(L <= budget)
    first = int(below[0]) + 1 if len(below) else None
    undershoot = max(0.0, float((budget - L[below[0]:].min()) / budget)) if len(below) else 0.0
    tail = max(T // 10, 1)
    return {"settling_step": settle, "first_at_budget": first, "undershoot": undershoot,
            "final_error": float(np.mean(L[-tail:] / budget - 1.0))}


def predict(model: LengthModel, make_dual, steps: int, seeds: int = 40, budget: float | None = None) -> dict:
    """The model's prediction of a run's response under the controllers ``make_dual()`` builds (a fresh
    DualController per run): the noise-free run's measures (``settling_step``, ``first_at_budget``,
    ``undershoot``, ``final_error``, as in :func:`response_metrics`), and over ``seeds`` noisy runs the median
    of each (``*_median``; a run that never settles counts as settling at infinity, so a median of inf means
    that most runs do not settle within ``steps``) and ``settled_frac``, the fraction that settle."""
    budget = make_dual().budget if budget is None else float(budget)
    out = response_metrics(simulate(model, make_dual(), steps, seed=None)[1], budget)
    runs = [response_metrics(simulate(model, make_dual(), steps, seed=s)[1], budget) for s in range(seeds)]
    if runs:
        settle = [math.inf if r["settling_step"] is None else r["settling_step"] for r in runs]
        first = [math.inf if r["first_at_budget"] is None else r["first_at_budget"] for r in runs]
        out.update(settling_step_median=float(np.median(settle)), first_at_budget_median=float(np.median(first)),
                   undershoot_median=float(np.median([r["undershoot"] for r in runs])),
                   final_error_median=float(np.median([r["final_error"] for r in runs])),
                   settled_frac=float(np.mean(np.isfinite(settle))))
    return out


def _grid_row(model, budget, steps, seeds, floor, lambda_init, eta, ceiling, controller, kp, kd) -> dict:
    def make():
        return DualController(budget, eta, ceiling=ceiling, init=lambda_init, floor=floor, controller=controller,
                              kp=kp, kd=kd)

    det = response_metrics(simulate(model, make(), steps, seed=None)[1], budget)
    runs = [response_metrics(simulate(model, make(), steps, seed=s)[1], budget) for s in range(seeds)] or [det]
    settle = [r["settling_step"] if r["settling_step"] is not None else math.inf for r in runs]
    return {"controller": controller, "eta": eta, "ceiling": ceiling, "kp": kp, "kd": kd,
            "settle_noiseless": det["settling_step"], "settle_median": float(np.median(settle)),
            "settled_frac": float(np.mean(np.isfinite(settle))),
            "undershoot": float(np.mean([r["undershoot"] for r in runs])),
            "final_error": float(np.mean([r["final_error"] for r in runs]))}


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(math.isnan(x) or x < 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r}")
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="choose eta, Lambda and pid gains on a length-response model",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics", help="metrics.jsonl of a run to fit the length model to")
    p.add_argument("--model", help='model parameters as JSON instead of --metrics, e.g. \'{"tau": 8, "a": 60, '
                                   '"b": 55, "sigma": 1, "l0": 47, "delay": 0}\'')
    p.add_argument("--scale", type=_floats, default=None,
                   help="scales of the target's flattening to fit over, comma-separated (inf: a linear target; "
                        "default: inf and a grid from 3 to 0.05)")
    p.add_argument("--sigma", type=float, default=None,
                   help="measurement noise of the mean length in tokens instead of the fitted one (0: none)")
    p.add_argument("--budget", type=float, help="B (default: the metrics' budget)")
    p.add_argument("--steps", type=int, default=None, help="steps to simulate (default: the metrics' steps, or 70)")
    p.add_argument("--seeds", type=int, default=20, help="noisy runs per setting (median settling step)")
    p.add_argument("--controller", default="integral,pid", help="integral, pid or both (comma-separated)")
    p.add_argument("--eta", type=_floats, default=[0.05], help="dual step / integral gain ki, comma-separated")
    p.add_argument("--ceiling", type=_floats, default=[1.0], help="Lambda values, comma-separated")
    p.add_argument("--kp", type=_floats, default=[0.0], help="proportional gains (pid), comma-separated")
    p.add_argument("--kd", type=_floats, default=[0.0], help="derivative gains (pid), comma-separated")
    p.add_argument("--floor", type=float, default=0.0)
    p.add_argument("--lambda-init", type=float, default=0.0)
    p.add_argument("--top", type=int, default=20, help="print the best N settings (by median settling step)")
    p.add_argument("--plot", help="write lambda and length of the best settings (noise-free) to this PNG")
    p.add_argument("--json", help="write the model and the full table to this JSON file")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        if (args.metrics is None) == (args.model is None):
            raise ValueError("give exactly one of --metrics and --model")
        steps = args.steps
        if args.metrics:
            lam, length, budget = read_trajectory(args.metrics)
            model = fit_length_model(lam, length, scales=args.scale or SCALES)
            steps = steps or len(length)
            observed = response_metrics(length, budget)
        else:
            model = LengthModel(**json.loads(args.model))
            budget, observed, steps = None, None, steps or 70
        budget = args.budget if args.budget is not None else budget
        if args.sigma is not None:
            if not args.sigma >= 0:
                raise ValueError(f"--sigma must be a number of tokens >= 0, got {args.sigma!r}")
            model.sigma = float(args.sigma)
        if args.seeds < 0:
            raise ValueError(f"--seeds must be >= 0, got {args.seeds}")
        if budget is None or not budget > 0:
            raise ValueError(f"--budget must be a number of tokens > 0, got {budget!r}")
        controllers = [c.strip() for c in args.controller.split(",")]
        for c in controllers:
            if c not in ("integral", "pid"):
                raise ValueError(f"--controller: each entry must be integral or pid, got {c!r}")
        if steps < 5:
            raise ValueError(f"--steps must be >= 5, got {steps}")
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        print(f"laconic-nemo simulate: {exc}", file=sys.stderr)
        return 2

    shape = "lambda" if math.isinf(model.scale) else f"{model.scale:g} * (1 - exp(-lambda / {model.scale:g}))"
    print(f"length model: tau {model.tau:.2f} steps, target {model.a:.1f} - {model.b:.1f} * {shape}, "
          f"sigma {model.sigma:.2f} tokens, L at step 1 {model.l0:.1f}, delay {model.delay}; "
          f"lambda at L = B: {model.equilibrium_lambda(budget):.3f}")
    if observed is not None:
        print(f"observed run: settling step {observed['settling_step']}, first L <= B at step "
              f"{observed['first_at_budget']}, undershoot {100 * observed['undershoot']:.1f}%, final error "
              f"{100 * observed['final_error']:+.1f}%")
    rows = []
    for controller in controllers:
        gains = [(0.0, 0.0)] if controller == "integral" else list(itertools.product(args.kp, args.kd))
        for eta, ceiling, (kp, kd) in itertools.product(args.eta, args.ceiling, gains):
            try:
                rows.append(_grid_row(model, budget, steps, args.seeds, args.floor, args.lambda_init, eta, ceiling,
                                      controller, kp, kd))
            except ValueError as exc:
                print(f"skipped {controller} eta={eta} ceiling={ceiling} kp={kp} kd={kd}: {exc}", file=sys.stderr)
    rows.sort(key=lambda r: (r["settle_median"], r["undershoot"]))
    print(f"{'controller':>10} {'eta':>7} {'Lambda':>7} {'kp':>6} {'kd':>6} | {'settle (no noise)':>17} "
          f"{'settle (median)':>15} {'settled':>7} {'undershoot':>10} {'final err':>9}")
    for r in rows[:args.top]:
        print(f"{r['controller']:>10} {r['eta']:>7g} {r['ceiling']:>7g} {r['kp']:>6g} {r['kd']:>6g} | "
              f"{str(r['settle_noiseless']):>17} {r['settle_median']:>15g} {100 * r['settled_frac']:>6.0f}% "
              f"{100 * r['undershoot']:>9.1f}% {100 * r['final_error']:>+8.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": asdict(model), "budget": budget, "observed": observed,
                                               "rows": rows}, indent=1))
    if args.plot:
        _plot(model, budget, steps, args, rows[:4], args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot(model, budget, steps, args, rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_lam) = plt.subplots(1, 2, figsize=(11, 3.6))
    if args.metrics:
        lam, length, _ = read_trajectory(args.metrics)
        ax_l.plot(np.arange(1, len(length) + 1), length, color="k", lw=1, label="observed")
        ax_lam.plot(np.arange(1, len(lam) + 1), lam, color="k", lw=1)
    for r in rows:
        dual = DualController(budget, r["eta"], ceiling=r["ceiling"], init=args.lambda_init, floor=args.floor,
                              controller=r["controller"], kp=r["kp"], kd=r["kd"])
        lam, length = simulate(model, dual, steps, seed=None)
        label = f"{r['controller']} eta {r['eta']:g} Lambda {r['ceiling']:g}" + (
            f" kp {r['kp']:g} kd {r['kd']:g}" if r["controller"] == "pid" else "")
        x = np.arange(1, steps + 1)
        ax_l.plot(x, length, label=label)
        ax_lam.plot(x, lam)
    ax_l.axhspan(0.95 * budget, 1.05 * budget, color="tab:green", alpha=0.15)
    ax_l.axhline(budget, color="k", ls="--", lw=1)
    ax_l.set_title("mean length (B +- 5%)")
    ax_lam.set_title("lambda")
    ax_l.legend(fontsize=7)
    for ax in (ax_l, ax_lam):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
