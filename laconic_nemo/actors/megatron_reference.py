"""The reference policy pi_ref of the megatron-core actor (``grpo.kl_beta > 0``): a frozen copy of the weights where
``grpo.reference_on`` puts it, swapped into the model for reference log-probs.

* ``device``: the copy stays on the device; swapping exchanges the storage of every weight with its reference
  tensor (no copy);
* ``cpu`` / ``pinned``: the copy stays in host memory (pinned: page-locked, GPU only); swapping saves the current
  weights to the host (into a reused pinned buffer when pinned), loads the reference, and loads the saved weights
  back afterwards.

:class:`ReferencePolicy` is the reference part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`; it
reads and writes the weights through the weights part (:class:`laconic_nemo.actors.megatron_shards.ModelWeights`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from laconic_nemo.actors.megatron_build import resolve_choice
from laconic_nemo.actors.megatron_shards import ModelWeights


def resolve_reference_on(reference_on: str, device: torch.device) -> str:
    """``grpo.reference_on`` (checked at the config boundary) with ``auto`` -> ``device``; ``pinned`` refused off
    a GPU."""
    where = resolve_choice(reference_on, "device")
    if where == "pinned" and device.type != "cuda":
        raise ValueError("grpo.reference_on=pinned needs a GPU (pinned host memory); use device, cpu or auto")
    return where


class ReferencePolicy:
    """pi_ref: ``state`` (local name -> tensor of the weights part's shape; None: no reference policy) kept where
    ``reference_on`` (device, pinned or cpu, resolved) puts it; kept at all only when ``kl_beta`` > 0 (on
    :meth:`snapshot`)."""

    def __init__(self, weights: ModelWeights, reference_on: str, kl_beta: float, device: torch.device):
        self.weights, self.reference_on, self.kl_beta, self.device = weights, reference_on, float(kl_beta), device
        self.state: dict[str, torch.Tensor] | None = None
        self.scratch: dict[str, torch.Tensor] | None = None  # pinned host buffer for reference_on=pinned

    @property
    def on_device(self) -> bool:
        """Whether a reference policy is held in device memory (for the memory model)."""
        return self.state is not None and self.reference_on == "device"

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` where ``reference_on`` keeps the reference weights (device, pinned or CPU memory)."""
        if self.reference_on == "device":
            return t.detach().to(self.device, copy=True)
        out = t.detach().to("cpu", copy=True)
        return out.pin_memory() if self.reference_on == "pinned" else out

    def reset(self) -> None:
        """Freeze the current weights as the reference policy pi_ref (placed by ``reference_on``)."""
        self.state = {k: self.place(v) for k, v in self.weights.param_state().items()}

    def snapshot(self) -> None:
        """The current weights become pi_ref (only kept when kl_beta > 0)."""
        if self.kl_beta > 0:
            self.reset()

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The reference weights in the model for the body of the ``with``; the current ones restored after."""
        if self.state is None:
            raise ValueError("reference log-probs need a reference policy (grpo.kl_beta > 0 or reset_reference())")
        if self.reference_on == "device":
            self._exchange()
            try:
                yield
            finally:
                self._exchange()
            return
        saved = self._save_params()
        self._load_params(self.state)
        try:
            yield
        finally:
            self._load_params(saved)

    def _exchange(self) -> None:
        """Device-resident reference: swap the storage of every weight with its reference tensor (no copy;
        calling it twice restores both)."""
        ref = self.state
        for k, v in self.weights.param_state().items():
            v.data, ref[k] = ref[k], v.data

    def _save_params(self) -> dict[str, torch.Tensor]:
        """Host copies of the current weights (into a reused pinned buffer when ``reference_on=pinned``)."""
        current = self.weights.param_state()
        if self.reference_on != "pinned":
            return {k: v.detach().to("cpu", copy=True) for k, v in current.items()}
        if self.scratch is None:
            self.scratch = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in current.items()}
        return {k: self.scratch[k].copy_(v.detach(), non_blocking=True) for k, v in current.items()}

    @torch.no_grad()
    def _load_params(self, state: dict[str, torch.Tensor]) -> None:
        non_blocking = self.reference_on == "pinned"
        for k, v in self.weights.param_state().items():
            v.data.copy_(state[k].to(v.device, non_blocking=non_blocking))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_entry(self) -> dict[str, torch.Tensor] | None:
        """A checkpoint's ``"reference"`` entry: host copies of pi_ref (None without one)."""
        return None if self.state is None else {k: v.to("cpu", copy=True) for k, v in self.state.items()}

    def load_checkpoint_entry(self, ref: dict[str, torch.Tensor] | None) -> None:
        """Restore what :meth:`checkpoint_entry` returned, placed by ``reference_on``."""
        self.state = None if ref is None else {k: self.place(v) for k, v in ref.items()}
