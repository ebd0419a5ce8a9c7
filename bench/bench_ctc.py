#!/usr/bin/env python
"""CTC under compile_dp: graph size, trace seconds and step time against the number of frames T.

Model: a tiny ``transformers.Wav2Vec2ForCTC`` (hidden 8, one layer, vocabulary 5, conv strides
4 and 2, so T is about samples / 8; dropout, LayerDrop and SpecAugment off), its own labels
(``model(x, attention_mask=mask, labels=labels).loss``, 12 labels per example), P = 4.

For each T and each CTC implementation (``kernel``: PyTorch's ``_ctc_loss`` through the
``opake::ctc_nll`` custom ops, the default; ``recursion``: the forward recursion unrolled over
the frames, the fallback), in this process:

- ``nodes``: nodes of the traced per-example gradient graph (``trace_per_example_grads``);
- ``trace s``: that trace alone;
- ``first s``: the first call of a ``compile_dp`` step (traces again, runs the passes, lowers);
- ``step ms``: the median of ``--reps`` further calls, the two implementations' steps called
  alternately so that both see the same load; ``rec/kern``: the median per-round ratio.

``--backend inductor`` lowers with Inductor instead of ``aot_eager`` (slow for the recursion at
large T: the unrolled graph is what Inductor compiles)::

    PYTHONPATH=. python bench/bench_ctc.py --frames 50,200,500 --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any


def _model() -> Any:
    import torch
    import transformers

    config = transformers.Wav2Vec2Config(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        vocab_size=5, attn_implementation="eager", hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config).train()


def _batch(frames: int, p: int) -> tuple:
    import torch

    g = torch.Generator().manual_seed(1)
    samples = 8 * frames + 4
    x = torch.randn(p, samples, generator=g)
    mask = torch.ones(p, samples, dtype=torch.long)
    mask[1:, samples // 2 :] = 0
    labels = torch.randint(1, 5, (p, 12), generator=g)
    labels[0, 8:] = -100
    return x, mask, labels


def _loss(m: Any, x: Any, mask: Any, labels: Any) -> Any:
    return m(x, attention_mask=mask, labels=labels).loss


@contextlib.contextmanager
def _impl(name: str):  # noqa: ANN202
    from opake_compile import _ctc

    saved = _ctc._kernel_applies
    if name == "recursion":
        _ctc._kernel_applies = lambda log_probs: False
    try:
        yield
    finally:
        _ctc._kernel_applies = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", default="50,200,500")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="aot_eager", help="aot_eager or inductor")
    parser.add_argument("--impls", default="kernel,recursion")
    args = parser.parse_args()

    import torch

    import opake_compile as opake
    from opake_compile.compiler.trace import trace_per_example_grads

    torch.set_num_threads(max(1, torch.get_num_threads()))
    impls = args.impls.split(",")
    backend = None if args.backend == "inductor" else args.backend
    print("T    impl       nodes  trace s  first s  step ms")
    for frames in [int(t) for t in args.frames.split(",")]:
        batch, p = _batch(frames, 4), 4
        steps, times = {}, {k: [] for k in impls}
        for impl in impls:
            model = _model()
            with _impl(impl):
                t0 = time.perf_counter()
                traced = trace_per_example_grads(model, _loss, batch, batched_positions=(0, 1, 2), physical_batch_size=p)
                trace_s = time.perf_counter() - t0
                step = opake.compile_dp(_loss, model=model, clipping_norm=1.0, backend=backend, physical_batch_size=p)
                t0 = time.perf_counter()
                step(*batch)
                first_s = time.perf_counter() - t0
            steps[impl] = step
            print(f"{frames:<4} {impl:<10} {len(traced.gm.graph.nodes):>6} {trace_s:>8.2f} {first_s:>8.2f}", flush=True)
        ratios = []
        for _ in range(args.reps):
            for impl in impls:
                t0 = time.perf_counter()
                steps[impl](*batch)
                times[impl].append(1e3 * (time.perf_counter() - t0))
            if len(impls) == 2:
                ratios.append(times[impls[1]][-1] / times[impls[0]][-1])
        line = "  ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in times.items())
        extra = f"  {impls[1][:3]}/{impls[0][:4]} {statistics.median(ratios):.2f}" if ratios else ""
        print(f"{frames:<4} step: {line}{extra}", flush=True)


if __name__ == "__main__":
    main()
