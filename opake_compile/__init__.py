"""opake_compile: differentially private training for PyTorch as a compiler transform.

``compile_dp`` traces a batch loss, rewrites its graph into per-example gradients of the
trainable parameters, clips each example to L2 norm C, sums, and lowers through Inductor;
``DPOptimizer`` adds Gaussian noise and steps any ``torch.optim`` optimizer; ``PoissonSampler``
and :mod:`opake_compile.accounting` make the guarantee real. The eager functional API
(:mod:`.pytree`, :mod:`.functional`, :mod:`.random`, :mod:`.dpsgd`) is the reference the
compiled path is verified against.

    >>> import opake_compile as opake
"""

from opake_compile import (
    accounting,
    auditing,
    distributed,
    dpftrl,
    dpsgd,
    exceptions,
    functional,
    patches,
    pytree,
    random,
    sampling,
    schedules,
    serialization,
)
from opake_compile.checkpoint import Checkpointer
from opake_compile.compiler import DPStep, DPStepResult, compile_dp
from opake_compile.dpsgd import (
    ClippedPytree,
    NoisedPytree,
    clip_pytree,
    clipped_grad,
    gaussian_noise,
)
from opake_compile.functional import empty_collate, make_functional, with_batch_dim
from opake_compile.optim import DPOptimizer, accumulate
from opake_compile.sampling import PoissonSampler
from opake_compile.verify import VerificationReport, verify

__version__ = "0.1.0"

__all__ = [
    "accounting",
    "auditing",
    "distributed",
    "dpftrl",
    "dpsgd",
    "exceptions",
    "functional",
    "patches",
    "pytree",
    "random",
    "sampling",
    "schedules",
    "serialization",
    "Checkpointer",
    "compile_dp",
    "DPStep",
    "DPStepResult",
    "DPOptimizer",
    "accumulate",
    "ClippedPytree",
    "NoisedPytree",
    "clip_pytree",
    "clipped_grad",
    "gaussian_noise",
    "make_functional",
    "with_batch_dim",
    "empty_collate",
    "PoissonSampler",
    "verify",
    "VerificationReport",
]
