"""The weights of the megatron-core actor: this rank's shard (its checkpoint entries ``"model"`` and ``"parallel"``;
the optimiser and scheduler entries are the training step's, :mod:`laconic_nemo.actors.megatron_step`), and the
unsharded (TP shards concatenated, PP stages merged, vocabulary padding removed) weights and gradients, named as in
a TP = 1 / PP = 1 GPTModel; :func:`merge_rank_states` merges saved shards offline by the same rules.

:class:`ModelWeights` is the weights part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`: it owns
the bare GPTModel of this rank, its layout and vocabulary sizes; the reference policy
(:mod:`laconic_nemo.actors.megatron_reference`) and the training step read and write the weights through it.
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


class ModelWeights:
    """This rank's weights: the bare GPTModel of one pipeline stage (``module``, unwrapped from DDP), its state for
    checkpoints and the warm-up cache, and where its shards sit in the unsharded model.

    info: this rank's layout (:class:`laconic_nemo.runtime.megatron_env.ParallelInfo`); config: megatron's
    TransformerConfig (``num_layers`` L over ``pp`` stages); vocab_size: the real vocabulary V; padded_vocab_size:
    Vp, a multiple of TP (the embedding and output layer hold ``[Vp / tp, H]`` rows on each TP rank).
    """

    def __init__(self, module: torch.nn.Module, info: Any, config: Any, vocab_size: int, padded_vocab_size: int):
        self.module, self.info, self.config = module, info, config
        self.vocab_size, self.padded_vocab_size = int(vocab_size), int(padded_vocab_size)

    def param_state(self) -> dict[str, torch.Tensor]:
        """The module's tensors by local name (parameters and buffers, the live tensors, not copies)."""
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}

    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights (CPU copies), e.g. a warmed-up policy to cache or a checkpoint's ``"model"``."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.param_state().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`model_state` (same layout); the optimiser is untouched."""
        current = self.param_state()
        missing = set(current) - set(state)
        if missing:
            raise ValueError(f"model state lacks tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state[k].to(v.device))

    # ------------------------------------------------------------------ checkpoints
    def layout_entry(self) -> dict[str, Any]:
        """A checkpoint's ``"parallel"`` entry: the TP x PP layout and what merging the shards offline needs."""
        info = self.info
        return {"tp": info.tp_size, "pp": info.pp_size, "tp_rank": info.tp_rank, "pp_rank": info.pp_rank,
                "num_layers": self.config.num_layers, "vocab_size": self.vocab_size,
                "tp_split_dims": self.tp_split_dims()}

    def load_checkpoint_entries(self, state: dict[str, Any]) -> None:
        """Check a checkpoint's ``"parallel"`` layout against this run's and load its ``"model"`` weights."""
        par = state.get("parallel", {})
        if par and (par.get("tp"), par.get("pp")) != (self.info.tp_size, self.info.pp_size):
            raise ValueError(
                f"checkpoint was written with tp={par.get('tp')}, pp={par.get('pp')}; this run has "
                f"tp={self.info.tp_size}, pp={self.info.pp_size}"
            )
        current = self.param_state()
        missing = set(current) - set(state["model"])
        if missing:
            raise ValueError(f"checkpoint lacks model tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state["model"][k].to(v.device))

    # ------------------------------------------------------------------ full (unsharded) tensors
    def global_name(self, name: str) -> str:
        """Local parameter name -> name in the unsharded single-stage model (global layer index)."""
        return global_param_name(name, self.info.pp_rank, self.config.num_layers // self.info.pp_size)

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
            mine[self.global_name(name)] = t
        if self.info.pp_size > 1:
            everything: list[Any] = [None] * self.info.pp_size
            dist.all_gather_object(everything, mine, group=parallel_state.get_pipeline_model_parallel_group())
            full = {}
            for d in everything:
                full.update(d)
            return full
        return mine

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded float32 CPU weights (TP shards concatenated, PP stages merged, vocab padding removed: the
        embedding and output layer ``[V, H]``), named as in a TP=1/PP=1 GPTModel; identical on every rank."""
        return self._gather_full(grads=False)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients (``main_grad``) of the last backward, same naming and shapes as
        :meth:`full_state_dict`."""
        return self._gather_full(grads=True)

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (naming of :meth:`full_state_dict`): pad the vocabulary, take this rank's
        TP shard and PP layers. Padded vocabulary rows are set to zero."""
        for name, p in self.module.named_parameters():
            key = self.global_name(name)
            if key not in full:
                raise KeyError(f"full state dict lacks {key!r}")
            t = full[key].to(torch.float32)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and t.shape[0] < self.padded_vocab_size:
                t = torch.cat([t, t.new_zeros(self.padded_vocab_size - t.shape[0], *t.shape[1:])], dim=0)
            if getattr(p, "tensor_model_parallel", False) and self.info.tp_size > 1:
                t = t.chunk(self.info.tp_size, dim=p.partition_dim)[self.info.tp_rank]
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
