"""Every bad input named before work starts: `laconic-nemo train` / `plan` / `eval` refuse bad recipes,
overrides, data files, output folders and flags with exit status 2 and a message naming the key, file
and line, before any rank, model or warm-up exists (no "launching" line, nothing written). Plus the
building blocks of the fault-injection tests: collective timeouts from the config, complete checkpoints
only, config differences on resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from laconic_nemo.cli import main
from laconic_nemo.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "LACONIC_PREFLIGHT_DONE"):
        monkeypatch.delenv(k, raising=False)


def refused(capsys, argv, *needles):
    """Run the CLI in-process; it must exit 2 before launching anything, naming every needle."""
    rc = main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text
    assert "launching" not in text and "warm-up" not in text, text
    for n in needles:
        assert n in text, (n, text)
    return text


def math_recipe(tmp_path, data: Path, *extra):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 1,
                                                   "num_key_value_heads": 2, "max_position_embeddings": 256}))
    return [TINY, "data.kind=math", "model.source=hf", f"model.path={model}", "reward.kind=math",
            f"data.train_files=[{data}]", "warmup.num_steps=0", "parallel.tensor_model_parallel_size=1",
            f"run.output_dir={tmp_path / 'out'}", *extra]


# ---------------------------------------------------------------- item 9, 12: types, YAML, overrides
@pytest.mark.parametrize("override, needle", [
    ("run.num_steps=2.7", "run.num_steps = 2.7 is invalid: allowed an integer"),
    ("grpo.group_size=8.9", "grpo.group_size = 8.9 is invalid: allowed an integer"),
    ("laconic.budget=abc", "laconic.budget = 'abc' is invalid: allowed a number"),
    ("data.train_files=foo.json", "data.train_files = 'foo.json' is invalid: allowed a list"),
    ("laconic=5", "laconic = 5 is invalid: allowed a mapping"),
    ("checkpoint.resume_allow_changes=[run.sede]", "checkpoint.resume_allow_changes"),
])
def test_wrong_types_are_refused_naming_the_key(capsys, tmp_path, override, needle):
    refused(capsys, ["train", TINY, override, f"run.output_dir={tmp_path}"], needle)


def test_a_real_number_key_still_takes_a_fraction():
    assert load_config(TINY, ["laconic.budget=30.5"]).laconic.budget == 30.5


def test_recipe_yaml_errors_and_wrong_sections_name_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [base]\nrun:\n  name: x\n  seed: [1,\n")
    (tmp_path / "base.yaml").write_text((ROOT / "recipes" / "base.yaml").read_text())
    text = refused(capsys, ["train", str(bad)], str(bad), "YAML syntax error", "line 5")
    assert "Traceback" not in text
    five = tmp_path / "five.yaml"
    five.write_text("defaults: [base]\nlaconic: 5\n")
    refused(capsys, ["train", str(five)], "laconic = 5 is invalid")


# ---------------------------------------------------------------- item 16: --nprocs
@pytest.mark.parametrize("value", ["abc", "-2", "0", "1.5"])
def test_bad_nprocs_is_refused(capsys, tmp_path, value):
    refused(capsys, ["train", TINY, "--nprocs", value, f"run.output_dir={tmp_path}"], f"--nprocs = {value!r}")


# ---------------------------------------------------------------- item 7, 12: data rows and parse errors
@pytest.mark.parametrize("row, field", [
    ({"problem": None, "answer": "1"}, "'problem' = None"),
    ({"problem": "", "answer": "1"}, "'problem' = ''"),
    ({"problem": "p", "answer": None}, "'answer' = None"),
    ({"problem": "p", "answer": {}}, "'answer' = {}"),
    ({"problem": "p", "answer": True}, "'answer' = True"),
    ({"problem": "p", "answer": ""}, "'answer' = ''"),
    ({"problem": "p", "answer": []}, "'answer' = []"),
    ({"problem": "p"}, "'answer' is missing"),
])
def test_every_data_row_is_checked_by_plan_and_train(capsys, tmp_path, row, field):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "answer": 2}) + "\n\n" + json.dumps(row) + "\n")
    # row 2 of the data sits on line 3 (a blank line in between): the line is what a user opens
    refused(capsys, ["train", *math_recipe(tmp_path, data)], f"{data} line 3", field)
    refused(capsys, ["plan", *math_recipe(tmp_path, data, "parallel.backend=auto"), "--nodes", "1", "--gpus-per-node", "1"],
            f"{data} line 3", field)


def test_data_parse_errors_name_file_and_line(capsys, tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"problem": "a", "answer": 1}) + "\n{not json\n")
    refused(capsys, ["train", *math_recipe(tmp_path, jl)], f"{jl} line 2: invalid JSON")
    js = tmp_path / "d.json"
    js.write_text('[{"problem": "a", "answer": 1},\n {"problem": "b" "answer": 2}]')
    refused(capsys, ["train", *math_recipe(tmp_path, js)], f"{js} line 2: invalid JSON")


def test_prompt_longer_than_the_context_is_named_before_training(tmp_path):
    from laconic_nemo.app.task import build_task
    from tests.hf_fixtures import save_tiny_qwen2

    model = save_tiny_qwen2(tmp_path / "qwen")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "answer": 2}) + "\n" + json.dumps({"problem": "x" * 200,
                                                                                  "answer": 2}) + "\n")
    cfg = load_config(TINY, ["data.kind=math", "model.source=hf", f"model.path={model}", "reward.kind=math",
                             f"data.train_files=[{data}]", "data.prompt_template=plain",
                             "rollout.max_new_tokens=4000", "laconic.budget=100"])
    with pytest.raises(ConfigError, match=rf"{data} line 2: field 'problem' is 200 tokens.*at most 96 fit"):
        build_task(cfg)


# ---------------------------------------------------------------- item 10, 11: plan's checks and the output dir
@pytest.mark.parametrize("extra, needle", [
    (["model.num_attention_heads=3"], "parallel.tensor_model_parallel_size = 2 does not fit the layout: a divisor of "
                                      "the attention heads (3)"),
    (["--nprocs", "4", "parallel.tensor_model_parallel_size=1", "grpo.num_prompts_per_step=6",
      "grpo.minibatch_size=48"], "grpo.num_prompts_per_step = 6 does not fit the layout: divisible by DP = 4"),
    (["rollout.max_new_tokens=200"], "rollout.max_new_tokens = 200 does not fit the layout"),
    (["checkpoint.resume=/nonexistent/step_000001"], "checkpoint.resume = '/nonexistent/step_000001' is invalid"),
    (["model.source=hf", "model.path=/nonexistent/model", "rollout.engine=megatron"],
     "model.path = '/nonexistent/model' does not fit the layout: an existing checkpoint"),
])
def test_train_runs_plans_checks_before_any_rank(capsys, tmp_path, extra, needle):
    refused(capsys, ["train", TINY, *extra, f"run.output_dir={tmp_path / 'out'}"], needle)
    assert not (tmp_path / "out").exists()


def test_missing_data_file_is_named_before_any_rank(capsys, tmp_path):
    refused(capsys, ["train", *math_recipe(tmp_path, tmp_path / "missing.jsonl")], "missing.jsonl")


def test_output_dir_that_is_a_file_or_not_writable_is_refused(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["train", TINY, f"run.output_dir={f}"], f"run.output_dir = '{f}' is invalid: it is a file")
    refused(capsys, ["train", TINY, f"run.output_dir={f}/sub"], "is a file, not a folder")
    # /proc refuses new files even to root: a folder nobody can write in
    refused(capsys, ["train", TINY, "run.output_dir=/proc/laconic_run"], "cannot write in /proc")
    refused(capsys, ["train", TINY, f"run.output_dir={tmp_path}", "warmup.cache_dir=/proc/cache"],
            "warmup.cache_dir")


# ---------------------------------------------------------------- item 15: eval
def test_eval_user_errors_are_named_without_touching_the_network(capsys, tmp_path, monkeypatch):
    import socket

    attempts = []

    def no_network(*args, **kwargs):  # any name lookup or connection (a Hub request, its retries) is recorded
        attempts.append(args[:2])
        raise OSError("network use in a test of offline checks")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ok = ["eval", "--model", str(model), "--backend", "transformers", "--output-dir", str(tmp_path / "o")]
    refused(capsys, ["eval", "--model", "/nonexistent/model", "--output-dir", str(tmp_path)],
            "--model '/nonexistent/model' does not exist")
    refused(capsys, ["eval", "--model", "org/typo-model", "--output-dir", str(tmp_path)], "never downloaded")
    assert attempts == []  # named offline: no Hub request, hence no retries
    refused(capsys, [*ok, "--benchmarks", "nosuch"], "--benchmarks: unknown ['nosuch']")
    refused(capsys, [*ok, "--n-samples", "0"], "--n-samples = 0 is invalid")
    refused(capsys, [*ok, "--limit", "0"], "--limit = 0 is invalid")
    refused(capsys, [*ok, "--base-summary", str(tmp_path / "none.json")], "--base-summary")
    refused(capsys, ["eval", "--model", str(tmp_path), "--output-dir", str(tmp_path / "o")], "no config.json")


# ---------------------------------------------------------------- item 2, 8: resume building blocks
def test_resume_picks_only_complete_renamed_checkpoints(tmp_path):
    from laconic_nemo.grpo.resume import find_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_000001.tmp").mkdir(parents=True)
    (root / "step_000001.tmp" / "trainer_state.json").write_text("{}")
    assert find_checkpoint(root) is None
    (root / "step_000002").mkdir()
    (root / "step_000002" / "trainer_state.json").write_text('{"step": 2, "shaper": {"shaper": "grpo"}}')
    (root / "latest").write_text("step_000003")  # names a folder pruned away
    assert find_checkpoint(root) == root / "step_000002"


def test_config_differences_are_all_listed_and_allowed_keys_pass():
    from laconic_nemo.grpo.resume import ResumeError, check_resume_config

    saved = {"run": {"seed": 1, "num_steps": 5}, "grpo": {"group_size": 8}, "laconic": {"eta": 0.1}}
    now = {"run": {"seed": 2, "num_steps": 9}, "grpo": {"group_size": 4}, "laconic": {"eta": 0.1, "new": 3}}
    with pytest.raises(ResumeError) as e:
        check_resume_config("ck", saved, now, [], defaults={"laconic": {"new": 3}})
    msg = str(e.value)
    assert "grpo.group_size: checkpoint 8 -> this run 4" in msg and "run.seed: checkpoint 1 -> this run 2" in msg
    assert "run.num_steps" not in msg and "laconic.new" not in msg  # operational; a new key at its default
    allowed = check_resume_config("ck", saved, now, ["run.seed", "grpo.group_size"], defaults={"laconic": {"new": 3}})
    assert {k for k, _, _ in allowed} == {"run.seed", "grpo.group_size", "run.num_steps"}


# ---------------------------------------------------------------- item 6: collective timeout from the config
COLLECTIVE = """
import os, sys, time, torch, torch.distributed as dist
from laconic_nemo.runtime.megatron_env import init_distributed
from megatron.core import parallel_state
init_distributed(1, 1, backend="gloo", timeout_s=3)
if dist.get_rank() == 1:
    time.sleep(60)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=parallel_state.get_data_parallel_group())
except Exception as exc:
    print(f"timed out after {time.monotonic() - t0:.1f} s: {type(exc).__name__}", flush=True)
    os._exit(7)
"""


def test_collectives_time_out_after_the_configured_seconds(tmp_path):
    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", COLLECTIVE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 7, out[-2000:]
    seconds = float(out.split("timed out after ")[1].split(" s")[0])
    # not before the configured 3 s; torch's default (30 minutes) would have hit the 90 s hang guard above
    assert seconds >= 2.5, seconds


# ---------------------------------------------------------------- bad input met only after launch, now named before
def plan_argv(*extra):
    return ["plan", TINY, "--nodes", "1", "--gpus-per-node", "2", *extra]


@pytest.mark.parametrize("overrides, needle", [
    (["model.hidden_size=95"], "model.hidden_size = 95 is invalid: allowed a multiple of model.num_attention_heads = 4"),
    (["data.synthetic.min_terms=9"], "data.synthetic.min_terms = 9 is invalid: allowed an integer <= "
                                     "data.synthetic.max_terms = 8"),
    (["data.synthetic.max_terms=40"], "data.synthetic.max_terms = 40 is invalid: allowed an integer in [2, 12]"),
    (["data.synthetic.p_compact=2"], "data.synthetic.p_compact = 2.0 is invalid: allowed a number in [0, 1]"),
    (["data.num_prompts=0"], "data.num_prompts = 0 is invalid: allowed an integer >= 1"),
    (["run.log_every=0"], "run.log_every = 0 is invalid: allowed an integer >= 1"),
    (["warmup.batch_size=0"], "warmup.batch_size = 0 is invalid: allowed an integer >= 1"),
    (["data.kind=math"], "data.kind = 'math' is invalid: allowed synthetic with model.source = synthetic"),
    (["laconic.budget=${run.nosuch}"], "laconic.budget: Interpolation key 'run.nosuch' not found"),
    (["model.max_position_embeddings=100"], "rollout.max_new_tokens = 96 does not fit the layout: at most "
                                            "model.max_position_embeddings - the longest prompt = 100 - 19 = 81"),
])
def test_inputs_that_failed_in_the_ranks_are_refused_by_plan_and_train(capsys, tmp_path, overrides, needle):
    """Each of these launched the ranks (or, for plan, printed a layout and exited 0) before it was refused."""
    refused(capsys, ["train", TINY, *overrides, f"run.output_dir={tmp_path / 'out'}"], needle)
    refused(capsys, plan_argv(*overrides), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a host without CUDA")
def test_nccl_on_a_host_without_cuda_is_refused_before_launch(capsys, tmp_path):
    refused(capsys, ["train", TINY, "parallel.backend=nccl", f"run.output_dir={tmp_path}"],
            "parallel.backend = 'nccl' is invalid on this host: it has no CUDA device")


@pytest.mark.parametrize("content, needle", [
    (b"", "no rows (an empty file)"),
    (b'{"problem": "1+1", "answer": 2}\n{"problem": "2+2", "answer": NaN}\n', "line 2: field 'answer' = nan"),
    (b'{"problem": "1+1", "answer": 2}\n{"problem": "2+2", "answer": Infinity}\n', "line 2: field 'answer' = inf"),
    (b'{"problem": "1+1", "answer": 2}\n{"problem": "2\xff+2", "answer": 4}\n',
     "line 2: byte 0xff at column 15 is not UTF-8 text"),
])
def test_bad_data_files_name_file_and_line_in_plan_and_train(capsys, tmp_path, content, needle):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    refused(capsys, ["train", *math_recipe(tmp_path, data)], f"{data}", needle)
    refused(capsys, ["plan", *math_recipe(tmp_path, data, "parallel.backend=auto"), "--nodes", "1",
                     "--gpus-per-node", "1"], f"{data}", needle)


def test_non_utf8_json_data_and_recipe_files_name_file_and_line(capsys, tmp_path):
    js = tmp_path / "d.json"
    js.write_bytes(b'[{"problem": "1+1", "answer": 2},\n {"problem": "\xe9", "answer": 1}]')
    refused(capsys, ["train", *math_recipe(tmp_path, js)], f"{js} line 2: byte 0xe9 at column 15 is not UTF-8")
    (tmp_path / "base.yaml").write_text((ROOT / "recipes" / "base.yaml").read_text())
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"defaults: [base]\nrun:\n  name: caf\xe9\n")
    text = refused(capsys, ["train", str(recipe)], f"{recipe} line 3, column 12: byte 0xe9 is not UTF-8")
    assert "Traceback" not in text


def test_output_folder_name_clashes_are_refused_up_front(capsys, tmp_path):
    """A file where the run writes a folder, or the reverse, crashed the run after a step or two."""
    out = tmp_path / "a"
    out.mkdir()
    (out / "checkpoints").write_text("x")
    refused(capsys, ["train", TINY, f"run.output_dir={out}"], f"{out / 'checkpoints'} is a file, and the run writes "
                                                              "a folder there")
    out = tmp_path / "b"
    (out / "metrics.jsonl").mkdir(parents=True)
    refused(capsys, ["train", TINY, f"run.output_dir={out}"], f"{out / 'metrics.jsonl'} is a folder, and the run "
                                                              "writes a file there")


def fake_checkpoint(out: Path, overrides: list[str], step: int = 2, world_size: int = 2, rows: int | None = None,
                    copy: bool = False) -> Path:
    """A complete checkpoint folder as the trainer writes it (what the pre-flight reads: trainer_state.json with
    the resolved config), ``rows`` rows of metrics.jsonl (default: ``step``) and optionally their copy."""
    from laconic_nemo.config import to_dict
    from laconic_nemo.core import lambda_controller
    from laconic_nemo.core.dual import shaper_state

    cfg = load_config(TINY, [*overrides, f"run.output_dir={out}"])
    ckpt = out / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    # the shaper's entry as the trainer writes it: lambda's controller included (a resume restores it)
    state = {"step": step, "world_size": world_size, "dp_size": 1,
             "shaper": shaper_state(cfg.laconic.shaper, lambda_controller(cfg.laconic, cfg.rollout.max_new_tokens)),
             "config": to_dict(cfg)}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    lines = "".join(json.dumps({"step": s, "lambda": 0.0}) + "\n" for s in range(1, step + 1))
    (out / "metrics.jsonl").write_text("".join(lines.splitlines(True)[: step if rows is None else rows]))
    if copy:
        (ckpt / "metrics.jsonl").write_text(lines)
    return ckpt


def test_a_tensor_parallel_change_cannot_be_allowed_on_resume(capsys, tmp_path):
    """The refusal of a config change suggests checkpoint.resume_allow_changes; for TP that led to a ValueError
    in both ranks (the shards are split for the checkpoint's TP)."""
    out = tmp_path / "run"
    fake_checkpoint(out, [])
    refused(capsys, ["train", TINY, "--nprocs", "2", "parallel.tensor_model_parallel_size=1",
                     "checkpoint.resume_allow_changes=[parallel.tensor_model_parallel_size]", f"run.output_dir={out}"],
            "parallel.tensor_model_parallel_size = 1 is invalid for resuming", "allowed 2, the checkpoint's")


def test_metrics_rows_missing_for_the_checkpoints_steps_are_refused_without_a_copy(capsys, tmp_path):
    """Restored from the checkpoint's copy when it has one (tests/test_reliability_e2e.py); a checkpoint
    without one (written before copies were kept) is refused naming the file, instead of a silent gap."""
    out = tmp_path / "run"
    fake_checkpoint(out, [], step=3, rows=1)
    refused(capsys, ["train", TINY, f"run.output_dir={out}"], f"{out / 'metrics.jsonl'} lacks the rows of 2 of the 3 "
                                                              "steps", "first missing: step 2")


def test_eval_checks_output_folder_and_base_summary_before_loading_a_model(capsys, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")  # not a loadable model: reaching the loader is a traceback
    ok = ["eval", "--model", str(model), "--backend", "transformers"]
    refused(capsys, [*ok, "--output-dir", "/proc/laconic_eval"], "--output-dir = '/proc/laconic_eval' is invalid: "
                                                                 "cannot write in /proc")
    bad = tmp_path / "base.json"
    bad.write_text('{"benchmarks": {"aime2024": {"pass@1": 0.3,\n "tokens": }}}')
    refused(capsys, [*ok, "--output-dir", str(tmp_path / "o"), "--base-summary", str(bad)],
            f"--base-summary {bad} line 2: invalid JSON")
    bad.write_text('{"model": "base"}')
    refused(capsys, [*ok, "--output-dir", str(tmp_path / "o"), "--base-summary", str(bad)],
            "not a summary of `laconic-nemo eval`")
    (model / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": }')
    refused(capsys, [*ok, "--output-dir", str(tmp_path / "o")], f"{model / 'config.json'} line 2: invalid JSON")


# ---------------------------------------------------------------- every ranged key of the schema
def _outside(rng, kind) -> list:
    """Values just outside ``rng`` (a Range of laconic_nemo.config) for a field of type ``kind``."""
    step = 1 if kind is int else 0.5
    if rng.choices is not None:
        return ["nosuch_choice"]
    out = []
    if rng.ge is not None:
        out.append(rng.ge - step)
    if rng.gt is not None:
        out.append(rng.gt if kind is float else rng.gt)
    if rng.le is not None:
        out.append(rng.le + step)
    if rng.lt is not None:
        out.append(rng.lt)
    if kind is float:
        out.append(".inf")
    return out


# keys without a Range, each checked elsewhere: (key, a bad value, what the refusal says)
CHECKED_ELSEWHERE = [
    ("data.prompt_template", "nosuch", "data.prompt_template = 'nosuch'"),
    ("data.target_length_range", "[5,1]", "data.target_length_range = [5, 1] is invalid"),
    ("data.synthetic.reasoning_marker", "</think>", "data.synthetic.reasoning_marker = '</think>' is invalid"),
    ("data.synthetic.stated_range", "[5,1]", "data.synthetic.stated_range = [5, 1] is invalid"),
    ("data.synthetic.budgets_by_terms", "[1,2]", "data.synthetic.budgets_by_terms = [1, 2] is invalid"),
    ("checkpoint.resume", "/nonexistent/step_000001", "checkpoint.resume = '/nonexistent/step_000001' is invalid"),
    ("checkpoint.resume_allow_changes", "[no.such]", "checkpoint.resume_allow_changes = 'no.such' is invalid"),
    ("run.output_dir", "/proc/laconic_out", "run.output_dir = '/proc/laconic_out' is invalid"),
    ("warmup.cache_dir", "/proc/laconic_cache", "warmup.cache_dir = '/proc/laconic_cache' is invalid"),
    ("model.path", "/nonexistent/model", "model.path"),
    ("data.train_files", "[/nonexistent.jsonl]", "data.train_files"),
    ("rollout.batch_buckets", "[16,8]", "rollout.batch_buckets = [16, 8] is invalid"),
    ("logging.tensorboard_dir", "/proc/laconic_tb", "logging.tensorboard_dir = '/proc/laconic_tb' is invalid"),
    ("logging.wandb_project", "''", "logging.wandb_project = '' is invalid"),
    ("data.target_lengths", "[0,5]", "data.target_lengths = [0, 5] is invalid"),
    ("data.budget_key", "budget", "data.budget_key = 'budget' is invalid"),
    ("laconic.reasoning_marker", "''", "laconic.reasoning_marker = '' is invalid"),
    ("laconic.per_prompt_budget", "true", "laconic.per_prompt_budget = True is invalid"),
    ("laconic.budget_classes", "[10,20]", "laconic.budget_classes = [10.0, 20.0] is invalid"),
    ("model.shape_from", "/nonexistent/config.json", "model.shape_from = '/nonexistent/config.json' does not fit"),
]
# keys any value of whose type is valid
FREE = {"run.name", "data.target_instruction", "data.shuffle", "grpo.leave_one_out", "grpo.sort_by_length",
        "laconic.count_eos", "rollout.compact", "rollout.cuda_graphs", "rollout.vllm.colocate", "checkpoint.export_hf", "logging.plot",
        "logging.rank_trace", "logging.tensorboard", "logging.wandb", "logging.wandb_name", "logging.wandb_entity"}


def test_every_key_has_a_range_or_a_check_elsewhere():
    """The schema walk below covers every key: a number or choice key carries a Range (laconic_nemo.config.opt),
    every other key is listed with the check that refuses its bad values, or takes any value of its type."""
    import dataclasses
    import typing

    from laconic_nemo.config import SYNTHETIC_ALPHABET, SYNTHETIC_MAX_TERMS, Config, ranged_keys
    from laconic_nemo.data.synthetic import ALPHABET, LETTERS

    def walk(schema, prefix=""):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    ranged = {k for k, *_ in ranged_keys()}
    elsewhere = {k for k, _, _ in CHECKED_ELSEWHERE}
    keys = set(walk(Config))
    assert keys - ranged - elsewhere - FREE == set()
    assert not ranged & (elsewhere | FREE) and not elsewhere & FREE
    assert SYNTHETIC_MAX_TERMS == len(LETTERS)
    assert sorted(SYNTHETIC_ALPHABET) == sorted(ALPHABET)  # the config's copy of the tokenizer's characters


def test_schema_walk_every_ranged_key_out_of_range_is_refused_before_launch(capsys, tmp_path):
    """For every key with a Range, each value just outside it (and infinity for a number) is refused by the
    config boundary both commands load recipes through (config.validate_config, called by load_config), naming
    the key and its allowed range; for the first ranged key of every section, `train` and `plan` exit 2 with that
    line before anything starts (the path is the same for every key: load_config, then exit 2)."""

    from omegaconf import OmegaConf

    from laconic_nemo.config import ranged_keys, validate_config

    valid = load_config(TINY)
    tried, sections = 0, set()
    for key, rng, kind, nullable in ranged_keys():
        allowed = rng.describe(kind) + (" or null" if nullable else "")
        for value in _outside(rng, kind):
            typed = float("inf") if value == ".inf" else value if isinstance(value, str) else kind(value)
            shown = repr(typed)
            needle = f"{key} = {shown} is invalid: allowed {allowed}"
            cfg = OmegaConf.structured(valid)  # the loaded values, as the boundary receives them
            OmegaConf.update(cfg, key, typed)
            with pytest.raises(ConfigError) as err:
                validate_config(cfg)
            assert needle in str(err.value), (needle, str(err.value))
            tried += 1
        section = key.rsplit(".", 1)[0]
        if section not in sections:
            sections.add(section)
            override = f"{key}={_outside(rng, kind)[0]}"
            refused(capsys, ["train", TINY, override, f"run.output_dir={tmp_path / 'out'}"], f"{key} = ")
            refused(capsys, plan_argv(override), f"{key} = ")
    # every section that has a ranged key went through train and plan once
    assert sections == {key.rsplit(".", 1)[0] for key, *_ in ranged_keys()}
    assert tried > 100 and len(sections) >= 13 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, needle", CHECKED_ELSEWHERE)
def test_keys_checked_elsewhere_are_refused_before_launch(capsys, tmp_path, key, value, needle):
    extra = ["data.kind=math", "reward.kind=math", "model.source=hf", f"model.path={tmp_path}",
             f"data.train_files=[{tmp_path / 'd.jsonl'}]", "parallel.tensor_model_parallel_size=1",
             "warmup.num_steps=0"] if key in ("model.path", "data.train_files", "data.prompt_template") else []
    if extra:
        (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_hidden_layers": 1,
                                                           "max_position_embeddings": 256}))
        (tmp_path / "d.jsonl").write_text(json.dumps({"problem": "1+1", "answer": 2}) + "\n")
    out = [] if key == "run.output_dir" else [f"run.output_dir={tmp_path / 'out'}"]
    refused(capsys, ["train", TINY, *extra, f"{key}={value}", *out], needle)


# ---------------------------------------------------------------- durable checkpoints, stops explained (building blocks)
class _Actor:
    """What CheckpointManager needs of an actor (one process: TP = PP = DP = 1)."""

    dp_rank, tp_rank, pp_rank = 0, 0, 0

    def __init__(self, value: float):
        import torch

        self.w = torch.full((256,), value)

    def state_dict_for_checkpoint(self):
        return {"w": self.w.clone()}

    def load_checkpoint_state(self, state):
        self.w = state["w"]


def test_checkpoints_carry_a_manifest_and_a_damaged_one_is_named_and_skipped(tmp_path):
    import torch

    from laconic_nemo.grpo.checkpoint import CheckpointManager
    from laconic_nemo.grpo.resume import choose_checkpoint, damage, read_manifest

    root = tmp_path / "checkpoints"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    mgr = CheckpointManager(root, keep_last=3, rank=0)
    for step in (1, 2):
        mgr.save(step, _Actor(float(step)), lambda step=step: {"step": step, "shaper": {"shaper": "grpo"}}, metrics_file=tmp_path / "metrics.jsonl")
    files = read_manifest(root / "step_000002")
    assert set(files) == {"model_tp00_pp00.pt", "rng_rank00000.pt", "trainer_state.json", "metrics.jsonl"}
    import zlib

    for name, meta in files.items():  # sizes and CRC-32 of what is on disk
        data = (root / "step_000002" / name).read_bytes()
        assert (len(data), zlib.crc32(data)) == (meta["size"], meta["crc32"]), name
    assert (root / "step_000002" / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}']
    assert choose_checkpoint(root) == (root / "step_000002", [])

    # a byte flipped in place: the size still matches, the CRC-32 of the rank that reads the file does not
    shard = root / "step_000002" / "model_tp00_pp00.pt"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert damage(root / "step_000002") is None
    assert "model_tp00_pp00.pt does not match manifest.json" in mgr.verify(root / "step_000002", _Actor(0.0))
    assert mgr.verify(root / "step_000001", _Actor(0.0)) is None

    # an empty shard, as a power cut leaves an unsynced file: named, and the previous checkpoint chosen
    shard.write_bytes(b"")
    found, notes = choose_checkpoint(root)
    assert found == root / "step_000001"
    assert notes[0] == (f"checkpoint {root / 'step_000002'} is damaged and skipped: {shard} has 0 bytes, "
                        f"manifest.json says {files['model_tp00_pp00.pt']['size']}")
    assert notes[1] == f"resuming from the previous complete checkpoint {root / 'step_000001'}"
    actor = _Actor(0.0)
    mgr.load(found, actor)
    assert torch.equal(actor.w, torch.full((256,), 1.0))


def test_a_crc_mismatch_seen_by_a_rank_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    """CheckpointManager.resume_point (the trainer's resume): every rank checks the files it reads (all-reduced); a
    damaged latest is named and the previous complete one resumed."""
    from laconic_nemo.grpo.checkpoint import CheckpointManager

    out = tmp_path / "run"
    cfg = load_config(TINY, [f"run.output_dir={out}"])
    mgr = CheckpointManager(out / "checkpoints", keep_last=3, rank=0)
    for step in (1, 2):
        mgr.save(step, _Actor(float(step)), lambda step=step: {"step": step, "shaper": {"shaper": "grpo"}})
    shard = out / "checkpoints" / "step_000002" / "rng_rank00000.pt"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    assert mgr.resume_point(cfg, _Actor(0.0), log=True) == out / "checkpoints" / "step_000001"
    text = capsys.readouterr().out
    assert f"checkpoint {out / 'checkpoints' / 'step_000002'} is damaged and skipped: {shard} does not match" in text
    assert "resuming from the previous complete checkpoint" in text


def test_a_full_disk_is_named_by_the_checkpoint_writer(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full file system does; torch alone would say only
    'basic_ios::clear: iostream error' or 'unexpected pos'."""
    from laconic_nemo.grpo.checkpoint import CheckpointWriteError, write_durable

    with pytest.raises(CheckpointWriteError, match=r"cannot write /dev/full: No space left on device"):
        write_durable(Path("/dev/full"), {"w": __import__("torch").zeros(10000)})
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        write_durable(Path("/dev/full"), data=b"x" * 100000)


def test_the_launcher_names_the_cause_and_scales_its_watchdog():
    from laconic_nemo.app.train_cli import _cause, _watchdog_bound

    torch_words = ["Traceback (most recent call last):", "RuntimeError: [enforce fail at inline_container.cc:672] . "
                   "unexpected pos 64 vs 0", "basic_ios::clear: iostream error"]
    assert _cause(torch_words, None) == "No space left on device"
    assert _cause(["OSError: [Errno 28] No space left on device"], None) == "No space left on device"
    assert _cause(["ValueError: something else"], None) == ""
    # hand-worked: inside a step every rank has measured one (longest 4.0 s): max(60, 10 x 4.0) = 60; 9.5 s -> 95
    beat = lambda s: {"phase": "generate", "step": 3, "step_s": s}  # noqa: E731
    assert _watchdog_bound([beat(4.0), beat(2.0)], 600.0, 10.0, 60.0)[0] == 60.0
    assert _watchdog_bound([beat(4.0), beat(9.5)], 600.0, 10.0, 60.0)[0] == 95.0
    # a rank outside a step (checkpoint, start-up), a rank without a heartbeat yet, or scaling off: watchdog_s
    assert _watchdog_bound([beat(4.0), {"phase": "checkpoint", "step": 3}], 600.0, 10.0, 60.0)[0] == 600.0
    assert _watchdog_bound([beat(4.0), None], 600.0, 10.0, 60.0)[0] == 600.0
    assert _watchdog_bound([beat(4.0), beat(4.0)], 600.0, 0.0, 60.0)[0] == 600.0


def test_metrics_rows_lost_before_a_resume_are_restored_from_the_checkpoint(tmp_path, capsys):
    from laconic_nemo.grpo.metrics import MetricsWriter

    ckpt = tmp_path / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    rows = [{"step": s, "lambda": s / 10} for s in (1, 2, 3)]
    (ckpt / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:9])  # cut short inside row 2
    MetricsWriter(tmp_path, 0, 0, 5, 1).truncate(3, ckpt)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert "the rows of steps 2-3 were missing; restored the rows of steps 1-3" in capsys.readouterr().out
    path.unlink()  # removed altogether
    MetricsWriter(tmp_path, 0, 0, 5, 1).truncate(3, ckpt)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_metrics_lines_that_are_not_utf8_are_named_or_dropped_when_torn(tmp_path):
    from laconic_nemo.grpo.resume import ResumeError, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n{"step": 3}\n')
    with pytest.raises(ResumeError, match=r"metrics.jsonl line 2: corrupt metrics row \(byte 0xff is not UTF-8\)"):
        read_metrics(path)
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff')
    assert read_metrics(path) == ([{"step": 1}], True)
