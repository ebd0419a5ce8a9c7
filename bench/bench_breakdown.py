#!/usr/bin/env python
"""Where the DP step's extra time goes: paired CPU time and a per-op profile of one DP step
against the compiled non-private step, on the GPT-2-width shapes of ``bench_shapes.py``.

Rows, all compiled with Inductor in this process and timed in rotating order:

- ``np_grad``: ``torch.compile``d ``torch.func.grad`` of the loss (the non-private step);
- ``dp_default``: ``compile_dp`` with its default rewrites;
- ``dp_ghost_embeddings`` (with ``--compare-ghost-embeddings``): the same with the token and
  position embeddings (and the tied LM head) forced onto the Gram-form norm, the default
  before the cost model learned the embeddings' scatter-add norm;
- ``dp_float64_sums`` (with ``--compare-float64-sums``): the same with every book-keeping sum a
  float64 product over all rows, as before the CPU's per-example float32 products
  (``opake::per_example_mm``; the graph is traced with ``per_example_sum_ok`` answering no);
- ``dp_budget_<B>`` (with ``--compare-budget B``, repeatable): ``GhostClipping(materialize_budget=B)``,
  which lets more layers sum their per-example gradients directly; ``--direct-pass-cost X``
  traces those rows with ``rewrites.DIRECT_PASS_COST = X``.

``--threads 1`` (default) times CPU seconds of this process (``time.process_time``) on one
thread: on a machine shared with other jobs that counts the work done and not the waiting,
which wall time on several threads does not. ``--profile`` prints the torch profiler's
self-CPU table of one step of each row, with Inductor's kernels named
(``enable_kernel_profile``).

    python bench/bench_breakdown.py --model gpt2_t512_b2 --rounds 5 --compare-ghost-embeddings
    python bench/bench_breakdown.py --model gpt2_t256_b8 --rounds 3 --profile
    python bench/bench_breakdown.py --model gpt2_t256_b8 --rounds 5 --compare-float64-sums
    python bench/bench_breakdown.py --model gpt2_t256_b8 --rounds 5 --compare-budget 1.0 --direct-pass-cost 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2_t512_b2", help="gpt2_t<T>_b<B> (GPT-2 width, 2 layers)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--attention", default="sdpa", choices=("eager", "sdpa"),
                    help="attn_implementation of the GPT-2 model (as in bench_shapes.py)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="1: CPU time on one thread; more: wall time")
    ap.add_argument("--compare-ghost-embeddings", action="store_true")
    ap.add_argument("--compare-float64-sums", action="store_true")
    ap.add_argument("--compare-budget", type=float, action="append", default=[], metavar="B",
                    help="add a row with GhostClipping(materialize_budget=B) (repeatable)")
    ap.add_argument("--direct-pass-cost", type=float, default=None,
                    help="the --compare-budget rows' rewrites.DIRECT_PASS_COST (default: the library's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", type=int, default=25, help="rows of each profile table")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ns = ap.parse_args()

    import torch
    import torch._inductor.config as icfg

    import bench_shapes
    import bench_step as bs
    import opake_compile as opake
    from opake_compile.compiler.passes.rewrites import GhostClipping

    torch.set_num_threads(ns.threads)
    clock = time.process_time if ns.threads == 1 else time.perf_counter
    icfg.cpp.enable_kernel_profile = ns.profile
    t, b = (int(v) for v in ns.model.removeprefix("gpt2_t").split("_b"))
    torch.manual_seed(0)
    spec = bench_shapes.build_gpt2(bs, ns.quick, t, b, ns.vocab, ns.attention)
    b = spec.batch_size
    args = spec.make_batch(spec.batch_size, torch.Generator().manual_seed(1))
    model = spec.model

    loss = bs._param_loss(spec)
    params = {k: p.detach() for k, p in bs._trainable(model).items()}
    cgrad = torch.compile(lambda p, *a: torch.func.grad(loss)(p, *a))

    def np_grad() -> object:
        with torch.no_grad():
            return cgrad(params, *args)

    steps = {"dp_default": opake.compile_dp(spec.loss_fn, model=model, clipping_norm=1.0, physical_batch_size=b, backend="inductor")}
    if ns.compare_ghost_embeddings:
        force = {"transformer.wte.weight": "ghost", "transformer.wpe.weight": "ghost"}
        steps["dp_ghost_embeddings"] = opake.compile_dp(
            spec.loss_fn, model=model, clipping_norm=1.0, physical_batch_size=b, backend="inductor",
            rewrites=[GhostClipping(force=force)],
        )
    if ns.compare_float64_sums:
        steps["dp_float64_sums"] = opake.compile_dp(
            spec.loss_fn, model=model, clipping_norm=1.0, physical_batch_size=b, backend="inductor")
    for budget in ns.compare_budget:
        steps[f"dp_budget_{budget:g}"] = opake.compile_dp(
            spec.loss_fn, model=model, clipping_norm=1.0, physical_batch_size=b, backend="inductor",
            rewrites=[GhostClipping(materialize_budget=budget)],
        )
    fns = {"np_grad": np_grad} | {k: (lambda s=s: s(*args)) for k, s in steps.items()}
    from opake_compile.compiler.passes import _factors, rewrites

    def traced_with(step, patches: list[tuple[object, str, object]]):
        """``step`` called on the batch, its first call (the trace) with ``setattr(module,
        name, value)`` for each patch, restored afterwards."""
        traced: list[bool] = []

        def call() -> object:
            if traced:
                return step(*args)
            saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
            for m, name, value in patches:
                setattr(m, name, value)
            try:
                return step(*args)
            finally:
                for m, name, value in saved:
                    setattr(m, name, value)
                traced.append(True)

        return call

    if ns.direct_pass_cost is not None:  # the trace reads the cost model
        for budget in ns.compare_budget:
            key = f"dp_budget_{budget:g}"
            fns[key] = traced_with(steps[key], [(rewrites, "DIRECT_PASS_COST", ns.direct_pass_cost)])
    if ns.compare_float64_sums:  # the trace: every sum a float64 product over all rows
        never = lambda *a, **k: False  # noqa: E731
        fns["dp_float64_sums"] = traced_with(
            steps["dp_float64_sums"], [(_factors, "per_example_sum_ok", never), (rewrites, "per_example_sum_ok", never)])
    print(f"{spec.description}; {ns.threads} thread(s), {'CPU' if ns.threads == 1 else 'wall'} time, load {os.getloadavg()}")
    for k, f in fns.items():
        t0 = time.perf_counter()
        f()
        print(f"{k}: first call {time.perf_counter() - t0:.1f} s", flush=True)
        f()
    for k, s in steps.items():
        print(f"{k} coverage:")
        for name, label in s.coverage.items():
            if not label.startswith("direct"):
                print(f"    {name:40s} {label}")
    keys, ts = list(fns), {k: [] for k in fns}
    for r in range(ns.rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            t0 = clock()
            fns[k]()
            ts[k].append(clock() - t0)
    base = statistics.median(ts["np_grad"])
    print(f"{'row':22s} {'median ms':>10s} {'x np (medians)':>15s} {'x np (per round)':>17s}")
    for k in keys:
        per_round = statistics.median(a / n for a, n in zip(ts[k], ts["np_grad"]))
        print(f"{k:22s} {statistics.median(ts[k]) * 1e3:10.0f} {statistics.median(ts[k]) / base:15.3f} {per_round:17.3f}")
    print(f"load after: {os.getloadavg()}")
    if ns.profile:
        from torch.profiler import ProfilerActivity, profile

        for k in keys:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                fns[k]()
            print(f"===== {k}")
            table = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=ns.rows, max_name_column_width=60, max_shapes_column_width=70,
            )
            print(table)


if __name__ == "__main__":
    main()
