"""What the GPU benchmarks (gpu_step.py, its rollout and training parts, paper_step.py, plain_decode.py) share:
the model shapes, the data-sheet limits, the FLOP count and the small helpers (synchronise, free, sizes, the
actor built from a shape)."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dist"))  # reference_loop: today's loop, the baseline of the engine rows

SHAPES = {
    # Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B): 1.54 B parameters, tied embeddings, GQA 12/2 heads
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_layers=28, num_attention_heads=12,
                         num_kv_heads=2, head_dim=128, ffn_hidden_size=8960, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
    # the same layout at ~0.1 B parameters
    "small": dict(model_type="qwen2", hidden_size=512, num_layers=8, num_attention_heads=8, num_kv_heads=2,
                  head_dim=64, ffn_hidden_size=2048, vocab_size=151936, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
    # DeepSeek-R1-Distill-Qwen-1.5B (its config.json: Qwen2, untied output, rope_theta 10000)
    "deepseek-1.5b": dict(model_type="qwen2", hidden_size=1536, num_layers=28, num_attention_heads=12,
                          num_kv_heads=2, head_dim=128, ffn_hidden_size=8960, vocab_size=151936,
                          max_position_embeddings=131072, rope_theta=1e4, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, qkv_bias=True, qk_norm=False),
    # CPU smoke shapes
    "tiny-untied": dict(model_type="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                        head_dim=16, ffn_hidden_size=128, vocab_size=512, max_position_embeddings=2048,
                        rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=False),
    "tiny": dict(model_type="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 head_dim=16, ffn_hidden_size=128, vocab_size=512, max_position_embeddings=2048,
                 rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
}
H100_BF16_PEAK = 989e12  # H100 SXM dense bf16, data sheet
H100_HBM_TBS = 3.35  # H100 SXM HBM3, data sheet (../shared/gpu/README.md)
PAPER_STEPS, PAPER_GPUS, PAPER_ROWS_PER_GPU, PAPER_OPT_STEPS = 500, 16, 48, 4  # deepseek_1.5b_b1500.yaml, DP 16


def hf_config(arch) -> dict:
    """The Hugging Face config.json of ``arch`` (qwen2)."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "intermediate_size": arch.ffn_hidden_size, "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.rms_norm_eps, "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu", "use_sliding_window": False, "attention_dropout": 0.0,
    }


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def params_count(arch) -> int:
    h, f, v, L = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.num_layers
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    attn = h * (q + 2 * kv) + (q + 2 * kv) * arch.qkv_bias + q * h
    layer = attn + 3 * h * f + 2 * h
    return L * layer + v * h * (1 if arch.tie_word_embeddings else 2) + h


def train_flops(arch, lengths: list[int]) -> float:
    """Model FLOPs of forward + backward for sequences of ``lengths`` tokens: 6 x (non-embedding params +
    output layer) per token, plus causal attention 6 x 2 x L x s^2/2 x heads x head_dim per sequence."""
    n_dense = params_count(arch) - arch.vocab_size * arch.hidden_size  # the embedding lookup is no matmul
    n_dense += arch.vocab_size * arch.hidden_size  # the output projection is
    tokens = sum(lengths)
    attn = sum(6 * 2 * arch.num_layers * (s * s / 2) * arch.num_attention_heads * arch.head_dim for s in lengths)
    return 6.0 * n_dense * tokens + attn


def matmul_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def size(gib: float) -> str:
    from laconic_nemo.actors.memory import size as _size

    return _size(gib)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def free(*objs):
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_actor(arch, attention: str, device, dtype, args):
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.bridge.megatron import actor_kwargs
    from laconic_nemo.runtime.megatron_env import init_distributed

    info = init_distributed(1, 1, backend="auto", seed=0)
    kw = actor_kwargs(arch, 1, 1, cpu=device.type != "cuda", dtype=dtype, attention=attention)
    return MegatronCoreActor(info, **kw, lr=1e-6, micro_batch_size=args.micro_batch, kl_beta=0.0,
                             sampler="device", sort_by_length=True, micro_batch_tokens=args.micro_batch_tokens)


def recompute_setting(setting: str, num_layers: int) -> int | None:
    """``grpo.recompute_layers`` for a command-line setting: ``auto`` (None: chosen by memory), ``all`` or N."""
    if setting == "auto":
        return None
    return num_layers if setting == "all" else int(setting)


def recompute_label(layers: int, num_layers: int, setting: int | None) -> str:
    how = "by memory: " if setting is None else ""
    return f"{how}no recompute" if layers == 0 else f"{how}recompute {layers}/{num_layers} layers"


def copy_bandwidth_tbs(device) -> float:
    """A device-to-device copy of 256 MiB (read + write), TB/s."""
    n = 64 * 2**20
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 5 * 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e12


def bound_tok_s(weight_bytes: int, kv_bytes_per_token: int, rows: int, mean_cached: float, tbs: float) -> float:
    """Decode upper bound: each step reads the weights once and every row's cached keys / values."""
    return rows * tbs * 1e12 / (weight_bytes + rows * mean_cached * kv_bytes_per_token)
