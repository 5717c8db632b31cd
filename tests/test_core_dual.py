"""DualController: the projected dual step, its clips, convergence to mean length = B, exact state round-trip."""

import io
import json
import math
import pickle
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from laconic_nemo.core import DualController


def test_update_hand_values():
    d = DualController(budget=1000, eta=0.01, ceiling=0.3)
    assert d.value == 0.0
    assert d.update(1500) == pytest.approx(0.005)  # 0 + 0.01 * (1.5 - 1)
    assert d.update(3000) == pytest.approx(0.025)  # + 0.01 * 2
    assert d.update(0) == pytest.approx(0.015)  # - 0.01
    assert d.update(0) == pytest.approx(0.005)
    assert d.update(0) == 0.0  # clipped at the floor
    assert d.num_updates == 5


def test_update_is_plain_float64_formula():
    rng = random.Random(3)
    d = DualController(budget=1500, eta=0.002, max_length=4096, floor=1e-5, init=1e-5)
    lam = 1e-5
    for _ in range(500):
        m = rng.uniform(0, 4096)
        lam = min(max(lam + 0.002 * (m / 1500.0 - 1.0), 1e-5), 1500 / (4096 - 1500))
        assert d.update(m) == lam  # bit for bit
        assert isinstance(d.value, float)


def test_default_ceiling_and_no_ceiling():
    assert DualController(2000, 0.002, max_length=4096).ceiling == 2000 / 2096
    assert DualController(2000, 0.002, ceiling=0.1, max_length=4096).ceiling == 0.1
    d = DualController(100, 1.0)
    assert math.isinf(d.ceiling)
    assert d.update(1e6) == pytest.approx(1e4 - 1)  # no upper clip


def test_lambda_stays_in_bounds_under_random_updates():
    rng = random.Random(0)
    for _ in range(200):
        B = rng.uniform(50, 3000)
        floor = rng.choice([0.0, 1e-5, 0.01])
        ceil = floor + rng.choice([0.0, 0.1, 0.3, 5.0])
        d = DualController(B, eta=rng.choice([0.0, 1e-3, 0.1, 10.0]), ceiling=ceil, floor=floor,
                           init=rng.uniform(floor, ceil))
        for _ in range(50):
            lam = d.update(rng.uniform(0, 10 * B))
            assert floor <= lam <= ceil


def _run(d, mu, steps):
    """Drive the controller with a mean-length response mu(lambda) (tokens); return the lambda path."""
    path = []
    for _ in range(steps):
        path.append(d.update(mu(d.value)))
    return path


def test_converges_to_fixed_point_mean_length_equals_budget():
    """mu(lam) = B * (m0 - gamma * lam): the fixed point is lam* = (m0 - 1) / gamma where mu(lam*) = B.
    The error evolves as e <- (1 - eta * gamma) e, so eta <= 1 / gamma converges monotonically."""
    B, m0, gamma = 1500.0, 1.6, 2.0
    lam_star = (m0 - 1) / gamma  # 0.3
    mu = lambda lam: B * max(m0 - gamma * lam, 0.0)  # noqa: E731
    for eta in (0.01, 0.1, 0.25, 0.5):  # 1 / gamma = 0.5
        d = DualController(B, eta, ceiling=1.0)
        path = _run(d, mu, 3000)
        assert path[-1] == pytest.approx(lam_star, abs=1e-9)
        assert mu(path[-1]) == pytest.approx(B, rel=1e-8)
        assert all(b >= a - 1e-15 for a, b in zip(path, path[1:]))  # monotone approach from below
        # measured contraction of the error matches 1 - eta * gamma
        e0, e1 = lam_star - path[0], lam_star - path[1]
        if e0 > 1e-12:
            assert e1 / e0 == pytest.approx(1 - eta * gamma, abs=1e-9)


def test_step_between_one_and_two_over_gamma_converges_with_overshoot():
    B, m0, gamma = 1500.0, 1.6, 2.0  # lam* = 0.3
    mu = lambda lam: B * max(m0 - gamma * lam, 0.0)  # noqa: E731
    d = DualController(B, eta=0.8, ceiling=1.0)  # 1 - eta * gamma = -0.6
    path = _run(d, mu, 200)
    errs = [lam - 0.3 for lam in path[:6]]
    assert all(a * b < 0 for a, b in zip(errs, errs[1:]))  # alternates around the fixed point
    assert path[-1] == pytest.approx(0.3, abs=1e-12)


def test_large_step_oscillates_between_clips():
    B, m0, gamma = 1500.0, 1.6, 2.0
    mu = lambda lam: B * max(m0 - gamma * lam, 0.0)  # noqa: E731
    d = DualController(B, eta=5.0, ceiling=1.0)  # eta * gamma = 10 >> 2
    tail = _run(d, mu, 200)[-50:]
    assert set(tail) == {0.0, 1.0}
    assert all(abs(lam - 0.3) > 0.25 for lam in tail)


def test_noisy_mean_length_tracks_budget_on_average():
    rng = random.Random(7)
    B, m0, gamma = 2000.0, 1.4, 4.0  # lam* = 0.1
    d = DualController(B, eta=0.01, max_length=4096)
    path = _run(d, lambda lam: B * (m0 - gamma * lam) + rng.gauss(0, 100), 6000)
    tail = path[2000:]
    assert sum(tail) / len(tail) == pytest.approx(0.1, abs=0.005)


def test_feasible_policy_returns_lambda_to_floor():
    """If the mean length is below B whatever lambda is, lambda decays to the floor and stays there."""
    d = DualController(1000, eta=0.01, ceiling=0.3, init=0.2, floor=1e-5)
    path = _run(d, lambda lam: 800.0, 200)
    assert path[-1] == 1e-5 and all(b <= a for a, b in zip(path, path[1:]))


def test_state_dict_round_trips_bit_for_bit():
    rng = random.Random(5)
    d = DualController(1500, eta=0.002, max_length=4096, floor=1e-5, init=1e-5)
    for _ in range(37):
        d.update(rng.uniform(0, 4096))
    sd = d.state_dict()
    restored = []
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    for loaded in (pickle.loads(pickle.dumps(sd)), json.loads(json.dumps(sd)), torch.load(buf)):
        e = DualController(1500, eta=0.002, max_length=4096, floor=1e-5, init=1e-5)
        e.load_state_dict(loaded)
        assert e.value.hex() == d.value.hex()
        assert e.num_updates == 37
        restored.append(e)
    seq = [rng.uniform(0, 4096) for _ in range(20)]
    ref = [d.update(m) for m in seq]
    for e in restored:
        assert [e.update(m) for m in seq] == ref


def test_state_dict_without_ceiling_is_json_safe():
    d = DualController(100, 0.1)
    s = json.dumps(d.state_dict(), allow_nan=False)
    e = DualController(100, 0.1)
    e.load_state_dict(json.loads(s))
    assert math.isinf(e.ceiling)


@pytest.mark.parametrize("key,kwargs", [
    ("budget", dict(budget=2000)), ("eta", dict(eta=0.01)), ("ceiling", dict(ceiling=0.1)),
    ("floor", dict(floor=0.0, init=0.0)),
])
def test_load_mismatch_is_reported(key, kwargs):
    base = dict(budget=1500, eta=0.002, ceiling=0.2, floor=1e-5, init=1e-5)
    d = DualController(**base)
    d.update(3000)
    e = DualController(**{**base, **kwargs})
    with pytest.raises(ValueError, match=key):
        e.load_state_dict(d.state_dict())
    e.load_state_dict(d.state_dict(), strict=False)  # keeps this run's settings, clips lambda into them
    assert e.floor <= e.value <= e.ceiling


def test_load_missing_key():
    d = DualController(1500, 0.002)
    sd = d.state_dict()
    del sd["lam"]
    with pytest.raises(ValueError, match="lam"):
        d.load_state_dict(sd)


@pytest.mark.parametrize("kwargs,key", [
    (dict(budget=0, eta=0.1), "budget"),
    (dict(budget=-5, eta=0.1), "budget"),
    (dict(budget=1000, eta=-0.1), "eta"),
    (dict(budget=1000, eta=math.nan), "eta"),
    (dict(budget=1000, eta=0.1, max_length=1000), "max_length"),
    (dict(budget=1000, eta=0.1, max_length=500), "max_length"),
    (dict(budget=1000, eta=0.1, floor=-1e-3), "floor"),
    (dict(budget=1000, eta=0.1, floor=0.2, ceiling=0.1, init=0.15), "ceiling must be >= floor"),
    (dict(budget=1000, eta=0.1, ceiling=0.1, init=0.5), "init"),
    (dict(budget=1000, eta=0.1, floor=1e-5, init=-1e-6), "init"),
    (dict(budget=1000, eta=0.1, ceiling=math.inf), "ceiling"),
])
def test_invalid_settings(kwargs, key):
    with pytest.raises(ValueError, match=key) as info:
        DualController(**kwargs)
    if key in ("eta", "floor", "init", "budget", "max_length"):
        assert any(s in str(info.value) for s in (">=", ">", "[")), "message should state the allowed range"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "x", None])
def test_invalid_mean_length(bad):
    d = DualController(1000, 0.1)
    with pytest.raises(ValueError, match="mean_length"):
        d.update(bad)
    assert d.value == 0.0 and d.num_updates == 0


def _worker(rank, world, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(100 + rank)  # every rank holds different responses
    d = DualController(1500, eta=0.002, max_length=4096, floor=1e-5, init=1e-5)
    lams = []
    for step in range(30):
        n_local = 16 + 8 * rank + step % 3
        lengths = torch.randint(0, 4097, (n_local,), generator=g).to(torch.float64)
        stats = torch.tensor([lengths.sum().item(), float(n_local)], dtype=torch.float64)
        dist.all_reduce(stats)
        lams.append(d.update(stats[0].item() / stats[1].item()).hex())
    q.put((rank, lams))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_bit_for_bit_after_all_reduce():
    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    assert len(set(results[0])) > 1  # lambda actually moved


def test_init_below_floor_is_used_then_clipped_by_the_first_step():
    """The authors' scripts start at lambda_len_init = 0 with lambda_floor = 1e-5: the initial lambda is kept
    unclipped (it prices the first step) and the first dual step clips into [floor, ceiling]."""
    d = DualController(2000, eta=0.002, ceiling=0.1, floor=1e-5, init=0.0)
    assert d.value == 0.0
    assert d.update(1000.0) == 1e-5            # 0 + 0.002 * (0.5 - 1) < floor -> floor
    e = DualController(2000, eta=0.002, ceiling=0.1, floor=1e-5, init=0.0)
    assert e.update(3000.0) == 0.0 + 0.002 * (3000.0 / 2000.0 - 1.0)
    # a state saved before the first update round-trips; after an update it must be inside [floor, ceiling]
    f = DualController(2000, eta=0.002, ceiling=0.1, floor=1e-5, init=0.0)
    f.load_state_dict(DualController(2000, eta=0.002, ceiling=0.1, floor=1e-5, init=0.0).state_dict())
    assert f.value == 0.0
    with pytest.raises(ValueError, match=r"'lam' = 0.0 is invalid: allowed a number in \[floor, ceiling\] = "
                                         r"\[1e-05, 0.1\]"):
        f.load_state_dict({**f.state_dict(), "num_updates": 3})
