"""`laconic-nemo plan RECIPE --nodes N --gpus-per-node G [key=value ...]`: a dry run of a cluster launch.

Loads and validates the recipe (``laconic_nemo.config``), then runs the pre-flight that ``train`` runs too
(:func:`laconic_nemo.plan.preflight.check_recipe`): the layout (:mod:`laconic_nemo.plan.layout`), the model folder
(:mod:`laconic_nemo.plan.model_folder`: a folder NeMo's Qwen2 converter can read, a tokenizer whose end strings
are single tokens) and what the trainer builds before step 1 (:mod:`laconic_nemo.plan.step_one`). It prints the
resolved layout and the exact commands a launch (``launch/submit.sh``) runs. A bad layout or key exits with code 2
and a message naming the key.

The command lines come from :func:`render_commands`; ``launch/submit.sh`` builds the same lines in
bash (``tests/test_launch.py`` checks that the two agree).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from laconic_nemo.config import Config, ConfigError, load_config
from laconic_nemo.plan.images import IMAGES
from laconic_nemo.plan.layout import ROLLOUT_ENGINES, Plan
from laconic_nemo.plan.model_folder import split_overrides

# Defaults shared with launch/submit.sh (environment variables of the same name override both). The container is the
# squash file of the recipe's image (laconic_nemo/plan/images.py), which each launch wrapper writes as its default.
DEFAULT_REPO_IN_CONTAINER = "/opt/laconic-nemo"



def default_container(plan: Plan) -> str:
    """The squash file of the plan's image (what the launch wrapper of the recipe uses when CONTAINER is unset);
    none when the plan targets this machine."""
    return "none" if plan.image is None else IMAGES[plan.image].squash


def default_mounts() -> str:
    """Container mounts as launch/submit.sh derives them from DATA_DIR, CKPT_DIR, RESULTS_DIR, REPO_DIR."""
    repo = os.environ.get("REPO_DIR", str(Path(__file__).resolve().parents[2]))  # the repository root
    return ",".join([
        f"{os.environ.get('DATA_DIR', '/lustre/data')}:/data",
        f"{os.environ.get('CKPT_DIR', '/lustre/checkpoints')}:/checkpoints",
        f"{os.environ.get('RESULTS_DIR', '/lustre/results')}:/results",
        f"{repo}:{DEFAULT_REPO_IN_CONTAINER}",
    ])


def srun_prefix(nodes: int, ntasks_per_node: int, container: str, mounts: str, gpus_per_node: int | None = None) -> str:
    """The pyxis srun prefix, flag for flag as launch/submit.sh writes it (minus its --output/--label).
    ``container="none"``: launch/submit.sh's container-less mode, the same line without the --container-* flags."""
    parts = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}"]
    if gpus_per_node is not None:
        parts.append(f"--gpus-per-node={gpus_per_node}")
    if container != "none":
        parts += [f"--container-image={container}", f"--container-mounts={mounts}", "--no-container-mount-home",
                  f"--container-workdir={DEFAULT_REPO_IN_CONTAINER}"]
    parts.append("--export=ALL")
    return " ".join(shlex.quote(p) for p in parts)


def render_commands(plan: Plan, cfg: Config, recipe: str, overrides: list[str], container: str, mounts: str,
                    hf_model: str | None = None) -> list[str]:
    """The srun lines a launch runs, in order: plan (validation in the container), prepare (HF -> .nemo
    conversion, skipped inside when model.path exists), train (one task per GPU)."""
    ov = "".join(f" {shlex.quote(o)}" for o in overrides)
    q = shlex.quote
    hf = f" --hf-model={q(hf_model)}" if hf_model else ""
    cmds = [f"{srun_prefix(1, 1, container, mounts)} python -m laconic_nemo plan {q(recipe)} "
            f"--nodes={plan.nodes} --gpus-per-node={plan.gpus_per_node}{hf}{ov}"]
    if hf_model:
        cmds.append(f"{srun_prefix(1, 1, container, mounts, 1)} python -m laconic_nemo.nemo_entry --prepare"
                    f"{hf} {q(recipe)}{ov}")
    cmds.append(f"{srun_prefix(plan.nodes, plan.gpus_per_node, container, mounts, plan.gpus_per_node)} "
                f"bash launch/torch_env.sh python -m laconic_nemo.nemo_entry {q(recipe)}{ov}")
    return cmds


def format_plan(plan: Plan, cmds: list[str]) -> str:
    lines = [
        f"recipe           {plan.recipe}",
        f"actor            {plan.actor}",
        f"world            {plan.world_size} GPUs = {plan.nodes} nodes x {plan.gpus_per_node}",
        f"layout           TP {plan.tp} x PP {plan.pp} x DP {plan.dp}",
        f"rollout batch    {plan.num_prompts_per_step} prompts x G {plan.group_size} = {plan.rollout_batch} responses",
        f"per DP rank      {plan.prompts_per_rank} prompts, {plan.samples_per_rank} responses",
        f"minibatch        {plan.minibatch_size} responses ({plan.steps_per_rollout} optimiser steps per rollout)",
        f"micro-batch      {plan.micro_batch_size} responses per rank, {plan.micro_batches_per_step} per optimiser "
        "step (gradient accumulation)",
        f"tokens per step  <= {plan.max_generated_tokens_per_step} generated (L_max {plan.max_new_tokens}); "
        f"{plan.budget_tokens_per_step} at the budget B {plan.budget:g}",
        f"steps            {plan.num_steps}",
        f"rollout engine   {ROLLOUT_ENGINES.get(plan.rollout_engine, plan.rollout_engine)}",
        f"image            {IMAGES[plan.image].describe() if plan.image else 'none: this machine (CONTAINER=none)'}",
    ]
    if plan.kv_cache:
        lines.append(f"KV cache         {plan.kv_cache} per GPU, allocated once (rollout.kv_cache_rows, "
                     "max_prompt_length + max_new_tokens)")
    if plan.decode_graphs:
        lines.append(f"decode graphs    {plan.decode_graphs}")
    if plan.tokenizer:
        lines.append(f"tokenizer        {plan.tokenizer}" + (f"; end strings {plan.end_strings}" if plan.end_strings
                                                              else ""))
    if plan.training_memory:
        lines.append(f"train memory     {plan.training_memory}")
    if plan.packed_attention:
        lines.append(f"packed attention {plan.packed_attention}")
    elif plan.attention:
        lines.append(f"attention        {plan.attention}")
    lines += [f"warning          {w}" for w in plan.warnings]
    lines.append("commands:")
    lines += [f"  {c}" for c in cmds]
    return "\n".join(lines)


class _IntermixedParser(argparse.ArgumentParser):
    """Lets options and key=value overrides come in any order after the recipe."""

    _busy = False

    def parse_known_args(self, args=None, namespace=None):
        if self._busy:
            return super().parse_known_args(args, namespace)
        self._busy = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._busy = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML (e.g. recipes/deepseek_1.5b_b1500.yaml)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--hf-model", default=os.environ.get("HF_MODEL") or None,
                   help="HF checkpoint converted to model.path when the .nemo is missing (env HF_MODEL)")
    p.add_argument("--container", default=os.environ.get("CONTAINER") or None,
                   help="container squash file or URI (env CONTAINER; default: the squash file of --image); none: no "
                        "pyxis, as launch/submit.sh with CONTAINER=none")
    p.add_argument("--image", default="auto",
                   help="the image the launch runs in, whose versions and attention kernel plan names: auto (the "
                        "recipe's actor and rollout engine, laconic_nemo/plan/images.py), none (this machine) or "
                        "one of " + ", ".join(IMAGES))
    p.add_argument("--mounts", default=os.environ.get("MOUNTS") or default_mounts(),
                   help="pyxis container mounts (env MOUNTS; default derived as in launch/submit.sh)")
    p.add_argument("--skip-path-checks", action="store_true",
                   help="do not check that data and checkpoint paths exist (planning away from the cluster)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory of one GPU (default 80, an H100): the KV cache must fit "
                        "rollout.kv_cache_memory_fraction of it")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="validate a recipe for a cluster layout and print the launch commands",
                              description=__doc__.split("\n\n")[0])
    p.__class__ = _IntermixedParser
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from laconic_nemo.plan.preflight import check_recipe

    recipe_ov, nemo_ov = split_overrides(list(args.overrides))  # nemo.* keys go to the NeMo config
    try:
        cfg = load_config(args.recipe, recipe_ov)
        # the pre-flight `train` runs too (laconic_nemo.plan.preflight): plan refuses what train would refuse
        image = "none" if args.container == "none" else args.image
        plan, built = check_recipe(cfg, args.nodes, args.gpus_per_node, recipe=args.recipe, hf_model=args.hf_model,
                                   nemo_overrides=nemo_ov, check_paths=not args.skip_path_checks,
                                   gpu_memory_gib=args.gpu_memory_gib, image=image)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"laconic-nemo plan: {exc}", file=sys.stderr)
        return 2
    container = args.container or default_container(plan)
    cmds = render_commands(plan, cfg, args.recipe, list(args.overrides), container, args.mounts, args.hf_model)
    if args.json:
        print(json.dumps({**asdict(plan), "build": asdict(built), "commands": cmds}, indent=1))
    else:
        print(format_plan(plan, cmds))
        print(format_build(built))
    return 0


def format_build(b) -> str:
    """The build section of the plan printout (see :class:`laconic_nemo.plan.step_one.StepOneBuild`)."""
    dual = "no dual step" if b.dual is None else ", ".join(f"{k} {v}" for k, v in b.dual.items())
    lines = [
        "built (CPU, as before step 1):",
        f"  shaper         {b.shaper}, lambda_init {b.lambda_init:g}, {dual}, count_eos {b.count_eos}",
        f"  advantages     {', '.join(f'{k} {v}' for k, v in b.advantages.items())}",
        f"  loss           {', '.join(f'{k} {v}' for k, v in b.loss.items())}",
        f"  reward         {b.reward}",
        f"  template       {b.prompt_template}",
        f"  tokenizer      {b.tokenizer or '(path not here: not loaded)'}",
    ]
    if b.prompt_preview is not None:
        lines.append(f"  first prompt   {b.prompt_preview!r}")
    for i, c in enumerate(b.constraints):
        lines.append(f"  {'constraints' if i == 0 else '':<14} {c}")
    return "\n".join(lines)
