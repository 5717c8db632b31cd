"""Scripts that start the grading pool: worker processes (forkserver, spawn) import the main script again, so
a script that scores at import time must keep that code under ``if __name__ == "__main__":``. The pool refuses
to start from unguarded top-level code and says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from laconic_nemo.rewards.math_reward import unguarded_line

REPO_ROOT = Path(__file__).resolve().parents[1]
GUARD = 'if __name__ == "__main__":'

HEADER = "from laconic_nemo.rewards import MathReward\n\n"

# (script body after HEADER, 1-based line of the scoring call, whether that line runs at import time)
SOURCES = [
    ('reward = MathReward(num_workers=1)\nres = reward.score(["\\\\boxed{4}"], ["4"])\n', 4, True),
    ('MathReward(num_workers=1).score(["\\\\boxed{4}"], ["4"])\n', 3, True),
    ('with MathReward(num_workers=1) as r:\n    r.score(["\\\\boxed{4}"], ["4"])\n', 4, True),
    ('def main():\n    with MathReward(num_workers=1) as r:\n        r.score(["\\\\boxed{4}"], ["4"])\n\n\nmain()\n',
     8, True),
    ('for k in range(2):\n    MathReward(num_workers=1).start()\n', 4, True),
    ('try:\n    MathReward(num_workers=1).start()\nfinally:\n    pass\n', 4, True),
    ('def main():\n    MathReward(num_workers=1).start()\n\n\n' + GUARD + '\n    main()\n', 8, False),
    (GUARD + '\n    MathReward(num_workers=1).start()\n', 4, False),
    ('if not __import__("multiprocessing").parent_process():\n    MathReward(num_workers=1).start()\n', 4, False),
]


@pytest.mark.parametrize("body, line, runs_at_import", SOURCES)
def test_unguarded_line(body, line, runs_at_import):
    source = HEADER + body
    assert any(word in source.splitlines()[line - 1] for word in ("score(", "start()", "main()"))
    assert unguarded_line(source, line) is runs_at_import


def _run(tmp_path: Path, name: str, source: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    return proc, time.perf_counter() - start


def test_unguarded_script_is_refused_before_workers_start(tmp_path):
    proc, _ = _run(tmp_path, "unguarded.py", """\
        from laconic_nemo.rewards import MathReward

        reward = MathReward(num_workers=1)
        print(reward.score(["so \\\\boxed{4}"], ["4"]).statuses)
        """)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: MathReward:"), proc.stderr[-2000:]
    assert "unguarded.py (line 4)" in last and GUARD in last and "num_workers=0" in last
    assert "keep dying" not in proc.stderr  # refused up front, no worker ran the script again


def test_guarded_script_scores(tmp_path):
    proc, _ = _run(tmp_path, "guarded.py", """\
        from laconic_nemo.rewards import MathReward


        def main():
            with MathReward(num_workers=1) as reward:
                print(reward.score(["so \\\\boxed{4}"], ["4"]).statuses)


        if __name__ == "__main__":
            main()
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['correct']"


def test_script_with_other_top_level_guard_gets_the_advice(tmp_path):
    # a top-level ``if`` that is not the __main__ guard is not refused up front; the workers then die at
    # start, and both the worker's and the parent's error say what to do
    proc, _ = _run(tmp_path, "if_true.py", """\
        from laconic_nemo.rewards import MathReward

        if True:
            with MathReward(num_workers=1) as reward:
                print(reward.score(["so \\\\boxed{4}"], ["4"]).statuses)
        """)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "keep dying at start" in last and "if_true.py" in last and GUARD in last, proc.stderr[-2000:]
    assert "while this process was importing the main script to become a worker" in proc.stderr
