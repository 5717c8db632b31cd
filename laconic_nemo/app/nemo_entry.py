"""In-container entry point (NGC NeMo container, one process per GPU under srun).

    python -m laconic_nemo.nemo_entry RECIPE [key=value ...] [nemo.<key>=value ...]
    python -m laconic_nemo.nemo_entry --prepare --hf-model HF_DIR RECIPE [key=value ...]

The recipe (``laconic_nemo.config.load_config``: base.yaml schema, unknown keys rejected) is loaded
and validated before anything else. Then:

* ``model.source: nemo`` -> the NeMo-Aligner actor (:mod:`laconic_nemo.actors.nemo_aligner`), set
  up exactly as NeMo-Aligner's ``train_gpt_reinforce_actor.py`` does (``load_and_override_model_config``
  -> ``resolve_and_create_trainer`` -> ``exp_manager`` -> ``load_from_nemo`` -> ``init_peft`` ->
  ``init_distributed`` -> ``init_using_ptl``), with the NeMo config derived from the recipe by
  :func:`build_nemo_config` in NeMo-Aligner's ``gpt_reinforce_actor.yaml`` layout (``trainer``,
  ``exp_manager``, ``pretrained_checkpoint``, ``model.reinforce`` ...). Overrides prefixed with
  ``nemo.`` go to that config (e.g. ``nemo.model.reinforce.rollout_micro_batch_size=16``,
  ``nemo.trainer.reinforce.trt_llm.enable=true``), the others to the recipe.
* any other source -> the megatron-core trainer (``laconic_nemo.app.train_cli``).

Both run the same :func:`laconic_nemo.app.run.run`. ``--prepare`` converts the HF
checkpoint to the recipe's ``model.path`` with NeMo's ``convert_qwen2_hf_to_nemo.py`` when that file
is missing (Qwen2 architecture: DeepSeek-R1-Distill-Qwen, DeepScaleR, Qwen2.5-Math), run through
:mod:`laconic_nemo.tools.convert_qwen2` so that a folder with ``tokenizer.json`` only converts; Qwen3 has no
converter in these NeMo pins and runs on the megatron-core actor with the HF bridge.

End strings: NeMo's sampler gets ``"<|endoftext|>"`` (its alias for the EOS id) plus the chat end strings
that are single tokens of the loaded tokenizer (:func:`laconic_nemo.bridge.end_tokens.resolve_end_strings`);
a ``nemo.model.reinforce.sampling_params.end_strings`` override is refused at start-up if any string is
not a single token (NeMo would decode every row at every step to look for it). The decode engine
(``rollout.engine: megatron``) stops on the ids of the same strings (``SamplingParams.stop_ids``).

Exit codes: 0 finished, 2 bad configuration, 3 stopped on SIGUSR1/SIGTERM after a checkpoint, or during the
start-up before there was anything to save (``launch/submit.sh`` requeues the job), 5 a step ran out of GPU memory
(fatal: the last line names the memory model's prediction and the keys to change).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from laconic_nemo.app.train_cli import EARLY_SIGNALS, install_early_stop
from laconic_nemo.bridge.end_tokens import END_OF_SEQ, EndStringError, end_token_ids, resolve_end_strings
from laconic_nemo.config import Config, ConfigError, load_config
from laconic_nemo.plan.model_folder import (  # noqa: F401 - END_STRINGS_KEY: this module's name of it, for callers
    END_STRINGS_KEY,
    end_strings_override,
    split_overrides,
)
from laconic_nemo.tools.convert_qwen2 import QWEN2_CONVERTER, ConversionBusy, convert_to_target


def early_signal() -> int | None:
    """The first SIGUSR1 / SIGTERM received during the start-up (before the trainer's own handler), or None."""
    return EARLY_SIGNALS[0] if EARLY_SIGNALS else None


def build_nemo_config(cfg: Config, nodes: int, gpus_per_node: int, nemo_overrides: list[str] = (),
                      resume_step: int = 0, rank: int = 0) -> DictConfig:
    """The NeMo-Aligner (0.7.0 ``gpt_reinforce_actor.yaml`` layout) config for a recipe.

    Only what the NeMo side needs: parallel layout, precision, optimiser, generation parameters and
    batch sizes (the GRPO loop itself reads the recipe). Keys of the .nemo's own model config that
    are not set here (architecture, tokenizer) come from the checkpoint. The ``exp_manager`` loggers are the
    recipe's ``logging`` dashboards (:func:`laconic_nemo.grpo.metrics.nemo_logger_settings`; ``resume_step``:
    the step of the checkpoint the run resumes, ``rank``: this process's global rank).
    """
    from laconic_nemo.grpo.metrics import nemo_logger_settings

    g, o, r = cfg.grpo, cfg.optim, cfg.rollout
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    world = int(nodes) * int(gpus_per_node)
    dp = world // (tp * pp)
    samples_per_rank = g.rollout_per_rank(max(dp, 1))
    # NeMo sets the LR scheduler's length to trainer.max_steps (nemo/core/classes/modelPT.py:694, after
    # megatron_base_model.py:785-787), and NemoAlignerActor.train_step steps it once per optimiser step:
    # rollout batch / minibatch of them per GRPO step
    optimiser_steps = cfg.run.num_steps * (g.rollout_batch // g.minibatch_size)
    trt_llm = {"enable": False, "reshard": False, "model_type": "llama", "unload_engine_train": False,
               "max_input_len": 1024, "seed": cfg.run.seed}
    precision = {"bf16": "bf16", "fp16": 16, "fp32": 32}[cfg.model.precision]
    nemo = {
        "trainer": {
            "num_nodes": int(nodes), "devices": int(gpus_per_node), "accelerator": "gpu", "precision": precision,
            "logger": False, "enable_checkpointing": False, "use_distributed_sampler": False, "max_time": None,
            "max_epochs": 1, "max_steps": optimiser_steps, "gradient_clip_val": float(o.grad_clip),
            "reinforce": {"trt_llm": trt_llm},
        },
        "exp_manager": {
            "exp_dir": None, "name": cfg.run.name,
            "create_checkpoint_callback": False, "resume_if_exists": False, "resume_ignore_no_checkpoint": True,
            **nemo_logger_settings(cfg, resume_step, rank),
        },
        "pretrained_checkpoint": {"restore_from_path": str(cfg.model.path)},
        "model": {
            "mcore_gpt": True,
            "micro_batch_size": g.micro_batch_size,
            "global_batch_size": g.minibatch_size,
            "megatron_amp_O2": cfg.model.precision != "fp32",
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            # off: sequence parallelism scatters the sequence over TP and megatron asserts it divides
            # (tensor_parallel/mappings.py); rollout widths are arbitrary
            "sequence_parallel": False,
            "seed": cfg.run.seed,
            "precision": precision,
            "dist_ckpt_format": "torch_dist",
            "optim": {
                "name": "distributed_fused_adam", "lr": float(o.lr), "weight_decay": float(o.weight_decay),
                "betas": [float(o.adam_beta1), float(o.adam_beta2)], "eps": float(o.adam_eps),
                "bucket_cap_mb": 200, "overlap_grad_sync": False, "contiguous_grad_buffer": True,
                # constant after a linear warmup: cosine annealing down to min_lr = lr
                "sched": {"name": "CosineAnnealing", "warmup_steps": int(o.warmup_steps), "constant_steps": 0,
                          "min_lr": float(o.lr)},
            },
            "reinforce": {
                "rollout_micro_batch_size": max(1, samples_per_rank),
                "num_rollout_samples": g.rollout_batch,
                "forward_micro_batch_size": g.micro_batch_size,
                "val_rollout_micro_batch_size": max(1, samples_per_rank),
                "num_val_samples": g.rollout_batch,
                "offload_adam_states": True,
                "sampling_params": {
                    "use_greedy": False, "temperature": r.temperature, "top_k": 0, "top_p": r.top_p,
                    "repetition_penalty": 1.0, "add_BOS": False, "all_probs": False, "compute_logprob": False,
                    # the EOS alias; the tokenizer's single-token chat end strings are added at start-up
                    "end_strings": [END_OF_SEQ],
                },
                "length_params": {"max_length": r.max_new_tokens, "min_length": 1},
                "trt_llm": trt_llm,
            },
            "peft": {"peft_scheme": "none", "restore_from_path": None},
            "data": {"data_impl": "jsonl", "splits_string": None, "data_prefix": None, "skip_warmup": True,
                     "num_workers": 0, "reset_position_ids": False, "reset_attention_mask": False,
                     "eod_mask_loss": False, "index_mapping_dir": None},
        },
    }
    out = OmegaConf.create(nemo)
    if nemo_overrides:
        out = OmegaConf.merge(out, OmegaConf.from_dotlist(list(nemo_overrides)))
    if out.trainer.reinforce.trt_llm.enable:
        out.model.reinforce.trt_llm = out.trainer.reinforce.trt_llm
    return out


def conversion_command(hf_model: str, output_path: str, precision: str = "bf16") -> list[str]:
    """NeMo's Qwen2 converter through :mod:`laconic_nemo.tools.convert_qwen2` (tokenizer.json-only folders)."""
    return [sys.executable, "-m", "laconic_nemo.tools.convert_qwen2", "--converter", QWEN2_CONVERTER,
            "--input_name_or_path", str(hf_model), "--output_path", str(output_path), "--precision", precision]


def nemo_checkpoint_dir(folder: str | Path) -> Path:
    """Where the actor's NeMo checkpoint of a trainer step lives: ``NLPDDPStrategy.save_checkpoint`` was
    given ``folder/model.ckpt`` and wrote the distributed checkpoint to ``ckpt_to_dir`` of it, the folder
    ``folder/model``; ``NLPDDPStrategy.load_checkpoint`` needs that folder (it raises "Distributed
    checkpoints should be a directory" for the ``.ckpt`` name)."""
    from laconic_nemo.actors.nemo_aligner import NEMO_CKPT

    return Path(folder) / NEMO_CKPT


def apply_end_strings(model, requested: list[str] | None) -> list[str]:
    """Set the end strings of a loaded ``MegatronGPTReinforceActorModel`` (its ``_sampling_params``, read by
    ``infer``, and ``cfg.reinforce.sampling_params``, read by ``verify_is_valid_and_clamp_range_``).

    requested: None builds them from ``model.tokenizer``; a list is checked (EndStringError names a string
    that is not a single token)."""
    from omegaconf import open_dict

    ends = resolve_end_strings(model.tokenizer.text_to_ids, requested)
    model._sampling_params["end_strings"] = list(ends)
    with open_dict(model.cfg):
        model.cfg.reinforce.sampling_params.end_strings = list(ends)
    return ends


def prepare(cfg: Config, hf_model: str | None, run=subprocess.call) -> int:
    """Convert ``hf_model`` to ``model.path`` if that .nemo is missing: one conversion per target at a time across
    jobs, in a scratch folder of its own, renamed onto ``model.path`` when complete
    (:func:`laconic_nemo.tools.convert_qwen2.convert_to_target`). ``run(command) -> exit status`` runs the converter."""
    if cfg.model.source != "nemo":
        print(f"prepare: model.source = {cfg.model.source}: nothing to convert")
        return 0
    target = Path(str(cfg.model.path))
    if target.exists():
        print(f"prepare: {target} exists")
        return 0
    if not hf_model:
        print(f"prepare: model.path {target} is missing and no --hf-model was given", file=sys.stderr)
        return 2
    if not Path(hf_model).exists():
        print(f"prepare: --hf-model {hf_model} does not exist", file=sys.stderr)
        return 2
    precision = cfg.model.precision

    def convert(out: Path) -> int:
        cmd = conversion_command(hf_model, str(out), precision)
        print("prepare: " + " ".join(cmd), flush=True)
        return run(cmd)

    try:
        return convert_to_target(target, convert, log=lambda msg: print(msg, flush=True))
    except ConversionBusy as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 1


EXPORT_DIR = "export"
EXPORT_NEMO = "policy.nemo"


def export_policy_nemo(model, output_dir: str | Path, rank: int) -> Path:
    """Collective (every rank): ``model.save_to`` the final policy as ``<output_dir>/export/policy.nemo``.

    NeMo's ``NLPSaveRestoreConnector.save_to(model, path)`` writes the distributed checkpoint to
    ``dirname(path)/model_weights`` on every rank, then rank 0 packs it into ``path``
    (``nemo/collections/nlp/parts/nlp_overrides.py:1068-1085,1127-1168``, nemo-toolkit 2.2.1), and megatron-core
    refuses a ``model_weights`` that is not empty (``megatron/core/dist_checkpointing/serialization.py:353-356``).
    An export interrupted after that first write would make the resumed run's export fail. So the save goes into
    ``export/.policy.nemo.scratch/`` (rank 0 empties it first: only one run uses an output directory, it holds
    ``run.lock``), and rank 0 renames the packed .nemo onto ``export/policy.nemo``. Returns that path."""
    from laconic_nemo.grpo.checkpoint import barrier

    export = Path(output_dir) / EXPORT_DIR
    scratch = export / f".{EXPORT_NEMO}.scratch"
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    barrier()
    model.save_to(str(scratch / EXPORT_NEMO))
    barrier()
    if rank == 0:
        os.replace(scratch / EXPORT_NEMO, export / EXPORT_NEMO)
        shutil.rmtree(scratch, ignore_errors=True)
    barrier()
    return export / EXPORT_NEMO


def resume_step(cfg: Config) -> int:
    """The step of the checkpoint this run resumes (0: a fresh start), from its ``trainer_state.json``."""
    from laconic_nemo.grpo.checkpoint import find_resume_checkpoint
    from laconic_nemo.grpo.resume import read_trainer_state

    found = find_resume_checkpoint(cfg)
    return 0 if found is None else int(read_trainer_state(found)["step"])


def set_collective_timeout(strategy, seconds: float) -> None:
    """Every process group of the NeMo path waits at most ``seconds`` (``parallel.collective_timeout_s``) in a
    collective, as the megatron-core path's do (:func:`laconic_nemo.runtime.megatron_env.init_distributed`).

    NeMo-Aligner's trainer (``resolve_and_create_trainer`` -> NeMo 2.2.1's ``MegatronTrainerBuilder._training_strategy``,
    ``nemo/collections/nlp/parts/megatron_trainer_builder.py:88-95``) builds its ``NLPDDPStrategy`` without a
    ``timeout``, so Lightning 2.4.0's default stood: torch's ``default_pg_timeout``, 30 minutes
    (``lightning/pytorch/strategies/ddp.py:83, 104``, ``lightning/fabric/plugins/collectives/torch_collective.py:12-15``). That one value makes both kinds of group:
    the default group (``DDPStrategy.setup_distributed``, ``ddp.py:197-203``: ``init_process_group(...,
    timeout=self._timeout)``) and megatron's groups (``NLPDDPStrategy.setup_distributed``,
    ``nemo/collections/nlp/parts/nlp_overrides.py:259-273`` -> ``init_model_parallel`` ``:143-172`` ->
    ``initialize_model_parallel(distributed_timeout_minutes=...)``, megatron-core 0.11 ``parallel_state.py:751``
    and every ``create_group(..., timeout=timeout)`` after it). Both are created in ``strategy.setup_environment``,
    from NeMo-Aligner's ``init_distributed`` (``nemo_aligner/utils/train_script_utils.py:70-83``) or earlier, from
    ``load_from_nemo`` for a distributed checkpoint (``nlp_overrides.py:1364-1372``): hence set on the strategy as
    soon as the trainer exists. Raises before any group exists, or when the strategy has no such setting."""
    from datetime import timedelta

    import torch.distributed as dist

    if not hasattr(strategy, "_timeout"):
        raise TypeError(f"{type(strategy).__name__} has no collective timeout (Lightning's DDPStrategy timeout) to "
                        f"set parallel.collective_timeout_s = {seconds} on")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("parallel.collective_timeout_s must be set on the NeMo trainer before its process groups "
                           "are created")
    strategy._timeout = timedelta(seconds=float(seconds))


def nemo_resume_path(cfg: Config) -> str | None:
    """The NeMo checkpoint folder the trainer's resume checkpoint refers to (None: fresh start).

    Uses :func:`laconic_nemo.grpo.checkpoint.find_resume_checkpoint` (``checkpoint.resume`` auto / never /
    path), so both actors pick checkpoints the same way."""
    import torch

    from laconic_nemo.actors.nemo_aligner import read_sidecar
    from laconic_nemo.grpo.checkpoint import find_resume_checkpoint

    found = find_resume_checkpoint(cfg)
    if found is None:
        return None
    ref = torch.load(Path(found) / "model_tp00_pp00.pt", weights_only=False)
    folder = ref.get("nemo_checkpoint") if isinstance(ref, dict) else None
    if folder is None or read_sidecar(folder) is None:
        raise FileNotFoundError(f"{found} does not refer to a complete NeMo checkpoint ({folder})")
    return str(folder)


def train_nemo(cfg: Config, nemo_overrides: list[str]) -> int:  # pragma: no cover - needs GPUs and NeMo
    import torch
    from nemo.utils.exp_manager import exp_manager

    from laconic_nemo.actors.nemo_aligner import NemoAlignerActor, NemoCheckpointHook, actor_model_class
    from laconic_nemo.app.run import run
    from laconic_nemo.app.task import Task
    from laconic_nemo.data.datasets import load_math_prompts
    from laconic_nemo.grpo.trainer import GRPOTrainer
    from laconic_nemo.rewards.format import build_reward_fn

    cls = actor_model_class()  # stubs TRT-LLM when absent, before the nemo_aligner imports below
    from nemo_aligner.utils.train_script_utils import (
        extract_optimizer_scheduler_from_ptl_model,
        init_distributed,
        init_peft,
        init_using_ptl,
        resolve_and_create_trainer,
    )
    from nemo_aligner.utils.utils import (
        load_and_override_model_config,
        load_from_nemo,
        retrieve_model_state_dict_in_cpu,
    )

    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    gpus = int(os.environ.get("SLURM_NTASKS_PER_NODE", str(max(torch.cuda.device_count(), 1))).split("(")[0])
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    ncfg = build_nemo_config(cfg, nodes, gpus, nemo_overrides, resume_step=resume_step(cfg), rank=rank)
    restore = ncfg.pretrained_checkpoint.restore_from_path
    ncfg.model = load_and_override_model_config(restore, ncfg.model)
    ptl_trainer = resolve_and_create_trainer(ncfg, "reinforce")
    set_collective_timeout(ptl_trainer.strategy, cfg.parallel.collective_timeout_s)  # before any process group
    exp_manager(ptl_trainer, ncfg.exp_manager)
    model = load_from_nemo(cls, ncfg.model, ptl_trainer, strict=True, restore_path=restore)
    ends = apply_end_strings(model, list(ncfg.model.reinforce.sampling_params.end_strings)
                             if end_strings_override(nemo_overrides) else None)
    print(f"nemo_entry: end strings {ends} (single tokens of the model's tokenizer)", flush=True)
    init_peft(model, ncfg.model)
    if cfg.grpo.kl_beta > 0 and ncfg.model.peft.peft_scheme == "none":
        # the INITIAL policy, captured before a resumed checkpoint is restored below
        model.init_policy_state_dict = retrieve_model_state_dict_in_cpu(
            model, megatron_amp_O2=ncfg.model.get("megatron_amp_O2", False))
    resume = nemo_resume_path(cfg)
    if resume is not None:
        ptl_trainer.ckpt_path = str(nemo_checkpoint_dir(resume))
    init_distributed(ptl_trainer, model, ncfg.model.get("transformer_engine", False))
    from laconic_nemo.runtime.run_lock import hold_output_dir

    lock = hold_output_dir(cfg.run.output_dir, torch.distributed.get_rank())  # rank 0 holds it; raises on all ranks

    items = load_math_prompts(list(cfg.data.train_files), cfg.data.prompt_template)
    from megatron.core import parallel_state as mps

    dummy = torch.utils.data.DataLoader(dataset=items, batch_size=max(1, int(ncfg.model.global_batch_size)
                                                                      // mps.get_data_parallel_world_size()))
    init_using_ptl(ptl_trainer, model, dummy, items)
    del model._train_dl
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(model)
    tok = model.tokenizer
    pad_id = tok.pad_id if getattr(tok, "pad_id", None) is not None and tok.pad_id >= 0 else tok.eos_id
    from laconic_nemo.rollout.engine import engine_settings_from_config

    actor = NemoAlignerActor(model, optimizer, scheduler, cfg.optim.grad_clip, pad_id, restored_from=resume,
                             rollout_engine=cfg.rollout.engine,
                             engine_settings=engine_settings_from_config(cfg, mps.get_data_parallel_world_size(),
                                                                         on_gpu=torch.cuda.is_available()),
                             logprob_chunk_size=cfg.grpo.logprob_chunk_size,
                             recompute_layers=cfg.grpo.recompute_layers, engine_memory=cfg.rollout.engine_memory)

    reward_fn, _grader = build_reward_fn(cfg.reward)
    # the decode engine stops on the ids of NeMo's end strings, as NeMo's own generation does
    task = Task(prompts=[(i.prompt, i.answer) for i in items], encode=tok.text_to_ids,
                decode=lambda ids: tok.ids_to_text(list(ids)), reward_fn=reward_fn, eos_id=tok.eos_id, pad_id=pad_id,
                stop_ids=tuple(end_token_ids(tok.text_to_ids, tok.eos_id, ends)))
    from laconic_nemo.grpo.metrics import nemo_sinks

    try:  # the dashboards are NeMo's own loggers (exp_manager's TensorBoardLogger / WandbLogger), fed by rank 0
        trainer = GRPOTrainer(cfg, actor, task.encode, task.decode, task.prompts, task.reward_fn, task.eos_id,
                              checkpoint_hook=NemoCheckpointHook(actor), stop_ids=task.stop_ids,
                              metric_sinks=lambda _step: nemo_sinks(ptl_trainer.loggers, cfg))
        code = run(trainer, task, early_signal=early_signal())
        if code == 0:  # the .nemo of the final policy (next ThinkPrune stage, evaluation)
            export_policy_nemo(model, cfg.run.output_dir, torch.distributed.get_rank())
    finally:
        if lock is not None:
            lock.release()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laconic_nemo.nemo_entry", description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key=value (recipe) or nemo.key=value (NeMo config)")
    p.add_argument("--prepare", action="store_true", help="convert the HF checkpoint if model.path is missing")
    p.add_argument("--hf-model", default=os.environ.get("HF_MODEL") or None)
    args = p.parse_intermixed_args(argv)
    recipe_ov, nemo_ov = split_overrides(list(args.overrides))
    try:
        cfg = load_config(args.recipe, recipe_ov)
        if nemo_ov:
            OmegaConf.from_dotlist(nemo_ov)
        if not args.prepare:
            from laconic_nemo.grpo.metrics import check_sinks

            check_sinks(cfg)  # a dashboard the recipe asks for, without its package
    except (ConfigError, ValueError) as exc:
        print(f"laconic_nemo.nemo_entry: {exc}", file=sys.stderr)
        return 2
    if args.prepare:
        if int(os.environ.get("SLURM_PROCID", "0")) != 0:
            return 0
        return prepare(cfg, args.hf_model)
    # From here on a SIGUSR1 / SIGTERM (Slurm's notice, relayed to every task by launch/submit.sh) is kept and
    # honoured once the ranks can agree to stop (app/run.py), as `laconic-nemo train` does; during the start-up
    # (NeMo's imports, the model load) its default action would end the process with a status other than 3, and
    # the job would not be requeued.
    install_early_stop()
    from laconic_nemo.runtime.run_lock import OutputDirLocked, check_free

    try:  # every rank, before anything is loaded: another live run holds run.output_dir
        check_free(cfg.run.output_dir)
    except OutputDirLocked as exc:
        print(f"laconic_nemo.nemo_entry: {exc}", file=sys.stderr)
        return 2
    if early_signal() is not None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # a lone process stops at once; the ranks of a multi-rank run go on to the trainer, which stops them together
        print(f"laconic_nemo.nemo_entry: stopped on signal {early_signal()} during start-up; nothing to save yet",
              file=sys.stderr)
        return 3
    if cfg.model.source != "nemo":
        from laconic_nemo.app.train_cli import pin_cpu_kernels, train

        try:  # a CPU run's kernels, as `laconic-nemo train` pins them, before the first one in this rank
            pin_cpu_kernels(cfg)
        except ConfigError as exc:
            print(f"laconic_nemo.nemo_entry: {exc}", file=sys.stderr)
            return 2
        return train(cfg)
    try:
        return train_nemo(cfg, nemo_ov)
    except (EndStringError, OutputDirLocked) as exc:  # OutputDirLocked: a run that started at the same time took it first
        print(f"laconic_nemo.nemo_entry: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
