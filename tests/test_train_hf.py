"""The cluster path's logic on CPU: `laconic-nemo train` with a Hugging Face checkpoint (model.source=hf),
math problems from a JSON file, the math-verify reward in worker processes, TP=2 over gloo.

A tiny random Qwen2 model and a character tokenizer are built locally; the run must load the HF
weights through the bridge (their logits are checked against transformers in tests/test_bridge*.py),
grade every response, update lambda from the global mean length and write a checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("math_verify")

from tests.hf_fixtures import save_tiny_qwen2  # noqa: E402
from tests.test_trainer_e2e import clean_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_train_from_hf_checkpoint_on_math_problems(tmp_path):
    model = save_tiny_qwen2(tmp_path / "qwen2", kv_heads=2)  # TP = 2 needs whole query groups per rank
    problems = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (tmp_path / "train.json").write_text(json.dumps(problems))
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "laconic_nemo", "train", str(ROOT / "recipes" / "tiny_cpu.yaml"),
        "model.source=hf", f"model.path={model}", "data.kind=math", f"data.train_files=[{tmp_path / 'train.json'}]",
        "data.prompt_template=plain", "reward.kind=math", "reward.num_workers=1", "warmup.num_steps=0",
        "rollout.max_new_tokens=12", "laconic.budget=6", "laconic.eta=0.5", "laconic.ceiling=null",
        "grpo.num_prompts_per_step=2",
        "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.micro_batch_size=4", "run.num_steps=2",
        "checkpoint.every_n_steps=1", "checkpoint.export_hf=true", "logging.plot=false", f"run.output_dir={out}",
    ]
    env = clean_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # every response of the batch went through the grader: boxed answers graded, the rest counted
        assert r["reward/graded"] + r["reward/no_answer"] == 8
        assert 0 <= r["mean_response_length"] <= 12
    # lambda follows the dual step from the logged global mean length: clip(0 + eta (L/B - 1), 0, Lambda)
    B, eta, Lmax = 6.0, 0.5, 12
    expected = min(max(0.0 + eta * (rows[0]["mean_response_length"] / B - 1.0), 0.0), B / (Lmax - B))
    assert rows[0]["lambda_next"] == pytest.approx(expected, abs=1e-12)
    assert rows[1]["lambda"] == rows[0]["lambda_next"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert sorted(p.name for p in (out / "checkpoints" / "step_000002").glob("model_*.pt")) == [
        "model_tp00_pp00.pt", "model_tp01_pp00.pt"]
    # checkpoint.export_hf: the final policy (step 2, not step 1) as a Hugging Face folder transformers loads
    import transformers

    from laconic_nemo.bridge import load_safetensors_dir
    from laconic_nemo.tools.export import export_hf

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    final = hf.state_dict()
    source = load_safetensors_dir(model)
    assert set(source) <= set(final) and any(not torch.equal(final[k], v) for k, v in source.items())
    for step, same in (("step_000001", False), ("step_000002", True)):
        export_hf(out / "checkpoints" / step, tmp_path / step)
        ref = load_safetensors_dir(str(tmp_path / step))
        assert all(torch.equal(final[k], v) for k, v in ref.items()) == same, step
