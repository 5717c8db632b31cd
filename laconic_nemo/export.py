"""`laconic-nemo export`: a megatron-core training checkpoint -> a Hugging Face model folder.

    laconic-nemo export RUN_DIR_OR_CHECKPOINT --to hf OUT_DIR

RUN_DIR_OR_CHECKPOINT is a run directory (``run.output_dir``: the complete checkpoint ``resume: auto`` would
continue from, :func:`laconic_nemo.grpo.resume.find_checkpoint`),
its ``checkpoints`` folder, or one ``checkpoints/step_XXXXXX`` folder. The per-rank shards
``model_tpXX_ppYY.pt`` are merged offline in this one process (no torch.distributed): TP shards are
concatenated and pipeline stages renumbered by :func:`laconic_nemo.actors.megatron_core.merge_rank_states`
(the actor's own unsharding rules), then the bridge maps the unsharded megatron tensors to Hugging Face
names (:func:`laconic_nemo.bridge.mapping.full_to_hf`: fused QKV and gate/up split, vocabulary padding
dropped). ``config.json`` and the tokenizer files come from the run's ``model.path`` (or ``--hf-config``).
Only runs with ``model.source: hf`` have a Hugging Face architecture; the synthetic GPT has none.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from laconic_nemo.grpo.resume import find_checkpoint

SHARD = re.compile(r"^model_tp(\d+)_pp(\d+)\.pt$")
STATE = "trainer_state.json"


class ExportError(ValueError):
    """A checkpoint that cannot be exported (missing, incomplete, or without a Hugging Face architecture)."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory, its ``checkpoints`` folder or a checkpoint folder -> the checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such run directory or checkpoint")
    if p.suffix == ".nemo" or (p / "model_config.yaml").is_file():
        raise ExportError(f"{p}: a NeMo checkpoint (NeMo-Aligner actor); this command exports the megatron-core "
                          "actor's checkpoints only: convert .nemo files with NeMo's checkpoint converters")
    if p.name.endswith(".tmp"):
        raise ExportError(f"{p}: an incomplete checkpoint (still being written, or the run died while writing it)")
    if (p / STATE).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = find_checkpoint(root)  # the trainer's rule: what `resume: auto` would continue from
    if found is None:
        raise ExportError(f"{p}: no complete checkpoint (a step_XXXXXX folder holding {STATE}) in {root}")
    return found


def read_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[tuple[int, int], dict[str, Any]]]:
    """(run config, {(tp_rank, pp_rank): rank state}) of a checkpoint folder; checks every rank is there."""
    try:
        state = json.loads((ckpt / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{ckpt}: unreadable {STATE} ({exc})") from exc
    cfg = state.get("config") or {}
    if str(cfg.get("model", {}).get("source")) == "nemo":  # its trainer state has no megatron-core shards beside it
        raise ExportError(f"{ckpt}: a NeMo-Aligner run (model.source: nemo); its policy is the run's "
                          "export/policy.nemo, which this command does not convert: use NeMo's checkpoint converters")
    par = cfg.get("parallel", {})
    tp, pp = int(par.get("tensor_model_parallel_size", 1)), int(par.get("pipeline_model_parallel_size", 1))
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


def _hf_source(cfg: dict[str, Any], ckpt: Path, hf_config: str | None) -> str:
    model = cfg.get("model", {})
    source = str(model.get("source", "synthetic"))
    if source != "hf":
        raise ExportError(
            f"{ckpt}: model.source is {source!r}; only runs with model.source: hf can be exported to Hugging Face "
            + ("(the synthetic GPT has no Hugging Face architecture; evaluate it with `laconic-nemo eval --model RUN "
               "--benchmarks synthetic`)" if source == "synthetic"
               else "(NeMo-Aligner runs end in a .nemo checkpoint)"))
    src = hf_config or model.get("path")
    if not src or not (Path(src) / "config.json").is_file():
        raise ExportError(f"{ckpt}: the run's Hugging Face config {src}/config.json is not readable; "
                          "pass --hf-config DIR (a folder with the base model's config.json and tokenizer)")
    return str(src)


def export_hf(src: str | Path, out_dir: str | Path, hf_config: str | None = None) -> Path:
    """Write the policy of checkpoint/run ``src`` as a Hugging Face folder ``out_dir``; returns the checkpoint
    folder read. Tensors keep the dtype they were trained in."""
    from laconic_nemo.actors.megatron_core import global_param_name, merge_rank_states
    from laconic_nemo.bridge import arch_from_hf_config, save_safetensors_dir
    from laconic_nemo.bridge.mapping import SPLIT_DIM, full_to_hf, weight_map

    ckpt = resolve_checkpoint(src)
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
    if arch.tie_word_embeddings:
        entries = [e for e in entries if e.megatron != "output_layer.weight"]
        full.pop("output_layer.weight", None)  # the last stage's copy of the embedding (PP > 1)
    names = {e.megatron for e in entries}
    missing, unknown = sorted(names - set(full)), sorted(set(full) - names)
    if missing or unknown:
        raise ExportError(f"{ckpt}: shards do not match the {arch.model_type} architecture of {hf_src}: "
                          f"missing {missing[:5]}, unexpected {unknown[:5]}")
    hf: dict[str, torch.Tensor] = {}
    for e in entries:
        hf.update(full_to_hf(e, full[e.megatron], arch, tp))
    save_safetensors_dir(str(out_dir), hf, config=hf_src, copy_from=hf_src)
    return ckpt


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
    p.add_argument("src", help="run directory (latest complete checkpoint), its checkpoints/ or a step_XXXXXX folder")
    p.add_argument("--to", choices=["hf"], default="hf", help="output format (hf: safetensors + config + tokenizer)")
    p.add_argument("out_dir", help="output folder")
    p.add_argument("--hf-config", default=None,
                   help="folder with the base model's config.json and tokenizer (default: the run's model.path)")
    p.set_defaults(func=main)


def main(args) -> int:
    try:
        ckpt = export_hf(args.src, args.out_dir, args.hf_config)
    except ExportError as exc:
        print(f"laconic-nemo export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {args.out_dir}")
    return 0
