"""The pid lambda controller: float64 reference of the PID Lagrangian, anti-windup, state round trip, and the
integral controller unchanged (bit for bit against the paper's update)."""

import io
import json
import pickle
import random

import numpy as np
import pytest
import torch

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.core import DualController, lambda_controller, load_shaper_state, shaper_state


def trainer_controller(cfg):
    """The lambda controller GRPOTrainer builds from a recipe."""
    return lambda_controller(cfg.laconic, cfg.rollout.max_new_tokens)


def _old_update(lam, m, eta, budget, floor, ceiling):
    """The dual step as it was before the pid controller existed (paper eq.; laconic_nemo/core/dual.py)."""
    lam = lam + eta * (m / budget - 1.0)
    return min(max(lam, floor), ceiling)


def _pid_reference(lengths, budget, kp, ki, kd, floor, ceiling, init, anti_windup=True):
    """Stooke, Achiam, Abbeel 2020, Algorithm 2, in numpy float64 with the integral accumulated in ERROR units
    (I = sum of errors, lambda = kp * Delta + ki * I + kd * partial), plus this project's choices: two-sided
    derivative, ki * I clipped into [floor, ceiling] (their I <- (I + Delta)_+), I held while lambda is at a
    clip and the error pushes further into it, I_0 = init / ki. Returns lambda after each step."""
    f64 = np.float64
    integ, prev, lam, out = f64(init) / f64(ki), None, f64(init), []
    lo, hi = f64(floor) / f64(ki), f64(ceiling) / f64(ki)
    for m in lengths:
        delta = f64(m) / f64(budget) - f64(1.0)
        partial = f64(0.0) if prev is None else delta - prev
        saturated = (lam >= ceiling and delta > 0) or (lam <= floor and delta < 0)
        if not (anti_windup and saturated):
            integ = integ + delta
        if anti_windup:
            integ = np.clip(integ, lo, hi)
        lam = np.clip(f64(kp) * delta + f64(ki) * integ + f64(kd) * partial, floor, ceiling)
        prev = delta
        out.append(float(lam))
    return out


def _lengths(seed, n, lo=0.0, hi=4096.0):
    rng = random.Random(seed)
    return [rng.uniform(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("init,floor", [(0.0, 1e-5), (1e-5, 1e-5), (0.1, 0.0), (0.0, 0.0)])
def test_integral_default_equals_the_old_update_bit_for_bit(init, floor):
    """Default controller, and pid with kp = kd = 0, equal the paper's update bit for bit over 2000 steps,
    including lambda_init below the floor and long runs at both clips."""
    budget, eta, ceiling = 1500.0, 0.02, 0.5
    # a mix of free motion and long stretches pinned at each clip
    seq = _lengths(1, 700) + [4096.0] * 300 + _lengths(2, 300) + [0.0] * 300 + _lengths(3, 400, 1000, 2000)
    default = DualController(budget, eta, ceiling=ceiling, init=init, floor=floor)
    assert default.controller == "integral"
    pid0 = DualController(budget, eta, ceiling=ceiling, init=init, floor=floor, controller="pid")
    lam = init
    at_clip = 0
    for m in seq:
        lam = _old_update(lam, m, eta, budget, floor, ceiling)
        at_clip += lam in (floor, ceiling)
        assert default.update(m).hex() == lam.hex()
        assert pid0.update(m).hex() == lam.hex()
    assert at_clip > 400


def test_pid_matches_float64_reference_of_stooke_algorithm():
    budget, floor, ceiling = 31.0, 1e-5, 1.0
    kp, ki, kd = 0.4, 0.05, 0.8
    seq = _lengths(7, 300, 10.0, 70.0) + [90.0] * 40 + [5.0] * 40 + _lengths(8, 100, 25.0, 40.0)
    d = DualController(budget, ki, ceiling=ceiling, floor=floor, init=0.0, controller="pid", kp=kp, kd=kd)
    ours = [d.update(m) for m in seq]
    ref = _pid_reference(seq, budget, kp, ki, kd, floor, ceiling, 0.0)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)
    assert min(ours) == floor and max(ours) == ceiling  # both clips were exercised


def test_pid_hand_values():
    d = DualController(100.0, 0.1, ceiling=1.0, controller="pid", kp=0.5, kd=2.0)
    # e = 0.5: I = 0.05; lambda = 0.05 + 0.25 + 0 (no derivative at the first step)
    assert d.update(150.0) == pytest.approx(0.30)
    # e = 0.2: I = 0.07; lambda = 0.07 + 0.1 + 2 * (0.2 - 0.5) = -0.43 -> floor 0
    assert d.update(120.0) == 0.0
    assert d.integral == pytest.approx(0.07)
    # e = 0.1, lambda was at the floor but e > 0: I = 0.08; lambda = 0.08 + 0.05 + 2 * (-0.1) < 0 -> 0
    assert d.update(110.0) == 0.0
    # e = -0.1 with lambda at the floor: I held at 0.08; lambda = 0.08 - 0.05 - 0.4 -> 0
    assert d.update(90.0) == 0.0
    assert d.integral == pytest.approx(0.08)
    # e = 0: I = 0.08; lambda = 0.08 + 0 + 2 * 0.1 = 0.28
    assert d.update(100.0) == pytest.approx(0.28)


def test_anti_windup_leaves_the_ceiling_as_soon_as_the_error_turns():
    """40 steps far above B pin lambda at the ceiling; when the length drops below B, the held integral
    lets lambda leave the ceiling at once, while a PID without anti-windup stays pinned for many steps."""
    budget, ceiling, kp, ki = 100.0, 0.5, 0.3, 0.05
    seq = [200.0] * 40 + [90.0] * 30
    d = DualController(budget, ki, ceiling=ceiling, controller="pid", kp=kp)
    ours = [d.update(m) for m in seq]
    assert d.floor <= d.integral <= ceiling
    windup = _pid_reference(seq, budget, kp, ki, 0.0, 0.0, ceiling, 0.0, anti_windup=False)
    assert ours[39] == ceiling and windup[39] == ceiling
    assert ours[40] < ceiling
    pinned = sum(1 for v in windup[40:] if v == ceiling)
    assert pinned >= 20, pinned
    # and the held integral is what a clip-free run would have had when it first reached the ceiling
    np.testing.assert_allclose(ours, _pid_reference(seq, budget, kp, ki, 0.0, 0.0, ceiling, 0.0), rtol=1e-9)


def test_pid_state_round_trips_and_resumes_bit_for_bit():
    kw = dict(budget=31.0, eta=0.05, ceiling=1.0, floor=1e-5, init=0.0, controller="pid", kp=0.4, kd=0.7)
    seq = _lengths(11, 60, 10.0, 60.0)
    d = DualController(**kw)
    for m in seq[:33]:
        d.update(m)
    sd = d.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    tail = [d.update(m) for m in seq[33:]]
    for loaded in (pickle.loads(pickle.dumps(sd)), json.loads(json.dumps(sd)), torch.load(buf)):
        e = DualController(**kw)
        e.load_state_dict(loaded)
        assert [e.update(m).hex() for m in seq[33:]] == [v.hex() for v in tail]
    # the integral and previous error matter: dropping them changes the continuation
    f = DualController(**kw)
    f.load_state_dict({k: v for k, v in sd.items() if k not in ("integral", "prev_error")} | {"controller": "pid",
                      "integral": sd["lam"], "prev_error": None})
    assert [f.update(m) for m in seq[33:]] != tail


def test_pid_state_mismatch_and_old_checkpoints():
    pid = DualController(31.0, 0.05, ceiling=1.0, controller="pid", kp=0.4)
    integral = DualController(31.0, 0.05, ceiling=1.0)
    integral.update(40.0)
    old = {k: v for k, v in integral.state_dict().items() if k not in ("controller", "kp", "kd")}
    DualController(31.0, 0.05, ceiling=1.0).load_state_dict(old)  # a checkpoint from before the pid controller
    with pytest.raises(ValueError, match="controller"):
        pid.load_state_dict(old)
    pid.load_state_dict(old, strict=False)  # switching controllers: lambda seeds the integral term
    assert pid.integral == integral.value
    other = DualController(31.0, 0.05, ceiling=1.0, controller="pid", kp=0.2)
    with pytest.raises(ValueError, match="kp"):
        other.load_state_dict(DualController(31.0, 0.05, ceiling=1.0, controller="pid", kp=0.4).state_dict())
    sd = DualController(31.0, 0.05, ceiling=1.0, controller="pid", kp=0.4).state_dict()
    del sd["integral"]
    with pytest.raises(ValueError, match="integral"):
        DualController(31.0, 0.05, ceiling=1.0, controller="pid", kp=0.4).load_state_dict(sd)


@pytest.mark.parametrize("kwargs,key", [
    (dict(controller="pi"), "controller"),
    (dict(controller="pid", kp=-0.1), "kp"),
    (dict(controller="pid", kd=float("nan")), "kd"),
    (dict(kp=0.3), "kp"),
])
def test_invalid_controller_settings(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DualController(31.0, 0.05, ceiling=1.0, **kwargs)


@pytest.mark.parametrize("override,key", [
    ("laconic.controller=pi", "laconic.controller"),
    ("laconic.kp=-1", "laconic.kp"),
    ("laconic.kd=0.5", "laconic.kd"),  # needs controller = pid
])
def test_config_validation_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("tiny_cpu", [override])


def test_recipe_builds_the_pid_controller():
    cfg = load_config("tiny_cpu", ["laconic.controller=pid", "laconic.kp=0.4", "laconic.kd=0.6", "laconic.budget=31",
                                   "laconic.eta=0.05", "laconic.ceiling=1.0"])
    d = trainer_controller(cfg)
    assert (d.controller, d.kp, d.eta, d.kd) == ("pid", 0.4, float(cfg.laconic.eta), 0.6)
    lam = d.update(46.0)
    assert lam == pytest.approx(0.05 * (46 / 31 - 1) + 0.4 * (46 / 31 - 1))
    assert trainer_controller(load_config("tiny_cpu")).controller == "integral"


def test_trainer_steps_the_pid_controller_and_its_json_checkpoint_state_resumes_bit_for_bit():
    """Through GRPOTrainer.train_step (a stub actor, no model): lambda_next is the pid controller's update on the
    step's global mean length, and the shaper state as trainer_state.json stores it (json) resumes bit for bit."""
    from pathlib import Path
    from types import SimpleNamespace

    from laconic_nemo.grpo.interfaces import GenerationOutput
    from laconic_nemo.grpo.trainer import GRPOTrainer

    class Actor(SimpleNamespace):
        def generate(self, prompt_ids, sampling):
            n, g = len(prompt_ids), torch.Generator().manual_seed(len(self.calls))
            self.calls.append(n)
            lengths = torch.randint(5, sampling.max_new_tokens, (n,), generator=g)
            tokens = torch.ones(n, 3 + int(lengths.max()), dtype=torch.long)
            return GenerationOutput(tokens, torch.full((n,), 2), lengths + 1, lengths, torch.zeros(n, dtype=bool))

        def logprobs(self, batch, reference=False, temperature=1.0):
            return torch.zeros(batch.response_mask.shape)

        def train_step(self, mb, loss_fn, micro):
            return loss_fn(torch.zeros(mb.response_mask.shape, requires_grad=True), mb)[1]

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"
    cfg = load_config(recipe, ["laconic.controller=pid", "laconic.kp=0.3", "laconic.kd=0.5", "laconic.floor=1e-5",
                               "laconic.budget=31", "laconic.eta=0.05", "laconic.ceiling=1.0"])

    def trainer():
        return GRPOTrainer(cfg, Actor(dp_rank=0, dp_size=1, dp_group=None, calls=[]), encode=list, decode=str,
                           prompts=[(f"P{i}", "1") for i in range(50)],
                           reward_fn=lambda texts, answers: ([1.0] * len(texts), {}), eos_id=1)

    t = trainer()
    ref = DualController(31.0, 0.05, ceiling=1.0, floor=1e-5, controller="pid", kp=0.3, kd=0.5)
    first = [t.train_step(s) for s in range(3)]
    for m in first:
        assert m["lambda"] == ref.value and m["lambda_next"] == ref.update(m["mean_response_length"])
    saved = json.loads(json.dumps(shaper_state(t.cfg.laconic.shaper, t.dual)))
    tail = [t.train_step(s)["lambda_next"] for s in range(3, 5)]
    u = trainer()
    u.actor.calls.extend([0, 0, 0])  # the stub's rollouts of steps 3 and 4
    load_shaper_state(u.cfg.laconic.shaper, u.dual, saved)
    assert [u.train_step(s)["lambda_next"].hex() for s in range(3, 5)] == [v.hex() for v in tail]
    assert len({m["lambda_next"] for m in first}) == 3


def test_tiny_cpu_pid_recipe_differs_from_tiny_cpu_only_in_the_controller():
    from laconic_nemo.config import to_dict

    base, pid = load_config("tiny_cpu"), load_config("tiny_cpu_pid")
    a, b = to_dict(base), to_dict(pid)
    diff = {k for k in a["laconic"] if a["laconic"][k] != b["laconic"][k]}
    assert diff == {"controller", "eta", "kp"}
    a.pop("laconic"), b.pop("laconic")
    a["run"].pop("name"), b["run"].pop("name"), a["run"].pop("output_dir"), b["run"].pop("output_dir")
    assert a == b
    dual = trainer_controller(pid)
    assert dual.controller == "pid" and dual.kp > 0


def _rank_worker(rank, world, port, q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(100 + rank)  # every rank holds different responses
    d = DualController(31.0, 0.15, ceiling=1.0, floor=1e-5, controller="pid", kp=1.0, kd=0.5)
    lams = []
    for step in range(40):
        n_local = 16 + 8 * rank + step % 3
        lengths = torch.randint(0, 96, (n_local,), generator=g)
        sums = torch.tensor([int(lengths.sum()), n_local], dtype=torch.int64)  # as the trainer: integer all-reduce
        dist.all_reduce(sums)
        lams.append(d.update(float(sums[0].item()) / float(sums[1].item())).hex())
    q.put((rank, lams, json.dumps(d.state_dict())))
    dist.destroy_process_group()


@pytest.mark.slow
def test_pid_ranks_agree_bit_for_bit_after_all_reduce():
    import torch.multiprocessing as mp

    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (lams, state) for r, lams, state in (q.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]  # lambda at every step and the whole controller state
    assert len(set(results[0][0])) > 10
