"""The per-recipe sbatch wrappers in launch/, written from one table.

Every training wrapper is the same 22 lines: a comment, the #SBATCH header, RECIPE, the HF checkpoint to
convert (NeMo-Aligner recipes), the default CONTAINER (the squash file of the image the recipe runs in:
:func:`laconic_nemo.plan.images.recipe_image`, the image ``laconic-nemo plan`` names), then
``source launch/submit.sh``, which does the work. They differ only in the fields of :class:`Wrapper` and the
recipe's image. To add or change one, edit :data:`WRAPPERS` and run from the repository root

    python launch/wrappers.py            # rewrite launch/<name>.sh for every row
    python launch/wrappers.py --check    # exit 1 naming each wrapper that differs from its row (tests do this)

``sbatch launch/<name>.sh`` is unchanged by this file: sbatch reads the generated scripts. Only training
wrappers are written here; other scripts in launch/ (submit.sh, torch_env.sh, ...) are left alone.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

LAUNCH = Path(__file__).resolve().parent
SOURCE_LINE = 'source "${REPO_DIR}/launch/submit.sh"'


@dataclass(frozen=True)
class Wrapper:
    name: str                 # launch/<name>.sh, Slurm job name laconic-<name>
    recipe: str               # recipe file, relative to the repository root
    about: str                # first comment line of the script
    hf_model: str | None      # HF checkpoint converted to the recipe's .nemo when that is missing (None: none)
    nodes: int = 2            # #SBATCH --nodes (8 GPUs per node)
    time: str = "24:00:00"    # #SBATCH --time

    def render(self) -> str:
        script = f"launch/{self.name}.sh"
        hf = "" if self.hf_model is None else f'HF_MODEL="${{HF_MODEL:-{self.hf_model}}}"\n'
        image = image_of(self.recipe)
        return f"""#!/bin/bash
# {self.about}
# Submit from the repository root:  sbatch {script}   (DRY_RUN=1 bash {script} to preview)
# Written by launch/wrappers.py from its table: edit the row there, then run python launch/wrappers.py.
#SBATCH --job-name=laconic-{self.name}
#SBATCH --nodes={self.nodes}
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time={self.time}
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

RECIPE={self.recipe}
{hf}# the recipe's image, {image.tag} ({image.dockerfile}; laconic_nemo/plan/images.py)
CONTAINER="${{CONTAINER:-{image.squash}}}"
REPO_DIR="${{REPO_DIR:-${{SLURM_SUBMIT_DIR:-$(pwd)}}}}"
# shellcheck source=launch/submit.sh
{SOURCE_LINE}
"""


def image_of(recipe: str):
    """The image ``recipe`` (relative to the repository root) runs in: :func:`laconic_nemo.plan.images.recipe_image`."""
    from laconic_nemo.config import load_config
    from laconic_nemo.plan.images import recipe_image

    return recipe_image(load_config(LAUNCH.parent / recipe))


HF = "/checkpoints/hf"
DEEPSCALER = "DeepScaleR-1.5B-Preview"


def _on_deepscaler(name: str, hf_model: str | None = f"{HF}/{DEEPSCALER}") -> Wrapper:
    """An ablation or baseline recipe derived from deepscaler_1.5b_b2000.yaml, named as its wrapper."""
    recipe = f"recipes/{name}.yaml"
    return Wrapper(name, recipe, f"{name.replace('_', ' ')} on {DEEPSCALER} (see {recipe}).", hf_model)


WRAPPERS: list[Wrapper] = [
    # paper runs
    Wrapper("deepseek_b1500", "recipes/deepseek_1.5b_b1500.yaml",
            "Paper run: DeepSeek-R1-Distill-Qwen-1.5B, B = 1500, 500 steps (NeMo-Aligner actor, DP 16).",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    Wrapper("deepseek_b1500_paper", "recipes/deepseek_1.5b_b1500_paper.yaml",
            "Paper textbook form of the DeepSeek-R1-Distill-Qwen-1.5B B = 1500 run (NeMo-Aligner actor, DP 16).",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    Wrapper("deepscaler_b2000", "recipes/deepscaler_1.5b_b2000.yaml",
            f"Paper run: {DEEPSCALER}, B = 2000, 300 steps, the authors' script knobs (DP 16).",
            f"{HF}/{DEEPSCALER}"),
    Wrapper("qwen_math_b550", "recipes/qwen_math_1.5b_b550.yaml",
            "Paper run (cost ablation): Qwen2.5-Math-1.5B-Instruct, B = 550, 350 steps, clipped cost.",
            f"{HF}/Qwen2.5-Math-1.5B-Instruct"),
    Wrapper("qwen_math_b550_linear", "recipes/qwen_math_1.5b_b550_linear.yaml",
            "Ablation: linear cost on Qwen2.5-Math-1.5B-Instruct, B = 550.",
            f"{HF}/Qwen2.5-Math-1.5B-Instruct"),
    # beyond the paper: the constraints beyond the mean (docs/algorithm.md)
    Wrapper("deepseek_reasoning_b1200", "recipes/deepseek_1.5b_reasoning_b1200.yaml",
            "Beyond the paper: DeepSeek-R1-Distill-Qwen-1.5B, reasoning-only budget 1200 (tokens before </think>).",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    Wrapper("deepseek_stated", "recipes/deepseek_1.5b_stated.yaml",
            "Beyond the paper: DeepSeek-R1-Distill-Qwen-1.5B, budgets 500-3000 stated in the prompt, one multiplier each.",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    Wrapper("deepseek_stated_band", "recipes/deepseek_1.5b_stated_band.yaml",
            "Beyond the paper: DeepSeek-R1-Distill-Qwen-1.5B, stated budgets 500-3000 with the band [rho B, B] per budget.",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    Wrapper("deepseek_tail", "recipes/deepseek_1.5b_tail.yaml",
            "Beyond the paper: DeepSeek-R1-Distill-Qwen-1.5B, B = 1500 and at most 5% of responses over 3000 tokens.",
            f"{HF}/DeepSeek-R1-Distill-Qwen-1.5B"),
    # model.source hf: the megatron-core actor reads the HF folder itself, nothing to convert
    Wrapper("qwen3_8b_b1000", "recipes/qwen3_8b_b1000.yaml",
            "Paper run: Qwen3-8B, B = 1000, 150 steps (megatron-core actor + HF bridge, TP 4 x PP 2 x DP 4).",
            None, nodes=4, time="48:00:00"),
    # ablations and baselines on DeepScaleR-1.5B-Preview
    *(_on_deepscaler(f"ablation_{a}") for a in (
        "budget_b1000", "budget_b1500", "budget_b1750", "ceiling_0.15", "ceiling_0.3", "eta_0.001", "eta_0.01",
        "fixed_lambda_0.001", "fixed_lambda_0.01", "fixed_lambda_0.05", "linear_cost")),
    *(_on_deepscaler(f"baseline_{b}") for b in ("efficient", "grpo", "l1_exact", "l1_max", "overlong")),
    # ThinkPrune stages: 4k starts from the HF checkpoint, 3k and 2k from the previous stage's exported policy
    _on_deepscaler("baseline_thinkprune_4k"),
    _on_deepscaler("baseline_thinkprune_3k", hf_model=None),
    _on_deepscaler("baseline_thinkprune_2k", hf_model=None),
]


def stale(launch: Path = LAUNCH) -> list[str]:
    """Problems with the wrappers in ``launch``: one that differs from (or is missing for) its row, and a
    script that sources submit.sh without a row (a hand-written training wrapper)."""
    names = {w.name for w in WRAPPERS}
    problems = [f"{w.name}.sh differs from its row in launch/wrappers.py" for w in WRAPPERS
                if not (launch / f"{w.name}.sh").is_file() or (launch / f"{w.name}.sh").read_text() != w.render()]
    problems += [f"{p.name} sources submit.sh but has no row in launch/wrappers.py"
                 for p in sorted(launch.glob("*.sh")) if p.stem not in names and SOURCE_LINE in p.read_text()]
    return problems


def write(launch: Path = LAUNCH) -> list[Path]:
    """Write every wrapper of the table into ``launch``; returns the files written."""
    out = []
    for w in WRAPPERS:
        path = launch / f"{w.name}.sh"
        path.write_text(w.render())
        path.chmod(0o755)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    if args.check:
        problems = stale()
        for line in problems:
            print(f"launch/{line}", file=sys.stderr)
        return 1 if problems else 0
    print(f"wrote {len(write())} wrappers in {LAUNCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
