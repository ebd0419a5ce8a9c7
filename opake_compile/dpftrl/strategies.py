"""Strategies of the matrix mechanism for DP-FTRL: which correlated noise to add.

Notation (Choquette-Choo et al. 2023; Denisov et al. 2022). Training releases, in effect, the
prefix sums ``A x`` of the per-step clipped gradient sums ``x`` (``A`` is the all-ones lower
triangle: the model after ``t`` SGD steps depends on ``x_0 + ... + x_t``). The matrix mechanism
factors ``A = B M`` with a lower-triangular *strategy* ``M``, releases ``M x + sigma C Z`` and
post-processes it by ``B``; equivalently it adds the *correlated noise* ``sigma C (M^-1 Z)[t]``
to the gradient sum of step ``t``. Every strategy here is lower-triangular **Toeplitz**: ``M``
is given by its first column ``m`` (``M[i, j] = m[i - j]``), whose generating function is the
rational function ``m(x) = P(x) / Q(x)``; the noise ``M^-1 Z`` has the generating function
``Q(x) / P(x)`` and is produced by a linear recursion whose state is ``max(deg P, deg Q)``
vectors of the model's size (see :mod:`opake_compile.dpftrl.noise`).

Normalisation: every strategy is scaled so that its largest column norm, the L2 sensitivity of
``M x`` when one example takes part in one step with a gradient of norm <= 1, is exactly 1.
So ``noise_multiplier`` keeps the meaning it has in DP-SGD for one participation; several
participations raise the sensitivity, reported by :meth:`Strategy.sensitivity` (``k``
participations at least ``b`` apart) and :meth:`Strategy.epoch_sensitivity` (one per epoch,
balls-in-bins) and charged by :func:`opake_compile.accounting.mf_gaussian`,
:func:`~opake_compile.accounting.b_min_sep` and :func:`~opake_compile.accounting.balls_in_bins`.

The factories:

* :func:`identity_strategy`: ``M = I``, i.e. DP-SGD's independent noise.
* :func:`band_mf_strategy`: BandMF (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta
  & Xu 2023, "(Amplified) Banded Matrix Factorization: A unified approach to private
  training"): ``M`` banded with ``bands`` nonzero diagonals, Toeplitz coefficients optimised
  for the prefix-sum error (McKenna 2024, "Scaling up the banded matrix factorization
  mechanism", shows banded Toeplitz is near-optimal). Compatible with amplification by cyclic
  Poisson sampling when ``bands`` groups are used.
* :func:`blt_strategy`: BLT, buffered linear Toeplitz (Dvijotham, McMahan, Pillutla, Steinke &
  Thakurta 2024, "Efficient and near-optimal noise generation for streaming differential
  privacy"; McMahan, Xu & Zhang 2024 for multiple participations):
  ``m_0 = 1, m_t = sum_i omega_i theta_i^(t-1)``; noise state ``buffers`` vectors.
* :func:`bisr_strategy`: BISR, banded inverse square root (Kalinin, McKenna, Upadhyay &
  Lampert 2025, "Back to square roots: an optimal bound on the matrix factorization error for
  multi-epoch differentially private SGD"): ``M^-1`` is the ``bands``-term truncation of the
  series of ``(1 - x)^(1/2)``, the inverse square root of the prefix-sum matrix.
* :func:`lambda_cgd_strategy`: DP-lambda-CGD (Kalinin, McKenna, Pagh & Lampert 2026,
  "DP-lambda-CGD: Efficient noise correlation for differentially private model training",
  arXiv:2601.22334): the noise of step ``t`` is ``Z_t - lambda Z_(t-1)`` (up to scale), so
  ``M^-1`` is bidiagonal; ``Z_(t-1)`` is regenerated from its random key, nothing is stored.

Errors are exact expectations for Gaussian noise of unit multiplier: the per-step squared
error of the prefix sums is ``sens^2 * ||row_t(A M^-1)||^2`` (``sens`` the sensitivity under
the participation pattern asked for). For Toeplitz ``M`` the largest is the last row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "Strategy",
    "identity_strategy",
    "band_mf_strategy",
    "blt_strategy",
    "bisr_strategy",
    "lambda_cgd_strategy",
]


def _series(num: np.ndarray, den: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of the power series ``num(x) / den(x)`` (float64)."""
    from scipy.signal import lfilter

    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter(num, den, impulse)


@dataclasses.dataclass(frozen=True, eq=False)
class Strategy:
    """An immutable lower-triangular Toeplitz strategy ``M`` of size ``n x n`` (``m(x) = P/Q``).

    Build one with a factory (:func:`band_mf_strategy`, ...), not directly.

    Attributes:
        name: ``"identity"``, ``"bandmf"``, ``"blt"``, ``"bisr"`` or ``"lambda-cgd"``.
        n: the number of steps the strategy is defined (and its errors computed) for. The noise
            mechanism refuses to go past step ``n - 1``.
        numerator, denominator: coefficients of ``P`` and ``Q`` (floats, lowest power first),
            ``Q[0] = 1``; scaled so that the largest column norm of ``M`` is 1.
        replay: the noise is a finite filter of ``Z`` (``P`` constant) regenerated from the
            random keys of past steps instead of buffered (DP-lambda-CGD).
        params: the parameters the factory chose (for reports and checkpoints).
    """

    name: str
    n: int
    numerator: tuple[float, ...]
    denominator: tuple[float, ...]
    replay: bool = False
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # The accounting charges sensitivity 1 per participation for a normalised M. A strategy
        # built or edited by hand (dataclasses.replace(s, n=...)) need not be: refuse it rather
        # than report too small an epsilon.
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ConfigurationError(f"Strategy.n must be a positive int, got {self.n!r}.")
        norm = float(np.linalg.norm(self.strategy_coefs()))  # column 0 is M's longest column
        if not norm <= 1.0 + 1e-9:
            raise ConfigurationError(
                f"Strategy {self.name!r}: the largest column norm of M over n={self.n} steps is {norm:.6g}, "
                "not 1: the privacy accounting assumes a normalised M. Build strategies with the factories "
                "(band_mf_strategy, blt_strategy, ...) for the number of steps you will take."
            )

    # ------------------------------------------------------------------ coefficients
    @property
    def num_buffers(self) -> int:
        """Vectors of the model's size the streaming noise keeps (0 for identity and lambda-CGD,
        whose past noise is regenerated)."""
        if self.replay:
            return 0
        return max(len(self.numerator), len(self.denominator)) - 1

    @property
    def bands(self) -> int | None:
        """Nonzero diagonals of ``M`` when ``M`` is banded (``Q = 1``), else ``None``."""
        return len(self.numerator) if len(self.denominator) == 1 else None

    def strategy_coefs(self, n: int | None = None) -> np.ndarray:
        """``m``: the first column of ``M`` (length ``n``, default :attr:`n`), float64."""
        return _series(np.asarray(self.numerator), np.asarray(self.denominator), n or self.n)

    def noising_coefs(self, n: int | None = None) -> np.ndarray:
        """The first column of ``M^-1`` (the weights of ``Z_t, Z_(t-1), ...`` in the noise)."""
        return _series(np.asarray(self.denominator), np.asarray(self.numerator), n or self.n)

    def matrix(self, n: int | None = None) -> np.ndarray:
        """``M`` as a dense float64 ``(n, n)`` array (for tests and small ``n``)."""
        return _toeplitz(self.strategy_coefs(n))

    def inverse_matrix(self, n: int | None = None) -> np.ndarray:
        """``M^-1`` as a dense float64 ``(n, n)`` array."""
        return _toeplitz(self.noising_coefs(n))

    # ------------------------------------------------------------------ privacy
    def sensitivity(self, participations: int = 1, min_separation: int | None = None) -> float:
        """The L2 sensitivity of ``M x`` (gradients of norm <= 1) over :attr:`n` steps.

        Participation pattern: one example takes part in at most ``participations`` steps, any
        two of them at least ``min_separation`` steps apart (``(k, b)``-min-separation of
        Choquette-Choo et al. 2023; ``participations=1``: single epoch, always 1 here).
        A fixed epoch order of ``s`` steps per epoch is ``min_separation=s``.

        How it is computed: when ``m`` is nonnegative and nonincreasing, the worst case is
        ``k`` participations exactly ``b`` apart starting at step 0 (McKenna 2024, Thm. 2), and
        the value is exact; when ``M`` is banded with at most ``b`` bands the columns touched
        have disjoint rows, so it is ``sqrt(k)``; otherwise the triangle inequality bounds it
        by ``k`` (an upper bound, never an underestimate).

        Raises:
            ConfigurationError: ``participations > 1`` without ``min_separation``, or a bad value.
        """
        k = check_positive_int(participations, name="participations")
        if k == 1:
            return 1.0
        if min_separation is None:
            raise ConfigurationError("Pass min_separation (steps between two participations) with participations > 1.")
        b = check_positive_int(min_separation, name="min_separation")
        k = min(k, -(-self.n // b))
        m = self.strategy_coefs()
        if np.all(m >= 0) and np.all(np.diff(m) <= 0):
            return math.sqrt(_minsep_sq(m, b, k))
        if self.bands is not None and self.bands <= b:
            return math.sqrt(k)
        return float(k)

    def epoch_sensitivity(self, epoch_steps: int, steps: int | None = None) -> float:
        """The L2 sensitivity of the first ``steps`` rows of ``M x`` when an example takes part
        at most once in each epoch of ``epoch_steps`` consecutive steps, anywhere in it.

        This is the participation pattern of balls-in-bins sampling that draws new bins every
        epoch (:class:`~opake_compile.sampling.BallsInBinsSampler`): epoch ``e`` covers steps
        ``[e s, (e + 1) s)``, so two participations in consecutive epochs can be 1 step apart
        (the last step of one epoch, the first of the next), with no minimum separation. The
        first ``T = steps`` rows of ``M x`` depend only on the leading ``T x T`` block of ``M``
        (lower triangular), so the value is that block's and is nondecreasing in ``T``.

        How it is computed, with ``G = M_T^T M_T`` (Toeplitz ``M``: ``G[i, j] = sum_(u <= T - 1
        - max(i, j)) m_u m_(u + |i - j|)``): an example at positions ``p_0 < p_1 < ...`` (one
        per epoch) with gradients ``g_e`` of norm <= 1 changes the release by
        ``||sum_e M[:, p_e] g_e^T||_F^2 = sum_(e, f) G[p_e, p_f] <g_e, g_f>
        <= sum_(e, f) |G[p_e, p_f]|``. The diagonal and consecutive-epoch terms are maximised
        exactly by dynamic programming over the position in each epoch (a chain: each term
        couples two neighbouring epochs); every term of epochs ``d >= 2`` apart, whose lags
        lie in ``[(d - 1) s + 1, (d + 1) s - 1]``, is bounded by the largest
        ``sum_u |m_u| |m_(u + l)|`` over those lags. The result is an upper bound, never an
        underestimate; it is exact when ``G >= 0`` entrywise and ``M`` has at most ``s + 1``
        bands (identity: ``sqrt(epochs)``; BandMF with nonnegative coefficients), since then
        the terms of non-neighbouring epochs vanish. Cost ``O(T s)`` time plus ``O(T^2)`` for
        the far terms (an autocorrelation), memory ``O(T)`` plus blocks of about 32 MiB.

        Args:
            epoch_steps: ``s``, steps per epoch, >= 1.
            steps: ``T``, rows released, ``1 <= T <= n`` (default :attr:`n`).

        Raises:
            ConfigurationError: a bad value, or ``steps > n``.
        """
        s = check_positive_int(epoch_steps, name="epoch_steps")
        t = self.n if steps is None else check_positive_int(steps, name="steps")
        if t > self.n:
            raise ConfigurationError(f"steps={t} exceeds the {self.n} steps of {self!r}.")
        return math.sqrt(_epoch_sens_sq(self.strategy_coefs(t), s))

    # ------------------------------------------------------------------ utility
    def per_step_squared_error(self, participations: int = 1, min_separation: int | None = None) -> np.ndarray:
        """Expected squared error of each prefix sum, shape ``(n,)``, for noise multiplier 1
        and clipping norm 1, scaled by the squared sensitivity of the pattern (units:
        squared gradient-sum units)."""
        w = self.noising_coefs()
        return np.cumsum(np.cumsum(w) ** 2) * self.sensitivity(participations, min_separation) ** 2

    def mean_squared_error(self, participations: int = 1, min_separation: int | None = None) -> float:
        """Mean over the ``n`` prefix sums of :meth:`per_step_squared_error`."""
        return float(self.per_step_squared_error(participations, min_separation).mean())

    def max_squared_error(self, participations: int = 1, min_separation: int | None = None) -> float:
        """Largest per-step squared error (the last prefix sum, ``M`` being Toeplitz)."""
        return float(self.per_step_squared_error(participations, min_separation)[-1])

    def rmse(self, participations: int = 1, min_separation: int | None = None) -> float:
        """``sqrt(mean_squared_error)``."""
        return math.sqrt(self.mean_squared_error(participations, min_separation))

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}_strategy(n={self.n}{', ' + extra if extra else ''})"


def _toeplitz(col: np.ndarray) -> np.ndarray:
    n = len(col)
    i, j = np.indices((n, n))
    return np.where(i >= j, col[np.clip(i - j, 0, n - 1)], 0.0)


def _minsep_sq(m: np.ndarray, b: int, k: int) -> float:
    """||sum of columns 0, b, ..., (k-1)b of M||^2 for Toeplitz ``M`` with first column ``m``."""
    n = len(m)
    v = np.zeros(n)
    for i in range(k):
        v[i * b :] += m[: n - i * b]
    return float(v @ v)


def _abs_autocorr(a: np.ndarray) -> np.ndarray:
    """``A[l] = sum_u a[u] a[u + l]`` for ``l < len(a)`` (``a >= 0``), never rounded down."""
    n = len(a)
    if n <= 20000:
        return np.correlate(a, a, mode="full")[n - 1 :]
    from scipy.signal import fftconvolve

    out = fftconvolve(a, a[::-1])[n - 1 :]
    return np.maximum(out, 0.0) + 1e-9 * float(a @ a)  # FFT rounding, bounded above


def _epoch_sens_sq(m: np.ndarray, s: int) -> float:
    """Upper bound on ``max sum_(e, f) |G[p_e, p_f]|`` over one position ``p_e`` per epoch of
    ``s`` steps, ``G = M^T M`` for the Toeplitz ``M`` with first column ``m`` (see
    :meth:`Strategy.epoch_sensitivity`): exact chain DP for the diagonal and neighbouring
    epochs, a bound for epochs two or more apart."""
    t = len(m)
    epochs = -(-t // s)
    far = 0.0
    if epochs >= 3:
        acorr = _abs_autocorr(np.abs(m))
        for d in range(2, epochs):
            lo, hi = (d - 1) * s + 1, min((d + 1) * s - 1, t - 1)
            far += 2.0 * (epochs - d) * float(acorr[lo : hi + 1].max())
    lags = np.arange(2 * s)
    padded = np.concatenate([m, np.zeros(2 * s)])
    carry = np.zeros(2 * s)  # D_l(r) = sum_(u <= r) m_u m_(u + l), carried as r grows
    chunk = max(1, (1 << 22) // (3 * s))  # rows of D per block: bounded memory for long epochs
    best = np.zeros(min(s, t - (epochs - 1) * s))  # max over the next epoch, per position
    for e in range(epochs - 1, -1, -1):  # r = t - 1 - p grows as e falls
        start, end = e * s, min(e * s + s, t)
        value = np.empty(end - start)  # V_e(p): best sum over epochs >= e with p_e = p
        best_prev = np.full(s, -np.inf) if e > 0 else None  # for epoch e - 1 (full length s)
        for r0 in range(t - end, t - start, chunk):
            u = np.arange(r0, min(r0 + chunk, t - start))
            d = carry + np.cumsum(m[u][:, None] * padded[u[:, None] + lags[None, :]], axis=0)
            carry = d[-1]
            b = (t - 1 - u) - start  # positions of these rows in epoch e
            value[b] = np.abs(d[:, 0]) + best[b]
            if best_prev is not None:
                # G[p_a, p_b] for p_a = start - s + a in epoch e - 1: lag s + b - a, row r = t - 1 - p_b
                lag = s + b[:, None] - np.arange(s)[None, :]
                cand = 2.0 * np.abs(np.take_along_axis(d, lag, axis=1)) + value[b][:, None]
                best_prev = np.maximum(best_prev, cand.max(axis=0))
        best = best_prev
    return float(value.max()) + far


def _make(name: str, n: int, num: np.ndarray, den: np.ndarray, *, replay: bool = False, **params: Any) -> Strategy:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    num, den = num / den[0], den / den[0]
    if not (np.all(np.isfinite(num)) and np.all(np.isfinite(den))) or num[0] <= 0:
        raise ConfigurationError(f"{name}: the strategy coefficients are not finite with m_0 > 0 ({num}, {den}).")
    m = _series(num, den, n)
    norm = float(np.linalg.norm(m))  # column 0 is the longest column of a Toeplitz M
    num = num / norm
    w = _series(den, num, n)
    if not np.all(np.isfinite(w)) or np.max(np.abs(w)) > 1e12:
        raise ConfigurationError(f"{name}: M^-1 is numerically unstable for n={n} (noise weights up to {np.max(np.abs(w)):.3g}).")
    return Strategy(name, n, tuple(float(x) for x in num), tuple(float(x) for x in den), replay, tuple(params.items()))


def _check_n(n: Any) -> int:
    return check_positive_int(n, name="n")


def identity_strategy(n: int) -> Strategy:
    """``M = I``: independent noise, DP-SGD through the matrix-mechanism API.

    ``mf_gaussian_noise(identity_strategy(n), sigma, key)`` adds bit for bit the noise of
    ``gaussian_noise(sigma, key)``.

    Args:
        n: the number of steps.
    """
    return _make("identity", _check_n(n), np.ones(1), np.ones(1))


# ---------------------------------------------------------------------- objectives
def _check_objective(objective: str) -> str:
    if objective not in ("mean", "max"):
        raise ConfigurationError(f"Expected objective 'mean' or 'max' (squared error of the prefix sums), got {objective!r}.")
    return objective


def _error_and_grad_w(w: np.ndarray, objective: str) -> tuple[float, np.ndarray]:
    """Prefix-sum error E of noise weights ``w`` and dE/dw."""
    n = len(w)
    s = np.cumsum(w)
    if objective == "mean":
        weights = (n - np.arange(n)) / n
    else:
        weights = np.ones(n)
    err = float(np.sum(weights * s * s))
    ds = 2.0 * weights * s
    dw = np.cumsum(ds[::-1])[::-1]
    return err, dw


def _bandmf_loss(tail: np.ndarray, n: int, objective: str) -> tuple[float, np.ndarray]:
    """sens^2 * E for banded Toeplitz m = (1, *tail) and its gradient in ``tail``."""
    m = np.concatenate([[1.0], tail])
    w = _series(np.ones(1), m, n)
    err, dw = _error_and_grad_w(w, objective)
    v = np.convolve(w, w)[:n]  # d w_i / d m_j = -(w * w)_(i - j)
    de_dm = np.array([-np.dot(dw[j:], v[: n - j]) for j in range(len(m))])
    norm_sq = float(m @ m)
    grad = 2.0 * m * err + norm_sq * de_dm
    return norm_sq * err, grad[1:]


def band_mf_strategy(n: int, bands: int, *, objective: str = "mean", max_iterations: int = 500) -> Strategy:
    """BandMF: the banded Toeplitz strategy with ``bands`` diagonals minimising prefix-sum error.

    Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization"; banded Toeplitz
    parameterisation as in McKenna 2024. The coefficients ``m_1 .. m_(bands-1)`` (with
    ``m_0 = 1``) minimise ``||m||^2 * error(M^-1)`` by L-BFGS (scipy) with the exact gradient,
    started from the truncated series of ``(1 - x)^(-1/2)`` (Fichtenberger et al. 2023); the
    result is then normalised to column norm 1. Banded with ``bands <= b``, its sensitivity
    under ``k`` participations ``b`` apart is ``sqrt(k)``, so the optimum does not depend on
    ``k``. The noise keeps ``bands - 1`` vectors.

    Args:
        n: the number of steps.
        bands: nonzero diagonals, ``1 <= bands <= n`` (1 is DP-SGD).
        objective: ``"mean"`` (mean squared error of the prefix sums) or ``"max"``.
        max_iterations: L-BFGS iterations.

    Raises:
        ConfigurationError: bad ``n``, ``bands`` or ``objective``.
    """
    from scipy.optimize import minimize

    n = _check_n(n)
    bands = check_positive_int(bands, name="bands")
    if bands > n:
        raise ConfigurationError(f"Expected bands={bands} <= n={n}.")
    objective = _check_objective(objective)
    init = _inv_sqrt_coefs(bands)
    if bands > 1:
        res = minimize(_bandmf_loss, init[1:], args=(n, objective), jac=True, method="L-BFGS-B",
                       options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10})
        tail = res.x if res.fun <= _bandmf_loss(init[1:], n, objective)[0] else init[1:]
        init = np.concatenate([[1.0], tail])
    return _make("bandmf", n, init, np.ones(1), bands=bands, objective=objective)


def _inv_sqrt_coefs(k: int) -> np.ndarray:
    """First ``k`` coefficients of ``(1 - x)^(-1/2)``."""
    c = np.ones(k)
    for i in range(1, k):
        c[i] = c[i - 1] * (2 * i - 1) / (2 * i)
    return c


def _sqrt_coefs(k: int) -> np.ndarray:
    """First ``k`` coefficients of ``(1 - x)^(1/2)``."""
    c = np.ones(k)
    for i in range(1, k):
        c[i] = c[i - 1] * (i - 1.5) / i
    return c


def bisr_strategy(n: int, bands: int) -> Strategy:
    """BISR: banded inverse square root (Kalinin, McKenna, Upadhyay & Lampert 2025).

    ``M^-1`` is the lower-triangular Toeplitz matrix of the first ``bands`` coefficients of
    ``(1 - x)^(1/2)`` (the square root of the prefix-sum matrix's inverse, truncated), ``M``
    its inverse, normalised. The noise ``M^-1 Z`` is a finite filter of the last ``bands``
    Gaussian draws; the state keeps ``bands - 1`` vectors.

    Args:
        n: the number of steps.
        bands: nonzero diagonals of ``M^-1``, ``1 <= bands <= n``.
    """
    n = _check_n(n)
    bands = check_positive_int(bands, name="bands")
    if bands > n:
        raise ConfigurationError(f"Expected bands={bands} <= n={n}.")
    return _make("bisr", n, np.ones(1), _sqrt_coefs(bands), bands=bands)


def lambda_cgd_strategy(
    n: int,
    lam: float | None = None,
    *,
    objective: str = "mean",
    participations: int = 1,
    min_separation: int | None = None,
) -> Strategy:
    """DP-lambda-CGD (Kalinin, McKenna, Pagh & Lampert 2026, arXiv:2601.22334).

    The noise of step ``t`` is proportional to ``Z_t - lam * Z_(t-1)``: ``M^-1`` is bidiagonal
    and ``M`` has the coefficients ``lam^t``. ``Z_(t-1)`` is regenerated from its random key
    (PRNG replay), so the state holds no vector.

    Args:
        n: the number of steps.
        lam: the correlation in ``[0, 1)``; ``None`` chooses the one minimising ``objective``.
        objective: ``"mean"`` or ``"max"`` squared prefix-sum error.
        participations, min_separation: the pattern whose sensitivity scales the error that
            ``lam=None`` minimises.

    Raises:
        ConfigurationError: ``lam`` outside ``[0, 1)``.
    """
    n = _check_n(n)
    objective = _check_objective(objective)
    k = check_positive_int(participations, name="participations")
    if k > 1 and min_separation is None:
        raise ConfigurationError("Pass min_separation with participations > 1.")
    sep = n if min_separation is None else check_positive_int(min_separation, name="min_separation")
    if lam is None:
        from scipy.optimize import minimize_scalar

        def loss(x: float) -> float:
            m = x ** np.arange(n)
            sens_sq = _minsep_sq(m, sep, min(k, -(-n // sep)))
            return sens_sq * _error_and_grad_w(_series(np.array([1.0, -x]), np.ones(1), n), objective)[0]

        lam = float(minimize_scalar(loss, bounds=(0.0, 0.999), method="bounded", options={"xatol": 1e-6}).x)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam < 1.0:
        raise ConfigurationError(f"Expected lam in [0, 1), got {lam!r}.")
    return _make("lambda-cgd", n, np.ones(1), np.array([1.0, -float(lam)]), replay=True, lam=float(lam))


def _blt_polys(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P, Q with P/Q = 1 + sum_i omega_i x / (1 - theta_i x)."""
    q = np.ones(1)
    for t in theta:
        q = np.convolve(q, [1.0, -t])
    p = q.copy()
    for i, w in enumerate(omega):
        rest = np.ones(1)
        for j, t in enumerate(theta):
            if j != i:
                rest = np.convolve(rest, [1.0, -t])
        p = p + w * np.concatenate([[0.0], rest, np.zeros(len(q) - 1 - len(rest))])
    return p, q


def blt_strategy(
    n: int,
    buffers: int = 3,
    *,
    participations: int = 1,
    min_separation: int | None = None,
    objective: str = "mean",
    restarts: int = 4,
) -> Strategy:
    """BLT: buffered linear Toeplitz (Dvijotham et al. 2024; McMahan, Xu & Zhang 2024).

    ``m_0 = 1`` and ``m_t = sum_i omega_i theta_i^(t-1)`` for ``t >= 1``, with decays
    ``theta_i`` in (0, 1) and weights ``omega_i > 0`` (so ``m`` is positive and nonincreasing
    when ``sum omega <= 1``, and the min-separation sensitivity is exact). The parameters
    minimise ``sens^2 * error`` for the given participation pattern by L-BFGS (scipy, finite
    differences) from ``restarts`` starting points. The noise keeps ``buffers`` vectors.

    Args:
        n: the number of steps.
        buffers: number of (theta, omega) pairs, >= 1.
        participations, min_separation: the pattern the sensitivity is optimised for.
        objective: ``"mean"`` or ``"max"`` squared prefix-sum error.
        restarts: starting points of the optimisation.

    Raises:
        ConfigurationError: bad arguments, or no starting point gave a stable strategy.
    """
    from scipy.optimize import minimize

    n = _check_n(n)
    nb = check_positive_int(buffers, name="buffers")
    objective = _check_objective(objective)
    k = check_positive_int(participations, name="participations")
    if k > 1 and min_separation is None:
        raise ConfigurationError("Pass min_separation with participations > 1.")
    sep = n if min_separation is None else check_positive_int(min_separation, name="min_separation")

    def unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        theta = 1.0 / (1.0 + np.exp(-x[:nb]))
        omega = np.exp(x[nb:])
        return theta, omega

    def loss(x: np.ndarray) -> float:
        theta, omega = unpack(x)
        p, q = _blt_polys(theta, omega)
        m = _series(p, q, n)
        w = _series(q, p, n)
        if not np.all(np.isfinite(w)) or np.max(np.abs(w)) > 1e8 or np.any(np.diff(m) > 0):
            return 1e30
        sens_sq = _minsep_sq(m, sep, min(k, -(-n // sep)))
        return sens_sq * _error_and_grad_w(w, objective)[0]

    best = None
    rng = np.random.default_rng(0)
    for r in range(max(1, restarts)):
        # decays spread over time scales up to n, small weights (a near-sqrt shape)
        scales = np.geomspace(2.0, max(4.0, float(n)), nb) * (1.0 if r == 0 else rng.uniform(0.5, 2.0, nb))
        theta0 = np.clip(1.0 - 1.0 / scales, 1e-3, 1 - 1e-6)
        omega0 = np.full(nb, 0.5 / nb)
        x0 = np.concatenate([np.log(theta0 / (1 - theta0)), np.log(omega0)])
        if loss(x0) >= 1e30:
            continue
        res = minimize(loss, x0, method="L-BFGS-B", options={"maxiter": 300})
        if res.fun < 1e30 and (best is None or res.fun < best.fun):
            best = res
    if best is None:
        raise ConfigurationError(f"blt_strategy found no stable BLT for n={n}, buffers={nb}.")
    theta, omega = unpack(best.x)
    order = np.argsort(theta)[::-1]
    theta, omega = theta[order], omega[order]
    p, q = _blt_polys(theta, omega)
    return _make("blt", n, p, q, buffers=nb, theta=tuple(float(t) for t in theta), omega=tuple(float(w) for w in omega))
