"""The CPU-checkable side of the vLLM rollout engine: the weight stream and the output assembly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
from bridge_common import tiny_hf_model  # noqa: E402

from laconic_nemo.bridge import arch_from_hf_config, hf_shapes, load_hf_state_dict, model_provider  # noqa: E402
from laconic_nemo.rollout.vllm import (  # noqa: E402
    VLLMRolloutEngine,
    build_generation_output,
    sampling_from_recipe,
    stream_policy_weights,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dist1():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    yield init_distributed(1, 1, seed=0)
    destroy_distributed()


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3"])
def test_weight_stream_refits_a_hf_model(dist1, family):
    """Stream a megatron policy into a differently initialised HF model through the same sink signature as
    vLLM's ``load_weights(weights: Iterable[(name, tensor)])``; the receiver then computes the policy's logits."""
    cfg, hf = tiny_hf_model(family, seed=0)
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True).eval()
    load_hf_state_dict([model], hf.state_dict(), arch)
    _, receiver = tiny_hf_model(family, seed=1)
    seen = {}

    def load_weights(weights):
        sd = receiver.state_dict()
        for name, t in weights:
            seen[name] = tuple(t.shape)
            with torch.no_grad():
                sd[name].copy_(t)

    n = stream_policy_weights([model], arch, load_weights, dtype=torch.float32)
    assert seen == hf_shapes(arch) and n == len(seen)
    ids = torch.randint(0, arch.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(receiver(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_weight_stream_is_drained_when_the_sink_stops_early(dist1):
    cfg, hf = tiny_hf_model("llama")
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True)
    n = stream_policy_weights([model], arch, lambda it: next(iter(it)))
    assert n == len(hf_shapes(arch))


def test_build_generation_output_layout():
    eos, L = 9, 4
    out = build_generation_output(
        prompts=[[1, 2], [3], [4, 5, 6]],
        responses=[[7, eos], [7, 7, 7, 7], [8]],  # EOS present / truncated / stop without EOS in ids
        finish_reasons=["stop", "length", "stop"], eos_id=eos, max_new_tokens=L, pad_id=0)
    assert out.tokens.tolist() == [[1, 2, 7, eos, 0], [3, 7, 7, 7, 7], [4, 5, 6, 8, eos]]
    assert out.prompt_lengths.tolist() == [2, 1, 3]
    assert out.response_lengths.tolist() == [2, 4, 2]
    assert out.lengths.tolist() == [1, L, 1]
    assert out.truncated.tolist() == [False, True, False]
    with pytest.raises(ValueError, match="finish_reason"):
        build_generation_output([[1]], [[2]], ["abort"], eos, L)
    with pytest.raises(ValueError, match="max_new_tokens"):
        build_generation_output([[1]], [[2] * 5], ["length"], eos, L)


def test_engine_needs_vllm_and_reads_recipe():
    from laconic_nemo.config import build_config

    cfg = build_config({"rollout": {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 4096}})
    s = sampling_from_recipe(cfg, eos_id=5, seed=3)
    assert (s.temperature, s.top_p, s.max_new_tokens, s.eos_id, s.seed) == (0.6, 0.95, 4096, 5, 3)
    arch = arch_from_hf_config(tiny_hf_model("qwen2")[0])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMRolloutEngine("x", arch, gpu_memory_utilization=1.5)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="rollout.engine=megatron"):
            VLLMRolloutEngine("x", arch)
    # a rank without an engine still takes part in the export but cannot generate
    idle = VLLMRolloutEngine("x", arch, owns_engine=False)
    with pytest.raises(RuntimeError, match="owns no vLLM engine"):
        idle.generate([[1]], s)
