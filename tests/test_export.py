"""`laconic-nemo export RUN --to hf OUT`: the trainer's per-rank megatron-core shards -> a Hugging Face folder.

One spawned 2-process job per layout (tests/dist/export_checks.py) trains a tiny Qwen2 policy one GRPO step at
TP=2 or PP=2 and checkpoints it through GRPOTrainer.save_checkpoint; the export then runs here in this single
process (no torch.distributed), and transformers must load the folder and give the trained policy's log-probs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

import export_checks  # noqa: E402

from laconic_nemo.cli import main as cli_main  # noqa: E402
from laconic_nemo.core.dual import DualController, shaper_state  # noqa: E402
from laconic_nemo.tools.export import ExportError, export_hf  # noqa: E402
from tests.hf_fixtures import save_tiny_qwen2  # noqa: E402


def hf_logprobs(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) [N, T-1] under the transformers model in ``model_dir``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_export_matches_trained_policy(tmp_path, layout):
    # 2 layers (one per stage at PP=2), 2 KV heads (one per rank at TP=2); Qwen2 has QKV biases. At PP=2 the
    # embedding is tied: stage 0 holds the embedding, stage 1 its copy as the output layer, and the export
    # writes stage 0's, so the two must have stayed equal through training.
    source = Path(save_tiny_qwen2(tmp_path / "qwen2", hidden=32, layers=2, kv_heads=2, tie=layout == "pp2"))
    run = tmp_path / "run"
    export_checks.launch(layout, str(source), str(run))
    ref = torch.load(run / "policy_logprobs.pt", weights_only=False)
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), "--to", "hf", str(out)]) == 0  # the run directory: latest checkpoint
    lp = hf_logprobs(out, ref["tokens"])
    assert (lp - ref["trained"]).abs().max() < 2e-5
    # the step moved the policy away from the source weights, so equality above is not a copy of the source
    assert (ref["trained"] - ref["source"]).abs().max() > 1e-2
    assert (hf_logprobs(source, ref["tokens"]) - ref["source"]).abs().max() < 2e-5
    # a complete HF folder: same tensor names and shapes as the source, config and tokenizer copied
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(source / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    # shards written before the actor recorded its TP split dims: the bridge's name table gives them
    legacy = tmp_path / "legacy"
    shutil.copytree(run / "checkpoints" / "step_000001", legacy)
    for f in legacy.glob("model_*.pt"):
        st = torch.load(f, weights_only=False)
        del st["parallel"]["tp_split_dims"]
        torch.save(st, f)
    export_hf(legacy, tmp_path / "hf_legacy")
    assert (hf_logprobs(tmp_path / "hf_legacy", ref["tokens"]) - ref["trained"]).abs().max() < 2e-5
    if layout == "tp2":
        _check_errors(tmp_path, run, source)
        _check_eval_on_run_dir(tmp_path, run, ref)


def _check_eval_on_run_dir(tmp_path: Path, run: Path, ref: dict) -> None:
    """`laconic-nemo eval --model RUN_DIR` exports the run once into OUTPUT_DIR/model and evaluates that."""
    pytest.importorskip("math_verify")
    from laconic_nemo.eval.runner import SAMPLES, read_samples
    from laconic_nemo.tools.export import MARKER

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(run), "--backend", "transformers", "--benchmarks", "math500", "--n-samples", "1",
            "--max-tokens", "3", "--limit", "2", "--output-dir", str(out), "--grader-workers", "0"]
    assert cli_main(argv) == 0
    assert (hf_logprobs(out / "model", ref["tokens"]) - ref["trained"]).abs().max() < 2e-5
    assert len(read_samples(str(out / SAMPLES))) == 2
    assert json.loads((out / "summary.json").read_text())["model"] == "run"
    # a rerun (resume) reuses the export of the same checkpoint instead of writing it again
    weights = out / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert cli_main(argv) == 0 and weights.stat().st_mtime_ns == stamp
    # another checkpoint is exported afresh
    (out / "model" / MARKER).write_text(json.dumps({"checkpoint": "elsewhere"}))
    assert cli_main(argv) == 0 and (out / "model" / MARKER).read_text() != json.dumps({"checkpoint": "elsewhere"})
    assert not (out / "model.tmp").exists()


def _check_errors(tmp_path: Path, run: Path, source: Path) -> None:
    """Clear errors naming the path: missing path, incomplete checkpoint, synthetic model, missing HF config."""
    ckpt = run / "checkpoints" / "step_000001"
    with pytest.raises(ExportError, match=str(tmp_path / "nowhere")):
        export_hf(tmp_path / "nowhere", tmp_path / "o")
    (tmp_path / "policy.nemo").write_bytes(b"")
    with pytest.raises(ExportError, match="policy.nemo: a NeMo checkpoint"):
        export_hf(tmp_path / "policy.nemo", tmp_path / "o")
    # a checkpoint still being written (the trainer's .tmp folder) never counts
    partial = tmp_path / "partial" / "checkpoints" / "step_000002.tmp"
    shutil.copytree(ckpt, partial)
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_hf(tmp_path / "partial", tmp_path / "o")
    with pytest.raises(ExportError, match="incomplete checkpoint"):
        export_hf(partial, tmp_path / "o")
    # a shard lost: the missing file is named
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model_tp01_pp00.pt").unlink()
    with pytest.raises(ExportError, match="missing model_tp01_pp00.pt"):
        export_hf(broken, tmp_path / "o")
    # the run's model.source decides whether there is a Hugging Face architecture at all
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["config"]["model"]["source"] = "synthetic"
    (broken / "model_tp01_pp00.pt").symlink_to(ckpt / "model_tp01_pp00.pt")
    (broken / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ExportError, match="synthetic GPT has no Hugging Face architecture"):
        export_hf(broken, tmp_path / "o")
    state["config"]["model"].update(source="hf", path=str(tmp_path / "gone"))
    (broken / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ExportError, match="--hf-config"):
        export_hf(broken, tmp_path / "o")
    assert export_hf(broken, tmp_path / "o", hf_config=str(source)) == broken
    # the command reports the error and exits 2 instead of a traceback
    assert cli_main(["export", str(tmp_path / "nowhere"), "--to", "hf", str(tmp_path / "o2")]) == 2


def test_nemo_aligner_run_is_named(tmp_path):
    """A NeMo-Aligner run keeps the trainer's state in checkpoints/step_X but its weights in NeMo's format:
    the export names the run's kind instead of reporting missing megatron-core shards."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    state = {"step": 3, "shaper": shaper_state("laconic", DualController(budget=100.0, eta=0.01)),
             "config": {"model": {"source": "nemo", "path": "/checkpoints/base.nemo"}, "parallel": {"tensor_model_parallel_size": 2}}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt.parent / "latest").write_text(ckpt.name)
    with pytest.raises(ExportError, match="a NeMo-Aligner run"):
        export_hf(tmp_path / "run", tmp_path / "out")
