"""Stage 2 of the compiler: the pass pipeline and ``insert_clipping``.

The oracle for the clipped graph is :func:`opake_compile.dpsgd.clipping.clip_and_sum` applied to
the per-example gradients of the raw (stage-1) graph, plus hand-written norms.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from _models import conv2d_case, lora_case, mlp_case, seeded
from opake_compile import compile_dp
from opake_compile.compiler._graph_utils import nodes_with_role, role_of
from opake_compile.compiler.passes import PassReport, insert_clipping, run_pipeline
from opake_compile.compiler.trace import trace_per_example_grads
from opake_compile.dpsgd.clipping import clip_and_sum


def _traced(case, n, p):
    args = case.make_batch(n, 5)
    pad = tuple(torch.cat([a, a.new_zeros((p - n, *a.shape[1:]))]) for a in args)
    tr = trace_per_example_grads(case.model, case.loss_fn, pad, batched_positions=tuple(range(len(args))), physical_batch_size=p)
    return tr, pad


def _inputs(tr, model, c, mask, args):
    named = dict(model.named_parameters())
    state = [named[k].detach() for k in tr.layout.trainable]
    state += [named[k.split(":", 1)[1]].detach() for k in tr.layout.others]
    return (*state, torch.tensor(c, dtype=torch.float64), mask, *args)


def _clip(tr):
    clip_input = len(tr.layout.trainable) + len(tr.layout.others)
    return lambda gm: insert_clipping(gm, param_names=tr.layout.trainable, clip_input=clip_input)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c", [0.05, 1.0, 1e4])
def test_insert_clipping_matches_clip_and_sum_with_mask(dtype, c):
    case = mlp_case(seed=4, dtype=dtype)
    tr, args = _traced(case, 3, 5)
    mask = torch.tensor([True, False, True, True, False])
    raw = tr.gm(*_inputs(tr, case.model, c, mask, args))
    losses_raw, grads_raw = raw[0], dict(zip(tr.layout.trainable, raw[1:]))
    reports = run_pipeline(tr.gm, [_clip(tr)])
    losses, norms, kept, *sums, num_kept, mean_loss = tr.gm(*_inputs(tr, case.model, c, mask, args))
    want, want_norms, want_kept = clip_and_sum(grads_raw, c, mask)
    torch.testing.assert_close(losses, losses_raw)
    torch.testing.assert_close(norms, want_norms)
    assert torch.equal(kept, want_kept)
    # The kept count and the mean loss over the real (unmasked) rows, for the step's result.
    assert num_kept.dtype == torch.int64 and int(num_kept) == int(want_kept.sum()) == 3
    torch.testing.assert_close(mean_loss, losses_raw[mask].mean())
    eps = torch.finfo(dtype).eps
    for name, s in zip(tr.layout.trainable, sums):
        # Released sums are float64 (numerics, point 3); the eager reference sums in its dtype.
        assert s.dtype == torch.float64 and s.shape == case.model.get_parameter(name).shape
        torch.testing.assert_close(s, want[name].double(), rtol=100 * eps, atol=100 * eps * max(1.0, c))
    assert len(reports) == 1


def test_pass_report_and_roles():
    case = conv2d_case(seed=0)
    case.model[0].bias.requires_grad_(False)
    tr, _ = _traced(case, 2, 2)
    (report,) = run_pipeline(tr.gm, [_clip(tr)])
    trainable = tr.layout.trainable
    assert isinstance(report, PassReport)
    assert report.name == "insert_clipping"
    assert report.modified is True
    assert report.matches == {"clipped_parameters": len(trainable)}
    assert report.coverage == {k: "materialized" for k in trainable}
    assert "0.bias" not in report.coverage
    assert set(nodes_with_role(tr.gm.graph, "sq_norm")) == set(trainable)
    assert set(nodes_with_role(tr.gm.graph, "clipped_sum")) == set(trainable)
    assert len(nodes_with_role(tr.gm.graph, "clip_factor")) == 1
    assert len(nodes_with_role(tr.gm.graph, "kept")) == 1
    out = next(n for n in tr.gm.graph.nodes if n.op == "output").args[0]
    # (per-example losses, norms, kept flags, clipped sums..., kept count, mean loss)
    assert len(out) == 5 + len(trainable)
    assert [role_of(n) for n in out[3:-2]] == [("clipped_sum", k) for k in trainable]
    assert [role_of(n) for n in out[-2:]] == [("kept_count", ""), ("mean_loss", "")]
    for name, node in zip(trainable, out[3:]):
        assert tuple(node.meta["val"].shape) == tuple(case.model.get_parameter(name).shape)
    # The clip factor is removed with a select, never by multiplying with a 0/1 mask.
    factor = nodes_with_role(tr.gm.graph, "clip_factor")[""]
    assert factor.target == torch.ops.aten.where.self


def test_nonfinite_rows_are_selected_away_in_the_graph():
    """A NaN gradient row (log of a negative input) contributes exactly zero; the others are
    clipped as usual."""
    case = mlp_case(seed=1, dtype=torch.float64, layernorm=False)

    def loss(m, x, y):
        return F.cross_entropy(m(torch.log(x)), y)

    x = torch.rand(4, 5, generator=seeded(0), dtype=torch.float64) + 0.5
    x[2, 0] = -1.0  # log(-1) = NaN: example 2 has a NaN gradient
    y = torch.tensor([0, 1, 2, 0])
    tr = trace_per_example_grads(case.model, loss, (x, y), batched_positions=(0, 1), physical_batch_size=4)
    run_pipeline(tr.gm, [_clip(tr)])
    _, norms, kept, *sums, num_kept, mean_loss = tr.gm(*_inputs(tr, case.model, 0.5, torch.ones(4, dtype=torch.bool), (x, y)))
    assert kept.tolist() == [True, True, False, True] and int(num_kept) == 3
    assert torch.isnan(norms[2]) and torch.isnan(mean_loss)  # the loss is not privatised: NaN shows
    keep = torch.tensor([0, 1, 3])
    tr2 = trace_per_example_grads(case.model, loss, (x[keep], y[keep]), batched_positions=(0, 1), physical_batch_size=3)
    run_pipeline(tr2.gm, [_clip(tr2)])
    _, _, _, *want, _, _ = tr2.gm(*_inputs(tr2, case.model, 0.5, torch.ones(3, dtype=torch.bool), (x[keep], y[keep])))
    for s, w in zip(sums, want):
        assert torch.isfinite(s).all()
        torch.testing.assert_close(s, w)


def test_run_pipeline_runs_later_passes_and_collects_reports():
    case = mlp_case(seed=0)
    tr, args = _traced(case, 2, 2)
    seen = []

    def noop(gm):
        seen.append(sorted(nodes_with_role(gm.graph, "clipped_sum")))
        return PassReport(name="noop", modified=False)

    reports = run_pipeline(tr.gm, [_clip(tr), noop])
    assert [r.name for r in reports] == ["insert_clipping", "noop"]
    assert seen == [sorted(tr.layout.trainable)]  # the rewrite stage sees the tagged nodes


def test_step_coverage_and_explain_list_every_trainable_parameter():
    case = lora_case(seed=0)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None, rewrites=[])
    assert "not traced yet" in step.describe()
    out = step(*case.make_batch(3, 0))
    assert out.coverage == {"lora_a": "materialized", "lora_b": "materialized"}
    assert step.coverage == out.coverage
    buf = io.StringIO()
    assert step.explain(file=buf) is None
    text = step.describe()
    assert buf.getvalue().strip() == text.strip()
    lines = text.splitlines()
    for name in ("lora_a", "lora_b"):
        assert any(name in line and "materialized" in line for line in lines), text
    assert "base.weight" not in text and "base.bias" not in text
    assert "insert_clipping" in text and "clipped_parameters=2" in text


def test_explain_with_default_rewrites_lists_every_trainable_parameter():
    case = conv2d_case(seed=0)
    case.model[4].weight.requires_grad_(False)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    out = step(*case.make_batch(3, 0))
    trainable = [k for k, p in case.model.named_parameters() if p.requires_grad]
    assert set(out.coverage) == set(trainable)
    text = step.describe()
    for name in trainable:
        assert any(
            line.split()[:1] == [name] and line.rstrip().endswith(out.coverage[name]) for line in text.splitlines()
        ), (name, text)
    assert "4.weight" not in text
    assert "pass insert_clipping" in text


def test_rewrite_refuses_a_gradient_touched_by_an_unaccounted_in_place_op():
    """Fail closed: if something mutates the materialised per-example gradient in place (here
    an injected ``mul_`` on the weight gradient's bmm), replacing it with ghost norms would drop
    the mutation, so the parameter must stay materialised; the result still equals the graph
    with the mutation."""
    from opake_compile.compiler._graph_utils import Emitter
    from opake_compile.compiler.passes.rewrites import ghost_clipping

    case = mlp_case(seed=1)
    n = p = 4
    reports = {}
    outs = {}
    for rewrite in (False, True):
        tr, args = _traced(case, n, p)
        run_pipeline(tr.gm, [_clip(tr)])
        bmms = [nd for nd in tr.gm.graph.nodes if nd.target is torch.ops.aten.bmm.default]
        assert bmms, "expected the per-example weight gradients to be bmm outputs"
        victim = bmms[0]
        em = Emitter(tr.gm.graph, before=victim.next)
        em(torch.ops.aten.mul_.Tensor, victim, 0.5)  # an in-place op no rule accounts for
        tr.gm.recompile()
        if rewrite:
            reports = run_pipeline(tr.gm, [ghost_clipping])[0].coverage
        outs[rewrite] = tr.gm(*_inputs(tr, case.model, 0.3, torch.ones(p, dtype=torch.bool), args))
    touched = [name for name in tr.layout.trainable if name not in reports]
    assert touched, f"the mutated gradient was rewritten anyway: {reports}"
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b)
