"""Layer 0: the bridge from opake_compile's privacy processes to Google's ``dp-accounting``.

Everything numerical happens inside dp-accounting (PLD: Koskela et al. 2020, Doroshenko et al.
2022; RDP: Mironov 2017). This module only

* defines :class:`EpsilonDeltaDpEvent`, a ``DpEvent`` for a mechanism known only by its
  (epsilon, delta) guarantee, which dp-accounting 0.6 has no event for;
* teaches the PLD accountant that event through a thin subclass (the PLD is dp-accounting's own
  pessimistic ``from_privacy_parameters``; the RDP accountant cannot represent it), which also
  memoises single-step PLDs so that queries differing only in the step count are cheap;
* builds a fresh dp-accounting accountant per query and turns its ``UnsupportedEventError`` into
  a :class:`~opake_compile.exceptions.ConfigurationError` that names the accountant and the part
  of the process it cannot account for.
"""

from __future__ import annotations

import collections
import importlib.metadata
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attr
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.privacy_accountant import PrivacyAccountant, UnsupportedEventError
from dp_accounting.rdp import rdp_privacy_accountant

from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "METHODS",
    "EpsilonDeltaDpEvent",
    "PLDCache",
    "TRUNCATED_EVENT",
    "dp_accounting_version",
    "validate_options",
    "make_dp_accountant",
    "compose",
    "privacy_profile",
]

#: Accounting methods understood by :func:`make_dp_accountant`, with their options and defaults.
METHODS: Mapping[str, Mapping[str, Any]] = {
    "pld": {"value_discretization_interval": 1e-4},
    "rdp": {"orders": None},
}

#: dp-accounting's truncated-Poisson Gaussian event (added in 0.6), or None in older versions.
TRUNCATED_EVENT: type | None = getattr(dp_event, "TruncatedSubsampledGaussianDpEvent", None)


class _DropExcludedOrders(logging.Filter):
    """dp-accounting's RDP accountant logs a warning for every Renyi order whose series does not
    converge ("... Excluding this order from the epsilon computation"), dozens per call on small
    noise multipliers (26 lines in a two-epoch run of the Opacus layer: a newcomer's review).
    Leaving an order out can only raise the epsilon reported (it is a minimum over orders), so
    these lines are dropped; every other dp-accounting message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Excluding this order" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropExcludedOrders())


def dp_accounting_version() -> str:
    """The installed dp-accounting version, for error messages."""
    try:
        return importlib.metadata.version("dp-accounting")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored copies
        return "unknown"


@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaDpEvent(dp_event.DpEvent):
    """A mechanism known only to satisfy (epsilon, delta)-DP.

    dp-accounting 0.6 has no such event. opake_compile's PLD accountant composes it through the
    pessimistic PLD of :func:`dp_accounting.pld.privacy_loss_distribution.from_privacy_parameters`
    (the dominating pair of every (epsilon, delta)-DP mechanism: loss +inf with probability
    delta, +-epsilon otherwise). dp-accounting's own accountants, and the RDP accountant, reject
    it as unsupported, which is the correct fail-closed behaviour.

    Attributes:
        epsilon: the epsilon of the guarantee (nats), finite and >= 0.
        delta: the delta of the guarantee, in [0, 1).
    """

    epsilon: float
    delta: float


class PLDCache:
    """A small LRU memo of single-event PLDs, owned by one :class:`Accountant`.

    Building the PLD of one subsampled-Gaussian step is the expensive part of a PLD query
    (discretising the privacy loss); composing it k times is cheap. Queries that differ only in
    k (``max_steps``, an optimizer reporting epsilon after every step) reuse the built PLD.
    PLD objects are immutable (``compose``/``self_compose`` return new ones), so sharing is safe.
    """

    def __init__(self, maxsize: int = 16) -> None:
        self._maxsize = maxsize
        self._items: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._items[key] = build()
        if len(self._items) > self._maxsize:
            self._items.popitem(last=False)
        return value


class _PLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's ``PLDAccountant`` plus :class:`EpsilonDeltaDpEvent` and a PLD memo.

    Every event not listed in :meth:`_build_leaf` goes to the parent unchanged; the listed ones
    are built with exactly the dp-accounting constructor and arguments the parent uses, then
    memoised in a :class:`PLDCache`. The parent keeps its composed PLD in the private attribute
    ``_pld``; dp-accounting offers no public hook to compose an extra PLD, so this subclass
    relies on it and checks at construction that it is still there.
    """

    def __init__(self, value_discretization_interval: float, cache: PLDCache | None) -> None:
        super().__init__(value_discretization_interval=value_discretization_interval)
        if not isinstance(getattr(self, "_pld", None), privacy_loss_distribution.PrivacyLossDistribution):
            raise ConfigurationError(  # pragma: no cover - depends on the dp-accounting version
                "opake_compile's PLD accountant needs dp-accounting's PLDAccountant to keep its "
                f"PLD in `_pld`; dp-accounting {dp_accounting_version()} does not. Pin "
                "dp-accounting 0.6."
            )
        self._interval = value_discretization_interval
        self._cache = cache

    def _build_leaf(self, event: dp_event.DpEvent) -> Callable[[], Any] | None:
        """A builder for the PLD of one application of ``event``, or None to defer to the parent."""
        interval, relation = self._interval, self.neighboring_relation
        if isinstance(event, EpsilonDeltaDpEvent):
            params = pld_common.DifferentialPrivacyParameters(event.epsilon, event.delta)
            return lambda: privacy_loss_distribution.from_privacy_parameters(
                params, value_discretization_interval=interval
            )
        if (
            isinstance(event, dp_event.PoissonSampledDpEvent)
            and isinstance(event.event, dp_event.GaussianDpEvent)
            and event.sampling_probability > 0
            and event.event.noise_multiplier > 0
        ):
            return lambda: privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=event.event.noise_multiplier,
                value_discretization_interval=interval,
                sampling_prob=event.sampling_probability,
                neighboring_relation=relation,
            )
        if (
            TRUNCATED_EVENT is not None
            and isinstance(event, TRUNCATED_EVENT)
            and event.sampling_probability > 0
            and event.truncated_batch_size > 0
            and event.dataset_size > 0
            and event.noise_multiplier > 0
        ):
            return lambda: privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
                dataset_size=event.dataset_size,
                sampling_probability=event.sampling_probability,
                truncated_batch_size=event.truncated_batch_size,
                noise_multiplier=event.noise_multiplier,
                value_discretization_interval=interval,
                neighboring_relation=relation,
            )
        return None

    def _maybe_compose(self, event: dp_event.DpEvent, count: int, do_compose: bool):
        build = self._build_leaf(event)
        if build is None:
            return super()._maybe_compose(event, count, do_compose)
        if do_compose and count > 0:
            if self._cache is None:
                pld = build()
            else:
                pld = self._cache.get_or_build((event, self._interval, self.neighboring_relation), build)
            self._pld = self._pld.compose(pld.self_compose(count) if count > 1 else pld)
        return None


def validate_options(method: Any, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Check an accounting method name and its options; return them normalised.

    Raises:
        InputTypeError: ``method`` is not a string, or ``orders`` is not a sequence of numbers.
        ConfigurationError: unknown method or option, or an option outside its range.
    """
    if not isinstance(method, str):
        raise InputTypeError(f"Expected method to be 'pld' or 'rdp', got {type(method).__name__}.")
    key = method.lower()
    if key not in METHODS:
        raise ConfigurationError(f"Expected method={method!r} to be one of {sorted(METHODS)}.")
    unknown = sorted(set(options) - set(METHODS[key]))
    if unknown:
        raise ConfigurationError(
            f"Unknown option(s) {unknown} for the {key} accountant; it accepts "
            f"{sorted(METHODS[key])}."
        )
    merged = {**METHODS[key], **options}
    if key == "pld":
        interval = merged["value_discretization_interval"]
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise InputTypeError(
                f"Expected value_discretization_interval to be a float, got {type(interval).__name__}."
            )
        if not (math.isfinite(interval) and interval > 0):
            raise ConfigurationError(
                f"Expected value_discretization_interval={interval!r} to be finite and > 0."
            )
        merged["value_discretization_interval"] = float(interval)
    else:
        orders = merged["orders"]
        if orders is not None:
            if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence):
                raise InputTypeError(
                    f"Expected orders to be a sequence of numbers > 1, got {type(orders).__name__}."
                )
            values = []
            for order in orders:
                if isinstance(order, bool) or not isinstance(order, (int, float)):
                    raise InputTypeError(f"Expected every RDP order to be a number, got {order!r}.")
                if not order > 1:
                    raise ConfigurationError(f"Expected every RDP order > 1, got {order!r}.")
                values.append(float(order))
            if not values:
                raise ConfigurationError("Expected at least one RDP order, got an empty sequence.")
            merged["orders"] = tuple(values)
    return key, merged


def make_dp_accountant(
    method: str, options: Mapping[str, Any], cache: PLDCache | None = None
) -> PrivacyAccountant:
    """A fresh, empty dp-accounting accountant for validated ``method`` and ``options``."""
    if method == "pld":
        return _PLDAccountant(options["value_discretization_interval"], cache)
    return rdp_privacy_accountant.RdpAccountant(orders=options["orders"])


def _find(event: dp_event.DpEvent, kind: type) -> dp_event.DpEvent | None:
    """The first sub-event of type ``kind`` in ``event`` (depth first), or None."""
    if isinstance(event, kind):
        return event
    children: Sequence[dp_event.DpEvent] = ()
    if isinstance(event, dp_event.ComposedDpEvent):
        children = event.events
    elif isinstance(event, (dp_event.SelfComposedDpEvent, dp_event.PoissonSampledDpEvent)):
        children = (event.event,)
    for child in children:
        found = _find(child, kind)
        if found is not None:
            return found
    return None


def compose(
    method: str, options: Mapping[str, Any], event: dp_event.DpEvent, cache: PLDCache | None = None
) -> PrivacyAccountant:
    """A fresh accountant for ``method`` with ``event`` composed once.

    Raises:
        ConfigurationError: the accountant cannot account for some part of ``event``. The message
            names the accountant, the dp-accounting version and the offending part.
    """
    accountant = make_dp_accountant(method, options, cache)
    if accountant.supports(event):
        accountant.compose(event)
        return accountant
    version = dp_accounting_version()
    if TRUNCATED_EVENT is not None and _find(event, TRUNCATED_EVENT) is not None:
        raise ConfigurationError(
            f"truncated Poisson sampling is not supported by the {method} accountant of "
            f"dp-accounting {version} yet; account for it with accountant='pld', or drop "
            "truncated_batch_size (never account a truncated sampler as untruncated)."
        )
    bad = _find(event, EpsilonDeltaDpEvent)
    if bad is not None:
        raise ConfigurationError(
            f"The {method} accountant cannot compose eps_delta({bad.epsilon}, {bad.delta}): an "
            "(epsilon, delta) guarantee has no Renyi-DP curve. Use accountant='pld'."
        )
    try:  # Let dp-accounting say what is wrong.
        accountant.compose(event)
    except UnsupportedEventError as err:
        raise ConfigurationError(
            f"The {method} accountant of dp-accounting {version} cannot account for this "
            f"process: {err}"
        ) from err
    return accountant  # pragma: no cover - supports() and compose() disagree


def privacy_profile(accountant: PrivacyAccountant) -> Callable[[np.ndarray], np.ndarray]:
    """The privacy profile eps -> delta(eps) of a composed accountant, vectorised over eps >= 0.

    PLD: dp-accounting's own ``get_delta_for_epsilon`` on the composed (pessimistic) PLD, called
    per eps (its scalar form is one numpy pass over the PMF; its array form loops over the PMF
    in Python and is ~1000x slower). RDP: its ``get_delta`` per eps (an upper bound). A
    non-private part gives delta = 1 everywhere.
    """
    if getattr(accountant, "_contains_non_dp_event", False):
        return lambda eps: np.ones(np.shape(eps))
    if isinstance(accountant, _PLDAccountant):
        pld = accountant._pld
        return lambda eps: np.array([pld.get_delta_for_epsilon(float(e)) for e in np.atleast_1d(eps)], dtype=np.float64)
    return lambda eps: np.array([accountant.get_delta(float(e)) for e in np.atleast_1d(eps)], dtype=np.float64)
