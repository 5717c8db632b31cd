"""The megatron-core actor on the Hugging Face bridge path at DP=2 (2 processes over gloo) against a float64
transformers reference, with log-probs at the sampling temperature (tests/dist/bridge_dp_checks.py).

Gradients must be SUMMED over DP (the shared loss is normalised by global counts). megatron-core 0.11 fixes
the DDP reduction scale when ``DistributedDataParallel`` is constructed
(``megatron/core/distributed/distributed_data_parallel.py:228-243``: ``gradient_scaling_factor = 1.0`` if
``config.calculate_per_token_loss`` else ``1.0 / data_parallel_world_size``), so the flag must be on the
bridge's TransformerConfig before the wrapper is built.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

import bridge_dp_checks  # noqa: E402

from tests.hf_fixtures import save_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge_dp")
    hf = save_tiny_qwen2(root / "hf", hidden=32, layers=2, seed=4)
    bridge_dp_checks.launch(hf, str(root))
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_logprobs_at_the_sampling_temperature_match_float64(results):
    for r in results:
        assert r["dp_size"] == 2
        assert r["logprob_err"] < 5e-5
        assert r["logprob_t1_gap"] > 1e-2  # temperature 1 would give other numbers


def test_gradients_are_summed_over_dp_on_the_bridge_path(results):
    for r in results:
        assert r["calculate_per_token_loss"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-4, abs=1e-6)
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-4)  # averaged would be half
        for name, err in r["grad_err"].items():
            assert err < 1e-4 * r["grad_scale"][name] + 1e-7, name
