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
    (root / "step_000002" / "trainer_state.json").write_text("{}")
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
from laconic_nemo.megatron_env import init_distributed
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
    from laconic_nemo.megatron_env import free_port

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
