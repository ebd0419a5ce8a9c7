"""The ghost-norm / book-keeping rewrite pass.

For each trainable parameter, the clip pass left two tagged consumers of the materialised
per-example gradient ``G`` (shape ``(P, *param.shape)``): its squared norm (``sq_norm``) and its
share of the clipped sum (``clipped_sum``). This pass

1. decomposes ``G`` into terms: it looks through shape-preserving views, ``add`` (a weight
   used twice, tied embeddings) and transposes of the last two dims, down to a 3-D
   ``(P, R, C)`` form;
2. asks the rules (:data:`RULES`, a table: one matcher per family, each in its own module) to
   express every term as a product of two per-example factors
   (:class:`~opake_compile.compiler.passes._factors.Factor`);
3. when every term matched and the Gram-matrix norm is not more expensive than the
   materialised one (Bu et al. 2023's mixed strategy), replaces both tagged nodes with the
   ghost norm and the book-keeping sum. ``G`` becomes dead and is never computed.

Parameters with no match keep the materialised path; the report says which path each took.
A rule that raises, or that gives up after emitting nodes, never breaks the step: every node
emitted for that parameter is erased again (the graph is left exactly as the clip pass made it
for that parameter) and the parameter keeps the materialised path, with the reason in the
report's notes (shown by ``DPStep.describe``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, nodes_with_role, shape, val
from opake_compile.compiler.passes import _kernels
from opake_compile.compiler.passes._base import PassReport
from opake_compile.compiler.passes._factors import (
    GRAM_COST_FACTOR,
    Factor,
    fast_gram_ok,
    emit_clipped_sum,
    emit_factor_magnitude,
    emit_per_example_bound,
    emit_sq_norm,
    emit_sq_norm_materialized,
    ghost_cost,
    materialized_cost,
    materialized_fits,
    merge_groups,
    merge_parts,
    mixed_product_dtype,
    per_example_sum_ok,
    view_root,
)
from opake_compile.compiler.passes.ghost_conv import match_conv
from opake_compile.compiler.passes.numerics import NORM_DTYPE
from opake_compile.compiler.passes.ghost_embedding import match_embedding, match_embedding_bag
from opake_compile.compiler.passes.ghost_matmul import match_matmul
from opake_compile.exceptions import ConfigurationError

aten = torch.ops.aten

__all__ = [
    "RULES",
    "WHOLE_RULES",
    "BOOKKEEPING_MODES",
    "FORCEABLE_PATHS",
    "GhostClipping",
    "ghost_clipping",
    "REWRITE_PASSES",
    "is_fast_path",
    "fast_path_share",
]

Rule = Callable[[Emitter, fx.Node, bool, int], "Factor | None"]
WholeRule = Callable[[Emitter, fx.Node, int], "Factor | None"]

#: Term rules: (emitter, 3-D term node, transposed?, P) -> Factor in the gradient's (R, C) form.
RULES: dict[str, Rule] = {
    "linear": match_matmul,
    "embedding": match_embedding,
    "embedding_bag": match_embedding_bag,
}

#: Whole-gradient rules: (emitter, G node of shape (P, *param.shape), P) -> Factor whose (R, C)
#: form reshapes row-major to the parameter's shape.
WHOLE_RULES: dict[str, WholeRule] = {
    "conv": match_conv,
}

#: Families whose per-example gradient is formed faster from the factors (one bmm) than in the
#: traced graph, so that the mixed strategy (materialised norm, book-keeping sum) pays off.
#: Measured on CPU: linear yes; conv no (im2col + bmm lost to the grouped convolution backward).
#: Embeddings: the per-example gradient is one scatter-add of B (``K x C``), so forming it
#: for the norm costs ``R C`` per example against the Gram form's ``K^2 (1 + C)`` (or
#: ``K^2 (R + C)`` in float64 for a tied LM head, which dominated GPT-2 width at T = 512).
_MIXED_RULES = frozenset({"linear", "embedding", "embedding_bag"})

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default, aten.alias.default)


def _is_swap_last_two(node: fx.Node) -> bool:
    if node.target is aten.transpose.int:
        dims = {d % 3 for d in node.args[1:3]}
        return len(shape(node)) == 3 and dims == {1, 2}
    if node.target is aten.permute.default:
        return list(node.args[1]) == [0, 2, 1]
    return False


def _terms(node: fx.Node, flipped: bool) -> list[tuple[fx.Node, bool]]:
    """Split ``node`` (3-D) into ``(term, transposed)`` whose (oriented) sum is ``node``."""
    if node.op == "call_function":
        if node.target in _VIEWS and isinstance(node.args[0], fx.Node) and shape(node.args[0]) == shape(node):
            return _terms(node.args[0], flipped)
        if _is_swap_last_two(node):
            return _terms(node.args[0], not flipped)
        if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            if all(isinstance(x, fx.Node) and shape(x) == shape(node) for x in (a, b)):
                return _terms(a, flipped) + _terms(b, flipped)
    return [(node, flipped)]


def _matrix_form(g: fx.Node) -> fx.Node | None:
    """Walk back through reshapes from ``G`` to a 3-D ``(P, R, C)`` node with the same numel."""
    node = g
    numel = math.prod(shape(g))
    while True:
        s = shape(node)
        if len(s) == 3 and math.prod(s) == numel:
            return node
        if node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], fx.Node):
            if math.prod(shape(node.args[0])) != numel:
                return None
            node = node.args[0]
            continue
        return None


def _mutated(g: fx.Node, factors: list[Factor]) -> bool:
    """Whether an in-place op the rules did not account for touches the materialised form
    (``G`` and what lies between it and the factors). Such a graph is left alone: replacing
    ``G`` would silently drop the mutation."""
    stop: set[fx.Node] = set()
    for f in factors:
        for n in (f.a, f.b):
            stop.add(n)
            stop.update(n.all_input_nodes)
    allowed = {n for f in factors for n in f.cleanup}
    seen, todo = set(), [g]
    while todo:
        node = todo.pop()
        if node in seen or node in stop or node.op != "call_function":
            continue
        seen.add(node)
        for user in node.users:
            if user in allowed:
                continue
            if isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
                return True
        todo.extend(node.all_input_nodes)
    return False


@dataclasses.dataclass(frozen=True)
class _Match:
    """The factors of one parameter's per-example gradient, in blocks: ``G`` is the
    concatenation of the blocks along ``cat_dim`` of its ``(R, C)`` form (0: rows, 1: columns;
    ``None``: one block), each block the sum of its factors' products. Blocks come from one
    parameter sliced into pieces used separately (``nn.MultiheadAttention.in_proj_weight``
    with distinct query, key and value): their gradients occupy disjoint entries."""

    blocks: list[list[Factor]]
    cat_dim: int | None = None

    @property
    def factors(self) -> list[Factor]:
        return [f for b in self.blocks for f in b]


def _match(em: Emitter, g: fx.Node, p: int, enabled: frozenset[str]) -> tuple[_Match, str] | tuple[None, str]:
    found, why = _match_rules(em, g, p, enabled)
    if found is not None and _mutated(g, found.factors):
        return None, "an in-place op the rules do not account for touches its per-example gradient"
    return found, why


class _RuleFailed(Exception):
    """Emitting a matched rewrite raised: the parameter falls back to the materialised path."""


def _call_rule(name: str, rule: Callable[..., Factor | None], em: Emitter, failures: list[str], *args: object) -> Factor | None:
    """``rule(em, *args)`` as a transaction: if it raises or gives up (``None``), every node it
    emitted is erased and, for an exception, the reason is appended to ``failures``. A rule
    that fails is a rule that does not match; the next rule gets its chance."""
    mark = em.mark()
    try:
        f = rule(em, *args)
    except Exception as err:  # noqa: BLE001 - any failure of a rule means "no match", reported
        em.erase_since(mark)
        failures.append(f"the {name} rule failed ({type(err).__name__}: {err})")
        return None
    if f is None:
        em.erase_since(mark)
    return f


def _match_rules(em: Emitter, g: fx.Node, p: int, enabled: frozenset[str]) -> tuple[_Match, str] | tuple[None, str]:
    failures: list[str] = []
    found, why = _match_rules_inner(em, g, p, enabled, failures)
    if found is None and failures:
        why = "; ".join(failures)
    return found, why


def _match_rules_inner(
    em: Emitter, g: fx.Node, p: int, enabled: frozenset[str], failures: list[str]
) -> tuple[_Match, str] | tuple[None, str]:
    for name, rule in WHOLE_RULES.items():
        if name not in enabled:
            continue
        f = _call_rule(name, rule, em, failures, g, p)
        if f is not None:
            return _Match([[f]]), "ok"
    top = _matrix_form(g)
    if top is None:
        return None, "its per-example gradient has no (P, R, C) matrix form"
    pieces, cat_dim = _pieces(top)
    blocks = []
    for piece, flipped in pieces:
        factors, why = _match_terms(em, piece, flipped, p, enabled, failures)
        if factors is None:
            return None, why
        blocks.append(factors)
    return _Match(blocks, cat_dim), "ok"


def _match_terms(
    em: Emitter, top: fx.Node, flipped: bool, p: int, enabled: frozenset[str], failures: list[str]
) -> tuple[list[Factor], str] | tuple[None, str]:
    """Factors whose products sum to ``top`` (3-D; transposed when ``flipped``)."""
    _, r, c = shape(top)
    if flipped:
        r, c = c, r
    factors = []
    for term, fl in _terms(top, flipped):
        for name, rule in RULES.items():
            f = _call_rule(name, rule, em, failures, term, fl, p) if name in enabled else None
            if f is not None:
                break
        else:
            return None, f"no rule matches the term computed by {term.target}"
        if f.rows != r or f.cols != c:
            return None, "a matched term has the wrong shape"
        factors.append(f)
    return factors, "ok"


def _pieces(top: fx.Node) -> tuple[list[tuple[fx.Node, bool]], int | None]:
    """``top`` as ``[(piece, transposed)]`` and the dim of ``top``'s ``(R, C)`` form they are
    concatenated along, looking through views and transposes for an ``aten.cat`` of 3-D
    pieces along dim 1 or 2 (the backward of ``chunk``/``split`` of a parameter); else
    ``[(top, False)], None``."""
    node, flipped = top, False
    while node.op == "call_function":
        if node.target in _VIEWS and isinstance(node.args[0], fx.Node) and shape(node.args[0]) == shape(node):
            node = node.args[0]
        elif _is_swap_last_two(node):
            node, flipped = node.args[0], not flipped
        else:
            break
    if node.op == "call_function" and node.target is aten.cat.default:
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else 0
        if all(isinstance(x, fx.Node) and len(shape(x)) == 3 for x in parts) and dim % 3 in (1, 2):
            cat_dim = dim % 3 - 1
            return [(x, flipped) for x in parts], (1 - cat_dim if flipped else cat_dim)
    return [(top, False)], None


#: How the book-keeping sums of dense terms are emitted (see :class:`GhostClipping`).
BOOKKEEPING_MODES = ("per_layer", "fused")

#: Extra peak memory the per-example gradients summed directly may take (default of
#: :class:`GhostClipping`'s ``materialize_budget``), as a fraction of the step's estimated
#: parameter, input and saved-activation memory (:func:`_baseline_bytes`). A layer that frees
#: at least as much as it holds (its input and output gradient no longer wait for the clip
#: factors) costs nothing against it.
MATERIALIZE_BUDGET = 0.2

#: The passes a per-example gradient summed directly costs beyond its product (written once,
#: read by the float64 norm, read by the masked weighted sum), in multiply-adds per entry of
#: ``P x R x C``: memory-bound, so priced as a constant per entry. Measured on a 2-core CPU at
#: width 768, paired against the Gram form: K = 512 (GPT-2 and Llama shapes, 270-430 Gram
#: multiply-adds per entry) gained 12-25 %; K = 256 gained 3.5 % with every layer direct but
#: nothing with the attention layers alone (80-130 per entry); K = 197 (ViT-B/16, about 50)
#: lost 2 %. Priced high enough that the marginal K = 256 layers keep the Gram form.
DIRECT_PASS_COST = 96

#: Coverage label of a linear layer whose per-example gradient is formed and summed directly
#: (no Gram-form norm, no book-keeping product): chosen where that is cheaper and fits the
#: memory budget (:func:`_choose_direct`).
DIRECT_SUM = "direct:{rules} (per-example gradient summed directly)"


#: Paths :class:`GhostClipping` can be told to take for a parameter (``force=``): ``"ghost"``
#: (Gram-form norm), ``"mixed"`` (norm from the materialised per-example gradient, sum
#: book-kept), ``"materialized"`` (no rewrite: a per-example vector for biases).
FORCEABLE_PATHS = ("ghost", "mixed", "materialized")


class GhostClipping:
    """The rewrite pass, restricted to some rule families.

    Args:
        rules: names from :data:`RULES` and :data:`WHOLE_RULES` (default: all of them).
        bookkeeping: how each linear layer's clipped sum is formed. ``"per_layer"`` (default):
            one opaque ``opake::bookkeeping_mm`` call per layer, whose masked copies live only
            during that call; peak memory stays near the non-private step's (MLP bench: 1.20x).
            ``"fused"``: plain graph ops that Inductor fuses into the kernel computing the clip
            factor; it saves the per-call cost (~50 us per layer on CPU, visible on small models:
            MLP bench 1.04x instead of ~1.1x the non-private time) but can keep every layer's
            masked copies alive at once (MLP bench: 1.5x memory). Same result up to
            rounding. Its products are float64 (exact for float32 and lower factors, whatever
            the matmul precision setting); for float64 factors, an example whose scaled
            factor's rounding in the subnormal range its partners could amplify adds nothing
            to that parameter's sum (``_kernels.underflow_unsafe``; the CPU operator computes
            it exactly instead).
        force: parameter name -> one of :data:`FORCEABLE_PATHS`, overriding the cost model
            (for tests of each path's numerics, and for users who know better). A forced
            path that cannot apply (no rule matches; ``"mixed"`` for an embedding) raises at
            the first call rather than silently taking another path.
        materialize_budget: linear layers over long sequences may skip the Gram-form norm and
            the book-keeping product: their per-example gradients (P x R x C each) are formed
            by one batched product, and the norm and the clipped sum read them directly, as
            Opacus' hooks do. Where K (R + C) >= R C (K positions) that frees as much memory
            as it holds, since the layer's input and output gradient need not wait for the
            clip factors; elsewhere it may hold at most this fraction of the step's estimated
            parameter, input and saved-activation memory in all (:data:`MATERIALIZE_BUDGET`).
            Taken only where the cost model finds it faster (:data:`DIRECT_PASS_COST`); the
            coverage label is ``direct:linear (...)``. ``None``: never (Gram-form and mixed
            paths only). Same norms and sums up to rounding; the bound is the clip pass's own
            (:mod:`.numerics`, case "materialised").

    Raises:
        ConfigurationError: an unknown rule name, ``bookkeeping`` mode or forced path, or a
            negative ``materialize_budget``.

    Example::

        compile_dp(loss, model=m, clipping_norm=1.0, rewrites=[GhostClipping(rules=("linear",))])
        compile_dp(loss, model=m, clipping_norm=1.0, rewrites=[GhostClipping(bookkeeping="fused")])
        compile_dp(loss, model=m, clipping_norm=1.0, rewrites=[GhostClipping(force={"fc.weight": "mixed"})])
    """

    def __init__(
        self,
        rules: tuple[str, ...] | None = None,
        *,
        bookkeeping: str = "per_layer",
        force: Mapping[str, str] | None = None,
        materialize_budget: float | None = MATERIALIZE_BUDGET,
    ) -> None:
        known = set(RULES) | set(WHOLE_RULES)
        chosen = known if rules is None else set(rules)
        unknown = chosen - known
        if unknown:
            raise ConfigurationError(f"Unknown rewrite rule(s) {sorted(unknown)}; known: {sorted(known)}.")
        if bookkeeping not in BOOKKEEPING_MODES:
            raise ConfigurationError(f"Unknown bookkeeping={bookkeeping!r}; choose from {BOOKKEEPING_MODES}.")
        bad = {k: v for k, v in (force or {}).items() if v not in FORCEABLE_PATHS}
        if bad:
            raise ConfigurationError(f"Unknown path(s) in force={bad}; choose from {FORCEABLE_PATHS}.")
        if materialize_budget is not None and not materialize_budget >= 0:
            raise ConfigurationError(f"materialize_budget must be None or >= 0, got {materialize_budget!r}.")
        self.rules = frozenset(chosen)
        self.bookkeeping = bookkeeping
        self.force = dict(force or {})
        self.materialize_budget = materialize_budget
        self.name = "ghost_clipping"

    def __call__(self, gm: fx.GraphModule) -> PassReport:
        return _ghost_clipping(gm, self.rules, self.bookkeeping, self.force, self.materialize_budget)

    def __repr__(self) -> str:
        extra = f", force={self.force!r}" if self.force else ""
        if self.materialize_budget != MATERIALIZE_BUDGET:
            extra += f", materialize_budget={self.materialize_budget!r}"
        return f"GhostClipping(rules={tuple(sorted(self.rules))}, bookkeeping={self.bookkeeping!r}{extra})"


def ghost_clipping(gm: fx.GraphModule) -> PassReport:
    """Replace materialised per-example norms and clipped sums by ghost norms and
    book-keeping sums wherever the rules match and it is cheaper. In place."""
    return _ghost_clipping(gm, frozenset(RULES) | frozenset(WHOLE_RULES))


def _ghost_clipping(
    gm: fx.GraphModule,
    enabled: frozenset[str],
    bookkeeping: str = "per_layer",
    force: Mapping[str, str] | None = None,
    materialize_budget: float | None = MATERIALIZE_BUDGET,
) -> PassReport:
    force = dict(force or {})
    graph = gm.graph
    sq_nodes = nodes_with_role(graph, "sq_norm")
    mass_nodes = nodes_with_role(graph, "sum_mass")
    magnitude_nodes = nodes_with_role(graph, "magnitude")
    sum_nodes = nodes_with_role(graph, "clipped_sum")
    unknown = sorted(set(force) - set(sq_nodes))
    if unknown:
        raise ConfigurationError(f"force names parameter(s) {unknown} that are not trainable parameters of this step.")
    kept = next(iter(nodes_with_role(graph, "kept").values()))
    factor = next(iter(nodes_with_role(graph, "clip_factor").values()))
    clip = next(iter(nodes_with_role(graph, "clip_norm_eff").values()))
    sum_acc = val(factor).dtype
    out_node = next(n for n in graph.nodes if n.op == "output")
    matches: dict[str, int] = {}
    coverage: dict[str, str] = {}
    notes: dict[str, str] = {}
    methods: dict[str, str] = {}
    grams: dict = {}  # Gram matrices shared between parameters (see emit_sq_norm)
    forward = _loss_ancestors(out_node)
    direct: dict[str, str] = {}
    if materialize_budget is not None:
        candidates, holders = _survey(graph, sq_nodes, force, enabled, sum_acc)
        budget = int(materialize_budget * _baseline_bytes(graph, forward))
        direct = _choose_direct(candidates, holders, budget)
    # Whether the kept examples are a prefix (and how many), read by every book-keeping call:
    # computed once, before the output.
    kept_prefix = _kernels.kept_prefix(kept, Emitter(graph, before=out_node))
    for name, sq in sq_nodes.items():
        wanted = force.get(name, "auto")
        if wanted == "materialized":
            coverage[name] = "materialized (forced)"
            continue
        if name in direct:
            # The clip pass's own form: G is formed (one batched product) and its norm and
            # the clipped sum read it.
            coverage[name] = DIRECT_SUM.format(rules="linear")
            notes[name] = direct[name]
            continue
        # Transaction: every node emitted while trying this parameter is erased again unless
        # the rewrite completes (a rule may raise, or give up, after emitting nodes).
        # Factor nodes go right after G's inputs would be ideal; before the norm is enough,
        # since every operand of G precedes it. The sums go before the output.
        em, em_out = Emitter(graph, before=sq), Emitter(graph, before=out_node)
        grams_before = dict(grams)
        done = False
        try:
            label, why, used, method = _rewrite_parameter(
                em, em_out, name, sq, mass_nodes[name], magnitude_nodes[name], sum_nodes[name], wanted, enabled,
                bookkeeping, grams, kept, factor, clip, sum_acc, kept_prefix, forward,
            )
            done = used is not None
        except _RuleFailed as err:
            if wanted != "auto":
                raise ConfigurationError(f"force={{{name!r}: {wanted!r}}}: {err}.") from err.__cause__
            label, why, used, method = None, f"{err}; kept on the materialised path", None, None
        finally:
            if not done:  # the sums use the norm-side nodes: erase them first
                em_out.erase_since(0)
                em.erase_since(0)
                grams.clear()
                grams.update(grams_before)
        if label is not None:
            coverage[name] = label
        if method is not None:
            methods[name] = method
        if why is not None:
            notes[name] = why
        for rule in used or ():
            matches[rule] = matches.get(rule, 0) + 1
    if not kept_prefix.users:  # (its inputs are dead too: dead-code elimination removes them)
        graph.erase_node(kept_prefix)
    return PassReport(
        name="ghost_clipping", modified=bool(matches), matches=matches, coverage=coverage, notes=notes, methods=methods
    )


def _rewrite_parameter(
    em: Emitter,
    em_out: Emitter,
    name: str,
    sq: fx.Node,
    mass: fx.Node,
    magnitude: fx.Node,
    old_sum: fx.Node,
    wanted: str,
    enabled: frozenset[str],
    bookkeeping: str,
    grams: dict,
    kept: fx.Node,
    factor: fx.Node,
    clip: fx.Node,
    sum_acc: torch.dtype,
    kept_prefix: fx.Node,
    forward: frozenset[fx.Node],
) -> tuple[str | None, str | None, list[str] | None]:
    """Try to rewrite one parameter's norm and clipped sum (``forward``: the nodes the losses
    are computed from, :func:`_loss_ancestors`).

    Returns:
        ``(coverage label or None, note or None, matched rule names or None)``; the graph is
        changed only when the rule names are returned (the caller erases anything emitted
        otherwise; norm-side nodes go through ``em``, sum-side nodes through ``em_out``).

    Raises:
        _RuleFailed: a rule or the emission of its replacement raised.
        ConfigurationError: a forced path cannot apply.
    """
    g = _gradient_of(sq)
    p = shape(g)[0]
    found, why = _match(em, g, p, enabled)
    if found is None:
        if wanted != "auto":
            raise ConfigurationError(f"force={{{name!r}: {wanted!r}}}: no rewrite rule matches this parameter ({why}).")
        if len(shape(g)) == 2:
            # Biases and normalisation affine parameters: the per-example gradient is a
            # (P, d) vector, as small as the activations it comes from. Nothing to gain.
            return "direct (per-example vector)", None, None, None
        if _elementwise_reduction(g):
            # LayerNorm / RMSNorm affine weights over several dims: the per-example gradient is
            # a sum over positions of an elementwise product, no larger than the activation
            # it is read from and formed in one pass over it. Nothing to gain either.
            return DIRECT_ELEMENTWISE, None, None, None
        return None, why, None, None
    found = _Match([[_mark_inputs(f, forward) for f in block] for block in found.blocks], found.cat_dim)
    factors = found.factors
    rules = "+".join(sorted({f.rule for f in factors}))
    if wanted == "mixed" and any(f.onehot and f.rule not in _MIXED_RULES for f in factors):
        raise ConfigurationError(f"force={{{name!r}: 'mixed'}}: a {rules} term has no materialised norm form.")
    plans = []
    for block in found.blocks:
        plan = _plan(block, p, wanted, sum_acc)
        if plan[0] == "materialized":
            return "materialized (cheaper than ghost)", plan[1], None, None
        plans.append(plan)
    try:
        sqs, masses, sums = [], [], []
        for block, (mode, gram_dtype) in zip(found.blocks, plans):
            if mode == "mixed":
                # Mixed strategy (Bu et al. 2023): the Gram form would cost more than forming
                # the per-example gradient, so form it for the norm only; the sum stays
                # book-keeping.
                b_sq, b_mass = emit_sq_norm_materialized(em, block, sum_acc)
            else:
                b_sq, b_mass = emit_sq_norm(em, block, grams, gram_dtype)
            b_sq, b_mass = merge_groups(em, b_sq, b_mass, block[0].groups)
            b_sq = emit_per_example_bound(em, block, b_sq, b_mass, sum_acc, bookkeeping)
            sqs.append(b_sq)
            masses.append(b_mass)
            sums.append(emit_clipped_sum(em_out, block, kept, factor, clip, sum_acc, bookkeeping, kept_prefix))
        new_sq, new_mass = merge_parts(em, sqs, masses)
        # Per block: each has its own shape (pieces of one parameter used separately).
        new_magnitude = None
        for block in found.blocks:
            m = emit_factor_magnitude(em, block, p, grams)
            new_magnitude = m if new_magnitude is None else em(aten.maximum.default, new_magnitude, m)
        summed = sums[0] if len(sums) == 1 else em_out(aten.cat.default, sums, found.cat_dim)
        summed = em_out(aten.reshape.default, summed, list(shape(g)[1:]))
    except Exception as err:  # noqa: BLE001 - reported, the parameter falls back
        raise _RuleFailed(f"emitting the {rules} rewrite failed ({type(err).__name__}: {err})") from err
    modes = {mode for mode, _ in plans}
    if modes == {"mixed"}:
        label = f"bk:{rules} (norm materialized)"
    elif modes == {"ghost"}:
        label = f"ghost:{rules}"
    else:
        n = sum(mode == "mixed" for mode, _ in plans)
        label = f"ghost:{rules} (norm materialized in {n} of {len(plans)} blocks)"
    # Everything is emitted: only now redirect the uses (nothing above changed the graph's
    # existing nodes, so a failure before this point is undone by erasing the new nodes).
    summed.meta["opake_role"] = ("clipped_sum", name)
    sq.replace_all_uses_with(new_sq)
    mass.replace_all_uses_with(new_mass)
    magnitude.replace_all_uses_with(new_magnitude)
    old_sum.replace_all_uses_with(summed)
    for f in factors:
        for node in f.cleanup:
            em.graph.erase_node(node)
    # What fixes this parameter's norm values beyond rounding: each block's form and its
    # precisions (DPStep compares it across the graphs of one step, see _ghost_clipping).
    method = label + " " + ", ".join(
        f"{mode}/{dtype if mode == 'ghost' else mixed_product_dtype(block, sum_acc)}"
        + ("/per-example sum" if per_example_sum_ok(block, sum_acc, bookkeeping) else "")
        for block, (mode, dtype) in zip(found.blocks, plans)
    )
    return label, None, [f.rule for f in factors], method


def _loss_ancestors(out_node: fx.Node) -> frozenset[fx.Node]:
    """The forward computation: every node the per-example losses (the graph's first output)
    are computed from. Layer inputs belong to it; output gradients, formed after the loss,
    do not."""
    seen: set[fx.Node] = set()
    losses = out_node.args[0][0]
    stack = [losses] if isinstance(losses, fx.Node) else []  # none: nothing is centred
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return frozenset(seen)


def _mark_inputs(f: Factor, forward: frozenset[fx.Node]) -> Factor:
    """``f`` with ``input_side`` set where exactly one of its dense factors is (a view of) a
    forward value: that side holds the layer's inputs, the other its output gradients
    (float32 Gram norms centre the inputs, :func:`._factors._centre`). Linear terms only:
    a convolution's unfolded input is large, and a centred copy of it would cost memory."""
    if f.onehot or f.rule != "linear":
        return f
    a_in, b_in = view_root(f.a) in forward, view_root(f.b) in forward
    if a_in == b_in:
        return f
    return dataclasses.replace(f, input_side="a" if a_in else "b")


def _plan(factors: list[Factor], p: int, wanted: str, sum_acc: torch.dtype) -> tuple[str, object]:
    """How one block's norm is formed: ``("ghost", gram dtype)``, ``("mixed", None)``, or
    ``("materialized", why)`` when forming the per-example gradient in the traced graph is
    cheaper and no mixed form exists (conv)."""
    dense = not any(f.onehot for f in factors)
    mixable = all(f.rule in _MIXED_RULES for f in factors)
    # Float32 Gram matrices where their rounding bound is small (fast_gram_ok), else float64.
    gram_dtype = torch.float32 if fast_gram_ok(factors, sum_acc) else NORM_DTYPE
    if wanted == "mixed":
        return "mixed", None
    # Against the mixed path (same memory) the float64 Gram form's real cost counts; against
    # keeping the traced per-example gradient (conv), only flops: materialising costs memory
    # (P x R x C alive; the CNN bench's peak memory went from 1.28x to 1.81x of the
    # non-private step when the float64 factor was applied there too).
    cost_factor = GRAM_COST_FACTOR if (mixable and gram_dtype == NORM_DTYPE) else 1
    ghost = ghost_cost(factors, p, cost_factor)
    direct = materialized_cost(factors, p)
    # A float64 mixed product (long sequences, mixed_product_dtype) costs about what a float64
    # Gram form does.
    mixed_factor = GRAM_COST_FACTOR if (mixable and mixed_product_dtype(factors, sum_acc) != sum_acc) else 1
    if wanted == "auto" and (dense or (mixable and materialized_fits(factors, p))) and ghost > direct * mixed_factor:
        if not mixable:
            # The traced form (e.g. oneDNN's grouped convolution backward) forms the
            # per-example gradient at least as fast as an explicit product would.
            return "materialized", _cost_note(factors, p, ghost, direct)
        return "mixed", None
    return "ghost", gram_dtype


#: Coverage label of a per-example gradient formed by elementwise ops and reductions over
#: positions (:func:`_elementwise_reduction`).
DIRECT_ELEMENTWISE = "direct (per-example elementwise)"

_SHAPE_OPS = _VIEWS + (aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten._to_copy.default)


def _elementwise_reduction(g: fx.Node) -> bool:
    """Whether ``G`` (``(P, *param.shape)``) is, up to reshapes and a sum over non-batch dims,
    a tensor the graph needs anyway (an output gradient: a bias over several dims) or
    pointwise ops on such tensors of the same size (LayerNorm over several dims:
    ``sum_t xhat_t * g_t``), with no outer product on the way (an ``expand``, or a broadcast
    of smaller operands only). Such a gradient costs one pass over an activation-sized
    tensor to form; there is no cheaper form to rewrite it to."""
    node, _ = _through(g)
    if node.op == "call_function" and node.target is aten.sum.dim_IntList:
        nd = len(shape(node.args[0]))
        dims = node.args[1] if len(node.args) > 1 else None
        if not dims or any(d % nd == 0 for d in dims):
            return False
        return _dense(node.args[0], 16, g)
    return _dense(g, 16, g)


def _through(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The producer behind a chain of size-preserving reshapes, and the chain."""
    chain = [node]
    while node.op == "call_function" and node.target in _SHAPE_OPS and isinstance(node.args[0], fx.Node):
        if math.prod(shape(node.args[0])) != math.prod(shape(node)):
            break
        node = node.args[0]
        chain.append(node)
    return node, chain


def _pointwise(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.pointwise in node.target.tags
    )


def _dense(node: fx.Node, depth: int, g: fx.Node | None = None) -> bool:
    """Whether ``node`` holds an activation-sized tensor that is not a broadcast: a pointwise
    op with a dense operand of its own size, or a tensor some other part of the graph reads
    too (an input, an output gradient). ``expand``, pointwise ops of smaller operands only,
    and products formed only for this gradient (whose only other readers are ``G``'s own
    norm and sum) are not."""
    node, chain = _through(node)
    if any(len(x.users) > 1 for x in chain if x is not g):
        return True  # the graph reads it elsewhere too: it exists anyway
    if node.op == "placeholder":
        return True
    if node.op != "call_function" or node.target is aten.expand.default:
        return False
    if _pointwise(node):
        if depth == 0:
            return False
        n = math.prod(shape(node))
        return any(
            math.prod(shape(x)) == n and _dense(x, depth - 1)
            for x in node.all_input_nodes
            if isinstance(x.meta.get("val"), torch.Tensor)
        )
    # Another producer read by nothing else: only an output of a multi-output op that is
    # no contraction (a normalisation's output, say) counts as an activation; anything
    # else (a contraction, a view the walk does not know) is formed for this gradient.
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0].target not in _CONTRACTIONS
    return False


#: Ops that form per-example weight gradients (outer products summed over positions).
_CONTRACTIONS = frozenset({
    aten.bmm.default, aten.mm.default, aten.baddbmm.default, aten.addmm.default,
    aten.convolution_backward.default, aten.embedding_dense_backward.default,
    aten._embedding_bag_backward.default, aten.stack.default, aten.cat.default,
})


def _cost_note(factors: list[Factor], p: int, ghost: int, direct: int) -> str:
    """Why the cost model kept a parameter materialised, with its numbers (``describe``)."""
    f = factors[0]
    k = sum(x.k for x in factors)
    groups = f" x {f.groups} groups" if f.groups > 1 else ""
    return (
        f"Gram form {ghost:.3g} vs forming the per-example gradient {direct:.3g} multiply-adds: "
        f"P={p}{groups}, R={f.rows}, C={f.cols}, K={k} positions; the Gram form wins only when "
        f"K (R + C) < R C, i.e. K < {f.rows * f.cols / (f.rows + f.cols):.3g}"
    )


def _gradient_of(sq: fx.Node) -> fx.Node:
    """The per-example gradient ``G`` a tagged ``sq_norm`` node reduces (recorded by the clip
    pass)."""
    g = sq.meta.get("opake_gradient")
    assert g is not None, "clip pass layout changed"
    return g


@dataclasses.dataclass
class _Candidate:
    """A parameter whose Gram-form (or mixed) path could give way to summing its per-example
    gradient directly: what that would save (multiply-adds) and what it would hold (bytes)."""

    name: str
    saving: float
    held: int
    roots: frozenset[fx.Node]  # the factors' view roots, held until the clip factors otherwise
    note: str


def _survey(
    graph: fx.Graph,
    sq_nodes: Mapping[str, fx.Node],
    force: Mapping[str, str],
    enabled: frozenset[str],
    sum_acc: torch.dtype,
) -> tuple[list[_Candidate], dict[fx.Node, int]]:
    """Match every parameter once without changing the graph, and price summing the
    per-example gradient directly for those whose factors are all dense linear terms.

    Returns:
        ``(candidates, holders)``: ``holders`` counts, per factor root, the matched parameters
        whose book-keeping sums read it (a root is freed early only if all of them go direct).
    """
    candidates: list[_Candidate] = []
    holders: dict[fx.Node, int] = {}
    for name, sq in sq_nodes.items():
        wanted = force.get(name, "auto")
        if wanted == "materialized":
            continue
        g = _gradient_of(sq)
        p = shape(g)[0]
        em = Emitter(graph, before=sq)
        try:
            found, _ = _match(em, g, p, enabled)
            if found is None:
                continue
            created = set(em.created)
            roots = frozenset(
                r for f in found.factors for r in (view_root(f.a), view_root(f.b)) if r not in created
            )
            for r in roots:
                holders[r] = holders.get(r, 0) + 1
            block = found.factors
            if (
                wanted != "auto"
                or len(found.blocks) != 1
                or val(g).dtype != sum_acc  # a bf16 model: the book-keeping sum is float32
                or not all(f.rule == "linear" and not f.onehot and f.groups == 1 for f in block)
            ):
                continue
            mode, gram_dtype = _plan(block, p, "auto", sum_acc)
            r, c, k = block[0].rows, block[0].cols, sum(f.k for f in block)
            passes = DIRECT_PASS_COST * p * r * c
            # What going direct saves: the Gram-form norm, or on the mixed path (whose product
            # forms G anyway) the book-keeping product.
            if mode == "mixed":
                saved = p * r * c * k
            else:
                saved = ghost_cost(block, p, GRAM_COST_FACTOR if gram_dtype == NORM_DTYPE else 1)
            held = p * r * c * val(g).element_size()
            note = (
                f"per-example gradient summed directly: {saved:.3g} multiply-adds of "
                f"{'book-keeping product' if mode == 'mixed' else 'Gram-form norm'} against passes priced at "
                f"{passes:.3g} over its P x R x C = {p} x {r} x {c} entries ({held / 2**20:.1f} MiB)"
            )
            candidates.append(_Candidate(name, saved - passes, held, roots, note))
        finally:
            em.erase_since(0)
    return candidates, holders


def _baseline_bytes(graph: fx.Graph, forward: frozenset[fx.Node]) -> int:
    """A floor on the step's peak memory: its placeholders (parameters, inputs) and the forward
    values the backward reads (saved activations), each storage counted once.

    In a graph of :class:`~opake_compile.compiler.step.DPStep` (which names its batched inputs
    in ``gm.meta["opake_batched_inputs"]``) only the values computed from the batch count:
    they grow with the physical size P and the per-example gradients do too, so which layers
    fit the budget is the same at every P. Counting the parameters as well made the choice
    depend on P, hence on the batch size: a hostile review's batch of 12 took the Gram form
    and one of 11 the direct sum, whose norms differ on cancelling data, so removing one
    example moved every other example's clip factor (10.8 C in all)."""
    batched_names = getattr(graph.owning_module, "meta", {}).get("opake_batched_inputs")
    batched: set[fx.Node] | None = None
    if batched_names is not None:
        batched = set()
        for node in graph.nodes:
            if (node.op == "placeholder" and node.name in batched_names) or any(a in batched for a in node.all_input_nodes):
                batched.add(node)
    held: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or (node in forward and any(u not in forward for u in node.users)):
            root = view_root(node)
            if batched is None or root in batched:
                held.add(root)
    return sum(_nbytes(n) for n in held)


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _choose_direct(candidates: list[_Candidate], holders: Mapping[fx.Node, int], budget: int) -> dict[str, str]:
    """The parameters to sum directly, greedily by saving per net byte held: a parameter
    is taken when it saves time and the net bytes of all taken so far stay within ``budget``.
    Net bytes: its ``P x R x C`` gradient, minus the factor roots freed once every parameter
    reading them is taken (q, k and v share their input: it is freed by the last of them),
    counted as zero when negative. The budget assumes a fusing backend (Inductor): under
    ``aot_eager`` or eager the norm's float64 copy of each G also exists, briefly.

    Returns:
        parameter name -> note for ``describe()``.
    """
    chosen: dict[str, _Candidate] = {}
    left = [c for c in candidates if c.saving > 0]
    taken: dict[fx.Node, int] = {}
    spent = 0

    def net(c: _Candidate) -> int:
        # Inputs (placeholders) stay alive whatever this pass does: never counted as freed.
        freed = sum(
            _nbytes(r) for r in c.roots if r.op != "placeholder" and taken.get(r, 0) + 1 == holders[r]
        )
        return c.held - freed

    while left:
        costs = [(net(c), c) for c in left]
        # A layer that frees more than it holds does not fund another: its backward may run
        # after the other's G is formed, and the estimate ignores when memory peaks.
        fits = [(n, c) for n, c in costs if spent + max(n, 0) <= budget]
        if not fits:
            break
        n, best = max(fits, key=lambda nc: nc[1].saving / max(nc[0], 1))
        left.remove(best)
        spent += max(n, 0)
        chosen[best.name] = best
        for r in best.roots:
            taken[r] = taken.get(r, 0) + 1
    total = f"all such layers hold {spent / 2**20:.1f} MiB net of a {budget / 2**20:.1f} MiB budget"
    return {name: f"{c.note}; {total}" for name, c in chosen.items()}


REWRITE_PASSES = [ghost_clipping]


def is_fast_path(label: str) -> bool:
    """Whether a coverage label names a fast path: ghost norms, book-keeping sums (``ghost:``,
    ``bk:``), per-example vectors or elementwise reductions (``direct``), and per-example
    gradients summed directly where the cost model found that faster, within its memory
    budget (``direct:``, :func:`_choose_direct`). Every ``materialized`` label is the slow
    path (``describe()`` says why it was kept)."""
    return not label.startswith("materialized")


def fast_path_share(coverage: Mapping[str, str], sizes: Mapping[str, int]) -> float:
    """The share of trainable elements on a fast path (:func:`is_fast_path`).

    Args:
        coverage: parameter name -> coverage label (``DPStep.coverage``).
        sizes: parameter name -> number of elements (``{k: p.numel() for k, p in
            model.named_parameters()}``).

    Returns:
        A float in [0, 1] (1.0 for no parameters).

    Example::

        step(x, y)
        share = fast_path_share(step.coverage, {k: p.numel() for k, p in model.named_parameters()})
    """
    total = sum(int(sizes[k]) for k in coverage)
    fast = sum(int(sizes[k]) for k, label in coverage.items() if is_fast_path(label))
    return 1.0 if total == 0 else fast / total
