"""The one-run audit: from canary scores and coins to a lower bound on the privacy loss."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np
import torch
from scipy import stats

from opake_compile.auditing import _stats
from opake_compile.auditing._record import CanaryRecord
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["OneRunEstimate", "guess_counts", "one_run"]

DEFAULT_GRID_SIZE = 10_000


# ----------------------------------------------------------------------------- guess rules
GUESS_GRID_STEPS_PER_OCTAVE = 2


def guess_counts(m: int) -> np.ndarray:
    """The guess budgets tried by the audit, fixed before looking at any score: k = m, then k
    shrinking geometrically by sqrt(2) down to 1 (about 2 log2(m) values: 20 for m = 1000).

    The significance is split evenly over them (Bonferroni). A small family fixed in advance
    keeps the split cheap (tau = (1 - confidence) / 20 rather than / m), which matters most for
    the delta term of the (eps, delta) test. On Gaussian synthetic scores (m = 10^3, 10^4)
    sqrt(2) spacing gave higher bounds than 2^(1/3), 2^(1/4) and 2^(1/8): the smaller split
    outweighs the guesses lost between budgets. Ties at a cut can make a rule guess fewer.

    Example::

        >>> from opake_compile.auditing import guess_counts
        >>> guess_counts(10).tolist()
        [1, 2, 3, 4, 5, 8, 10]
    """
    j = np.arange(0, int(GUESS_GRID_STEPS_PER_OCTAVE * math.log2(m)) + 2)
    ks = np.unique(np.ceil(m * 2.0 ** (-j / GUESS_GRID_STEPS_PER_OCTAVE) - 1e-9).astype(np.int64))
    return ks[(ks >= 1) & (ks <= m)]


@dataclasses.dataclass(frozen=True)
class _Candidates:
    """The guess rules of the audit. Rule k (k from :func:`guess_counts`) guesses "included"
    for every canary scoring strictly above the (k+1)-th highest score: exactly the top k
    when there is no tie there, fewer when a tie straddles the cut (the rule never breaks ties,
    so identical scores give no guesses). Arrays ``(n,)``, rules with a correct guess only."""

    k: np.ndarray  # guesses made
    c: np.ndarray  # correct guesses
    threshold: np.ndarray  # the rule guesses "included" iff score >= threshold
    num_rules: int  # the Bonferroni denominator: every rule, including those dropped here


def _candidates(in_scores: np.ndarray, out_scores: np.ndarray) -> _Candidates:
    scores = np.concatenate([in_scores, out_scores])
    m = len(scores)
    label = np.concatenate([np.ones(len(in_scores), bool), np.zeros(len(out_scores), bool)])
    order = np.argsort(-scores, kind="stable")
    s, lab = scores[order], label[order]
    budgets = guess_counts(m)
    # k' = number of scores strictly above s[k] (the (k+1)-th largest); all m when k = m.
    nxt = np.where(budgets < m, s[np.minimum(budgets, m - 1)], -np.inf)
    kprime = np.where(budgets < m, np.searchsorted(-s, -nxt, side="left"), m)
    tp = np.r_[0, np.cumsum(lab)]
    c = tp[kprime]
    pairs = sorted({(int(a), int(b)) for a, b in zip(kprime, c) if a > 0 and b > 0})
    k_arr = np.array([p[0] for p in pairs], dtype=np.int64)
    c_arr = np.array([p[1] for p in pairs], dtype=np.int64)
    thr = s[k_arr - 1] if len(k_arr) else np.zeros(0)
    return _Candidates(k=k_arr, c=c_arr, threshold=thr, num_rules=len(budgets))


def _roc_hull(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) vertices of the upper convex hull of the empirical ROC curve, from (0, 0)
    to (1, 1): the operating points of threshold attacks that may randomise between two
    thresholds (Andrew's monotone chain on the counts)."""
    scores = np.concatenate([in_scores, out_scores])
    label = np.concatenate([np.ones(len(in_scores), bool), np.zeros(len(out_scores), bool)])
    order = np.argsort(-scores, kind="stable")
    s, lab = scores[order], label[order]
    ks = np.flatnonzero(np.r_[s[:-1] > s[1:], True]) + 1  # cuts between distinct values
    tp = np.cumsum(lab)[ks - 1]
    xs = np.r_[0, ks - tp].tolist()
    ys = np.r_[0, tp].tolist()
    hull: list[int] = []
    for j in range(len(xs)):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            if (xs[a] - xs[o]) * (ys[j] - ys[o]) - (ys[a] - ys[o]) * (xs[j] - xs[o]) >= 0:
                hull.pop()  # a is not strictly above the chord o -> j
            else:
                break
        hull.append(j)
    x = np.array([xs[j] for j in hull], dtype=np.float64) / max(len(out_scores), 1)
    y = np.array([ys[j] for j in hull], dtype=np.float64) / max(len(in_scores), 1)
    return x, y


# ----------------------------------------------------------------------------- the searches
def _gdp_mu_ceiling(m: int, n_in: int, tau: float) -> float:
    """The largest mu the audit can certify: every included canary scored above every excluded
    one. Rule k (:func:`guess_counts`) then guesses its top min(k, n_in) canaries, all right,
    when k < m (with the included scores distinct and the excluded ones tied, a cut among the
    excluded guesses only the n_in above it), and all m, n_in of them right, when k = m. No
    outcome does better: a rule guesses at most k canaries and at most n_in of them rightly.
    (Taking k = n_in for granted overstated the ceiling when n_in is not a budget: m = 7,
    n_in = 6 claimed 0.453 at confidence 0.5, perfect scores certify 0.070; found by the
    property tests.) :meth:`OneRunEstimate.ceiling` scores the canaries so."""
    best = 0.0
    for k in guess_counts(m):
        guesses, right = (min(int(k), n_in), min(int(k), n_in)) if k < m else (m, n_in)
        if right > 0 and _stats.gdp_rejected(0.0, m, guesses, right, tau):
            best = max(best, _stats.largest_rejected(
                lambda mu, g=guesses, r=right: _stats.gdp_rejected(mu, m, g, r, tau), 0.0, rtol=1e-9))
    return best


def _gdp_search(cand: _Candidates, m: int, tau: float, mu_max: float, grid_size: int) -> tuple[float, float | None]:
    """The largest mu on the grid mu_max * j / grid_size rejected by some candidate rule.

    Coverage: per rule, the rejections are nested in mu (a weaker claim is rejected only if
    every stronger one is; property-tested), so "some mu >= the true mu is rejected" is the
    event "the true claim is rejected", of probability <= tau; over the rules, <= L tau =
    1 - confidence. The same holds for the (eps, delta) search, whose p-value increases in eps.
    Every value returned was itself tested and rejected (bisection keeps the rejected end).
    """
    if mu_max <= 0.0 or len(cand.k) == 0:
        return 0.0, None
    grid = lambda j: mu_max * j / grid_size  # noqa: E731
    best_j, best_t = 0, None
    order = np.lexsort((-cand.c, -cand.c / cand.k))  # most precise rules first: fewer searches
    for idx in order:
        k, c = int(cand.k[idx]), int(cand.c[idx])
        rej = lambda j: _stats.gdp_rejected(grid(j), m, k, c, tau)  # noqa: E731
        if best_j == grid_size:
            break
        lo = best_j + 1 if best_j > 0 else 1
        if not rej(lo):
            continue
        hi = grid_size
        if rej(hi):
            lo = hi
        else:
            while hi - lo > 1:  # rej(lo) and not rej(hi)
                mid = (lo + hi) // 2
                if rej(mid):
                    lo = mid
                else:
                    hi = mid
        best_j, best_t = lo, float(cand.threshold[idx])
    return grid(best_j), best_t


def _eps_delta_epsilon(cand: _Candidates, m: int, tau: float, delta: float) -> float:
    best = 0.0
    order = np.lexsort((-cand.c, -cand.c / cand.k))
    for idx in order:
        k, c = int(cand.k[idx]), int(cand.c[idx])
        if c / k <= 0.5:
            continue  # no evidence against eps = 0 (the binomial tail is >= 1/2)
        rej = lambda e: _stats.eps_delta_p_value(e, delta, m, k, c) <= tau  # noqa: E731
        if rej(best):
            best = _stats.largest_rejected(rej, best, rtol=1e-7)
    return best


# ----------------------------------------------------------------------------- the estimate
def _check_unit(value: Any, *, name: str, closed: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"Expected {name} to be a number, got {type(value).__name__}.")
    v = float(value)
    ok = (0.0 <= v <= 1.0) if closed else (0.0 < v < 1.0)
    if not ok:
        rng = "[0, 1]" if closed else "(0, 1)"
        raise ConfigurationError(f"Expected {name}={v!r} in {rng}.")
    return v


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float64)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class OneRunEstimate:
    """A one-run privacy audit: **lower bounds** on the privacy loss, each holding with
    probability at least ``confidence``.

    Built by :func:`one_run`. Two views, mirroring :mod:`opake_compile.accounting`'s queries:

    * ``method="gdp"`` (the default): ``mu_lower_bound`` is the largest mu such that "the
      training run is mu-GDP with respect to each canary" is rejected (Mahloujifar, Melis &
      Chaudhuri 2024): a lower bound on the run's mu. :meth:`epsilon_at`, :meth:`delta_at`,
      :meth:`beta_at` and :meth:`advantage` are those of mu_lower_bound-GDP, hence lower
      bounds on the run's epsilon(delta), ... *if its privacy curve is Gaussian-shaped* (the
      assumption of JAX-Privacy's ``epsilon_one_run_fdp`` too). DP-SGD's subsampled Gaussian
      is close to that after many steps (central limit theorem, Dong, Roth & Su 2022), not
      exactly; for a claim that assumes nothing about the mechanism use :meth:`eps_delta`.
      This view is much tighter for Gaussian-like mechanisms.
    * ``method="eps_delta"`` (:meth:`eps_delta`): the mechanism-agnostic (eps, delta) audit of
      Steinke, Nasr & Jagielski (2023); :meth:`epsilon_at` is the largest eps such that
      (eps, delta)-DP is rejected.

    A lower bound next to the accountant's epsilon (an upper bound) brackets the truth: an
    (eps, delta) audit above the accountant means a bug (noise not added, clipping skipped, a
    side channel). A GDP-view epsilon above it means a bug or a run whose curve is not
    Gaussian-shaped: on randomized response (exactly eps-DP, eps = 1, 10^4 canaries) the GDP
    view's epsilon exceeded the true eps in 75 % of 40 runs, the (eps, delta) view in none
    (review, 2026-12-05); on DP-SGD's subsampled Gaussian it stayed below.
    An audit far below it is *not* evidence of more privacy than accounted: the bound is only
    as strong as the canaries and the scores.

    Attributes:
        method: ``"gdp"`` or ``"eps_delta"``.
        confidence: the probability (over the coins and the training randomness) that every
            bound of this estimate holds; 1 - confidence is split evenly (Bonferroni) over the
            guess rules fixed in advance (:func:`guess_counts`), so picking the best rule
            after seeing the scores is accounted for.
        num_canaries: m.
        num_included: canaries that were trained on.
        mu_lower_bound: the GDP view's mu (0.0: no evidence of any privacy loss).
        mu_ceiling: the largest mu these m canaries could certify, with perfect scores.
        threshold: the score threshold of the guess rule that gave ``mu_lower_bound``
            ("included" iff score >= threshold); ``None`` when no rule gave evidence.
        grid_size: resolution of the mu search (mu is rounded down to mu_ceiling * j / grid_size).
    """

    method: str
    confidence: float
    num_canaries: int
    num_included: int
    mu_lower_bound: float
    mu_ceiling: float
    threshold: float | None
    grid_size: int
    in_scores: np.ndarray = dataclasses.field(repr=False)
    out_scores: np.ndarray = dataclasses.field(repr=False)

    # ------------------------------------------------------------------ privacy views
    @property
    def _tau(self) -> float:
        return (1.0 - self.confidence) / len(guess_counts(self.num_canaries))

    def _cands(self) -> _Candidates:
        return _candidates(self.in_scores, self.out_scores)

    def epsilon_at(self, delta: float) -> float:
        """A lower bound on epsilon at ``delta`` (nats), at ``confidence``.

        GDP view: the epsilon of mu_lower_bound-GDP at delta (inf at delta = 0 when mu > 0;
        a bound on the run if its privacy curve is Gaussian-shaped, see the class docstring).
        (eps, delta) view: the largest eps such that (eps, delta)-DP is rejected by the
        canaries, for any mechanism.

        Raises:
            ConfigurationError: ``delta`` not in [0, 1].
        """
        d = _check_unit(delta, name="delta", closed=True)
        if self.method == "gdp":
            return _stats.gdp_epsilon(self.mu_lower_bound, d) if d > 0 else (math.inf if self.mu_lower_bound > 0 else 0.0)
        return _eps_delta_epsilon(self._cands(), self.num_canaries, self._tau, d)

    def delta_at(self, epsilon: float) -> float:
        """A lower bound on delta at ``epsilon``, at ``confidence``.

        Raises:
            ConfigurationError: ``epsilon`` negative or NaN.
        """
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not float(epsilon) >= 0:
            raise ConfigurationError(f"Expected epsilon={epsilon!r} >= 0.")
        e = float(epsilon)
        if self.method == "gdp":
            return _stats.gdp_delta(self.mu_lower_bound, e)
        cand = self._cands()
        return max(
            (_stats.eps_delta_max_rejected_delta(e, self.num_canaries, int(k), int(c), self._tau) for k, c in zip(cand.k, cand.c)),
            default=0.0,
        )

    def _gdp_only(self, name: str) -> None:
        if self.method != "gdp":
            raise ConfigurationError(
                f"{name} is a trade-off-curve query of the mu-GDP view; the (eps, delta) audit "
                f"gives no curve. Use estimate.gdp().{name}(...)."
            )

    def beta_at(self, alpha: float) -> float:
        """The type-II error at type-I error ``alpha`` of mu_lower_bound-GDP:
        Phi(Phi^-1(1 - alpha) - mu). Theoretical (not measured): the run's best membership test
        is at least this strong somewhere on its curve, at ``confidence``.

        Raises:
            ConfigurationError: ``alpha`` not in [0, 1], or the (eps, delta) view.
        """
        self._gdp_only("beta_at")
        return _stats.gdp_beta(self.mu_lower_bound, _check_unit(alpha, name="alpha", closed=True))

    def advantage(self) -> float:
        """max over alpha of 1 - alpha - beta(alpha) for mu_lower_bound-GDP (2 Phi(mu/2) - 1),
        a lower bound on the best membership advantage, at ``confidence``.

        Raises:
            ConfigurationError: the (eps, delta) view.
        """
        self._gdp_only("advantage")
        return _stats.gdp_advantage(self.mu_lower_bound)

    # ------------------------------------------------------------------ views
    def eps_delta(self) -> OneRunEstimate:
        """The same audit, answered by the mechanism-agnostic (eps, delta) method of Steinke,
        Nasr & Jagielski (2023)."""
        return dataclasses.replace(self, method="eps_delta")

    def gdp(self, grid_size: int | None = None) -> OneRunEstimate:
        """The mu-GDP view, optionally with another ``grid_size`` for the mu search (larger:
        finer rounding, a few more tests per guess rule)."""
        g = self.grid_size if grid_size is None else _check_grid_size(grid_size)
        if g == self.grid_size:
            return dataclasses.replace(self, method="gdp")
        mu, t = _gdp_search(self._cands(), self.num_canaries, self._tau, self.mu_ceiling, g)
        return dataclasses.replace(self, method="gdp", grid_size=g, mu_lower_bound=mu, threshold=t)

    def ceiling(self) -> OneRunEstimate:
        """The estimate these canaries would give with perfect scores (every included canary
        above every excluded one): the most this audit can ever certify, whatever the model."""
        # Included canaries distinct, excluded ones tied below them: every rule's best outcome
        # (see _gdp_mu_ceiling).
        perfect_in = np.arange(self.num_included, 0, -1, dtype=np.float64)
        perfect_out = np.zeros(self.num_canaries - self.num_included)
        est = _estimate(perfect_in, perfect_out, self.confidence, self.grid_size)
        return dataclasses.replace(est, method=self.method)

    # ------------------------------------------------------------------ attack metrics
    def attack_auc(self) -> float:
        """Empirical area under the attack's ROC curve (Mann-Whitney: P[in score > out score],
        ties counted one half). 0.5: no signal. A point estimate, not a bound."""
        n_in, n_out = len(self.in_scores), len(self.out_scores)
        ranks = stats.rankdata(np.concatenate([self.in_scores, self.out_scores]))
        u = ranks[:n_in].sum() - n_in * (n_in + 1) / 2.0
        return float(u / (n_in * n_out))

    def attack_beta_at(self, fpr: float) -> float:
        """Empirical type-II error (1 - TPR) of the best threshold attack whose false positive
        rate on the held-out canaries is at most ``fpr``, randomising between two thresholds
        (a point on the ROC convex hull). A point estimate, not a bound.

        Raises:
            ConfigurationError: ``fpr`` not in [0, 1].
        """
        f = _check_unit(fpr, name="fpr", closed=True)
        x, y = _roc_hull(self.in_scores, self.out_scores)
        # x is non-decreasing; at a repeated x the later vertex has the larger y.
        keep = np.r_[x[1:] > x[:-1], True]
        return float(1.0 - np.interp(f, x[keep], y[keep]))

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        pct = f"{100 * self.confidence:g}%"
        head = (
            f"OneRunEstimate(LOWER BOUNDS at {pct} confidence, method={self.method!r}, "
            f"{self.num_canaries} canaries ({self.num_included} included)"
        )
        if self.method == "gdp":
            return (
                f"{head}: mu >= {self.mu_lower_bound:.4g} (ceiling for these canaries {self.mu_ceiling:.4g}); "
                "epsilon_at(delta) bounds epsilon if the run's privacy curve is Gaussian-shaped; "
                "eps_delta() assumes nothing)"
            )
        return f"{head}: query epsilon_at(delta) for the (eps, delta) lower bound)"


def _check_grid_size(g: Any) -> int:
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 2:
        raise ConfigurationError(f"Expected grid_size={g!r} to be an int >= 2.")
    return int(g)


def _estimate(in_scores: np.ndarray, out_scores: np.ndarray, confidence: float, grid_size: int) -> OneRunEstimate:
    m = len(in_scores) + len(out_scores)
    tau = (1.0 - confidence) / len(guess_counts(m))
    ceiling = _gdp_mu_ceiling(m, len(in_scores), tau)
    mu, t = _gdp_search(_candidates(in_scores, out_scores), m, tau, ceiling, grid_size)
    return OneRunEstimate(
        method="gdp",
        confidence=confidence,
        num_canaries=m,
        num_included=len(in_scores),
        mu_lower_bound=mu,
        mu_ceiling=ceiling,
        threshold=t,
        grid_size=grid_size,
        in_scores=_readonly(in_scores),
        out_scores=_readonly(out_scores),
    )


def one_run(
    scores: Any,
    record: CanaryRecord,
    *,
    confidence: float = 0.95,
    grid_size: int = DEFAULT_GRID_SIZE,
) -> OneRunEstimate:
    """Audit a training run from its canaries' membership scores: step three of the one-run
    audit (Steinke, Nasr & Jagielski 2023; Mahloujifar, Melis & Chaudhuri 2024).

    The attacker guesses "included" for its k highest-scored canaries and abstains on the rest
    (one-sided guesses, as in JAX-Privacy). About 2 log2(m) guess budgets k, fixed in advance
    (:func:`guess_counts`), are all tried and 1 - confidence is split evenly over them
    (Bonferroni), so the reported bounds hold at ``confidence`` even though the best budget
    was picked after seeing which guesses were right. Ties are never broken: a budget that
    would cut a group of equal scores guesses only the canaries strictly above it.

    Args:
        scores: ``(m,)`` membership scores, higher = more likely trained on (a numpy array,
            tensor or sequence of floats; from :func:`loss_scores` or :func:`gradient_scores`).
            Only their order matters. NaN is refused; +-inf are allowed.
        record: the :class:`CanaryRecord` from :func:`coin_flip` (score ``i`` is canary ``i``).
        confidence: in (0, 1); every bound holds with at least this probability.
        grid_size: the mu search rounds down to multiples of mu_ceiling / grid_size.

    Returns:
        A :class:`OneRunEstimate` (the GDP view; ``.eps_delta()`` for the (eps, delta) one).

    Raises:
        InputTypeError: ``record`` is not a CanaryRecord; scores are not real numbers.
        ConfigurationError: ``scores`` is not ``(m,)`` for the record's m, holds NaN; no
            canary was included or none excluded; ``confidence`` not in (0, 1).

    Edge cases: identical scores (no signal) give 0; scores independent of the coins give 0
    with probability at least ``confidence``; perfect scores give the ceiling.

    Example::

        >>> import numpy as np, opake_compile as opake
        >>> rec = opake.auditing.coin_flip(1000, opake.random.key(0))
        >>> rng = np.random.default_rng(0)
        >>> scores = rng.normal(size=1000) + 2.0 * rec.mask()      # a 2-GDP "mechanism"
        >>> est = opake.auditing.one_run(scores, rec)
        >>> 0 < est.mu_lower_bound < 2.0
        True
        >>> 0 <= est.eps_delta().epsilon_at(1e-5) < est.epsilon_at(1e-5)
        True
    """
    if not isinstance(record, CanaryRecord):
        raise InputTypeError(f"Expected record to be an auditing.CanaryRecord, got {type(record).__name__}.")
    conf = _check_unit(confidence, name="confidence")
    g = _check_grid_size(grid_size)
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().cpu().double().numpy()
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise InputTypeError(f"Expected scores to be real numbers ({err}).") from err
    if s.shape != (record.num_canaries,):
        raise ConfigurationError(f"Expected scores of shape ({record.num_canaries},) (one per canary), got {s.shape}.")
    if np.isnan(s).any():
        raise ConfigurationError(f"scores hold {int(np.isnan(s).sum())} NaN value(s); every canary needs a score.")
    mask = record.mask()
    if mask.all() or not mask.any():
        raise ConfigurationError(
            f"The record has {record.num_included} included and {record.num_excluded} excluded canaries; "
            "an audit needs both."
        )
    return _estimate(s[mask], s[~mask], conf, g)
