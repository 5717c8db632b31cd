"""Operators of a piece of eager PyTorch, counted at the dispatcher (a ``TorchDispatchMode``): what a decode step
asks of the device, measurable without a GPU.

Each ATen operator that reaches the backend is counted once (composite operators are seen as what they decompose
into, an operator's own inner calls are not seen). ``kernels`` leaves out what launches nothing on a GPU: views
(``OpOverload.is_view``: ``view``, ``slice``, ``transpose``, ...) and the alias / allocation operators of
:data:`NO_KERNEL`. On CPU this is the operator count; on a GPU most of these operators are one kernel each, but
not all (``torch.nn.functional.rms_norm`` is one fused kernel on CUDA and six operators on CPU), so GPU kernels are
counted by the profiler there (``benchmarks/gpu_step.py --profile``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

# operators that allocate or alias without computing (no kernel on a GPU)
NO_KERNEL = frozenset({"_unsafe_view", "alias", "lift_fresh", "detach", "empty", "empty_like", "empty_strided",
                       "new_empty", "new_empty_strided", "_reshape_alias", "resize_"})


@dataclass
class OpCount:
    """Operators counted by :class:`count_ops`: ``by_name`` (name -> calls), ``total`` and ``kernels``."""

    by_name: Counter = field(default_factory=Counter)
    total: int = 0
    kernels: int = 0

    def add(self, name: str, kernel: bool) -> None:
        self.by_name[name] += 1
        self.total += 1
        self.kernels += int(kernel)


class count_ops(TorchDispatchMode):
    """``with count_ops() as c: ...`` -> ``c.count`` (:class:`OpCount`) of the operators run inside."""

    def __init__(self):
        super().__init__()
        self.count = OpCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.count.add(name, not func.is_view and name not in NO_KERNEL)
        return func(*args, **(kwargs or {}))
