"""Checkpoint shards of the megatron-core actor: this rank's model, optimiser and scheduler state, and the
unsharded (TP shards concatenated, PP stages merged, vocabulary padding removed) weights and gradients, named as in
a TP = 1 / PP = 1 GPTModel; :func:`merge_rank_states` merges saved shards offline by the same rules.

:class:`ShardsMixin` is a part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

_LAYER_PREFIX = "decoder.layers."


def host_copy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor copied to the host and everything else deep-copied:
    what ``copy.deepcopy`` gives, but a device tensor is copied straight into host memory instead of into a new
    device tensor first. A tensor held in two places stays one tensor, as with deepcopy."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = {k: host_copy(v, memo) for k, v in obj.items()}
    elif type(obj) in (list, tuple):
        out = type(obj)(host_copy(v, memo) for v in obj)
    else:
        return copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


class ShardsMixin:
    """This rank's state for checkpoints and the warm-up cache, and the unsharded weights / gradients."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights (CPU copies), e.g. a warmed-up policy to cache."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._param_state().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`model_state` (same layout); the optimiser is untouched."""
        current = self._param_state()
        missing = set(current) - set(state)
        if missing:
            raise ValueError(f"model state lacks tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state[k].to(v.device))

    def _param_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


    # ------------------------------------------------------------------ checkpoints
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model, optimiser and scheduler state (host copies, ``torch.save``-able): no copy of a tensor
        is made on the device (the optimiser state is 12 bytes a parameter, ~20 GB at 1.5B on one rank)."""
        return {
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self._param_state().items()},
            "optimizer": host_copy(self.optimizer.state_dict()),
            "scheduler": {"step_count": self.step_count, "lr": self.lr, "warmup_steps": self.warmup_steps},
            "reference": None if self._ref_state is None else {k: v.to("cpu", copy=True) for k, v in self._ref_state.items()},
            "parallel": {"tp": self.info.tp_size, "pp": self.info.pp_size, "tp_rank": self.tp_rank,
                         "pp_rank": self.pp_rank, "num_layers": self.config.num_layers,
                         "vocab_size": self.vocab_size, "tp_split_dims": self.tp_split_dims()},
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned (same TP/PP layout)."""
        par = state.get("parallel", {})
        if par and (par.get("tp"), par.get("pp")) != (self.info.tp_size, self.info.pp_size):
            raise ValueError(
                f"checkpoint was written with tp={par.get('tp')}, pp={par.get('pp')}; this run has "
                f"tp={self.info.tp_size}, pp={self.info.pp_size}"
            )
        current = self._param_state()
        missing = set(current) - set(state["model"])
        if missing:
            raise ValueError(f"checkpoint lacks model tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state["model"][k].to(v.device))
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step_count = int(state["scheduler"]["step_count"])
        ref = state.get("reference")
        self._ref_state = None if ref is None else {k: self._place_reference(v) for k, v in ref.items()}

    # ------------------------------------------------------------------ full (unsharded) tensors
    def _global_name(self, name: str) -> str:
        """Local parameter name -> name in the unsharded single-stage model (global layer index)."""
        return global_param_name(name, self.pp_rank, self.config.num_layers // self.info.pp_size)

    def tp_split_dims(self) -> dict[str, int]:
        """Local parameter name -> the dimension its TP shards are concatenated along (TP-sharded ones only)."""
        return {name: int(p.partition_dim) for name, p in self.module.named_parameters()
                if getattr(p, "tensor_model_parallel", False)}

    def _local_tensors(self, grads: bool) -> dict[str, tuple[torch.Tensor, Any]]:
        out = {}
        for name, p in self.module.named_parameters():
            if grads:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                t = g
            else:
                t = p
            out[name] = (t.detach(), p)
        return out

    def _gather_full(self, grads: bool) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        mine = {}
        for name, (t, p) in self._local_tensors(grads).items():
            if getattr(p, "tensor_model_parallel", False) and self.info.tp_size > 1:
                parts = [torch.empty_like(t) for _ in range(self.info.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=p.partition_dim)
            t = t.float().cpu().clone()
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[: self.vocab_size]
            mine[self._global_name(name)] = t
        if self.info.pp_size > 1:
            everything: list[Any] = [None] * self.info.pp_size
            dist.all_gather_object(everything, mine, group=parallel_state.get_pipeline_model_parallel_group())
            full = {}
            for d in everything:
                full.update(d)
            return full
        return mine

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded float32 CPU weights (TP shards concatenated, PP stages merged, vocab padding removed),
        named as in a TP=1/PP=1 GPTModel; identical on every rank."""
        return self._gather_full(grads=False)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients (``main_grad``) of the last backward, same naming as :meth:`full_state_dict`."""
        return self._gather_full(grads=True)

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (naming of :meth:`full_state_dict`): pad the vocabulary, take this rank's
        TP shard and PP layers. Padded vocabulary rows are set to zero."""
        for name, p in self.module.named_parameters():
            key = self._global_name(name)
            if key not in full:
                raise KeyError(f"full state dict lacks {key!r}")
            t = full[key].to(torch.float32)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and t.shape[0] < self.padded_vocab_size:
                t = torch.cat([t, t.new_zeros(self.padded_vocab_size - t.shape[0], *t.shape[1:])], dim=0)
            if getattr(p, "tensor_model_parallel", False) and self.info.tp_size > 1:
                t = t.chunk(self.info.tp_size, dim=p.partition_dim)[self.tp_rank]
            if t.shape != p.shape:
                raise ValueError(f"{key}: shard shape {tuple(t.shape)} does not match parameter {tuple(p.shape)}")
            p.data.copy_(t.to(p.device, p.dtype))


def global_param_name(name: str, pp_rank: int, layers_per_stage: int) -> str:
    """Local parameter name of pipeline stage ``pp_rank`` -> its name in the unsharded single-stage model
    (``decoder.layers.<i>`` renumbered with the global layer index ``i + pp_rank * layers_per_stage``)."""
    if name.startswith(_LAYER_PREFIX):
        idx, tail = name[len(_LAYER_PREFIX):].split(".", 1)
        return f"{_LAYER_PREFIX}{int(idx) + pp_rank * layers_per_stage}.{tail}"
    return name


def merge_rank_states(states: dict[tuple[int, int], dict[str, torch.Tensor]], tp: int, pp: int, num_layers: int,
                      tp_split_dims: dict[str, int], vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Offline counterpart of :meth:`MegatronCoreActor.full_state_dict`: merge the per-rank weights of a
    TP x PP layout into the unsharded single-stage model, without torch.distributed.

    states: ``(tp_rank, pp_rank) -> {local name: tensor}`` for every rank of the layout (what
    :meth:`MegatronCoreActor.state_dict_for_checkpoint` holds under ``"model"``); tp_split_dims: local
    name -> TP concatenation dimension of the TP-sharded parameters (others are replicated, the copy of
    TP rank 0 is taken); vocab_size: when given, the padded vocabulary rows of the embedding and output
    layer are dropped ([Vp, H] -> [V, H]). Tensors keep their dtype; names as in :meth:`full_state_dict`.
    """
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in states]
    if missing:
        raise ValueError(f"rank states missing for (tp_rank, pp_rank) {missing}")
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        for name, t in states[(0, p)].items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            if name in tp_split_dims and tp > 1:
                t = torch.cat([states[(r, p)][name] for r in range(tp)], dim=tp_split_dims[name])
            if vocab_size is not None and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[:vocab_size]
            key = global_param_name(name, p, num_layers // pp)
            if key in full:
                raise ValueError(f"{key} is held by two pipeline stages")
            full[key] = t
    return full
