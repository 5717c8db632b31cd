"""Trainer pieces that need no model: L1 target lengths, config checks at construction."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from laconic_nemo.config import load_config
from laconic_nemo.grpo.trainer import GRPOTrainer

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"


def make_trainer(overrides, dp_rank=0, dp_size=1):
    cfg = load_config(TINY, overrides)
    actor = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, dp_group=None)
    prompts = [(f"P{i}", str(i)) for i in range(50)]
    return GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=prompts, reward_fn=None, eos_id=1)


def test_l1_targets_are_drawn_in_range_stated_in_the_prompt_and_layout_independent():
    # the tiny task's instruction is written in its tokenizer's characters (data.target_instruction is checked)
    ov = ["laconic.shaper=l1_exact", "data.target_length_range=[20,60]", "data.target_instruction=max{target}"]
    t = make_trainer(ov)
    texts, targets = t._prompt_texts(3, [4, 7, 9])
    assert all(20 <= n <= 60 for n in targets)
    assert texts == [f"P{i}max{n}" for i, n in zip([4, 7, 9], targets)]
    # the same prompt at the same step gets the same target on any rank / layout, and differs across steps
    other = make_trainer(ov, dp_rank=1, dp_size=2)
    assert other._prompt_texts(3, [7])[1] == [targets[1]]
    draws = {tuple(t._prompt_texts(s, [4, 7, 9])[1]) for s in range(20)}
    assert len(draws) > 15


def test_shapers_needing_targets_fail_early_without_a_range():
    with pytest.raises(ValueError, match="data.target_length_range"):
        make_trainer(["laconic.shaper=l1_max"])
    with pytest.raises(ValueError, match="data.target_length_range"):
        make_trainer(["laconic.shaper=l1_max", "data.target_length_range=[9,3]"])
    assert make_trainer([])._prompt_texts(0, [1, 2]) == (["P1", "P2"], None)


def test_batch_sizes_must_fit_the_data_parallel_layout():
    with pytest.raises(ValueError, match="num_prompts_per_step"):
        make_trainer(["grpo.num_prompts_per_step=15", "grpo.minibatch_size=120"], dp_size=2)
    with pytest.raises(ValueError, match="minibatch_size"):
        make_trainer(["grpo.minibatch_size=1"], dp_size=2)  # divides the rollout, not DP


def test_count_eos_reaches_the_shaper_and_the_dual_step():
    """laconic.count_eos: the dual step sees L with the EOS token (EasyR1's response-mask sum) and a response whose
    EOS is the L_max-th token is a hit; without it, L excludes EOS and only truncated responses are hits."""
    import torch

    from laconic_nemo.grpo.interfaces import GenerationOutput

    class Actor(SimpleNamespace):
        def generate(self, prompt_ids, sampling):
            n, lmax = len(prompt_ids), sampling.max_new_tokens
            # per group of 8: 2 truncated (L_max, no EOS), 2 with EOS as the L_max-th token, 4 short with EOS
            lengths = torch.tensor([lmax, lmax, lmax - 1, lmax - 1, 3, 4, 5, 6] * (n // 8))
            truncated = torch.tensor([True, True, False, False, False, False, False, False] * (n // 8))
            resp = lengths + (~truncated).long()
            tokens = torch.ones(n, 2 + int(resp.max()), dtype=torch.long)
            return GenerationOutput(tokens, torch.full((n,), 2), resp, lengths, truncated)

        def logprobs(self, batch, reference=False, temperature=1.0):
            return torch.zeros(batch.response_mask.shape)

        def train_step(self, mb, loss_fn, micro):
            return loss_fn(torch.zeros(mb.response_mask.shape, requires_grad=True), mb)[1]

    means, hits = {}, {}
    for flag in (False, True):
        cfg = load_config(TINY, [f"laconic.count_eos={str(flag).lower()}", "laconic.hit_cap=0.25",
                                 "grpo.clip_dual=3.0"])
        trainer = GRPOTrainer(cfg, Actor(dp_rank=0, dp_size=1, dp_group=None), encode=list, decode=str,
                              prompts=[(f"P{i}", "1") for i in range(50)],
                              reward_fn=lambda texts, answers: ([0.0] * len(texts), {}), eos_id=1)
        m = trainer.train_step(0)
        means[flag], hits[flag] = m["mean_response_length"], m["shaper/frac_truncated"]
    lmax = int(cfg.rollout.max_new_tokens)
    plain = (2 * lmax + 2 * (lmax - 1) + 3 + 4 + 5 + 6) / 8
    assert means[False] == plain and means[True] == plain + 6 / 8
    assert (hits[False], hits[True]) == (2 / 8, 4 / 8)


def test_warmup_cache_key_follows_what_changes_the_warmed_up_policy(tmp_path):
    """Two configs whose warm-ups differ (micro-batch order, packing and its token budget) never share a cached
    policy; a change that does not touch the warm-up (the budget) does."""
    from laconic_nemo.app.warmup import warmup_cache_dir as _warmup_cache_dir

    base = [f"warmup.cache_dir={tmp_path}"]
    plain = _warmup_cache_dir(load_config(TINY, base))
    assert _warmup_cache_dir(load_config(TINY, [*base, "grpo.sort_by_length=true"])) != plain
    assert _warmup_cache_dir(load_config(TINY, [*base, "laconic.budget=25"])) == plain
    packed = _warmup_cache_dir(load_config(TINY, [*base, "grpo.micro_batch_tokens=256"]))
    assert packed != plain and packed != _warmup_cache_dir(load_config(TINY, [*base, "grpo.micro_batch_tokens=512"]))


def test_warmup_cache_key_names_code_versions_and_threads(tmp_path, monkeypatch):
    """A policy warmed up by other code, other torch / megatron-core versions, another thread count or other CPU
    kernels (each of which changes its floats) is cached under another key, so it is never loaded in place of this
    one."""
    from laconic_nemo.app import warmup

    cfg = load_config(TINY, [f"warmup.cache_dir={tmp_path}"])
    plain = warmup.warmup_cache_dir(cfg, 2)
    assert warmup.warmup_cache_dir(cfg, 2, threads=1) == plain  # the entry points' default: LACONIC_THREADS=1
    assert warmup.warmup_cache_dir(cfg, 2, threads=2) != plain
    monkeypatch.setenv("LACONIC_THREADS", "2")
    assert warmup.warmup_cache_dir(cfg, 2) == warmup.warmup_cache_dir(cfg, 2, threads=2)
    monkeypatch.delenv("LACONIC_THREADS")
    # the CPU kernels' instruction set: pinned, the key is the same on every machine; another choice, another key
    pinned = {"pin": "avx2", "machine": "x86_64", "aten": "AVX2", "mkl_cbwr": "COMPATIBLE"}
    own = {"pin": None, "machine": "x86_64", "aten": "AVX512", "mkl_cbwr": None, "cpu": "some CPU"}
    assert warmup.warmup_cache_dir(cfg, 2, isa=pinned) == warmup.warmup_cache_dir(cfg, 2, isa=dict(pinned))
    assert warmup.warmup_cache_dir(cfg, 2, isa=pinned) != warmup.warmup_cache_dir(cfg, 2, isa=own)
    assert warmup.warmup_cache_key(cfg, 2, isa=own)["cpu_isa"] == own
    versions = warmup.library_versions()
    from importlib.metadata import version

    assert set(versions) == {"python", "torch", "megatron-core"} and versions["megatron-core"] == version("megatron-core")
    monkeypatch.setattr(warmup, "library_versions", lambda: {**versions, "torch": "2.12.0+cpu"})
    assert warmup.warmup_cache_dir(cfg, 2) != plain
    monkeypatch.setattr(warmup, "library_versions", lambda: versions)
    monkeypatch.setattr(warmup, "warmup_code_digest", lambda: "0" * 12)
    assert warmup.warmup_cache_dir(cfg, 2) != plain


def test_code_fingerprint_ignores_text_and_sees_code():
    """The code part of the key: docstrings, comments and layout do not count; a changed summation does."""
    from laconic_nemo.app.warmup import WARMUP_MODULES, normalized_source, warmup_code_digest

    a = "def mean(x):\n    return sum(x) / len(x)\n"
    b = 'def mean(x):\n    """The mean."""\n    # one pass\n\n    return sum(x)/len(x)\n'
    c = "def mean(x):\n    return sum(reversed(x)) / len(x)\n"
    assert normalized_source(a) == normalized_source(b) != normalized_source(c)
    assert "laconic_nemo.actors.megatron_core" in WARMUP_MODULES and "laconic_nemo.data.synthetic" in WARMUP_MODULES
    assert len(warmup_code_digest()) == 12 and warmup_code_digest() == warmup_code_digest()


def test_cached_policy_is_used_only_with_the_key_it_was_written_for(tmp_path):
    """A cache folder without meta.json (written before the key named code and versions, or copied by hand) or
    with another key is refused, naming the folder and what differs."""
    import json

    from laconic_nemo.app.warmup import check_cache_meta, warmup_cache_key
    from laconic_nemo.config import ConfigError

    cfg = load_config(TINY, [f"warmup.cache_dir={tmp_path}"])
    key = warmup_cache_key(cfg, 2, threads=1)
    folder = tmp_path / "policy_x"
    folder.mkdir()
    with pytest.raises(ConfigError, match="policy_x has no meta.json"):
        check_cache_meta(folder, key)
    (folder / "meta.json").write_text(json.dumps({"key": {**key, "threads": 2, "code": "0" * 12}}))
    with pytest.raises(ConfigError, match=r"policy_x was written for other settings \(code, threads differ\)"):
        check_cache_meta(folder, key)
    (folder / "meta.json").write_text(json.dumps({"key": json.loads(json.dumps(key))}))
    check_cache_meta(folder, key)


def test_checkpoint_hook_writes_before_the_step_folder_and_is_pruned_with_it(tmp_path):
    """The NeMo-Aligner actor's checkpoint hook: its sharded checkpoint of step s (with the step and the shaper
    state in the sidecar) is written before step_s exists, the step folder's model shard refers to it, and it is
    removed when checkpoint.keep_last prunes step_s."""
    import torch

    from laconic_nemo.actors.nemo_aligner import NemoCheckpointHook
    from laconic_nemo.core import shaper_state

    seen = []

    class Actor(SimpleNamespace):
        def save_sharded_checkpoint(self, folder, laconic_state):
            seen.append((Path(folder).name, laconic_state, (tmp_path / "checkpoints" / Path(folder).name).exists()))
            Path(folder).mkdir(parents=True)
            self.last = str(folder)

        def state_dict_for_checkpoint(self):
            return {"nemo_checkpoint": self.last}

    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "checkpoint.keep_last=2"])
    actor = Actor(dp_rank=0, dp_size=1, dp_group=None)
    trainer = GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=[("P", "1")] * 50, reward_fn=None, eos_id=1,
                          checkpoint_hook=NemoCheckpointHook(actor))
    for step in (1, 2, 3):
        trainer.save_checkpoint(step)
    lam = shaper_state(trainer.cfg.laconic.shaper, trainer.dual)
    assert seen == [(f"step_{s:06d}", {"step": s, "shaper": lam}, False) for s in (1, 2, 3)]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in (root / "nemo").iterdir()) == ["step_000002", "step_000003"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000003"]
    ref = torch.load(root / "step_000003" / "model_tp00_pp00.pt", weights_only=False)
    assert ref["nemo_checkpoint"] == str(root / "nemo" / "step_000003")


def test_a_stated_target_is_the_users_words_inside_the_user_turn():
    """With a chat template the instruction goes at the end of the user turn, before the assistant turn opens (for
    deepseek_r1 not after "<think>\\n", where it would read as the model's own reasoning); plain: appended."""
    from laconic_nemo.data.datasets import TEMPLATES, chat_messages, render

    ov = ["laconic.shaper=l1_max", "data.target_lengths=[512,1024]", "data.kind=math", "reward.kind=math",
          "data.prompt_template=deepseek_r1", "model.source=hf", "model.path=/nonexistent/hf"]
    cfg = load_config(TINY, ov)
    actor = SimpleNamespace(dp_rank=0, dp_size=1, dp_group=None)
    prompts = [(render("deepseek_r1", f"What is {i}+1?"), str(i + 1)) for i in range(4)]
    t = GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=prompts, reward_fn=None, eos_id=1)
    texts, targets = t._prompt_texts(2, [0, 3])
    for text, i, n in zip(texts, [0, 3], targets):
        assert text == (f"<｜begin▁of▁sentence｜><｜User｜>What is {i}+1? Let's think step by step and output the final "
                        f"answer within \\boxed{{}}. Think for {n} tokens.<｜Assistant｜><think>\n")
    # every template: the instruction ends the user's message of the template's own chat turns
    from laconic_nemo.data.datasets import state_in_user_turn

    for name in TEMPLATES:
        stated = state_in_user_turn(name, render(name, " 2+2? "), " Think for 7 tokens.")
        turns = chat_messages(name, " 2+2? ")
        user = (turns[-1]["content"] if turns else render(name, " 2+2? ")) + " Think for 7 tokens."
        assert user in stated and stated.index(user) + len(user) == len(stated) - len(
            stated.split(" Think for 7 tokens.")[-1]), name


def test_phase_parts_are_timed_beside_the_phases(monkeypatch):
    """time/logprobs/old, time/logprobs/reference and time/policy_update/<k> (one per optimiser step) hold the
    seconds of those calls (a clock that only the actor's calls advance), inside their phases' time/logprobs and
    time/policy_update; the phases themselves are unchanged."""
    import torch

    from laconic_nemo.grpo import trainer as trainer_mod
    from laconic_nemo.grpo.interfaces import GenerationOutput

    clock = [0.0]
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])

    class Actor(SimpleNamespace):
        steps = 0

        def generate(self, prompt_ids, sampling):
            n = len(prompt_ids)
            lengths = torch.full((n,), 5)
            return GenerationOutput(torch.ones(n, 8, dtype=torch.long), torch.full((n,), 2), lengths + 1, lengths,
                                    torch.zeros(n, dtype=torch.bool))

        def logprobs(self, batch, reference=False, temperature=1.0):
            clock[0] += 3.0 if reference else 2.0
            return torch.zeros(batch.response_mask.shape)

        def train_step(self, mb, loss_fn, micro):
            Actor.steps += 1
            clock[0] += 10.0 * Actor.steps  # optimiser step k takes 10 k "seconds"
            return loss_fn(torch.zeros(mb.response_mask.shape, requires_grad=True), mb)[1]

    cfg = load_config(TINY, ["grpo.kl_beta=0.1", "grpo.minibatch_size=128"])  # 256 responses: 2 optimiser steps
    trainer = GRPOTrainer(cfg, Actor(dp_rank=0, dp_size=1, dp_group=None), encode=list, decode=str,
                          prompts=[(f"P{i}", "1") for i in range(50)],
                          reward_fn=lambda texts, answers: ([0.0] * len(texts), {}), eos_id=1)
    m = trainer.train_step(0)
    assert (m["time/logprobs/old"], m["time/logprobs/reference"], m["time/logprobs"]) == (2.0, 3.0, 5.0)
    assert (m["time/policy_update/1"], m["time/policy_update/2"], m["time/policy_update"]) == (10.0, 20.0, 30.0)
    assert "time/policy_update/3" not in m
    assert {k for k in m if k.startswith("time/")} == {f"time/{p}" for p in trainer_mod.PHASES} | {
        "time/logprobs/old", "time/logprobs/reference", "time/policy_update/1", "time/policy_update/2"}


def test_stop_signals_record_the_first_signal_agree_on_it_and_ignore_after_the_end():
    """The trainer's public stop interface (app/run.py drives it): install catches SIGUSR1 / SIGTERM / SIGINT,
    an early start-up signal is kept unless one arrived since, requested() is the all-ranks verdict (one
    process here), ignore() leaves a finished run's status alone."""
    import os
    import signal

    from laconic_nemo.grpo.trainer import STOP_SIGNALS, StopSignals

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        stop = make_trainer([]).stop
        assert isinstance(stop, StopSignals) and stop.signal is None
        stop.install()
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal == signal.SIGUSR1 and stop.requested()
        late = StopSignals()
        late.install(early=signal.SIGTERM)
        assert late.signal == signal.SIGTERM and late.requested()
        os.kill(os.getpid(), signal.SIGINT)  # recorded by the handler installed last
        assert late.signal == signal.SIGINT
        StopSignals.ignore()
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in STOP_SIGNALS)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
