"""The container images (laconic_nemo/plan/images.py, containers/): which recipe runs in which, the attention kernel
``plan`` names for it, and the Dockerfiles' pins against the table.

Docker cannot build here, so the Dockerfiles are read as text (as tests/test_launch.py reads them); every image's
last build step runs ``python -m laconic_nemo.plan.images NAME``, whose comparison (``mismatches``) is tested here
on stated and contradicting environments.

Versions the table states, and where they were read:
* NGC PyTorch release notes, release 25.12 (docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/
  rel-25-12.html): "PyTorch container image version 25.12 is based on 2.10.0a0+b4e4ee81d3", CUDA 13.1.0, torch in
  /usr/local/lib/python3.12/dist-packages.
* vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl, vllm-0.33.0.dist-info/METADATA: ``Requires-Dist: torch==2.14.0``;
  vllm 0.10.1.1's metadata (PyPI): ``Requires-Dist: torch==2.7.1``.
* torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl, torch/nn/attention/varlen.py:205-221: the signature of
  :data:`TORCH_2_14_VARLEN` below.
* megatron_core-0.19.2-cp312-...whl METADATA: Requires-Python >=3.12; Requires-Dist torch>=2.6.0, numpy,
  packaging>=24.2.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from laconic_nemo.config import load_config
from laconic_nemo.plan.cli import render_commands
from laconic_nemo.plan.images import (
    IMAGES,
    attention_line,
    image_for,
    mismatches,
    packed_kernel,
    recipe_image,
    vllm_fits,
)
from laconic_nemo.plan.layout import plan_layout

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK = ROOT / "recipes" / "deepseek_1.5b_b1500.yaml"
QWEN3 = ROOT / "recipes" / "qwen3_8b_b1000.yaml"
VLLM = ["rollout.engine=vllm", "parallel.pipeline_model_parallel_size=1"]  # vLLM rollouts need PP = 1
# vLLM's torch requirement per release (the wheels' METADATA, module docstring)
VLLM_TORCH = {"0.33.0": "==2.14.0", "0.10.1.1": "==2.7.1"}


def TORCH_2_14_VARLEN(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux=None,
                      scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                      seqused_k=None, block_table=None, num_splits: int | None = None):
    """torch 2.14.0's ``varlen_attn`` signature (torch/nn/attention/varlen.py:205-221), for the kernel choice."""


def test_plan_names_the_frozen_image_and_its_kernel_for_the_flagship(capsys):
    """recipes/deepseek_1.5b_b1500.yaml (NeMo-Aligner actor): plan names the frozen nemo:25.02 image, the kernel
    NeMo runs there (TransformerEngine's, padded micro-batches), and its srun lines use that image's squash file."""
    from laconic_nemo.cli import main

    plan = plan_layout(load_config(DEEPSEEK), 2, 8, check_paths=False)
    assert plan.image == "nemo" and IMAGES["nemo"].frozen and IMAGES["nemo"].base == "nvcr.io/nvidia/nemo:25.02.01"
    assert plan.attention.startswith("te: TransformerEngine's fused attention of laconic-nemo:25.02 on padded")
    assert plan.packed_attention is None  # NeMo-Aligner trains on padded micro-batches
    assert main(["plan", str(DEEPSEEK), "--nodes", "2", "--skip-path-checks", "--container", "", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["image"] == "nemo" and out["attention"] == plan.attention
    assert all("--container-image=/lustre/containers/laconic-nemo-25.02.sqsh" in c for c in out["commands"])
    assert main(["plan", str(DEEPSEEK), "--nodes", "2", "--skip-path-checks", "--container", ""]) == 0
    text = capsys.readouterr().out
    assert "image            nemo: laconic-nemo:25.02 (containers/Dockerfile, frozen; nvcr.io/nvidia/nemo:25.02.01" \
        in text and f"attention        {plan.attention}" in text


def test_plan_names_the_current_image_and_its_kernel_for_a_megatron_core_recipe():
    """recipes/qwen3_8b_b1000.yaml (megatron-core actor, packed micro-batches): the current NGC PyTorch image and
    TransformerEngine's THD kernel there, not the planning machine's torch; with rollout.engine=vllm the vLLM image,
    which has no TransformerEngine: torch 2.14.0's varlen_attn (model.attention=auto), and te refused."""
    cfg = load_config(QWEN3)
    plan = plan_layout(cfg, 4, 8, check_paths=False)
    assert plan.image == "mcore" and recipe_image(cfg).name == "mcore"
    assert plan.packed_attention == "te: TransformerEngine's THD attention of laconic-mcore:25.12 (cu_seqlens read " \
                                    "on the device)"
    assert IMAGES["mcore"].torch == "2.10.0a0+b4e4ee81d3" and IMAGES["mcore"].megatron_core == "0.19.2"
    v = plan_layout(load_config(QWEN3, VLLM), 4, 8, check_paths=False)
    assert v.image == "vllm" and v.packed_attention == "varlen: torch.nn.attention.varlen.varlen_attn of torch 2.14.0"
    te = plan_layout(load_config(QWEN3, [*VLLM, "model.attention=te"]), 4, 8, check_paths=False)
    assert te.packed_attention.startswith("none: model.attention=te needs TransformerEngine, which laconic-vllm")
    # sdpa on the NGC image: whether its pre-release torch has varlen_attn is read when the job starts
    s = plan_layout(load_config(QWEN3, ["model.attention=sdpa"]), 4, 8, check_paths=False)
    assert s.packed_attention.startswith("varlen where torch 2.10.0a0+b4e4ee81d3 has torch.nn.attention.varlen")
    # fp32 weights: flex whatever the torch
    f = plan_layout(load_config(QWEN3, ["model.attention=sdpa", "model.precision=fp32"]), 4, 8, check_paths=False)
    assert f.packed_attention.startswith("flex:")
    # unpacked training names the kernel without the packed path
    u = plan_layout(load_config(QWEN3, ["grpo.micro_batch_tokens=0"]), 4, 8, check_paths=False)
    assert u.packed_attention is None and u.attention.startswith("te (padded micro-batches")


def test_plan_for_this_machine_names_this_torch():
    """--image none (and CONTAINER=none) plans for the submitting machine: the kernel of its own torch, as before
    the images, which is also what `train`'s own pre-flight states (cluster=False)."""
    from laconic_nemo.runtime.kernels import describe_packed_attention

    for plan in (plan_layout(load_config(QWEN3), 4, 8, check_paths=False, image="none"),
                 plan_layout(load_config(QWEN3), 4, 8, check_paths=False, cluster=False)):
        assert plan.image is None and plan.packed_attention == describe_packed_attention("auto", torch.bfloat16)
    with pytest.raises(Exception, match="--image = 'nemo' runs the nemo_aligner actor"):
        plan_layout(load_config(QWEN3), 4, 8, check_paths=False, image="nemo")
    frozen = plan_layout(load_config(QWEN3, VLLM), 4, 8, check_paths=False, image="vllm-0.10")
    assert frozen.image == "vllm-0.10" and frozen.packed_attention.startswith("flex:")  # torch 2.7.1: no varlen_attn


def test_the_varlen_statements_follow_the_kernels_choice():
    """The table's varlen entries are what laconic_nemo.runtime.kernels decides for those torch releases: torch
    2.14.0's signature is a form varlen_form calls (so the vLLM image states varlen=True); torch 2.7.1 has none."""
    from laconic_nemo.runtime.kernels import varlen_form

    form = varlen_form(TORCH_2_14_VARLEN)
    assert form is not None and (form.causal, form.scale, form.enable_gqa) == ("window_size", True, True)
    assert IMAGES["vllm"].torch == "2.14.0" and IMAGES["vllm"].varlen is True
    assert IMAGES["vllm-0.10"].torch == "2.7.1" and IMAGES["vllm-0.10"].varlen is False
    assert packed_kernel(IMAGES["vllm"], "sdpa", "bf16").startswith("varlen:")
    assert attention_line(IMAGES["mcore"], "nemo_aligner", "auto", "bf16", False).startswith("te:")


def test_vllm_gets_its_own_image_because_it_does_not_fit_the_ngc_torch():
    """vLLM 0.33.0 requires torch==2.14.0: the NGC 25.12 container's source build 2.10.0a0+b4e4ee81d3 does not
    satisfy it (so vLLM is not installed in the mcore image, which keeps TransformerEngine's torch), the vLLM
    image's torch does; every image that carries vLLM carries the torch that vLLM requires."""
    assert not vllm_fits(IMAGES["mcore"].torch, VLLM_TORCH["0.33.0"])
    assert not vllm_fits("2.14.0a0+b4e4ee81d3", "==2.14.0")  # a pre-release of the same version does not either
    assert IMAGES["mcore"].vllm is None and IMAGES["mcore"].transformer_engine
    for image in IMAGES.values():
        if image.vllm:
            assert vllm_fits(image.torch, VLLM_TORCH[image.vllm]), image.name
    assert image_for("megatron_core", "vllm").vllm == "0.33.0"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'^vllm = \[(.*)\]$', pyproject, re.M) == [f'"vllm=={IMAGES["vllm"].vllm}"']


def _pinned(dockerfile: str) -> dict[str, str]:
    """package -> version of every ``"name[extras]==version"`` the Dockerfile's pip lines install."""
    pins = re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^"]+)"', dockerfile)
    return {name.lower(): version for name, version in pins}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_each_dockerfile_names_the_pins_of_its_table_row(name):
    """Each image's Dockerfile starts from the row's base, installs exactly the row's pins (package and version),
    names them in its header, and ends its build with the image check of that row."""
    image = IMAGES[name]
    text = (ROOT / image.dockerfile).read_text()
    lines = text.splitlines()
    bases = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M) or [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert bases == [image.base], bases
    assert _pinned(text) == image.pins
    header = "\n".join(ln for ln in lines if ln.startswith("#"))
    assert image.base.split(":")[-1].lstrip("v") in header
    assert f"-t {image.tag} ." in header, f"{image.dockerfile}: the build command names another tag"
    checks = [ln for ln in lines if re.search(rf"python3? -m laconic_nemo\.plan\.images {re.escape(name)}( |$)", ln)]
    assert len(checks) == 1 and lines.index(checks[0]) > max(i for i, ln in enumerate(lines) if "pip install" in ln)
    if image.vllm:
        assert f"vllm.__version__ == '{image.vllm}'" in text


def test_the_image_check_catches_a_row_the_image_contradicts():
    """`python -m laconic_nemo.plan.images NAME` (each Dockerfile's last step) passes where the environment is the
    row and names each contradiction otherwise; what the row does not state (None) is not checked, and a row
    without vLLM requires the image to have none."""
    row = IMAGES["mcore"]
    good = {"python": "3.12", "torch": row.torch, "transformer_engine": True, "megatron_core": "0.19.2", "vllm": None,
            "varlen": False, **{f"pin:{k}": v for k, v in row.pins.items()}}
    assert mismatches(row, good) == []
    bad = {**good, "torch": "2.14.0", "transformer_engine": False, "vllm": "0.33.0", "pin:transformers": "5.17.0"}
    assert mismatches(row, bad) == [
        "torch: the table states '2.10.0a0+b4e4ee81d3', the image has '2.14.0'",
        "transformer_engine: the table states True, the image has False",
        "vllm: the table states None, the image has '0.33.0'",
        "transformers: the Dockerfile pins 5.24.0, the image has '5.17.0'"]
    nemo = IMAGES["nemo"]  # torch / python unstated; megatron-core "0.11" admits 0.11.x, not 0.12
    base = {"transformer_engine": True, "vllm": None, **{f"pin:{k}": v for k, v in nemo.pins.items()}}
    assert mismatches(nemo, {**base, "megatron_core": "0.11.1", "torch": "anything"}) == []
    assert mismatches(nemo, {**base, "megatron_core": "0.12.0"}) == [
        "megatron_core: the table states '0.11', the image has '0.12.0'"]


def test_launch_wrappers_and_submit_dry_run_use_the_image_plan_names():
    """Each training wrapper's default CONTAINER is the squash file of the image plan names for its recipe, and a
    dry run of submit.sh without CONTAINER set runs every srun in it (the flagship in the frozen image, the Qwen3
    run in the current one); without a wrapper's default submit.sh refuses to guess."""
    import importlib.util
    import os
    import sys

    spec = importlib.util.spec_from_file_location("launch_wrappers_images", ROOT / "launch" / "wrappers.py")
    table = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = table
    spec.loader.exec_module(table)
    for w in table.WRAPPERS:
        cfg = load_config(ROOT / w.recipe)
        want = plan_layout(cfg, w.nodes, 8, check_paths=False).image
        assert f'CONTAINER="${{CONTAINER:-{IMAGES[want].squash}}}"' in (ROOT / "launch" / f"{w.name}.sh").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "CONTAINER"}
    env.update(DRY_RUN="1", REPO_DIR=str(ROOT))
    for script, recipe, nodes, hf in (("deepseek_b1500.sh", DEEPSEEK, 2, "/checkpoints/hf/DeepSeek-R1-Distill-Qwen-1.5B"),
                                      ("qwen3_8b_b1000.sh", QWEN3, 4, None)):
        out = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        sruns = [shlex.split(ln[2:]) for ln in out.stdout.splitlines() if ln.startswith("+ srun ")]
        cfg = load_config(recipe)
        plan = plan_layout(cfg, nodes, 8, check_paths=False)
        rendered = render_commands(plan, cfg, str(recipe.relative_to(ROOT)), [], IMAGES[plan.image].squash,
                                   f"/lustre/data:/data,/lustre/checkpoints:/checkpoints,/lustre/results:/results,"
                                   f"{ROOT}:/opt/laconic-nemo", hf)
        images = {t for s in sruns for t in s if t.startswith("--container-image=")}
        assert images == {f"--container-image={IMAGES[plan.image].squash}"} and len(sruns) == len(rendered)
        assert all(f"--container-image={IMAGES[plan.image].squash}" in r for r in rendered)
    bare = subprocess.run(["bash", "-c", f"RECIPE={QWEN3} source launch/submit.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "CONTAINER must name the image" in bare.stderr


def test_the_eval_launch_runs_in_the_vllm_image():
    text = (ROOT / "launch" / "eval.sh").read_text()
    assert f'CONTAINER="${{CONTAINER:-{IMAGES["vllm"].squash}}}"' in text
