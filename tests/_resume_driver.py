"""Runs the main job (``examples/train_digits.py``) for the kill-and-resume test of
``test_checkpoint.py``: ``python _resume_driver.py OUT KILL_AFTER -- ARGS...``.

With ``KILL_AFTER >= 0`` the process sends itself SIGKILL right after the checkpoint of that
step has been written (no sleeps, no clean-up: what a pre-emption does). Otherwise it trains to
the end and saves the final parameters, optimizer state and reported epsilon to ``OUT``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "examples")]  # this checkout's package and main job

import train_digits as td  # noqa: E402

from opake_compile import checkpoint as _checkpoint  # noqa: E402


def main() -> None:
    out, kill_after = sys.argv[1], int(sys.argv[2])
    argv = sys.argv[sys.argv.index("--") + 1 :]
    torch.set_num_threads(1)
    if kill_after >= 0:
        save = _checkpoint.Checkpointer.save

        def save_then_die(self, step_number, **objects):
            path = save(self, step_number, **objects)
            if step_number == kill_after:
                print(f"SIGKILL after writing {Path(path).name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        _checkpoint.Checkpointer.save = save_then_die
    summary = td.train(td.parse_args(argv))
    p = summary["private"]
    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in p["model"].state_dict().items()},
            "optimizer": p["optimizer"].state_dict(),
            "epsilon": p["epsilon"],
            "steps": p["steps"],
            "resumed_from_step": p["resumed_from_step"],
            "history": p["history"],
        },
        out,
    )
    print(f"done: {p['steps']} steps, epsilon {p['epsilon']!r}, resumed from step {p['resumed_from_step']}", flush=True)


if __name__ == "__main__":
    main()
