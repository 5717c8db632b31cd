"""Bridge under tensor and pipeline parallelism (run with 2 processes over gloo):

    torchrun --nproc_per_node 2 tests/dist/bridge_parallel.py

Part 1, TP=2: logits of the sharded GPTModel (vocab shards all-gathered) equal transformers' logits;
export gathers bit-exactly the HF tensors; re-import of the export reproduces every shard bit-exactly.
Part 2, PP=2: the same through two pipeline stages (hidden states sent from stage 0 to stage 1).
Prints one "OK <part> <family> rank<r> <max abs logit diff>" line per check (and appends it to
``$BRIDGE_RESULT_DIR/rank<r>.txt`` when that variable is set); exits non-zero on failure.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from bridge_common import hf_checkpoint_tensors, tiny_hf_model  # this file's folder: sys.path[0] under torchrun

from laconic_nemo.bridge import arch_from_hf_config, export_hf_state_dict, load_hf_state_dict, model_provider
from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

FAMILIES = ["qwen2", "qwen2_tied", "qwen3", "llama"]
ATOL = 2e-5


def report(line: str) -> None:
    print(line, flush=True)
    out_dir = os.environ.get("BRIDGE_RESULT_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.txt"), "a") as f:
            f.write(line + "\n")


def check_export(model, arch, hf, tag):
    ref = hf_checkpoint_tensors(hf, arch.tie_word_embeddings)
    exported = export_hf_state_dict([model], arch)
    assert sorted(exported) == sorted(ref), (tag, sorted(set(exported) ^ set(ref)))
    for k, v in ref.items():
        assert torch.equal(exported[k], v), (tag, k)
    only0 = export_hf_state_dict([model], arch, dst=0)
    assert (len(only0) == len(ref)) if dist.get_rank() == 0 else only0 == {}
    return exported


def check_reimport(model, arch, exported, provider_args, tag):
    model2 = model_provider(arch, cpu=True)(*provider_args)
    load_hf_state_dict([model2], exported, arch)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), (tag, n1)


def tp_part():
    info = init_distributed(2, 1, seed=0)
    group = __import__("megatron.core.parallel_state", fromlist=["x"]).get_tensor_model_parallel_group()
    for fam in FAMILIES:
        cfg, hf = tiny_hf_model(fam)
        arch = arch_from_hf_config(cfg)
        model = model_provider(arch, cpu=True)(True, True).eval()
        load_hf_state_dict([model], hf.state_dict(), arch)
        qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
        assert qkv.shape[0] == (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim // 2
        ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
        pos = torch.arange(11).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            local = model(ids, pos, None)
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local.contiguous(), group=group)
            logits = torch.cat(parts, -1)[..., : arch.vocab_size]
            ref = hf(input_ids=ids).logits
        diff = (logits - ref).abs().max().item()
        assert diff <= ATOL, (fam, diff)
        exported = check_export(model, arch, hf, f"tp2/{fam}")
        check_reimport(model, arch, exported, (True, True), f"tp2/{fam}")
        report(f"OK tp2 {fam} rank{info.rank} {diff:.2e}")


def pp_part():
    info = init_distributed(1, 2, seed=0)
    first, last = info.is_first_stage, info.is_last_stage
    for fam in FAMILIES:
        cfg, hf = tiny_hf_model(fam)
        arch = arch_from_hf_config(cfg)
        model = model_provider(arch, cpu=True)(first, last).eval()
        assert len(model.decoder.layers) == arch.num_layers // 2
        load_hf_state_dict([model], hf.state_dict(), arch)
        ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
        pos = torch.arange(11).unsqueeze(0).expand(2, -1)
        diff = 0.0
        with torch.no_grad():
            if first:
                hidden = model(ids, pos, None)  # [s, b, H]
                dist.send(hidden.contiguous(), dst=1)
            else:
                hidden = torch.empty(11, 2, arch.hidden_size)
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                logits = model(None, pos, None)[..., : arch.vocab_size]
                diff = (logits - hf(input_ids=ids).logits).abs().max().item()
                assert diff <= ATOL, (fam, diff)
        exported = check_export(model, arch, hf, f"pp2/{fam}")
        check_reimport(model, arch, exported, (first, last), f"pp2/{fam}")
        report(f"OK pp2 {fam} rank{info.rank} {diff:.2e}")


def main():
    torch.set_num_threads(1)
    tp_part()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    pp_part()
    destroy_distributed()


if __name__ == "__main__":
    main()
