"""The actor contract: :class:`PolicyActor` declares exactly the members the trainer uses, and both actors
(megatron-core, NeMo-Aligner) provide them; :class:`WarmupActor` likewise for the warm-up. Read from the
source with ``ast`` and from the classes' attributes (the NeMo-Aligner actor imports nemo only inside its
methods, so no NeMo install is needed)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from laconic_nemo.app.warmup import WarmupActor
from laconic_nemo.grpo.interfaces import PolicyActor

PKG = Path(__file__).resolve().parent.parent / "laconic_nemo"


def declared(protocol) -> set[str]:
    """The members a Protocol class declares itself (annotations and methods), its bases' excluded."""
    body = vars(protocol)
    return set(body.get("__annotations__", {})) | {k for k, v in body.items() if callable(v) and not k.startswith("_")}


def used_members(files: list[str], names: tuple[str, ...]) -> set[str]:
    """Attributes read from the actor in ``files``: ``<name>.X``, ``self.<name>.X`` and ``getattr(<...>, "X")``."""
    out = set()
    for f in files:
        for node in ast.walk(ast.parse((PKG / f).read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                if (isinstance(v, ast.Name) and v.id in names) or (isinstance(v, ast.Attribute) and v.attr in names
                                                                   and isinstance(v.value, ast.Name)
                                                                   and v.value.id == "self"):
                    out.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                target = node.args[0]
                if ((isinstance(target, ast.Attribute) and target.attr in names)
                        or (isinstance(target, ast.Name) and target.id in names)) \
                        and isinstance(node.args[1], ast.Constant):
                    out.add(node.args[1].value)
    return out


def init_assignments(cls) -> set[str]:
    """Names ``self.X`` assigned in ``cls.__init__`` (tuple targets too)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_policy_actor_declares_exactly_what_the_trainer_uses():
    used = used_members(["grpo/trainer.py", "grpo/checkpoint.py"], ("actor",))
    assert declared(PolicyActor) == used


def test_warmup_actor_declares_what_the_warmup_uses_beyond_the_policy_actor():
    used = used_members(["app/warmup.py"], ("actor",))
    assert declared(WarmupActor) == used - declared(PolicyActor)
    assert declared(WarmupActor) == {"model_state", "load_model_state", "reset_optimizer", "set_learning_rate",
                                     "snapshot_reference"}


def check_methods(cls, protocol):
    """Every method of ``protocol`` exists on ``cls`` and accepts the protocol's parameters by name (the actor's
    extra parameters have defaults)."""
    for name in declared(protocol):
        spec = vars(protocol)[name] if callable(vars(protocol).get(name)) else None
        if spec is None:
            continue
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}()"
        want = inspect.signature(spec).parameters
        have = inspect.signature(impl).parameters
        assert set(want) <= set(have), f"{cls.__name__}.{name}{inspect.signature(impl)} vs {inspect.signature(spec)}"
        extra = [p for n, p in have.items() if n not in want and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert all(p.default is not p.empty for p in extra), f"{cls.__name__}.{name}: {extra} need defaults"


def data_members(protocol) -> set[str]:
    return set(vars(protocol).get("__annotations__", {}))


@pytest.mark.parametrize("protocol", [PolicyActor, WarmupActor])
def test_megatron_core_actor_implements_the_contract(protocol):
    pytest.importorskip("megatron.core")
    from laconic_nemo.actors.megatron_core import MegatronCoreActor

    check_methods(MegatronCoreActor, protocol)
    for name in data_members(protocol):
        assert isinstance(getattr(MegatronCoreActor, name, None), property), name


def test_nemo_aligner_actor_implements_the_policy_actor():
    from laconic_nemo.actors.nemo_aligner import NemoAlignerActor

    check_methods(NemoAlignerActor, PolicyActor)
    assert data_members(PolicyActor) <= init_assignments(NemoAlignerActor)


def test_the_actor_does_not_initialise_torch_distributed():
    """The entry point initialises torch.distributed (megatron_env.init_distributed); building the actor before
    that is refused, naming the call, and leaves torch.distributed uninitialised."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.config import load_config

    if dist.is_initialized():
        pytest.skip("another test left torch.distributed initialised")
    cfg = load_config("tiny_cpu", [])
    with pytest.raises(RuntimeError, match="init_distributed"):
        MegatronCoreActor.from_config(cfg)
    assert not dist.is_initialized()


def test_megatron_core_actor_attributes_reach_the_part_that_owns_them():
    """Every attribute the actor keeps in one of its parts names a member that part sets when built, a setting
    written on the actor after it is built lands in the part, and a read-only one refuses the write."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from laconic_nemo.actors.megatron_batches import MicroBatches
    from laconic_nemo.actors.megatron_core import MegatronCoreActor, PartAttribute
    from laconic_nemo.actors.megatron_generate import Generation
    from laconic_nemo.actors.megatron_logprobs import Logprobs
    from laconic_nemo.actors.megatron_reference import ReferencePolicy
    from laconic_nemo.actors.megatron_schedule import ScheduleRunner
    from laconic_nemo.actors.megatron_shards import ModelWeights
    from laconic_nemo.actors.megatron_step import TrainStep

    parts = {"weights": ModelWeights, "batches": MicroBatches, "schedule": ScheduleRunner,
             "reference": ReferencePolicy, "log_probs": Logprobs, "generation": Generation, "stepper": TrainStep}
    assert set(parts) <= init_assignments(MegatronCoreActor)
    kept = {n: a for n, a in vars(MegatronCoreActor).items() if isinstance(a, PartAttribute)}
    assert {"micro_batch_tokens", "sort_by_length", "recompute_setting", "lr", "sampler", "reference_on",
            "engine_settings"} <= {n for n, a in kept.items() if not a.read_only}
    for name, attr in kept.items():
        assert name in init_assignments(parts[attr.part]), f"{attr.part} does not own {name}"
    actor = MegatronCoreActor.__new__(MegatronCoreActor)
    actor.batches, actor.stepper = SimpleNamespace(micro_batch_tokens=64), SimpleNamespace(optimizer="adam")
    actor.micro_batch_tokens = 0
    assert actor.batches.micro_batch_tokens == 0 and actor.micro_batch_tokens == 0
    with pytest.raises(AttributeError, match="optimizer"):
        actor.optimizer = None
    assert actor.stepper.optimizer == "adam"
