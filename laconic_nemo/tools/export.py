"""`laconic-nemo export`: a megatron-core training checkpoint -> a Hugging Face model folder.

    laconic-nemo export RUN_DIR_OR_CHECKPOINT --to hf OUT_DIR

RUN_DIR_OR_CHECKPOINT is a run directory (``run.output_dir``: the complete checkpoint ``resume: auto`` would
continue from, :func:`laconic_nemo.grpo.resume.find_checkpoint`),
its ``checkpoints`` folder, or one ``checkpoints/step_XXXXXX`` folder. The per-rank shards
``model_tpXX_ppYY.pt`` are merged offline in this one process (no torch.distributed): TP shards are
concatenated and pipeline stages renumbered by :func:`laconic_nemo.actors.megatron_shards.merge_rank_states`
(the actor's own unsharding rules), then the bridge maps the unsharded megatron tensors to Hugging Face
names (:func:`laconic_nemo.bridge.mapping.full_to_hf`: fused QKV and gate/up split, vocabulary padding
dropped). ``config.json`` and the tokenizer files come from the run's ``model.path`` (or ``--hf-config``).
Only runs with ``model.source: hf`` have a Hugging Face architecture; the synthetic GPT has none.

A NeMo-Aligner run (``model.source: nemo``) is exported from its NeMo distributed checkpoint
(``checkpoints/nemo/step_XXXXXX/model``, or that folder given directly), read by megatron-core's
``dist_checkpointing.load``; ``--hf-config`` names the Hugging Face folder its ``.nemo`` was converted from.
When that folder ties the embeddings (Qwen2.5-Math) but the NeMo checkpoint holds an output layer of its own
(NeMo's Qwen2 converter always builds an untied model), the trained output layer is written as
``lm_head.weight`` and the exported ``config.json`` says ``tie_word_embeddings: false``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from laconic_nemo.config import Config
from laconic_nemo.grpo.resume import find_checkpoint, saved_config

SHARD = re.compile(r"^model_tp(\d+)_pp(\d+)\.pt$")
STATE = "trainer_state.json"
DIST_METADATA = "metadata.json"  # megatron-core dist_checkpointing: names the tensor format (torch_dist, zarr)
NEMO_CKPT_DIR = "model"          # the NeMo checkpoint inside a NeMo-Aligner step folder (actors/nemo_aligner.py)


class ExportError(ValueError):
    """A checkpoint that cannot be exported (missing, incomplete, or without a Hugging Face architecture)."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory, its ``checkpoints`` folder or a checkpoint folder -> the checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such run directory or checkpoint")
    if p.suffix == ".nemo" or (p / "model_config.yaml").is_file():
        raise ExportError(f"{p}: a NeMo checkpoint (.nemo archive); this command exports a run directory or its "
                          "distributed checkpoints (checkpoints/nemo/step_XXXXXX): pass the run, or convert .nemo "
                          "files with NeMo's checkpoint converters")
    if (p / DIST_METADATA).is_file() or (p / NEMO_CKPT_DIR / DIST_METADATA).is_file():
        return p  # a NeMo-Aligner distributed checkpoint (the step folder or its model/ folder)
    if p.name.endswith(".tmp"):
        raise ExportError(f"{p}: an incomplete checkpoint (still being written, or the run died while writing it)")
    if (p / STATE).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = find_checkpoint(root)  # the trainer's rule: what `resume: auto` would continue from
    if found is None:
        raise ExportError(f"{p}: no complete checkpoint (a step_XXXXXX folder holding {STATE}) in {root}")
    return found


def read_checkpoint(ckpt: Path) -> tuple[Config, dict[tuple[int, int], dict[str, Any]]]:
    """(run config, {(tp_rank, pp_rank): rank state}) of a checkpoint folder; checks every rank is there."""
    cfg = _saved_config(ckpt)
    if cfg.model.source == "nemo":  # its trainer state has no megatron-core shards beside it
        raise ExportError(f"{ckpt}: a NeMo-Aligner run (model.source: nemo): its weights are NeMo's distributed "
                          "checkpoint, not megatron-core shards")
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    want = {f"model_tp{t:02d}_pp{p:02d}.pt": (t, p) for t in range(tp) for p in range(pp)}
    have = {f.name for f in ckpt.iterdir() if SHARD.match(f.name)}
    missing = sorted(set(want) - have)
    if missing:
        raise ExportError(f"{ckpt}: incomplete checkpoint for TP {tp} x PP {pp}: missing {', '.join(missing)}")
    shards = {}
    for name, rank in want.items():
        shards[rank] = torch.load(ckpt / name, map_location="cpu", weights_only=False, mmap=True)
        par_ckpt = shards[rank].get("parallel") or {}
        if par_ckpt and (par_ckpt.get("tp"), par_ckpt.get("pp")) != (tp, pp):
            raise ExportError(f"{ckpt / name}: written with TP {par_ckpt.get('tp')} x PP {par_ckpt.get('pp')}, "
                              f"the run config says TP {tp} x PP {pp}")
    return cfg, shards


def _saved_config(ckpt: Path) -> Config:
    """The run config of checkpoint ``ckpt`` (:func:`~laconic_nemo.grpo.resume.saved_config`); ExportError naming
    the folder when it cannot be read."""
    try:
        return saved_config(json.loads((ckpt / STATE).read_text()), ckpt)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{ckpt}: unreadable {STATE} ({exc})") from exc


def _hf_source(cfg: Config, ckpt: Path, hf_config: str | None) -> str:
    source = cfg.model.source
    if source != "hf":
        raise ExportError(
            f"{ckpt}: model.source is {source!r}; only runs with model.source: hf can be exported to Hugging Face "
            + ("(the synthetic GPT has no Hugging Face architecture; evaluate it with `laconic-nemo eval --model RUN "
               "--benchmarks synthetic`)" if source == "synthetic"
               else "(NeMo-Aligner runs end in a .nemo checkpoint)"))
    src = hf_config or cfg.model.path
    if not src or not (Path(src) / "config.json").is_file():
        raise ExportError(f"{ckpt}: the run's Hugging Face config {src}/config.json is not readable; "
                          "pass --hf-config DIR (a folder with the base model's config.json and tokenizer)")
    return str(src)


def export_hf(src: str | Path, out_dir: str | Path, hf_config: str | None = None) -> Path:
    """Write the policy of checkpoint/run ``src`` as a Hugging Face folder ``out_dir``; returns the checkpoint
    folder read. Tensors keep the dtype they were trained in."""
    from laconic_nemo.actors.megatron_shards import global_param_name, merge_rank_states
    from laconic_nemo.bridge import arch_from_hf_config, save_safetensors_dir
    from laconic_nemo.bridge.mapping import SPLIT_DIM, weight_map

    ckpt = resolve_checkpoint(src)
    nemo_dir = nemo_dist_checkpoint(ckpt)
    if nemo_dir is not None:
        export_nemo_hf(nemo_dir, out_dir, hf_config, ckpt)
        return ckpt
    cfg, shards = read_checkpoint(ckpt)
    hf_src = _hf_source(cfg, ckpt, hf_config)
    arch = arch_from_hf_config(hf_src)
    tp, pp = max(t for t, _ in shards) + 1, max(p for _, p in shards) + 1
    entries = weight_map(arch)
    per_stage = arch.num_layers // pp
    split = dict(shards[(0, 0)]["parallel"].get("tp_split_dims") or {})
    if not split:  # checkpoints written before the actor recorded its split dims: the bridge's name table
        kinds = {e.megatron: e.kind for e in entries}
        for (_, p), st in shards.items():
            for name in st["model"]:
                dim = SPLIT_DIM.get(kinds.get(global_param_name(name, p, per_stage), "none"))
                if dim is not None:
                    split[name] = dim
    full = merge_rank_states({r: st["model"] for r, st in shards.items()}, tp, pp, arch.num_layers, split)
    hf = _hf_tensors(full, arch, tp, f"{ckpt}: shards", hf_src)
    save_safetensors_dir(str(out_dir), hf, config=hf_src, copy_from=hf_src)
    return ckpt


def _hf_tensors(full: dict[str, torch.Tensor], arch, tp: int, what: str, hf_src: str) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of the full (unsharded) megatron-core state ``full`` of architecture ``arch``
    (``tp``: the TP size whose fused layouts ``full`` holds). Raises ExportError, naming ``what`` and ``hf_src``,
    when the names do not match the architecture or a tensor does not fit it."""
    from laconic_nemo.bridge.mapping import full_to_hf, weight_map

    entries = weight_map(arch)
    if arch.tie_word_embeddings:
        entries = [e for e in entries if e.megatron != "output_layer.weight"]
        full.pop("output_layer.weight", None)  # the last stage's copy of the embedding (PP > 1)
    names = {e.megatron for e in entries}
    missing, unknown = sorted(names - set(full)), sorted(set(full) - names)
    if missing or unknown:
        raise ExportError(f"{what} do not match the {arch.model_type} architecture of {hf_src}: "
                          f"missing {missing[:5]}, unexpected {unknown[:5]}")
    hf: dict[str, torch.Tensor] = {}
    for e in entries:
        try:
            hf.update(full_to_hf(e, full[e.megatron], arch, tp))
        except (RuntimeError, ValueError) as exc:
            raise ExportError(f"{what}: {e.megatron} {tuple(full[e.megatron].shape)} does not fit {hf_src} "
                              f"({exc})") from exc
    return hf


# ---------------------------------------------------------------------------------------------- NeMo-Aligner runs
# NeMo's MegatronGPTModel holds a megatron-core GPTModel as ``model`` (``model.module`` with megatron_amp_O2), so
# its distributed checkpoint holds megatron-core's sharded keys under that prefix, with the layers of a
# homogeneous decoder stacked along a leading axis (``model.decoder.layers.<name>`` [L, ...],
# megatron/core/transformer/transformer_block.py:640-647 in megatron-core 0.11). The keys are global, not per
# TP rank: a rank's qkv block is its slice of the full fused tensor, and SwiGLU's fc1 is stored as the full
# [gate; up] (mlp.py:147-190, apply_swiglu_sharded_factory), so the bridge's TP 1 layout applies at any TP.
# The Transformer Engine spec (NeMo's default "te_gpt") fuses the two pre-norms into the following linear layer
# (gpt_layer_specs.py: TELayerNormColumnParallelLinear); their weights map back to the local spec's names.
TE_NORM_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                 "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_NEMO_PREFIXES = ("model.module.", "model.")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")


def nemo_dist_checkpoint(ckpt: Path) -> Path | None:
    """The NeMo distributed checkpoint folder (holding ``metadata.json``) behind ``ckpt``, or None for a
    megatron-core actor's checkpoint. ``ckpt``: a distributed checkpoint, a NeMo-Aligner step folder
    (``checkpoints/nemo/step_X``, its ``model/`` inside), or the trainer's ``checkpoints/step_X`` of a
    NeMo-Aligner run (its NeMo checkpoint is ``checkpoints/nemo/step_X/model``, NemoCheckpointHook)."""
    for folder in (ckpt, ckpt / NEMO_CKPT_DIR):
        if (folder / DIST_METADATA).is_file():
            return folder
    try:
        if _saved_config(ckpt).model.source != "nemo":
            return None
    except ExportError:
        return None
    folder = ckpt.parent / "nemo" / ckpt.name / NEMO_CKPT_DIR
    if not (folder / DIST_METADATA).is_file():
        raise ExportError(f"{ckpt}: a NeMo-Aligner run (model.source: nemo) whose NeMo checkpoint {folder} "
                          f"(with {DIST_METADATA}) is missing")
    return folder


def _world_of_one():
    """megatron-core's loader asks torch.distributed for the rank: a single-process gloo group when none is
    running (file rendezvous, no port). Returns a function that ends what this started."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        return lambda: None
    tmp = tempfile.TemporaryDirectory()
    dist.init_process_group("gloo", init_method=f"file://{tmp.name}/store", rank=0, world_size=1)

    def end():
        dist.destroy_process_group()
        tmp.cleanup()

    return end


def load_nemo_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The model tensors of a NeMo distributed checkpoint -> {megatron-core name (global layer index, local
    spec names): full tensor}. Read by ``megatron.core.dist_checkpointing.load`` with the strategy the
    folder's ``metadata.json`` names; optimiser states are not read."""
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    end = _world_of_one()
    try:
        meta = dist_checkpointing.load_tensors_metadata(str(folder))
        wanted = {k: v for k, v in meta.items() if k.startswith(_NEMO_PREFIXES) and "_extra_state" not in k}
        if not wanted:
            raise ExportError(f"{folder}: no model tensors (keys under 'model.') in this distributed checkpoint")
        loaded = dist_checkpointing.load(wanted, str(folder), validate_access_integrity=False)
    finally:
        end()
    out: dict[str, torch.Tensor] = {}
    for key, t in loaded.items():
        name = next(key[len(p):] for p in _NEMO_PREFIXES if key.startswith(p))
        m = _STACKED.match(name)
        layers = [(f"decoder.layers.{i}.{m.group(1)}", t[i]) for i in range(t.shape[0])] if m else [(name, t)]
        for n, x in layers:
            for te, local in TE_NORM_NAMES.items():
                n = n.replace(te, local)
            out[n] = x.contiguous()
    return out


def export_nemo_hf(folder: Path, out_dir: str | Path, hf_config: str | None, ckpt: Path | None = None) -> None:
    """Write the policy in NeMo distributed checkpoint ``folder`` as a Hugging Face folder ``out_dir``;
    ``hf_config``: the Hugging Face folder the run's ``.nemo`` was converted from (config.json, tokenizer)."""
    from laconic_nemo.bridge import arch_from_hf_config, save_safetensors_dir
    from laconic_nemo.bridge.mapping import hf_shapes

    where = ckpt or folder
    if not hf_config or not (Path(hf_config) / "config.json").is_file():
        raise ExportError(f"{where}: a NeMo-Aligner checkpoint has no Hugging Face config; pass --hf-config DIR "
                          f"(the folder the .nemo was converted from, with config.json and tokenizer; got {hf_config})")
    arch = arch_from_hf_config(hf_config)
    weights = load_nemo_weights(folder)
    config: str | dict = hf_config
    if arch.tie_word_embeddings and "output_layer.weight" in weights:
        # NeMo trained an output layer of its own: NeMo's Qwen2 converter builds the model from its
        # megatron_qwen2_config.yaml (share_embeddings_and_output_weights: False) and fills output_layer.weight
        # with HF's lm_head.weight, the embedding of a tied checkpoint (Qwen2.5-Math-1.5B). A tied megatron-core
        # model has no output_layer.weight in its checkpoint (language_module.py, tie_embeddings_and_output_
        # weights_state_dict). The export keeps the trained layer as lm_head.weight and says so in config.json.
        arch = dataclasses.replace(arch, tie_word_embeddings=False)
        config = {**json.loads((Path(hf_config) / "config.json").read_text()), "tie_word_embeddings": False}
    # global tensors: the TP 1 layout
    hf = _hf_tensors(weights, arch, 1, f"{where}: NeMo checkpoint tensors", hf_config)
    shapes = hf_shapes(arch)
    bad = [f"{n} {tuple(t.shape)} != {shapes[n]}" for n, t in hf.items() if tuple(t.shape) != shapes[n]]
    if bad:
        raise ExportError(f"{where}: shapes do not match {hf_config}/config.json: {'; '.join(bad[:3])}")
    save_safetensors_dir(str(out_dir), hf, config=config, copy_from=hf_config)


MARKER = "exported_from.json"


def hf_model_dir(model: str | Path, cache_dir: str | Path, hf_config: str | None = None) -> str:
    """A model for evaluation: a Hugging Face folder (holding config.json) as is; a run directory or training
    checkpoint exported into ``cache_dir`` (reused when ``cache_dir`` already holds the export of that same
    checkpoint, which :data:`MARKER` records; written to ``<cache_dir>.tmp`` and renamed, so a crash never
    leaves a half export that would be reused)."""
    import os
    import shutil

    if (Path(model) / "config.json").is_file():
        return str(model)
    ckpt = resolve_checkpoint(model).resolve()
    cache = Path(cache_dir)
    marker = cache / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("checkpoint") == str(ckpt):
        return str(cache)
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(ckpt, tmp, hf_config)
    (tmp / MARKER).write_text(json.dumps({"checkpoint": str(ckpt)}))
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(tmp, cache)
    return str(cache)


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a training checkpoint as a Hugging Face model folder",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="run directory (latest complete checkpoint), its checkpoints/, a step_XXXXXX folder "
                               "or a NeMo distributed checkpoint folder")
    p.add_argument("--to", choices=["hf"], default="hf", help="output format (hf: safetensors + config + tokenizer)")
    p.add_argument("out_dir", help="output folder")
    p.add_argument("--hf-config", default=None,
                   help="folder with the base model's config.json and tokenizer (default: the run's model.path; "
                        "required for a NeMo-Aligner run)")
    p.set_defaults(func=main)


def main(args) -> int:
    try:
        ckpt = export_hf(args.src, args.out_dir, args.hf_config)
    except ExportError as exc:
        print(f"laconic-nemo export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {args.out_dir}")
    return 0
