"""The NeMo-Aligner actor: pure conversions and checkpoint sidecar on CPU (always), and, where
nemo-toolkit 2.2.1 + nemo-aligner 0.7.0 are installed (pytest marker `nemo`), the real subclass and the
shared GRPO loss through NeMo-Aligner's tensor-parallel log-prob function, checked against a float64
reference."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from laconic_nemo.actors import nemo_aligner as na
from laconic_nemo.app.nemo_entry import build_nemo_config, conversion_command, prepare, split_overrides
from laconic_nemo.config import load_config
from laconic_nemo.grpo.interfaces import TrainBatch, response_mask
from laconic_nemo.grpo.loss import make_grpo_loss_fn

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- CPU tier
def test_rollout_conversion_hand_worked():
    # three samples, prompt lengths 2, 3, 2; max_new_tokens 4
    # 0: ended on EOS after 2 tokens + EOS -> NeMo total 2 + 3 = 5; L = 2
    # 1: hit the limit (4 tokens, no end) -> total 3 + 4 = 7; L = 4, truncated
    # 2: stopped early without a valid end (clamped tokens) -> total 2 + 1; L = 1, not truncated
    tokens = torch.arange(21).view(3, 7)
    out = na.nemo_rollout_to_generation_output(tokens, torch.tensor([5, 7, 3]), torch.tensor([2, 3, 2]),
                                               torch.tensor([True, False, False]), max_new_tokens=4)
    assert out.response_lengths.tolist() == [3, 4, 1]
    assert out.lengths.tolist() == [2, 4, 1]
    assert out.truncated.tolist() == [False, True, False]
    mask = response_mask(out.prompt_lengths, out.response_lengths, tokens.shape[1])
    assert mask.sum(1).tolist() == [3, 4, 1]  # the interface's mask covers exactly the response tokens


def test_rollout_conversion_caps_rows_that_ran_past_max_new_tokens():
    """NeMo's batch sampler runs every row to max(prompt) + max_length, so a row whose prompt is k tokens
    shorter can generate (and end after) up to max_length + k tokens. Such a row is cut at L_max, counted
    as truncated, and the tokens after the cut are overwritten, so neither the mask nor the text sees them."""
    # prompts of 4 and 2 tokens, max_new_tokens 3 -> width 4 + 3 = 7
    # row 0: ended after 2 tokens + EOS (total 7): within the limit
    # row 1: prompt 2, ended on EOS after 4 tokens + EOS (total 7): 5 > 3 generated tokens
    # row 2: prompt 2, 3 tokens then EOS at total 6: 4 > 3 generated tokens (the EOS itself is past the cap)
    tokens = torch.tensor([[1, 1, 1, 1, 5, 6, 9], [1, 1, 5, 6, 7, 8, 9], [1, 1, 5, 6, 7, 9, 9]])
    out = na.nemo_rollout_to_generation_output(tokens, torch.tensor([7, 7, 6]), torch.tensor([4, 2, 2]),
                                               torch.tensor([True, True, True]), max_new_tokens=3, pad_id=0)
    assert out.response_lengths.tolist() == [3, 3, 3]
    assert out.lengths.tolist() == [2, 3, 3]
    assert out.truncated.tolist() == [False, True, True]
    assert out.tokens.tolist() == [[1, 1, 1, 1, 5, 6, 9], [1, 1, 5, 6, 7, 0, 0], [1, 1, 5, 6, 7, 0, 0]]
    assert int(out.lengths.max()) <= 3


def test_rollout_conversion_rejects_inconsistent_lengths():
    with pytest.raises(ValueError, match="response_lengths"):
        na.nemo_rollout_to_generation_output(torch.zeros(2, 4, dtype=torch.long), torch.tensor([1, 4]),
                                             torch.tensor([2, 2]), torch.tensor([True, True]), 4)


def test_pad_prompts_and_batch_round_trip():
    # room for max_new_tokens after the longest prompt: NeMo's sampler writes the response into this tensor
    tokens, lengths = na.pad_prompts([[5, 6, 7], [8]], pad_id=0, max_new_tokens=2)
    assert tokens.tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0]] and lengths.tolist() == [3, 1]
    b = TrainBatch(tokens=torch.ones(2, 5, dtype=torch.long), prompt_lengths=torch.tensor([2, 1]),
                   response_lengths=torch.tensor([2, 3]), response_mask=torch.ones(2, 4),
                   advantages=torch.tensor([0.5, -0.5]), old_logprobs=torch.zeros(2, 4))
    d = na.train_batch_to_nemo(b)
    assert "ref_logprobs" not in d and set(d) >= {"response_tokens", "advantages", "old_logprobs"}
    back = na.nemo_to_train_batch(d)
    assert torch.equal(back.tokens, b.tokens) and torch.equal(back.advantages, b.advantages)
    with pytest.raises(ValueError, match="advantages"):
        na.train_batch_to_nemo(TrainBatch(b.tokens, b.prompt_lengths, b.response_lengths, b.response_mask))


def test_loss_scale_and_divisors():
    assert na.loss_scale(4, 16) == 64.0
    assert na.largest_divisor_at_most(96, 10) == 8 and na.largest_divisor_at_most(7, 4) == 1
    with pytest.raises(ValueError):
        na.loss_scale(0, 1)


def test_sidecar_atomic(tmp_path):
    state = {"step": 25, "shaper": {"lam": 0.0123456789012345}}
    na.write_sidecar(tmp_path / "ck", state)
    assert na.read_sidecar(tmp_path / "ck") == state
    na.write_sidecar(tmp_path / "ck", {"step": 50})
    assert na.read_sidecar(tmp_path / "ck") == {"step": 50}
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [na.SIDECAR]  # no temporary left behind
    assert na.read_sidecar(tmp_path / "none") is None


def test_nemo_config_from_recipe():
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
    n = build_nemo_config(cfg, 2, 8, ["model.reinforce.rollout_micro_batch_size=16"])
    assert (n.trainer.num_nodes, n.trainer.devices, n.trainer.precision) == (2, 8, "bf16")
    assert n.model.global_batch_size == 192 and n.model.micro_batch_size == 4
    assert n.model.reinforce.length_params.max_length == 4096
    assert n.model.reinforce.sampling_params.temperature == 1.0
    assert n.model.reinforce.rollout_micro_batch_size == 16  # nemo.* override applied
    assert n.model.optim.sched.min_lr == n.model.optim.lr == 1e-6
    assert n.pretrained_checkpoint.restore_from_path == "/checkpoints/deepseek-r1-distill-qwen-1.5b.nemo"
    assert n.model.reinforce.sampling_params.end_strings == ["<|endoftext|>"]  # tokenizer's ones added at start-up


def test_nemo_config_keeps_sequence_parallel_off_with_tp():
    """With sequence parallelism megatron scatters the sequence dimension over TP and asserts
    ``dim_size % world_size == 0`` ("First dimension of the tensor should be divisible by tensor parallel
    size", megatron-core 0.11 ``megatron/core/tensor_parallel/mappings.py:65-69`` and ``:174-178``). Rollout
    widths (longest prompt + response) are arbitrary, so the NeMo path keeps it off at TP > 1."""
    q = build_nemo_config(load_config(ROOT / "recipes" / "qwen3_8b_b1000.yaml"), 4, 8)
    assert q.model.tensor_model_parallel_size == 4 and q.model.sequence_parallel is False


def test_nemo_exp_manager_gets_the_recipes_dashboards(tmp_path):
    """The NeMo path's dashboards are NeMo's own exp_manager loggers, set from the recipe's logging section."""
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                      [f"run.output_dir={tmp_path}", "logging.tensorboard=true", "logging.wandb=true",
                       "logging.wandb_mode=offline", "logging.wandb_project=p"])
    e = build_nemo_config(cfg, 1, 8, resume_step=20).exp_manager
    assert e.create_tensorboard_logger is True and e.explicit_log_dir == str(tmp_path / "nemo_logs")
    # events below the log dir (exp_manager moves its files away at every start); TensorBoard drops what a crash
    # left past step 20
    assert e.summary_writer_kwargs == {"sub_dir": "tensorboard", "purge_step": 21}
    assert e.create_wandb_logger is True
    w = e.wandb_logger_kwargs
    assert (w.project, w.name, w.offline, w.resume, w.save_dir) == ("p", cfg.run.name, True, "allow", str(tmp_path))
    assert w.id == json.loads((tmp_path / "wandb" / "laconic_run.json").read_text())["id"]
    assert build_nemo_config(cfg, 1, 8, rank=3).exp_manager.wandb_logger_kwargs.id is None  # rank 0 alone logs
    off = build_nemo_config(load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                                        ["logging.tensorboard=false"]), 1, 8).exp_manager
    assert off.create_tensorboard_logger is False and off.create_wandb_logger is False


def test_split_overrides():
    assert split_overrides(["laconic.budget=1", "nemo.model.seed=3"]) == (["laconic.budget=1"], ["model.seed=3"])


def test_prepare_converts_once_atomically(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    target = tmp_path / "ck" / "m.nemo"
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml", [f"model.path={target}"])
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        Path(cmd[cmd.index("--output_path") + 1]).write_text("nemo")
        return 0

    assert prepare(cfg, str(hf), run=fake_run) == 0
    assert target.read_text() == "nemo"
    assert [p.name for p in target.parent.iterdir()] == ["m.nemo"]  # no lock or scratch folder left behind
    assert calls[0][1:3] == ["-m", "laconic_nemo.tools.convert_qwen2"] and "--input_name_or_path" in calls[0]
    assert calls[0][calls[0].index("--converter") + 1].endswith("convert_qwen2_hf_to_nemo.py")
    assert prepare(cfg, str(hf), run=fake_run) == 0 and len(calls) == 1  # exists: no second conversion
    assert prepare(load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                               [f"model.path={tmp_path / 'other.nemo'}"]), None, run=fake_run) == 2
    assert conversion_command("a", "b")[-2:] == ["--precision", "bf16"]


# ---------------------------------------------------------------------------------------------- NeMo tier
def _nemo_available() -> str | None:
    try:
        import nemo  # noqa: F401
        import nemo_aligner  # noqa: F401
    except Exception as exc:  # ImportError, or a broken optional dependency of NeMo
        return f"nemo-toolkit / nemo-aligner not importable here ({type(exc).__name__}: {exc})"
    return None


nemo_skip = pytest.mark.skipif(_nemo_available() is not None, reason=str(_nemo_available()))


@pytest.mark.nemo
@nemo_skip
def test_real_subclass_and_upstream_signatures():
    import nemo_aligner

    cls = na.actor_model_class()  # first: it stubs the TRT-LLM module when tensorrt_llm is absent
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel
    from nemo_aligner.utils import train_script_utils, train_utils, utils

    assert nemo_aligner.__version__ == na.TARGET_VERSIONS["nemo_aligner"]
    assert issubclass(cls, MegatronGPTReinforceActorModel)

    def params(f):
        return list(inspect.signature(f).parameters)

    A = MegatronGPTReinforceActorModel
    assert params(A.infer) == ["self", "inference_batch"]
    assert params(A.get_inference_log_probs) == ["self", "response_tokens", "forward_micro_batch_size"]
    assert params(A.get_init_policy_logprobs) == ["self", "response_tokens"]
    assert params(A.get_loss_and_metrics) == ["self", "batch", "forward_only"]
    for name in ("prepare_for_inference", "finish_inference", "prepare_for_training", "prepare_for_training_step",
                 "finish_training_step", "finish_training"):
        assert params(getattr(A, name)) == ["self"], name
    assert params(utils.configure_batch_sizes) == ["mbs", "gbs", "dp"]
    assert params(train_utils.clip_gradients) == ["ptl_model", "clip_val"]
    assert params(train_script_utils.init_using_ptl) == ["ptl_trainer", "ptl_model", "train_dataloader", "train_ds"]
    assert params(utils.load_from_nemo)[:3] == ["cls", "model_cfg", "trainer"]
    assert "megatron_amp_O2" in params(utils.retrieve_model_state_dict_in_cpu)


@pytest.fixture
def gloo_world(monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=6, micro_batch_size=3,
                                     data_parallel_size=1)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # CPU stand-in for the device copy
    yield
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.nemo
@nemo_skip
def test_checkpoint_hooks_carry_laconic_state():
    cls = na.actor_model_class()
    parent = cls.__mro__[1]
    saved = {}
    obj = object.__new__(cls)
    obj.laconic_state = {"step": 3, "shaper": {"lam": 0.25}}
    # the parents' hooks need a built model; call only the laconic part around a no-op parent
    orig_save, orig_load = parent.on_save_checkpoint, parent.on_load_checkpoint
    try:
        parent.on_save_checkpoint = lambda self, ck: None
        parent.on_load_checkpoint = lambda self, ck: None
        cls.on_save_checkpoint(obj, saved)
        restored = object.__new__(cls)
        cls.on_load_checkpoint(restored, json.loads(json.dumps(saved)))
    finally:
        parent.on_save_checkpoint, parent.on_load_checkpoint = orig_save, orig_load
    assert restored.restored_laconic_state == {"step": 3, "shaper": {"lam": 0.25}}


def test_entry_rejects_bad_keys_before_anything_starts(capsys):
    from laconic_nemo.app.nemo_entry import main

    recipe = str(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
    assert main([recipe, "grpo.groupsize=4"]) == 2
    assert "grpo.groupsize" in capsys.readouterr().err
    assert main([recipe, "laconic.budget=9000"]) == 2  # B must stay below L_max
    assert "laconic.budget" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- NeMo tier: upstream paths
@pytest.fixture
def cpu_cuda_shims(monkeypatch):
    """NeMo's sampler and checkpoint code allocate through torch.cuda.*; on CPU those become CPU tensors."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "FloatTensor", lambda data: torch.tensor(data, dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "LongTensor", lambda data: torch.tensor(data, dtype=torch.long))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _nemo_tokenizer(tmp_path, family: str = "deepseek"):
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    from tests.hf_fixtures import DEEPSEEK_R1_DISTILL_SPECIALS, QWEN25_SPECIALS, save_bpe_tokenizer_json_only

    specials, eos = ((DEEPSEEK_R1_DISTILL_SPECIALS, DEEPSEEK_R1_DISTILL_SPECIALS[0]) if family == "deepseek"
                     else (QWEN25_SPECIALS, "<|im_end|>"))
    folder = save_bpe_tokenizer_json_only(tmp_path / f"tok_{family}", specials, eos)
    return AutoTokenizer(folder, use_fast=True), folder


def _nemo_strategy_end_check(nemo_tok, end_strings):
    """(end token ids, strings NeMo will compare as decoded text) from NeMo's own strategy code."""
    from nemo.collections.nlp.modules.common.text_generation_strategy import GPTModelTextGenerationStrategy

    strategy = object.__new__(GPTModelTextGenerationStrategy)
    strategy.model, strategy._end_of_generation_cache = SimpleNamespace(tokenizer=nemo_tok), None
    return strategy._get_end_of_generation_tokens_and_strings(nemo_tok.eos_id, list(end_strings))


@pytest.mark.nemo
@nemo_skip
@pytest.mark.parametrize("family", ["deepseek", "qwen"])
def test_end_strings_are_single_tokens_for_nemo(tmp_path, family):
    """``<|im_end|>`` is no token of the DeepSeek-R1-Distill tokenizer and ``<｜end▁of▁sentence｜>`` none of
    Qwen2.5's: NeMo (``text_generation_strategy.py:165-265``) would decode every row at every step. The
    config's end strings plus the tokenizer's single-token ones leave NeMo nothing to compare as text."""
    from laconic_nemo.bridge.end_tokens import EndStringError, resolve_end_strings

    nemo_tok, _ = _nemo_tokenizer(tmp_path, family)
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
    configured = list(build_nemo_config(cfg, 1, 8).model.reinforce.sampling_params.end_strings)
    ends = resolve_end_strings(nemo_tok.text_to_ids, None)
    assert set(configured) <= set(ends)
    tokens, to_check = _nemo_strategy_end_check(nemo_tok, ends)
    assert to_check == [] and nemo_tok.eos_id in tokens
    # the decode engine's stop ids (rollout.engine: megatron) are the ids NeMo's own sampler ends on
    from laconic_nemo.bridge.end_tokens import end_token_ids

    assert sorted(end_token_ids(nemo_tok.text_to_ids, nemo_tok.eos_id, ends)) == sorted(set(tokens))
    chat_end = "<｜end▁of▁sentence｜>" if family == "deepseek" else "<|im_end|>"
    assert chat_end in ends
    foreign = "<|im_end|>" if family == "deepseek" else "<｜end▁of▁sentence｜>"
    assert _nemo_strategy_end_check(nemo_tok, [foreign])[1] == [foreign]  # NeMo's slow path
    with pytest.raises(EndStringError, match="not a single token"):
        resolve_end_strings(nemo_tok.text_to_ids, ["<|endoftext|>", foreign])


# A deterministic "language model": the next token follows a chain 50 -> 51 -> ... -> 58 -> EOS; any
# other token leads to 40, which repeats forever (never ends).
CHAIN = list(range(50, 59))


def _next_token(t: int, eos: int) -> int:
    if t in CHAIN:
        return CHAIN[CHAIN.index(t) + 1] if t != CHAIN[-1] else eos
    return 40


def _fake_nemo_model(nemo_tok, ncfg, monkeypatch):
    """The parts of a MegatronGPTReinforceActorModel that ``infer`` / ``MegatronGPTModel.generate`` use, with
    those two methods taken from the real classes; only the network forward is replaced (NeMo's
    ``GPTModelTextGenerationStrategy.forward_step`` returns logits of the chain model above)."""
    import types

    from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
    from nemo.collections.nlp.modules.common.text_generation_strategy import GPTModelTextGenerationStrategy
    from omegaconf import OmegaConf

    na.actor_model_class()  # stubs TRT-LLM before the import below
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel

    V, eos = nemo_tok.vocab_size, nemo_tok.eos_id

    def forward_step(self, batch, tensor_shape):
        tokens = batch[0]
        nxt = torch.tensor([[_next_token(int(t), eos) for t in row] for row in tokens])
        return [{"logits": torch.nn.functional.one_hot(nxt, V).float() * 50.0}]

    monkeypatch.setattr(GPTModelTextGenerationStrategy, "forward_step", forward_step)
    m = types.SimpleNamespace(tokenizer=nemo_tok, training=False, model=None, use_trtllm_generation=False)
    m.cfg = OmegaConf.create({"position_embedding_type": "rope", "encoder_seq_length": 4096, "hidden_size": 8,
                              "reinforce": OmegaConf.to_container(ncfg.model.reinforce, resolve=True)})
    m._length_params = OmegaConf.to_container(ncfg.model.reinforce.length_params)
    m._sampling_params = OmegaConf.to_container(ncfg.model.reinforce.sampling_params)
    m.cuda = lambda: m
    m.prepare_for_inference = m.finish_inference = lambda: None
    m.generate = types.MethodType(MegatronGPTModel.generate, m)
    m.infer = types.MethodType(MegatronGPTReinforceActorModel.infer, m)
    return m


@pytest.mark.nemo
@nemo_skip
def test_rollout_through_nemo_sampler(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path):
    """NemoAlignerActor.generate -> MegatronGPTReinforceActorModel.infer -> MegatronGPTModel.generate ->
    NeMo's generate / sample_sequence_batch / TrackLengthGPTModelTextGenerationStrategy /
    verify_is_valid_and_clamp_range_, on the chain model. Checks: prompts padded for NeMo's in-place
    generation (no IndexError), end strings single tokens (no text comparison warned by NeMo), and a
    shorter-prompt row that NeMo let run past max_length capped at L_max and marked truncated."""
    import warnings

    from laconic_nemo.app.nemo_entry import apply_end_strings
    from laconic_nemo.grpo.interfaces import SamplingParams

    nemo_tok, _ = _nemo_tokenizer(tmp_path)
    eos, M = nemo_tok.eos_id, 4
    ncfg = build_nemo_config(load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                                         [f"rollout.max_new_tokens={M}", "laconic.budget=2"]), 1, 1)
    m = _fake_nemo_model(nemo_tok, ncfg, monkeypatch)
    apply_end_strings(m, None)
    actor = object.__new__(na.NemoAlignerActor)
    actor.model, actor.pad_id, actor.rollout_engine = m, eos, "nemo"
    prompts = [[10, 11, 12, 13, 14, 56],  # longest prompt: 57, 58, EOS (ends within L_max)
               [10, 53],                  # 54 .. 58, EOS: 6 tokens, NeMo lets it run (maxlen = 6 + 4)
               [10, 20, 30]]              # 40 forever: cut at L_max
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = actor.generate(prompts, SamplingParams(temperature=0.6, top_p=1.0, max_new_tokens=M, eos_id=eos,
                                                     seed=3))
    assert not [w for w in caught if "no associated special token" in str(w.message)]
    assert out.prompt_lengths.tolist() == [6, 2, 3]
    assert out.response_lengths.tolist() == [3, 4, 4]
    assert out.lengths.tolist() == [2, 4, 4] and int(out.lengths.max()) <= M
    assert out.truncated.tolist() == [False, True, True]
    rows = [out.tokens[i, p : p + r].tolist() for i, (p, r) in enumerate(zip([6, 2, 3], [3, 4, 4]))]
    assert rows == [[57, 58, eos], [54, 55, 56, 57], [40, 40, 40, 40]]


@pytest.mark.nemo
@nemo_skip
def test_nemo_sampler_writes_into_the_prompt_tensor(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path):
    """Upstream contract behind ``pad_prompts``: NeMo's ``sample_sequence_batch`` writes token t into column
    ``context_length`` of the tensor it was given (``text_generation_utils.py:954-1025``), so a tensor padded
    only to the longest prompt fails at the first generated token of that prompt."""
    nemo_tok, _ = _nemo_tokenizer(tmp_path)
    ncfg = build_nemo_config(load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                                         ["rollout.max_new_tokens=4", "laconic.budget=2"]), 1, 1)
    m = _fake_nemo_model(nemo_tok, ncfg, monkeypatch)
    lengths = torch.tensor([3, 2])
    narrow = torch.tensor([[10, 11, 52], [10, 53, nemo_tok.eos_id]])
    with pytest.raises(IndexError):
        m.infer({"text": narrow, "length": lengths})
    wide, _ = na.pad_prompts([[10, 11, 52], [10, 53]], nemo_tok.eos_id, 4)
    assert m.infer({"text": wide, "length": lengths})["response_tokens"].shape[1] <= 3 + 4


def _nemo_checkpoint_stack(monkeypatch):
    """NeMo's checkpoint path from ``trainer.save_checkpoint(path)`` down to megatron-core: a real
    ``NLPDDPStrategy`` (``save_checkpoint`` -> ``DistributedCheckpointIO.save_checkpoint(ckpt_to_dir(path))``
    -> ``megatron.core.dist_checkpointing.save``, whose rank-0 check refuses a non-empty destination,
    ``serialization.py:347-356``) and ``NLPDDPStrategy.load_checkpoint`` (directory check, common state,
    ``checkpoint_io.load_checkpoint``). Only the tensor byte writer/reader is a stand-in: megatron-core
    0.11's torch_dist writer does not run with the CPU torch here (``_write_item`` signature), and apex,
    which only the strategy's constructor asks for, is not installed."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from nemo.collections.nlp.parts import nlp_overrides
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy
    from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO

    class TensorFileSave(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)  # the format named in metadata.json, read back on load

        def save(self, sharded_state_dict, checkpoint_dir):
            from megatron.core.dist_checkpointing.dict_utils import nested_values

            torch.save({t.key: t.data for t in nested_values(sharded_state_dict)}, Path(checkpoint_dir) / "shards.pt")

        @property
        def can_handle_sharded_objects(self):
            return True

    class CheckpointIO(DistributedCheckpointIO):
        def load_checkpoint(self, path, map_location=None, sharded_state_dict=None, strict=None,
                            validate_access_integrity=True):
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

            shards = torch.load(Path(path) / "shards.pt")
            loaded = dist_checkpointing.load_common_state_dict(path)
            loaded["state_dict"] = dict_list_map_inplace(lambda t: shards[t.key].clone(),
                                                         sharded_state_dict["state_dict"])
            return loaded

    class Module:  # what the strategy asks of the LightningModule
        def __init__(self, w):
            self.w = w

        def sharded_state_dict(self):
            return {"w": ShardedTensor.from_rank_offsets("w", self.w, replica_id=0)}

    io = CheckpointIO("torch_dist")
    io._save_sharded_strategy = TensorFileSave()
    monkeypatch.setattr(nlp_overrides, "HAVE_APEX", True)
    strategy = NLPDDPStrategy()
    strategy.checkpoint_io = io
    weights = torch.arange(6.0).view(2, 3)
    strategy._lightning_module = Module(weights)

    def trainer_save_checkpoint(filepath):  # Lightning: dump_checkpoint (on_save_checkpoint hooks), then the strategy
        ckpt = {"sharded_state_dict": strategy.lightning_module.sharded_state_dict(), "optimizer_states": [],
                na.CHECKPOINT_KEY: model.laconic_state}
        strategy.save_checkpoint(ckpt, filepath, storage_options={"include_optimizer": False})

    model = SimpleNamespace(laconic_state=None, prepare_for_training=lambda: None, finish_training=lambda: None,
                            trainer=SimpleNamespace(save_checkpoint=trainer_save_checkpoint))
    actor = object.__new__(na.NemoAlignerActor)
    actor.model = model
    return actor, strategy, weights


@pytest.mark.nemo
@nemo_skip
def test_resave_after_an_interrupted_save_of_the_same_step(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path):
    """A job killed during the NeMo save of step X leaves a non-empty ``step_X/model`` (or ``step_X.tmp``);
    the resumed run reaches step X again and must be able to save it."""
    actor, _, _ = _nemo_checkpoint_stack(monkeypatch)
    folder = tmp_path / "checkpoints" / "nemo" / "step_000002"
    for leftover in (folder / "model", folder.with_name(folder.name + ".tmp") / "model"):
        leftover.mkdir(parents=True)
        (leftover / "__0_0.distcp").write_bytes(b"partial")
    actor.save_sharded_checkpoint(folder, {"step": 2, "shaper": {"lam": 0.5}})
    assert sorted(p.name for p in (folder / "model").iterdir()) == ["common.pt", "metadata.json", "shards.pt"]
    assert na.read_sidecar(folder) == {"step": 2, "shaper": {"lam": 0.5}}
    assert not folder.with_name(folder.name + ".tmp").exists()


@pytest.mark.nemo
@nemo_skip
def test_resume_path_is_the_folder_nemo_wrote(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path):
    """``NLPDDPStrategy.save_checkpoint(..., "<f>/model.ckpt")`` writes to ``ckpt_to_dir`` = ``<f>/model``
    (``nlp_overrides.py:421``, ``model_utils.py:717-734``); ``load_checkpoint`` refuses a path that is not a
    directory (``nlp_overrides.py:563-564``). The resume path must be that folder."""
    from nemo.utils.model_utils import ckpt_to_dir

    from laconic_nemo.app.nemo_entry import nemo_checkpoint_dir

    actor, strategy, weights = _nemo_checkpoint_stack(monkeypatch)
    folder = tmp_path / "nemo" / "step_000004"
    actor.save_sharded_checkpoint(folder, {"step": 4})
    assert nemo_checkpoint_dir(folder) == ckpt_to_dir(folder / "model.ckpt")
    with pytest.raises(ValueError, match="should be a directory"):
        strategy.load_checkpoint(str(folder / "model.ckpt"), load_optimizer_states=False)
    loaded = strategy.load_checkpoint(str(nemo_checkpoint_dir(folder)), load_optimizer_states=False)
    assert torch.equal(loaded["state_dict"]["w"], weights)
    assert loaded[na.CHECKPOINT_KEY] == {"step": 4}


CONVERTER_STAND_IN = '''"""Stand-in for NeMo's scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py (NeMo 2.2.x): the same
imports, arguments and first two lines of convert(); the weight conversion writes a marker file instead."""
from argparse import ArgumentParser

from transformers import Qwen2ForCausalLM, Qwen2Tokenizer


def get_args():
    parser = ArgumentParser()
    parser.add_argument("--input_name_or_path", type=str, default=None, required=True)
    parser.add_argument("--output_path", type=str, default=None, required=True)
    parser.add_argument("--precision", type=str, default="16")
    return parser.parse_args()


def convert(args):
    model = Qwen2ForCausalLM.from_pretrained(args.input_name_or_path)
    tokenizer = Qwen2Tokenizer.from_pretrained(args.input_name_or_path)
    with open(args.output_path, "w") as f:
        f.write(f"{model.config.vocab_size} {type(tokenizer).__name__}")


if __name__ == "__main__":
    convert(get_args())
'''


@pytest.mark.nemo
@nemo_skip
def test_prepare_converts_a_tokenizer_json_only_folder(tmp_path, monkeypatch):
    """NeMo's Qwen2 converter (``scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py``, read at NVIDIA/NeMo
    13ba900c: ``from transformers import Qwen2ForCausalLM, Qwen2Tokenizer`` and, in ``convert()``,
    ``tokenizer = Qwen2Tokenizer.from_pretrained(args.input_name_or_path)``, never used afterwards) fails with
    transformers 4.48 (the nemo:25.02 container's; this tier's) on a folder without vocab.json / merges.txt,
    as the DeepSeek-R1-Distill repositories ship. ``prepare`` must still convert it."""
    import importlib.util
    import runpy
    import sys

    import laconic_nemo.app.nemo_entry as ne
    from tests.hf_fixtures import save_tiny_qwen2

    hf = Path(save_tiny_qwen2(tmp_path / "hf"))
    assert (hf / "tokenizer.json").is_file() and not (hf / "vocab.json").exists() and not (hf / "merges.txt").exists()
    script = tmp_path / "convert_qwen2_hf_to_nemo.py"
    script.write_text(CONVERTER_STAND_IN)
    spec = importlib.util.spec_from_file_location("stand_in", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(TypeError):  # the upstream line, unpatched, on this folder
        mod.convert(SimpleNamespace(input_name_or_path=str(hf), output_path=str(tmp_path / "x")))

    monkeypatch.setattr(ne, "QWEN2_CONVERTER", str(script))
    target = tmp_path / "ck" / "m.nemo"
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml", [f"model.path={target}"])


    def run_in_process(cmd):  # `python -m module ...` / `python script ...` as the subprocess would, minus start-up
        saved = sys.argv
        try:
            if cmd[1] == "-m":
                sys.argv = [cmd[2], *cmd[3:]]
                runpy.run_module(cmd[2], run_name="__main__")
            else:
                sys.argv = cmd[1:]
                runpy.run_path(cmd[1], run_name="__main__")
        except SystemExit as exc:
            return int(exc.code or 0)
        finally:
            sys.argv = saved
        return 0

    assert ne.prepare(cfg, str(hf), run=run_in_process) == 0
    vocab, tok_class = target.read_text().split()
    assert int(vocab) == json.loads((hf / "config.json").read_text())["vocab_size"]
    assert tok_class == "Qwen2TokenizerFast"


# ---------------------------------------------------------------------------------------------- NeMo tier: export
def _nemo_gpt_model(monkeypatch, hf_dir: str):
    """A real NeMo ``MegatronGPTModel`` (mcore_gpt, local layer spec, fp32, CPU) of the Qwen2 shape in ``hf_dir``,
    configured as NeMo's ``convert_qwen2_hf_to_nemo.py`` load_config does (rmsnorm, fast-swiglu, rope base, query
    groups, override_vocab_size; qkv_bias as in its megatron_qwen2_config.yaml). Weights: NeMo's own random init. Three stand-ins, only where NeMo 2.2.1
    cannot run without Transformer Engine / apex (none touches the network or its weights):
    ``nlp_model.py:78`` asks for the BERT model list, whose import fails without TE (``bert_spec.py:36``
    NameError); ``megatron_gpt_model.py:143-167`` ``get_specs`` builds every spec eagerly, TE ones included
    ("TODO: This function will not work if TE is not installed") and is replaced by its own "" entry,
    ``get_gpt_layer_local_spec``; ``build_model.py:36,134`` uses apex's
    ``set_defaults_if_not_set_tensor_model_parallel_attributes``, replaced by megatron-core's function of that
    name. ``NVIDIA_PYTORCH_VERSION`` is set as in the NGC container (``megatron_base_model.py:396-399``)."""
    import nemo.collections.nlp.models.language_modeling.megatron_gpt_model as gpt_module
    import nemo.collections.nlp.models.nlp_model as nlp_model
    import nemo.collections.nlp.modules.common.megatron.build_model as build_module
    from lightning.pytorch import Trainer
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
    from nemo.collections.nlp.parts import nlp_overrides
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy
    from omegaconf import OmegaConf

    def local_spec(spec_name, transformer_config=None, use_te=True, hyena_cfg=None, fp8=False):
        assert spec_name == "" and not use_te, (spec_name, use_te)
        return get_gpt_layer_local_spec(transformer_config.num_moe_experts, transformer_config.moe_grouped_gemm)

    monkeypatch.setenv("NVIDIA_PYTORCH_VERSION", "25.02")
    monkeypatch.setattr(nlp_model, "get_megatron_pretrained_bert_models", lambda: [])
    monkeypatch.setattr(gpt_module, "get_specs", local_spec)
    monkeypatch.setattr(build_module, "set_defaults_if_not_set_tensor_model_parallel_attributes",
                        set_defaults_if_not_set_tensor_model_parallel_attributes, raising=False)
    monkeypatch.setattr(nlp_overrides, "HAVE_APEX", True)  # only NLPDDPStrategy's constructor asks
    c = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg = OmegaConf.create(dict(
        mcore_gpt=True, transformer_engine=False, micro_batch_size=3, global_batch_size=6,  # as gloo_world
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, encoder_seq_length=64,
        max_position_embeddings=64, num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"], init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,
        ffn_dropout=0.0, normalization="rmsnorm", layernorm_epsilon=c["rms_norm_eps"], bias=False, qkv_bias=True,
        activation="fast-swiglu", position_embedding_type="rope", rotary_base=c["rope_theta"],
        share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128,
        override_vocab_size=c["vocab_size"], tokenizer=dict(library="huggingface", type=hf_dir, use_fast=True),
        precision=32, use_cpu_initialization=True, optim=dict(name="adamw", lr=1e-4), apply_rope_fusion=False,
        bias_activation_fusion=False, bias_dropout_add_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False))
    trainer = Trainer(devices=1, accelerator="cpu", strategy=NLPDDPStrategy(), logger=False,
                      enable_checkpointing=False)
    return gpt_module.MegatronGPTModel(cfg, trainer).eval()


def _torch_dist_writer_for_this_torch(monkeypatch):
    """megatron-core 0.11's torch_dist writer calls ``_write_item(stream, data, write_item, storage_key)``
    (``strategies/filesystem_async.py:298,302``); torch 2.13 added leading ``transforms`` and trailing
    ``serialization_format`` arguments (``torch/distributed/checkpoint/filesystem.py:320-327``). This adapter
    passes the values that reproduce the old behaviour (no transforms, torch.save of each item); everything
    else in the save (planner, metadata, file layout) and the whole load are megatron-core's and torch's."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    def write_item(stream, data, write_item, storage_key):
        return filesystem._write_item(filesystem._StorageWriterTransforms(), stream, data, write_item, storage_key,
                                      filesystem.SerializationFormat.TORCH_SAVE)

    monkeypatch.setattr(filesystem_async, "_write_item", write_item)


@pytest.mark.nemo
@nemo_skip
@pytest.mark.parametrize("spec", ["local", "te"])
def test_export_nemo_run_to_hf_matches_nemo_logits(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path, spec):
    """A NeMo-Aligner run directory -> ``laconic-nemo export RUN --to hf OUT --hf-config HF``: transformers loads
    OUT and its logits equal the real NeMo MegatronGPTModel's (fp32, TP 1). The checkpoint is written as the actor
    writes it (NeMo's ``DistributedCheckpointIO`` over ``MegatronGPTModel.sharded_state_dict``, megatron-core's
    torch_dist strategy, only its byte call adapted: ``_torch_dist_writer_for_this_torch``) and read back by
    megatron-core's ``dist_checkpointing.load``. ``te``: the same tensors under the Transformer Engine spec's
    names, as the cluster's checkpoints have them (NeMo's default spec "te_gpt", ``megatron_gpt_model.py:158``;
    megatron-core ``gpt_layer_specs.py:105-111,141`` fuse the pre-norms into ``TELayerNormColumnParallelLinear``;
    NeMo's own ``convert_qwen2_nemo_to_hf.py`` reads ``linear_qkv.layer_norm_weight`` and
    ``linear_fc1.layer_norm_weight`` in convert(), "# layernorm" block, NVIDIA/NeMo 280786ed), which need TE to build."""
    import contextlib

    import transformers
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO

    from laconic_nemo.cli import main as cli_main
    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    hf = save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2)
    model = _nemo_gpt_model(monkeypatch, hf)
    from megatron.core.tensor_parallel import random as mp_random

    # the attention's dropout runs under megatron's CUDA RNG tracker; eval mode, dropout 0: no RNG is drawn
    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    V = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        causal = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1).expand(2, 1, 9, 9)  # True: masked (NeMo's)
        ref = model(tokens, torch.arange(9).expand(2, 9), causal, labels=None)  # [b, s, V]
    assert ref.shape == (2, 9, V)  # override_vocab_size, as NeMo's converter sets it: no padded rows

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 1, "shaper": {"shaper": "grpo"}, "config": {"model": {
        "source": "nemo", "path": "/checkpoints/base.nemo"}, "parallel": {"tensor_model_parallel_size": 1}}}))
    (run / "checkpoints" / "latest").write_text(step.name)
    sharded = model.sharded_state_dict()
    if spec == "te":
        for t in nested_values(sharded):
            t.key = t.key.replace("layers.input_layernorm.weight",
                                  "layers.self_attention.linear_qkv.layer_norm_weight")
            t.key = t.key.replace("layers.pre_mlp_layernorm.weight", "layers.mlp.linear_fc1.layer_norm_weight")
    _torch_dist_writer_for_this_torch(monkeypatch)
    nemo_dir = run / "checkpoints" / "nemo" / step.name / na.NEMO_CKPT
    DistributedCheckpointIO("torch_dist").save_checkpoint({"state_dict": sharded}, str(nemo_dir))
    assert json.loads((nemo_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"

    out = tmp_path / "out"
    assert cli_main(["export", str(run), "--to", "hf", str(out), "--hf-config", hf]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf_model(input_ids=tokens).logits
    assert got.shape == (2, 9, V)
    assert (got - ref).abs().max() < 1e-5
    # NeMo's random init, not the source HF weights: equality above is not a copy of --hf-config's model
    src = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (src(input_ids=tokens).logits - ref).abs().max() > 1e-2


@pytest.mark.nemo
@nemo_skip
def test_decode_engine_on_a_real_nemo_model(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path):
    """``rollout.engine: megatron`` on the NeMo-Aligner actor: ``NemoAlignerActor.generate`` runs the decode engine on
    the megatron-core GPTModel inside a real NeMo ``MegatronGPTModel`` (found through ``get_model_module_list``),
    between the model's ``prepare_for_inference`` / ``finish_inference``, over the tokenizer's vocabulary; its
    tokens equal today's sampler loop (megatron's ``InferenceParams`` forward on that GPTModel) for the same seeds,
    with prompts of different lengths, top-p < 1, EOS mid-batch and compaction."""
    import contextlib

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as mp_random
    from reference_loop import model_reference

    from laconic_nemo.grpo.interfaces import SamplingParams
    from laconic_nemo.rollout.engine import DecodeEngine, EngineSettings
    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    hf = save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2)
    model = _nemo_gpt_model(monkeypatch, hf)
    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    with torch.no_grad():  # NeMo's init at std 0.02 gives near-uniform draws; sharpen them so context matters
        for name, p in model.named_parameters():
            p.mul_(6.0 if "norm" not in name else 1.0)
    V, eos = model.tokenizer.vocab_size, model.tokenizer.eos_id
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 5, 2, 4)]
    prompts = [[t if t != eos else eos + 1 for t in p] for p in prompts]
    prompts = [p for p in prompts for _ in range(2)]  # G = 2
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=14, eos_id=eos, seed=9)
    calls: list[str] = []
    model.prepare_for_inference = lambda: calls.append("prepare")
    model.finish_inference = lambda: calls.append("finish")
    for sampler in ("exact", "device"):
        calls.clear()
        actor = object.__new__(na.NemoAlignerActor)
        actor.model, actor.pad_id, actor.dp_rank, actor.rollout_engine = model, eos, 0, "megatron"
        actor.vocab_size, actor._decode_engine, actor.engine_memory = None, None, "resident"
        actor.engine_settings = EngineSettings(sampler=sampler, sync_every=2, batch_buckets=(2, 4, 6), kv_block=4)
        out = actor.generate(prompts, sp)
        assert calls == ["prepare", "finish"]
        engine = actor.decode_engine()
        assert isinstance(engine, DecodeEngine) and isinstance(engine.model, GPTModel) and engine.vocab_size == V
        assert engine.fused  # the fused decode step serves NeMo's GPTModel
        ref = model_reference(engine.model, V, prompts, sp, sampler=sampler, sync_every=2, causal_mask=True)
        for k in ("tokens", "prompt_lengths", "response_lengths", "lengths", "truncated"):
            assert torch.equal(getattr(out, k), getattr(ref, k)), (sampler, k)
        assert out.truncated.any() and (~out.truncated).any()
        assert engine.stats.compactions >= 1


@pytest.mark.nemo
@nemo_skip
def test_decode_engine_memory_resident_or_released_on_a_real_nemo_model(gloo_world, cpu_cuda_shims, monkeypatch,
                                                                         tmp_path):
    """``rollout.engine_memory``. resident: the engine keeps its cache, buffers and graphs between rollouts and the
    NeMo actor's training plan counts them (``memory.live_engine_bytes``). release: after every rollout the engine
    holds nothing (the plan counts no engine), the next rollout allocates again and captures its steps again (the
    capture's warm-up sequence, rehearsed on CPU) and samples the same tokens as the resident engine."""
    import contextlib

    from megatron.core.tensor_parallel import random as mp_random

    from laconic_nemo.actors import memory
    from laconic_nemo.grpo.interfaces import SamplingParams
    from laconic_nemo.rollout.engine import EngineSettings
    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    model = _nemo_gpt_model(monkeypatch, save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2))
    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    model.prepare_for_inference = model.finish_inference = lambda: None
    eos = model.tokenizer.eos_id
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, eos_id=eos, seed=4)
    outs, plans, engines = {}, {}, {}
    for mode in ("resident", "release"):
        actor = object.__new__(na.NemoAlignerActor)
        actor.model, actor.pad_id, actor.dp_rank, actor.dp_size, actor.rollout_engine = model, eos, 0, 1, "megatron"
        actor.vocab_size, actor._decode_engine, actor.engine_memory = None, None, mode
        actor.logprob_chunk_size = 1024
        actor.engine_settings = EngineSettings(sampler="exact", batch_buckets=(2, 4), kv_block=4, rehearse_graphs=True)
        outs[mode] = [actor.generate(prompts, sp) for _ in range(2)]
        engine = actor.decode_engine()
        if mode == "release":
            assert engine.cache is None and engine.slots is None and not engine.runner.rehearsed
        else:
            assert engine.cache is not None and engine.runner.rehearsed
        plans[mode], engines[mode] = actor.plan_memory(4, 12, 1, device_gib=80.0), engine
    assert plans["release"].resident_gib == 0.0
    kv = engines["resident"].cache.shape.nbytes
    assert plans["resident"].resident_gib * memory.GIB == pytest.approx(memory.live_engine_bytes(engines["resident"]))
    assert plans["resident"].resident_gib * memory.GIB > kv > 0  # the cache, its buffers (no graph pool on CPU)
    assert plans["resident"].peaks_gib[0] - plans["release"].peaks_gib[0] == pytest.approx(plans["resident"].resident_gib)
    for a, b in zip(outs["resident"] + outs["release"], outs["resident"][:1] * 4):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)


@pytest.mark.nemo
@nemo_skip
def test_nemo_loggers_carry_every_metric_and_resume_without_duplicates(tmp_path, monkeypatch):
    """Through NeMo's exp_manager (its TensorBoardLogger and WandbLogger, W&B offline) on a CPU Lightning trainer:
    a run writes steps 1..3 and dies after its checkpoint of step 2; the resumed run (exp_manager again, restart
    marker at 3) writes 3..4. TensorBoard's reader shows lambda and the mean length at steps 1..4 once, step 3
    from the resumed run; the W&B run (one id) holds trainer/global_step 1..4 once."""
    import wandb
    from lightning.pytorch import Trainer
    from nemo.utils.exp_manager import exp_manager

    from laconic_nemo.grpo.metrics import MetricsWriter, nemo_sinks
    from tests.dashboards import tensorboard_scalars, wandb_history, wandb_offline_runs

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                      [f"run.output_dir={tmp_path}", "logging.tensorboard=true", "logging.wandb=true",
                       "logging.wandb_mode=offline"])

    def row(step, run):
        return {"step": step, "lambda": 0.01 * step + 0.1 * run, "mean_response_length": 900.0 - step,
                "budget": 1500.0, "task_reward": 0.5, "frac_over_budget": 0.25, "step_seconds": 2.0}

    def session(resume, steps, run):
        trainer = Trainer(devices=1, accelerator="cpu", logger=False, enable_checkpointing=False)
        exp_manager(trainer, build_nemo_config(cfg, 1, 1, resume_step=resume).exp_manager)
        writer = MetricsWriter(tmp_path, 0, 0, 4, log_every=1)
        writer.start(resume, nemo_sinks(trainer.loggers, cfg))
        for s in steps:
            writer.write(row(s, run))
        writer.close()
        wandb.finish()
        wandb.teardown()

    session(0, [1, 2, 3], run=0)
    session(2, [3, 4], run=1)
    tb = tensorboard_scalars(tmp_path / "nemo_logs" / "tensorboard")
    assert [s for s, _ in tb["lambda"]] == [1, 2, 3, 4] and tb["lambda"][2][1] == pytest.approx(0.13)
    assert [v for _, v in tb["mean_response_length"]] == [899.0, 898.0, 897.0, 896.0]
    runs = [wandb_history(f) for f in wandb_offline_runs(tmp_path)]
    assert len(runs) == 2 and len({run_id for run_id, _ in runs}) == 1
    history = [h for _, rows in runs for h in rows]
    assert [h["trainer/global_step"] for h in history] == [1, 2, 3, 4]
    assert [h["lambda"] for h in history] == pytest.approx([0.01, 0.02, 0.03, 0.14])  # 3: the first write stays


def _no_cuda_rng_tracker(monkeypatch):
    """megatron's training forward forks its CUDA RNG tracker around dropout (0 here); CPU has none."""
    import contextlib

    from megatron.core.tensor_parallel import random as mp_random

    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())


def _saved_storages(fn):
    """Run ``fn()``; return {storage pointer: (dtype, numel)} of every distinct storage autograd saves during it."""
    seen: dict[int, tuple] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.dtype, t.untyped_storage().nbytes() // t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


@pytest.mark.nemo
@nemo_skip
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_nemo_actor_logprobs_are_chunked_and_equal_float64(gloo_world, cpu_cuda_shims, monkeypatch, tmp_path,
                                                            temperature):
    """The NeMo-Aligner actor's log-probs, through a real NeMo ``MegatronGPTModel`` (local spec, fp32, CPU): the loss
    of its forward/loss function (``get_actor_forward_output_and_loss_func``) and the inference log-probs of its
    ``get_logprob_output_only_func`` equal float64 log_softmax(logits / T) of the model's own logits, and the logits'
    gradient equals the float64 reference loss's, with log-prob chunks of 2 positions (6 tokens over 3 rows, so
    every chunk is recomputed in backward). Nothing of the size of the ``[b, s, V]`` logits is saved for backward
    beside them: NeMo-Aligner's ``from_parallel_logits_to_logprobs`` saved its float32 softmax there
    (``nemo_aligner/utils/distributed.py:305-323``)."""
    from nemo.collections.nlp.modules.common.megatron.utils import get_ltor_masks_and_position_ids

    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    hf = save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2)
    model = _nemo_gpt_model(monkeypatch, hf)
    _no_cuda_rng_tracker(monkeypatch)
    gpt = model.model
    gpt.train()
    cls = na.actor_model_class()
    n, T = 3, 11
    V = gpt.vocab_size
    tokens = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(1))
    plen, rlen = torch.tensor([2, 3, 2]), torch.tensor([6, 8, 9])
    mask = response_mask(plen, rlen, T)
    batch = TrainBatch(tokens=tokens, prompt_lengths=plen, response_lengths=rlen, response_mask=mask,
                       advantages=torch.tensor([1.0, -0.5, 0.25]),
                       old_logprobs=(torch.randn(n, T - 1, generator=torch.Generator().manual_seed(2)) * 0.1 - 5.0)
                       * mask)
    num_tokens = float(mask.sum())
    loss_fn = make_grpo_loss_fn(clip_eps=0.2, kl_beta=0.0, aggregation="token_mean", global_num_tokens=num_tokens,
                                global_num_seqs=float(n), temperature=temperature)
    obj = object.__new__(cls)  # the subclass's own functions, on the real model
    obj.laconic_loss_fn, obj.laconic_logprob_chunk = loss_fn, 6
    obj._laconic_metric_sums = torch.zeros(len(na.LOSS_METRICS), dtype=torch.float64)
    d = na.train_batch_to_nemo(batch)
    att, _, pos = get_ltor_masks_and_position_ids(tokens, -1, False, False, False)
    d["attention_mask"], d["position_ids"] = att.expand(n, -1, -1, -1), pos.expand(n, -1)

    fwd = cls.get_actor_forward_output_and_loss_func(obj)
    out, loss_func = fwd(iter([d]), gpt)
    out.retain_grad()
    (scaled, reduced), saved = _saved_storages(lambda: loss_func(out))
    logits_storage = out.untyped_storage().data_ptr()  # the chunks' inputs are views of the logits
    assert not [v for p, v in saved.items() if p != logits_storage and v[1] >= n * T * V], saved
    scaled.backward()

    ref_logits = out.detach().double().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_logits / temperature, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ref_loss, _ = make_grpo_loss_fn(clip_eps=0.2, kl_beta=0.0, aggregation="token_mean",
                                    global_num_tokens=num_tokens, global_num_seqs=float(n))(
        ref_lp, TrainBatch(tokens, plen, rlen, mask.double(), batch.advantages.double(), batch.old_logprobs.double()))
    (ref_loss * 2).backward()  # 2 micro-batches configured (global 6 / micro 3)
    assert torch.allclose(scaled.double(), ref_loss * 2, atol=1e-6, rtol=1e-5)
    assert torch.allclose(reduced["loss"].double(), ref_loss * 2, atol=1e-6, rtol=1e-5)
    assert torch.allclose(out.grad.double(), ref_logits.grad, atol=1e-7, rtol=1e-4)
    assert out.grad.abs().max() > 0
    assert obj._laconic_metric_sums[na.LOSS_METRICS.index("loss")] == pytest.approx(float(ref_loss.detach()), abs=1e-6)

    # inference: old / reference log-probs at the sampling temperature, the same chunks, under no_grad
    obj.laconic_logprob_temperature = temperature
    with torch.no_grad():
        fn = cls.get_logprob_output_only_func(obj, inference_only=True)
        logits, id_func = fn(iter([[tokens, att.expand(n, -1, -1, -1), pos.expand(n, -1)]]), gpt)
        got = id_func(logits)
    ref = torch.log_softmax(logits.double() / temperature, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert got.shape == (n, T - 1) and torch.allclose(got.double(), ref, atol=1e-6)
    assert torch.allclose(logits, out.detach(), atol=1e-5)  # the training forward's logits (dropout 0)


def _loss_object_and_batch(cls, tokens: torch.Tensor, plen: torch.Tensor, rlen: torch.Tensor):
    """An object of the actor model class ``cls`` (its own functions, no model) with a token-mean GRPO loss and
    log-prob chunks of 6 tokens, and the batch of ``tokens`` [n, T] (prompt / response lengths ``plen``, ``rlen``,
    advantages 1, -0.5, 0.25, old log-probs -5) in NeMo's layout with NeMo's causal mask and positions."""
    from nemo.collections.nlp.modules.common.megatron.utils import get_ltor_masks_and_position_ids

    n, T = tokens.shape
    mask = response_mask(plen, rlen, T)
    batch = TrainBatch(tokens, plen, rlen, mask, torch.tensor([1.0, -0.5, 0.25]), torch.full((n, T - 1), -5.0) * mask)
    obj = object.__new__(cls)
    obj.laconic_loss_fn = make_grpo_loss_fn(clip_eps=0.2, kl_beta=0.0, aggregation="token_mean",
                                            global_num_tokens=float(mask.sum()), global_num_seqs=float(n))
    obj.laconic_logprob_chunk = 6
    obj._laconic_metric_sums = torch.zeros(len(na.LOSS_METRICS), dtype=torch.float64)
    d = na.train_batch_to_nemo(batch)
    att, _, pos = get_ltor_masks_and_position_ids(tokens, -1, False, False, False)
    d["attention_mask"], d["position_ids"] = att.expand(n, -1, -1, -1), pos.expand(n, -1)
    return obj, d


@pytest.mark.nemo
@nemo_skip
def test_nemo_actor_loss_backward_allocates_one_logit_sized_gradient(gloo_world, cpu_cuda_shims, monkeypatch,
                                                                      tmp_path):
    """The NeMo-Aligner actor's loss (``get_actor_forward_output_and_loss_func``, a real NeMo ``MegatronGPTModel``,
    fp32, CPU) over log-prob chunks of 2 positions (6 tokens over 3 rows: 6 chunks of 11 positions): its backward to
    the ``[b, s, V]`` logits allocates one tensor of their size, their gradient (the host allocator's events,
    ``laconic_nemo.runtime.host_memory``). Each chunk sliced out of the logits allocated a zero-filled one in
    backward (6), beside that gradient."""
    from laconic_nemo.runtime.host_memory import host_allocations
    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    model = _nemo_gpt_model(monkeypatch, save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2))
    _no_cuda_rng_tracker(monkeypatch)
    gpt = model.model.train()
    cls = na.actor_model_class()
    tokens = torch.randint(0, gpt.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    obj, d = _loss_object_and_batch(cls, tokens, torch.tensor([2, 3, 2]), torch.tensor([6, 8, 9]))
    out, loss_func = cls.get_actor_forward_output_and_loss_func(obj)(iter([d]), gpt)
    scaled, _ = loss_func(out)
    with host_allocations() as trace:
        (grad,) = torch.autograd.grad(scaled, out)
    assert grad.shape == out.shape and grad.abs().max() > 0
    assert trace.count_at_least(out.nbytes) == 1, (out.nbytes, [c for c in trace.changes if c >= out.nbytes])


@pytest.mark.nemo
@nemo_skip
def test_nemo_actor_loss_reads_the_16_bit_logits_inside_float16module(gloo_world, cpu_cuda_shims, monkeypatch,
                                                                      tmp_path):
    """With ``megatron_amp_O2`` NeMo wraps the GPTModel in megatron's ``Float16Module``, whose forward returns a
    float32 copy of the ``[b, s, V]`` logits on the last stage (``megatron/core/transformer/module.py:175-181``).
    The actor's loss calls the GPTModel inside it: the logits it sees are bf16 and no float32 tensor of their size
    is saved for backward."""
    import copy

    from megatron.core.transformer.module import Float16Module
    from nemo.collections.nlp.modules.common.megatron.utils import get_ltor_masks_and_position_ids

    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    model = _nemo_gpt_model(monkeypatch, save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=2, kv_heads=2))
    _no_cuda_rng_tracker(monkeypatch)
    gpt = copy.deepcopy(model.model)
    config = copy.copy(gpt.config)
    config.bf16 = True
    wrapped = Float16Module(config, gpt).train()
    n, T, V = 3, 9, gpt.vocab_size
    tokens = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(3))
    att, _, pos = get_ltor_masks_and_position_ids(tokens, -1, False, False, False)
    assert wrapped(tokens, pos.expand(n, -1), att.expand(n, -1, -1, -1)).dtype == torch.float32  # the wrapper's copy
    cls = na.actor_model_class()
    obj, d = _loss_object_and_batch(cls, tokens, torch.tensor([2, 3, 2]), torch.tensor([5, 6, 7]))

    def forward_and_loss():
        out, loss_func = cls.get_actor_forward_output_and_loss_func(obj)(iter([d]), wrapped)
        return out, loss_func(out)[0]

    (out, loss), saved = _saved_storages(forward_and_loss)
    assert out.dtype == torch.bfloat16
    assert not [v for v in saved.values() if v[0] == torch.float32 and v[1] >= n * T * V], saved
    loss.backward()
    assert all(p.grad is not None for p in gpt.parameters() if p.requires_grad)
