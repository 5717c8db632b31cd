"""One rank of the NeMo entry point (``laconic_nemo.app.nemo_entry.main``) on CPU, for tests/test_nemo_cluster.py.

The run is NeMo's and NeMo-Aligner's own start-up (``load_from_nemo``, the PyTorch Lightning trainer,
``init_distributed``, ``init_using_ptl``) over gloo; only what NeMo 2.2.1 cannot do without a GPU, Transformer
Engine or apex is stood in for, nothing of the model or the trainer: the stand-ins of
``tests/test_nemo_aligner._nemo_gpt_model`` (BERT model list, local layer spec, megatron-core's
``set_defaults_if_not_set_tensor_model_parallel_attributes``, ``HAVE_APEX`` for ``NLPDDPStrategy``), the CUDA
shims of ``tests/test_nemo_cluster._cpu_stand_ins``, ``setup_transformer_engine_cp_groups`` (a CUDA stream for TE's
context parallelism), apex's ``listify_model`` and norm classes (read when the optimiser's parameter groups are
built) and apex's ``distributed_fused_adam`` (torch's AdamW, without the three keys only it takes).

``SIGNAL_RANK``: that rank sends itself SIGUSR1 when the model starts loading (Slurm's notice during start-up).

``STOP_RANK``: once the process groups exist (where the entry point takes the output folder's lock), that rank
stops (SIGSTOP: frozen with its connections open, as a rank that died under NCCL looks to the others; a killed
rank's closed sockets would end a gloo collective at once) and every other rank enters an all-reduce on megatron's
data-parallel group (made by NeMo's ``init_model_parallel``), then on the default group (made by Lightning), prints
how long each waited (``collective on the <group> group failed after <s> s``) and raises the last failure, which
ends the rank as a failed collective of the entry point would.

    RANK=r WORLD_SIZE=2 ... python tests/dist/nemo_entry_rank.py RECIPE key=value ... nemo.key=value ...
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def stand_ins(patch) -> None:
    import nemo.collections.nlp.models.language_modeling.megatron_gpt_model as gpt_module
    import nemo.collections.nlp.models.nlp_model as nlp_model
    import nemo.collections.nlp.modules.common.megatron.build_model as build_module
    import nemo.collections.nlp.modules.common.megatron.utils as megatron_utils
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
    from nemo.collections.nlp.models.language_modeling.megatron_base_model import MegatronBaseModel
    from nemo.collections.nlp.parts import nlp_overrides

    from tests.test_nemo_cluster import _cpu_stand_ins

    def local_spec(spec_name, transformer_config=None, use_te=True, hyena_cfg=None, fp8=False):
        return get_gpt_layer_local_spec(transformer_config.num_moe_experts, transformer_config.moe_grouped_gemm)

    _cpu_stand_ins(patch)
    os.environ["NVIDIA_PYTORCH_VERSION"] = "25.02"
    patch.setattr(nlp_model, "get_megatron_pretrained_bert_models", lambda: [])
    patch.setattr(gpt_module, "get_specs", local_spec)
    patch.setattr(build_module, "set_defaults_if_not_set_tensor_model_parallel_attributes",
                  set_defaults_if_not_set_tensor_model_parallel_attributes, raising=False)
    patch.setattr(nlp_overrides, "HAVE_APEX", True)
    patch.setattr(MegatronBaseModel, "setup_transformer_engine_cp_groups", lambda self: None)
    patch.setattr(megatron_utils, "listify_model", lambda m: m if isinstance(m, list) else [m], raising=False)
    for name in ("FusedLayerNorm", "FastLayerNorm", "MixedFusedRMSNorm"):  # no module here is one of apex's norms
        patch.setattr(megatron_utils, name, type(name, (), {}), raising=False)


def stuck_in_collectives() -> None:
    """An all-reduce on megatron's data-parallel group, then on the default group, with a rank that never joins:
    each must fail after ``parallel.collective_timeout_s``. Prints how long each waited; raises the last failure."""
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    failure = None
    for name, group in (("data-parallel", parallel_state.get_data_parallel_group()), ("default", None)):
        t0, how = time.monotonic(), "returned"
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except Exception as exc:  # noqa: BLE001 - torch's DistBackendError / gloo's RuntimeError
            failure, how = exc, "failed"
        print(f"collective on the {name} group {how} after {time.monotonic() - t0:.1f} s", flush=True)
    if failure is not None:
        raise failure


def main() -> int:
    from _pytest.monkeypatch import MonkeyPatch
    from omegaconf import open_dict

    patch = MonkeyPatch()  # this process only
    stand_ins(patch)
    from laconic_nemo.actors import nemo_aligner

    nemo_aligner.actor_model_class()  # stubs TRT-LLM before nemo_aligner's modules are imported
    import nemo_aligner.utils.utils as aligner_utils

    import laconic_nemo.app.nemo_entry as entry

    load = aligner_utils.load_from_nemo

    def load_from_nemo(*args, **kwargs):
        if os.environ.get("SIGNAL_RANK") == os.environ["RANK"]:
            os.kill(os.getpid(), signal.SIGUSR1)
        return load(*args, **kwargs)

    build = entry.build_nemo_config

    def build_nemo_config(*args, **kwargs):
        ncfg = build(*args, **kwargs)
        with open_dict(ncfg):
            ncfg.model.optim.name = "adamw"
            for key in ("bucket_cap_mb", "overlap_grad_sync", "contiguous_grad_buffer"):
                ncfg.model.optim.pop(key)
        return ncfg

    patch.setattr(aligner_utils, "load_from_nemo", load_from_nemo)
    if os.environ.get("STOP_RANK") is not None:
        import laconic_nemo.runtime.run_lock as run_lock

        hold = run_lock.hold_output_dir

        def hold_output_dir(output_dir, rank):
            if str(rank) == os.environ["STOP_RANK"]:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                stuck_in_collectives()
            return hold(output_dir, rank)

        patch.setattr(run_lock, "hold_output_dir", hold_output_dir)
    patch.setattr(entry, "build_nemo_config", build_nemo_config)
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
