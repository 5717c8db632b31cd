"""Bridge at TP=2 and PP=2: two processes over gloo (tests/dist/bridge_parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bridge_tp2_and_pp2_match_transformers(tmp_path):
    env = dict(os.environ, BRIDGE_RESULT_DIR=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "tests", "dist", "bridge_parallel.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    ok = [line.split() for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    # 2 parts x 4 families x 2 ranks, each line with the max |logit difference| on that rank
    assert len(ok) == 16, out[-4000:]
    assert {(p, f) for _, p, f, _, _ in ok} == {(p, f) for p in ("tp2", "pp2")
                                                 for f in ("qwen2", "qwen2_tied", "qwen3", "llama")}
    assert max(float(x[-1]) for x in ok) <= 2e-5
