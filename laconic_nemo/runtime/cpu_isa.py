"""The instruction set of a CPU run's kernels: the machine's own (the default) or a pin (``LACONIC_CPU_ISA=avx2``).

torch's CPU wheel carries its kernels in several builds and picks one by the processor it runs on: ATen's
vectorised kernels (reductions, softmax, norms, element-wise maths) in AVX-512 where the CPU has it, else AVX2;
MKL (the wheel's BLAS, and its vector maths library VML, which ATen calls for sqrt, exp, log, ...) a code path
per processor, another on an Intel than on an AMD CPU; oneDNN (the GELU) its AVX-512 or AVX2 code. A sum over
16-wide vectors rounds otherwise than one over 8-wide vectors, so the same code, versions and threads give other
bits on another x86-64 machine, and a 70-step run drifts apart.

``LACONIC_CPU_ISA`` chooses:

* ``native`` (the default): torch's, MKL's and oneDNN's own choices (and the variables as the user set them).
  The run's floats are the machine's; what the main job shows is stated as a band over machines and seeds
  (README, "The main job"), not as one machine's bits.
* ``avx2``: the ranks are pinned, before torch runs its first kernel, to :data:`PINS` (overriding those variables):
  ``ATEN_CPU_CAPABILITY=avx2`` (ATen's AVX2 kernels), ``MKL_CBWR=COMPATIBLE`` (MKL's conditional-numerical-
  reproducibility branch that MKL runs on processors of every vendor; its ``AVX2`` branch is for Intel processors
  only) and ``ONEDNN_MAX_CPU_ISA=AVX2``. What it buys, measured (docs/megatron_cpu.md, "Which kernels part two
  machines"): the same bits under every ISA setting of one machine, and on two Intel Xeons with AVX-512; not the
  same bits on an Intel and an AMD machine: MKL's COMPATIBLE branch computes a float32 sqrt (VML, the optimiser's
  Adam denominator) that is not correctly rounded and whose bits follow the processor's approximate instructions.
  Its price: about 1.5x the CPU time of the native kernels.

Only CPU runs are pinned: a GPU run's kernels run on the GPU, and the pin would slow its CPU side for nothing.
Machines other than x86-64 (aarch64: no AVX2, no MKL) are not pinned either. The warm-up cache key and a
checkpoint's meta name the kernels in effect either way (:func:`cpu_isa`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from typing import Any

ISA_ENV = "LACONIC_CPU_ISA"
DEFAULT = "native"
# the settings of each pinned choice: every x86-64 CPU with AVX2, of any vendor, honours them (the same bits on
# every ISA setting of one vendor's machines, not across vendors: module docstring)
PINS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
CHOICES = (*PINS, "native")
X86_64 = ("x86_64", "amd64")


def cpu_isa_setting(env: MutableMapping[str, str] | None = None) -> str:
    """``LACONIC_CPU_ISA`` of ``env`` (default ``os.environ``): one of :data:`CHOICES`; ValueError naming the
    variable and the allowed values otherwise."""
    env = os.environ if env is None else env
    value = env.get(ISA_ENV, DEFAULT).strip().lower() or DEFAULT
    if value not in CHOICES:
        raise ValueError(f"{ISA_ENV} = {env.get(ISA_ENV)!r} is invalid: allowed {' | '.join(CHOICES)}")
    return value


def is_x86_64() -> bool:
    return platform.machine().lower() in X86_64


def runs_on_cpu(backend: str) -> bool:
    """A run's kernels run on the CPU: the gloo backend, or no CUDA device (``parallel.backend`` auto)."""
    import torch

    return backend == "gloo" or not torch.cuda.is_available()


def pin_cpu_isa(env: MutableMapping[str, str] | None = None, cpu: bool = True) -> dict[str, str]:
    """Write the pin of ``LACONIC_CPU_ISA`` into ``env`` (default ``os.environ``) when the run is on the CPU
    (``cpu``) of an x86-64 machine; returns the variables set (empty: nothing pinned). It must happen before
    torch's first kernel in the process that reads ``env`` (ATen and MKL read their variable once, then keep
    their choice): in the launcher for its ranks' environment, or at the start of a rank."""
    env = os.environ if env is None else env
    setting = cpu_isa_setting(env)
    if not cpu or setting not in PINS or not is_x86_64():
        return {}
    env.update(PINS[setting])
    return dict(PINS[setting])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_isa() -> dict[str, Any]:
    """What this process's CPU kernels run with (the warm-up cache key and ``meta.json`` name it): ``pin``, the
    name of the pinned choice in effect (None: not pinned), the machine, ATen's capability in effect (reading it
    fixes it: call after :func:`pin_cpu_isa`), ``MKL_CBWR`` and ``ONEDNN_MAX_CPU_ISA``. Not pinned (``native``, a
    GPU run, another machine, a CPU without AVX2), the CPU's model is named too: the kernels are then its own."""
    import torch

    aten = torch.backends.cpu.get_cpu_capability()
    mkl, onednn = os.environ.get("MKL_CBWR"), os.environ.get("ONEDNN_MAX_CPU_ISA")
    pin = next((name for name, v in PINS.items() if is_x86_64() and aten.lower() == v["ATEN_CPU_CAPABILITY"]
                and mkl == v["MKL_CBWR"] and onednn == v["ONEDNN_MAX_CPU_ISA"]), None)
    out: dict[str, Any] = {"pin": pin, "machine": platform.machine(), "aten": aten, "mkl_cbwr": mkl,
                           "onednn_max_cpu_isa": onednn}
    if pin is None:
        out["cpu"] = _cpu_model()
    return out


def planned_cpu_isa(env: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """What the ranks of a CPU run started from this environment run with: the pin of ``LACONIC_CPU_ISA`` on an
    x86-64 CPU with AVX2 (as :func:`cpu_isa` reports it in a pinned rank), without reading this process's own
    choice (a process whose kernels already ran, e.g. an evaluation inside a test, finds the trainer's warm-up
    cache under it); otherwise this process's :func:`cpu_isa`."""
    import torch

    env = os.environ if env is None else env
    pin = PINS.get(cpu_isa_setting(env))
    if pin is None or not is_x86_64() or not torch.cpu._is_avx2_supported():
        return cpu_isa()
    return {"pin": cpu_isa_setting(env), "machine": platform.machine(), "aten": pin["ATEN_CPU_CAPABILITY"].upper(),
            "mkl_cbwr": pin["MKL_CBWR"], "onednn_max_cpu_isa": pin["ONEDNN_MAX_CPU_ISA"]}


def describe(isa: dict[str, Any]) -> str:
    """One line for the logs: ``ATen AVX2, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=AVX2`` (and the CPU when not
    pinned)."""
    text = (f"ATen {isa['aten']}, MKL_CBWR={isa.get('mkl_cbwr') or 'unset'}, "
            f"ONEDNN_MAX_CPU_ISA={isa.get('onednn_max_cpu_isa') or 'unset'}")
    return text + (f", {isa['cpu']}" if "cpu" in isa else "")


def setting_of(isa: dict[str, Any]) -> str:
    """The ``LACONIC_CPU_ISA`` a :func:`cpu_isa` record was made under: its pin, else ``native`` (or a machine the pin
    does not apply to)."""
    return f"{ISA_ENV}={isa['pin']}" if isa.get("pin") else f"{ISA_ENV}=native or a machine without the pin"


def kernels_note(saved: dict[str, Any] | None, now: dict[str, Any], where: str) -> str | None:
    """One line when a resumed run's CPU kernels (``now``, :func:`cpu_isa`) are not those the checkpoint ``where`` was
    written with (``saved``, its record; None: not recorded, nothing to compare): what each ran with. A preempted job
    may come back on another machine or setting, so this is said, never refused: the steps from here round otherwise
    than those of a run that kept the checkpoint's kernels."""
    if not isinstance(saved, dict) or "aten" not in saved or saved == now:  # no record (or not one of ours)
        return None
    return (f"resumed under other CPU kernels than the checkpoint's: {where} was written with {describe(saved)} "
            f"({setting_of(saved)}), this process runs with {describe(now)} ({setting_of(now)}); its steps from here "
            "round otherwise than those of a run that kept the checkpoint's kernels")

