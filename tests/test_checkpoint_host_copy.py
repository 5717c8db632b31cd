"""The megatron-core actor's checkpoint state is copied to the host, tensor by tensor: ``copy.deepcopy`` of the
optimiser state (what the actor did) first made a second copy of every tensor where it lives, on the device: the
Adam moments and fp32 master weights, 12 bytes a parameter, ~20 GB at 1.5B on one rank, beside the training
state. On CPU the device cannot be seen, so the test forbids what made that copy: a tensor's ``__deepcopy__``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from laconic_nemo.actors.megatron_shards import host_copy  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def actor():
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.config import load_config
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    cfg = load_config("tiny_cpu", ["parallel.tensor_model_parallel_size=1", "model.num_layers=2",
                                   "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=29"])
    yield MegatronCoreActor.from_config(cfg)
    destroy_distributed()


def _adam_step(actor) -> None:
    """One optimiser step with gradients of ones, so the optimiser has moments to save."""
    for p in actor.module.parameters():
        g = torch.ones_like(p)
        if hasattr(p, "main_grad"):
            p.main_grad.copy_(g)
        else:
            p.grad = g
    actor.optimizer.step()


def test_checkpoint_state_deep_copies_no_tensor(actor, monkeypatch):
    """state_dict_for_checkpoint copies each optimiser tensor to the host (none through deepcopy), holds the same
    values as the optimiser's own state_dict, and is independent of it: the next step leaves it unchanged. Before,
    the deepcopy of the optimiser state failed here."""
    _adam_step(actor)
    live = actor.optimizer.state_dict()
    moments = [t for t in _tensors(live) if t.dim() > 0]
    assert moments, "the optimiser state holds tensors after a step"

    def refuse(self, memo):
        raise AssertionError("a tensor was deep-copied where it lives")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", refuse)
    state = actor.state_dict_for_checkpoint()
    monkeypatch.undo()
    saved = _tensors(state["optimizer"])
    assert len(saved) == len(_tensors(live)) and all(t.device.type == "cpu" for t in saved)
    assert all(torch.equal(a, b) for a, b in zip(saved, _tensors(live)))
    before = [t.clone() for t in saved]
    _adam_step(actor)
    after = _tensors(actor.optimizer.state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the live state moved on
    assert all(torch.equal(a, b) for a, b in zip(before, saved))      # the saved copy did not
    # and it restores: loading it gives back the saved optimiser state
    actor.load_checkpoint_state(state)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(actor.optimizer.state_dict()), before))


def test_host_copy_is_deepcopy_with_tensors_on_the_host():
    """host_copy does what copy.deepcopy does on nested dicts / lists / tuples: equal values, new tensors, a shared
    tensor still shared, non-tensor values copied (hand-built structure); deepcopy's own result compared."""
    shared = torch.arange(4.0)
    obj = {"state": {0: {"exp_avg": shared, "step": torch.tensor(3.0)}, 1: {"exp_avg": shared}},
           "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.95)}], "scale": None}
    out = host_copy(obj)
    assert out.keys() == obj.keys() and out["scale"] is None and out["param_groups"] is not obj["param_groups"]
    assert out["param_groups"][0]["betas"] == (0.9, 0.95) and out["param_groups"][0]["params"] == [0, 1]
    a, b = out["state"][0]["exp_avg"], out["state"][1]["exp_avg"]
    assert a is b and a is not shared and torch.equal(a, shared)
    ref = copy.deepcopy(obj)
    assert (ref["state"][0]["exp_avg"] is ref["state"][1]["exp_avg"]) == (a is b)
    shared.add_(1)
    assert torch.equal(a, torch.arange(4.0)) and float(out["state"][0]["step"]) == 3.0


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a nested state, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in obj for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
