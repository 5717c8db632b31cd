"""The GPU benchmarks (gpu_step.py, paper_step.py) and the padding-waste benchmark run on CPU at tiny shapes (so they
stay alive in CI), and their measurements hold what the GPU path promises: the same reference log-probs wherever
pi_ref's weights live, and less padding with length-sorted micro-batches and row compaction."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_gpu_step_runs_on_cpu_and_prints_its_table():
    out = _run("benchmarks/gpu_step.py", "--device", "cpu", "--skip", "local", "--new-tokens", "12",
               "--deepseek-new-tokens", "32", "--profile")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    names = [r.split("|")[2].strip() for r in rows[1:]]
    assert "HF generate (sdpa)" in names and "megatron device sampler, sdpa" in names
    assert any(n.startswith("GRPO step, sdpa, length-sorted") for n in names)
    # the decode engine at both row counts, each with its ratio to HF generate and its share of the bandwidth bound
    # computed in the run; the rollout / training log-prob mismatch (fp32 here: round-off only)
    for n in (8, 32):
        row = rows[1 + names.index(f"decode engine, device sampler, {n} rows")]
        assert re.search(r"\| [\d,]+ tok/s \| [\d.]+; [\d.]+% of the bound [\d,]+ tok/s \|", row), row
    mismatch = rows[1 + names.index("log-prob mismatch, engine vs training forward, 8 rows")]
    assert float(re.search(r"max \|diff\| ([\d.e+-]+)", mismatch).group(1)) < 1e-4
    # --profile: operators per decode step of the fused step, of the module path and of the plain step of
    # benchmarks/plain_decode.py at the same shape and rows; the ratio row; the fused step needs fewer operators
    for n in (8, 32):
        def ops(name):
            row = rows[1 + names.index(name)]
            return int(re.search(r"\| (\d+) operators per step", row).group(1))

        fused = ops(f"engine decode step (fused), {n} rows")
        modules = ops(f"engine decode step, module path (fused=False), {n} rows")
        plain_name = next(x for x in names if x.startswith(f"plain graphed step (benchmarks/plain_decode.py), {n} rows"))
        plain = ops(plain_name)
        assert fused < modules and plain > 0
        ratio = rows[1 + names.index(f"engine vs plain step, {n} rows")]
        assert f"kernels {fused / plain:.2f}x the plain step's" in ratio and re.search(r"speed [\d.]+x", ratio)
    # the window schedule on the paper's draw (no model): within the capture bound; at 256 rows the default buckets
    # (8, multiples of 16) read fewer bytes per step than powers of two
    sched = {n: r for n, r in zip(names, rows[1:]) if n.startswith("DeepSeek shape, ")}
    assert len(sched) == 6
    for r in sched.values():
        graphs, bound = map(int, re.search(r"(\d+) graphs \(bound (\d+)\)", r).groups())
        assert graphs <= bound
    gbs = {n: float(re.search(r"\| ([\d.]+) GB/step \|", r).group(1)) for n, r in sched.items()}
    assert gbs["DeepSeek shape, 256 rows, buckets 8, multiples of 16 (default)"] < \
        gbs["DeepSeek shape, 256 rows, buckets powers of two"]
    # the per-row KV length estimate on the DeepSeek-shaped rollout: attention reads at least what live rows hold
    est = rows[1 + next(i for i, x in enumerate(names) if x.startswith("per-row KV lengths"))]
    assert float(re.search(r"KV positions read ([\d.]+)x", est).group(1)) >= 1.0 and "% less" in est
    # the DeepSeek-shaped rollout (48 rows, lengths drawn around 0.73 x L_max) and the 500-step projection
    ds = rows[1 + next(i for i, n in enumerate(names) if n.startswith("DeepSeek-shaped rollout"))]
    mean = float(re.search(r"lengths mean (\d+)", ds).group(1))
    assert "48 rows, L_max 32" in ds and 8 < mean <= 32
    proj = rows[1 + next(i for i, n in enumerate(names) if n.startswith("paper run: 500 steps"))]
    assert re.search(r"\| [\d.]+ h \|", proj) and "not measured" in proj
    # the packed step beside today's: no padding at all (PP 1), chosen by memory (none on CPU), with its memory line
    packed = [r for n, r in zip(names, rows[1:]) if n.startswith("GRPO step, sdpa, packed micro-batches of <= 128")]
    assert len(packed) == 1 and "by memory: no recompute" in packed[0] and "padding 0.0%" in packed[0]
    memory = [r for r in rows if r.startswith("| memory | sdpa, packed")]
    assert len(memory) == 1 and "per micro-batch of" in memory[0] and "-> no recompute" in memory[0]
    # pi_ref swapped by pointer ("device") and copied from host memory ("cpu") give identical log-probs
    ref = [r for r in rows if "pi_ref weights on" in r]
    assert len(ref) == 2 and all("max |diff| to device 0.0e+00" in r for r in ref)
    # the sorted micro-batches pad less than the fixed-width ones on the same minibatch
    pads = {n: float(re.search(r"padding ([\d.]+)%", r).group(1)) for n, r in zip(names, rows[1:]) if "GRPO" in n}
    sorted_pad = next(v for k, v in pads.items() if "length-sorted" in k)
    fixed_pad = next(v for k, v in pads.items() if "fixed-width" in k)
    assert sorted_pad < fixed_pad
    # the chunked log-prob backward before (a slice of the logits per chunk) and after (one gradient buffer): its
    # time and peak, the same gradient, one allocation of the logits' size against one per chunk (16)
    lpb = {n.split(",")[0]: r for n, r in zip(names, rows[1:]) if r.startswith("| logprob-backward |")}
    assert set(lpb) == {"sliced chunks (before)", "one gradient buffer (after)", "gradients before / after"}, lpb
    assert "| identical |" in lpb["gradients before / after"]
    peaks = {}
    for name, allocs in (("sliced chunks (before)", 16), ("one gradient buffer (after)", 1)):
        m = re.search(r"\| ([\d.]+) s \(([\d.]+) s CPU\), peak ([\d,]+) MiB, (\d+) logit-sized allocations \|", lpb[name])
        assert m and int(m.group(4)) == allocs, lpb[name]
        peaks[name] = int(m.group(3).replace(",", ""))
    assert peaks["one gradient buffer (after)"] < peaks["sliced chunks (before)"]


def test_padding_waste_before_and_after_under_15_percent():
    out = _run("benchmarks/padding_waste.py", "--rows", "32", "--max-new", "512", "--median", "180",
               "--rollout-batch", "16", "--minibatch", "16", "--micro-batch-tokens", "1024")
    waste = {}
    for line in out.splitlines():
        m = re.match(r"\| (rollout|training) \| (.+?) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)% \|", line)
        if m:
            processed, useful = int(m.group(3).replace(",", "")), int(m.group(4).replace(",", ""))
            assert abs(100 * (1 - useful / processed) - float(m.group(5))) < 0.06  # the printed share is the ratio
            if m.group(2).startswith("packed"):
                waste[(m.group(1), "packed, PP 1" if "(PP 1)" in m.group(2) else "packed, PP > 1")] = float(m.group(5))
            else:
                waste[(m.group(1), m.group(2).startswith(("compacted", "length-sorted")))] = float(m.group(5))
    assert len(waste) == 6
    for phase in ("rollout", "training"):
        assert waste[(phase, True)] < 15.0 < waste[(phase, False)]
    # packing leaves no padding at all; pipeline parallelism's fixed shape pads the packs' tails, still < fixed width
    assert waste[("training", "packed, PP 1")] == 0.0
    assert 0.0 < waste[("training", "packed, PP > 1")] < waste[("training", False)]


def test_paper_step_runs_on_cpu_and_prints_every_phase_and_the_projection(tmp_path):
    """benchmarks/paper_step.py: `laconic-nemo train` on recipes/gpu_check_1.5b.yaml at a tiny shape, 3 steps; every
    phase with its steady seconds and first step's extra, MFU, peak memory, the kernel, the 500-step projection."""
    out = _run("benchmarks/paper_step.py", "--device", "cpu", "--output-dir", str(tmp_path))
    phases = {m.group(1): (float(m.group(2)), float(m.group(3)))
              for m in re.finditer(r"^\| (.+?) \| (-?[\d.]+) \| ([+-][\d.]+) \|$", out, re.M)}
    expected = ["rollout (generation + reward)", "old log-probs", "reference log-probs", "optimiser step 1",
                "optimiser step 2", "optimiser step 3", "optimiser step 4", "dual step", "step (checkpoint excluded)"]
    assert all(p in phases for p in expected), sorted(phases)
    assert "optimiser step 5" not in phases  # 48 responses, minibatch 12: four
    assert all(phases[p][0] > 0 for p in expected if p != "dual step")
    assert re.search(r"^\| checkpoint \(at the end of the run\) \| [\d.]+ \| - \|$", out, re.M)
    assert re.search(r"MFU [\d.]+% of 989 TFLOP/s", out) and "peak memory: n/a (CPU)" in out
    assert "packed kernel used: dense" in out and "# packed attention on a GPU here:" in out
    proj = re.search(r"^projection: 500 steps on 16 GPUs .* = ([\d.]+) h", out, re.M)
    assert proj and float(proj.group(1)) > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the table is the metrics' steady mean: the old log-probs' row against the run's own numbers
    steady = sum(r["time/logprobs/old"] for r in rows[1:]) / 2
    assert abs(phases["old log-probs"][0] - steady) < 0.006
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000003"
