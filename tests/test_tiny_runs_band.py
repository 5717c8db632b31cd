"""benchmarks/tiny_runs.py's grid: each cell's numbers, the band every cell must hold (its CLAIMS) and the README
block, on hand-made runs whose answers are worked out by hand (no training here: the grid itself is a benchmark)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tiny_runs  # noqa: E402


def _run(folder: Path, lengths: list[float], rewards: list[float], lambdas: list[float], shaper: str = "laconic",
         budget: float = 31.0, ceiling: float | None = 1.0) -> None:
    folder.mkdir(parents=True)
    rows = [{"step": i + 1, "mean_response_length": L, "task_reward": r, "lambda": lam, "lambda_next": lam,
             "budget": budget} for i, (L, r, lam) in enumerate(zip(lengths, rewards, lambdas))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ceiling_text = "null" if ceiling is None else ceiling
    (folder / "config.yaml").write_text(f"laconic:\n  shaper: {shaper}\n  budget: {budget}\n  ceiling: {ceiling_text}\n"
                                        f"rollout:\n  max_new_tokens: 96\n")


def test_a_cell_summary_is_its_first_and_last_tenth_and_its_settling_step(tmp_path):
    # 20 steps: tenths of 2 steps; the length reaches B at step 11 and stays within 5% of it (3-step means) from the
    # window ending at step 13 on
    lengths = [46.0] * 10 + [31.0, 31.0, 31.0] + [30.0] * 5 + [31.0, 32.0]
    rewards = [0.5, 0.7] + [0.8] * 16 + [0.9, 0.84]
    lambdas = [0.05 * i for i in range(20)]
    _run(tmp_path / "r", lengths, rewards, lambdas, ceiling=0.9)
    c = tiny_runs.cell_summary(tmp_path / "r")
    assert c["steps"] == 20 and c["budget"] == 31.0
    assert c["length0"] == 46.0 and c["length"] == 31.5 and c["rel"] == pytest.approx(0.5 / 31)
    assert c["reward0"] == pytest.approx(0.6) and c["reward"] == pytest.approx(0.87)
    assert c["lambda_end"] == pytest.approx(0.95) and c["at_ceiling"] == 2  # steps 19 and 20: 0.9, 0.95 >= 0.9
    assert c["settling"] == 13


def test_the_band_names_each_claim_a_cell_breaks(monkeypatch):
    monkeypatch.setattr(tiny_runs, "CLAIMS", {"length_tol": 0.05, "reward_min": 0.70, "reward_vs_grpo_se": 2.0})
    cell = {"rel": 0.0, "reward": 0.85, "reward_se": 0.03}
    assert tiny_runs.holds(cell, {"reward": 0.80, "reward_se": 0.04}) == []
    # 0.09 below GRPO's, the difference's standard error hypot(0.03, 0.04) = 0.05: within 2 of them (0.10)
    assert tiny_runs.holds(cell, {"reward": 0.94, "reward_se": 0.04}) == []
    assert tiny_runs.holds({**cell, "rel": 0.051}, {"reward": 0.80, "reward_se": 0.0}) == [
        "last tenth +5.1% of B (band +-5%)"]
    # 0.11 below: more than the 0.10 two standard errors allow
    assert tiny_runs.holds({"rel": -0.06, "reward": 0.69, "reward_se": 0.03}, {"reward": 0.80, "reward_se": 0.04}) == [
        "last tenth -6.0% of B (band +-5%)", "task reward 0.690 < 0.7",
        "task reward 0.690 below GRPO's 0.800 by 0.110, more than 2 standard errors (0.100)"]
    # a steady run has no spread: any shortfall counts
    assert tiny_runs.holds({"rel": 0.0, "reward": 0.85, "reward_se": 0.0}, {"reward": 0.851, "reward_se": 0.0}) == [
        "task reward 0.850 below GRPO's 0.851 by 0.001, more than 2 standard errors (0.000)"]
    assert "up to 2 standard errors" in tiny_runs.claim_vs_grpo()
    monkeypatch.setattr(tiny_runs, "CLAIMS", {"length_tol": 0.05, "reward_min": 0.80, "reward_vs_grpo_se": 0.0})
    assert tiny_runs.holds({"rel": 0.0, "reward": 0.85, "reward_se": 0.03}, {"reward": 0.86, "reward_se": 0.03}) == [
        "task reward 0.850 below GRPO's 0.860"]
    assert tiny_runs.claim_vs_grpo() == "at least GRPO's in the same cell"


def test_the_reward_standard_error_is_the_last_tenths_spread_over_the_root_of_its_steps(tmp_path):
    # 30 steps: a last tenth of 3 steps with rewards 0.7, 0.8, 0.9: sample sd 0.1, standard error 0.1 / sqrt(3)
    _run(tmp_path / "r", [31.0] * 30, [0.5] * 27 + [0.7, 0.8, 0.9], [0.0] * 30)
    c = tiny_runs.cell_summary(tmp_path / "r")
    assert c["reward"] == pytest.approx(0.8) and c["reward_se"] == pytest.approx(0.1 / 3 ** 0.5)
    # one step: one value, no spread to measure
    _run(tmp_path / "one", [31.0], [0.7], [0.0])
    assert tiny_runs.cell_summary(tmp_path / "one")["reward_se"] == 0.0


def test_the_main_jobs_seed_is_the_recipes():
    from laconic_nemo.config import load_config

    assert load_config(str(ROOT / "recipes" / "tiny_cpu.yaml")).run.seed == tiny_runs.SEED


def _grid(results: Path, laconic_last: dict) -> None:
    """A 2 x 2 grid of 10-step runs: LACONIC's last step at ``laconic_last[(setting, seed)]`` tokens (B 31)."""
    for st in ("native", "pin"):
        for seed in (7, 8):
            last = laconic_last[(st, seed)]
            _run(results / st / f"laconic_s{seed}", [45.0] + [31.0] * 8 + [last], [0.6] + [0.85] * 9, [0.1] * 10)
            _run(results / st / f"grpo_s{seed}", [48.0] * 10, [0.6] + [0.82] * 9, [0.0] * 10, shaper="grpo")
            _run(results / st / f"pid_s{seed}", [44.0] + [31.0] * 9, [0.6] + [0.83] * 9, [0.2] * 10)


def test_the_block_gives_medians_and_ranges_over_the_cells_and_check_fails_on_a_cell_out_of_the_band(tmp_path,
                                                                                                     capsys):
    made = {"date": "2026-11-28", "cpu_isa": {"machine": "x86_64", "cpu": "Test CPU"}, "threads_per_rank": 1,
            "versions": {"torch": "2.13.0+cpu", "megatron-core": "0.16.1", "python": "3.11"}}
    last = {("native", 7): 31.0, ("native", 8): 32.0, ("pin", 7): 30.0, ("pin", 8): 31.0}
    _grid(tmp_path / "a", last)
    text = tiny_runs.block(tmp_path / "a", made, [7, 8], ["native", "pin"])
    assert text.startswith(tiny_runs.BEGIN) and text.endswith(tiny_runs.END)
    row = next(line for line in text.splitlines() if line.startswith("| LACONIC, integral"))
    # first tenth 45 in every cell; last tenth = the last step: 31, 32, 30, 31 -> median 31.0, 30.0 to 32.0
    assert "| 45.0 (45.0 to 45.0) -> 31.0 (30.0 to 32.0) |" in row
    assert "| +0.0 (-3.2 to +3.2)% |" in row and "-> 0.850 (0.850 to 0.850) |" in row and row.endswith("| 4 (4 to 4) |")
    assert "Here 4 of 4 cells hold it." in text and "on Test CPU (" in text
    # the main job's seed (7) over the two settings: last tenths 31 and 30 against B 31
    assert "its last tenth is -3.2% to +0.0% of B, its task reward 0.850 to 0.850." in text
    assert tiny_runs.check_band(tmp_path / "a", [7, 8], ["native", "pin"]) == 0
    # one cell 7% over B: the check names it and fails
    _grid(tmp_path / "b", {**last, ("pin", 8): 33.2})
    assert tiny_runs.check_band(tmp_path / "b", [7, 8], ["native", "pin"]) == 1
    out = capsys.readouterr().out
    assert "seed 8, pin: last tenth 33.2 (+7.1% of B)" in out and "1 cell(s) leave the README's band" in out
    assert "Here 3 of 4 cells hold it." in tiny_runs.block(tmp_path / "b", made, [7, 8], ["native", "pin"])


def test_a_grid_with_runs_missing_or_still_training_reports_the_cells_that_ran(tmp_path, capsys):
    """A run not started, or one whose metrics stop short of its config's run.num_steps (still training), is left
    out: the summary counts the cells each run ran in, the per-cell table says "not run", and --check leaves out the
    GRPO claim where GRPO did not run (before: a KeyError / FileNotFoundError on the first missing run)."""
    made = {"date": "2026-11-28", "cpu_isa": {"machine": "x86_64", "cpu": "Test CPU"}, "threads_per_rank": 1,
            "versions": {"torch": "2.13.0+cpu", "megatron-core": "0.16.1", "python": "3.11"}}
    results = tmp_path / "g"
    _grid(results, {("native", 7): 31.0, ("native", 8): 32.0, ("pin", 7): 30.0, ("pin", 8): 31.0})
    for name in ("grpo_s7", "grpo_s8", "pid_s7", "pid_s8"):
        for f in (results / "pin" / name).iterdir():
            f.unlink()
        (results / "pin" / name).rmdir()
    # pin / laconic_s8 is still training: its config asks for 20 steps, its metrics hold 10
    cfg = results / "pin" / "laconic_s8" / "config.yaml"
    cfg.write_text(cfg.read_text() + "run:\n  num_steps: 20\n")
    assert not tiny_runs.present(results / "pin" / "laconic_s8") and tiny_runs.present(results / "pin" / "laconic_s7")
    text = tiny_runs.block(results, made, [7, 8], ["native", "pin"])
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| LACONIC, integral dual step (`tiny_cpu.yaml`, the main job)"].split(" | ")[1] == "3 of 4"
    assert rows["| GRPO, lambda = 0 (`tiny_cpu_grpo.yaml`)"].split(" | ")[1] == "2 of 4"
    assert "| 7 | pin | 30.0 (-3.2%), 0.850 +- 0.000, settles at 4 | not run | not run | holds |" in text
    assert "| 8 | pin | not run | not run | not run | - |" in text
    assert "Here 3 of 3 cells hold it (1 not run)." in text
    assert tiny_runs.check_band(results, [7, 8], ["native", "pin"]) == 0
    out = capsys.readouterr().out
    assert "seed 7, pin: last tenth 30.0 (-3.2% of B), task reward 0.850 (GRPO not run): holds the band" in out
    assert "seed 8, pin: LACONIC has not run here" in out
