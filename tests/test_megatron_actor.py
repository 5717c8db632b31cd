"""MegatronCoreActor on real megatron-core over gloo (2 processes per layout) against a float64 reference.

One spawned job per layout (TP=2 with a KL reference policy, PP=2, DP=2 at TP=1 with half the batch per rank)
runs every check and writes its measurements (tests/dist/actor_checks.py); the assertions live here. Log-probs
and training run on packed micro-batches (the default), and once on today's padded rows for comparison.
The float64 reference is a plain-torch GPT (tests/dist/reference_gpt.py) on the same unsharded weights,
so TP=2, PP=2 and DP=2 are each compared with the unsharded single-device computation.
"""

from __future__ import annotations

import actor_checks  # tests/dist (on sys.path through tests/conftest.py)
import pytest
import torch

LAYOUTS = ("tp2", "pp2", "dp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_actor")
    res = {}
    for layout in LAYOUTS:
        actor_checks.launch(layout, str(out))
        res[layout] = [torch.load(out / f"{layout}_rank{r}.pt", weights_only=False) for r in range(2)]
    return res


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_match_float64_reference(results, layout):
    for r in results[layout]:
        assert r["roundtrip_weights_err"] == 0.0  # shard/unshard of the weights is exact
        assert r["logprob_err"] < 5e-5
        assert r["logprob_past_end_max"] == 0.0  # nothing is scored past a row's end


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_step_matches_float64_reference(results, layout):
    for r in results[layout]:
        # loss of the GLOBAL batch (summed over micro-batches and, for dp2, over the two ranks)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-4, abs=1e-6)
        assert r["clip_fraction"] == pytest.approx(r["ref_clip_fraction"], abs=1e-6)
        assert 0 < r["clip_fraction"] < 1
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        # gradients after the global-norm clip (the reference norm is > grad_clip, so clipping is active)
        assert r["ref_grad_norm"] > 0.5
        assert r["grad_err"] < 1e-5 * r["grad_scale"] + 1e-7
        # the Adam update equals torch AdamW applied to the reference gradients
        assert r["update_err"] < 1e-3 * r["update_scale"]
    if layout == "dp2":
        assert results[layout][0]["dp_size"] == 2
        assert results[layout][0]["loss"] == results[layout][1]["loss"]  # metrics identical on every rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_and_unpacked_paths_agree(results, layout):
    """Packed micro-batches (several per rank; with PP 2 padded at their tails to one size) and today's padded
    rows give the same log-probs, loss and gradients, both within float32 rounding of the float64 reference."""
    for r in results[layout]:
        sizes, real = r["pack_sizes"], r["pack_real_tokens"]
        assert len(sizes) >= 2 and all(s <= actor_checks.MICRO_BATCH_TOKENS for s in real)
        if layout == "pp2":
            assert len(set(sizes)) == 1 and sum(real) < sum(sizes)  # fixed p2p shape, tails padded
        else:
            assert sizes == real  # no padding at all
        assert r["unpacked_logprob_err"] < 5e-5
        assert r["packed_vs_unpacked_logprob"] < 5e-5
        assert r["unpacked_loss"] == pytest.approx(r["ref_loss"], rel=1e-4, abs=1e-6)
        assert r["unpacked_grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        assert r["unpacked_grad_err"] < 1e-5 * r["grad_scale"] + 1e-7
        assert r["packed_vs_unpacked_grad"] < 1e-5 * r["grad_scale"] + 1e-7


def test_reference_policy_is_frozen_initial_weights(results):
    for r in results["tp2"]:
        assert r["ref_logprob_err_after_step"] < 5e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation(results, layout):
    eos, max_new = actor_checks.EOS, 30
    for r, g in [(r, r[key]) for r in results[layout] for key in ("gen", "dev_gen")]:
        assert r["gen_matches_float64_recompute"]  # KV-cached, TP-gathered sampling == float64 recompute
        assert r["dev_gen_matches_float64_recompute"]  # same for the device sampler with row compaction
        assert r["dev_gen_prefix_same"]  # a sample's tokens do not depend on the rest of the batch
        assert r["gen_same_seed"] and r["gen_other_seed_differs"] and r["gen_prefix_same"]
        assert r["gen_identical_across_ranks_of_dp_group"]
        stopped = ~g["truncated"]
        assert stopped.any() and g["truncated"].any()
        for i in range(len(g["lengths"])):
            p, n = int(g["prompt_lengths"][i]), int(g["response_lengths"][i])
            resp = g["tokens"][i, p : p + n]
            if g["truncated"][i]:
                assert n == max_new and g["lengths"][i] == max_new and not (resp == eos).any()
            else:
                assert resp[-1] == eos and not (resp[:-1] == eos).any() and g["lengths"][i] == n - 1
            assert (g["tokens"][i, p + n :] == eos).all()  # padded with the EOS id (pad_id None)
    # TP ranks (same DP rank) produce identical tokens; DP ranks use different random streams
    a, b = results[layout]
    for key in ("gen", "dev_gen"):
        if layout == "dp2":
            assert not torch.equal(a[key]["tokens"], b[key]["tokens"])
        else:
            assert torch.equal(a[key]["tokens"], b[key]["tokens"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_round_trip_is_bitwise(results, layout):
    for r in results[layout]:
        assert r["ckpt_step_changed_weights"]
        assert r["ckpt_bitwise"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_engine_equals_todays_sampler(results, layout):
    """The decode engine (the actor's ``generate``) against today's sampler loop on the same actor
    (tests/dist/engine_checks.py): equal tokens, lengths and truncation flags at TP 2, PP 2 and DP 2 x TP 1, for
    both samplers, prompts of different lengths in GRPO groups, EOS mid-batch, top-p < 1, compaction into smaller
    buckets, and in passes of 5 rows; the engine's log-probs agree with the training forward's. All through the
    fused decode step (rollout/fused.py: its row-parallel GEMMs all-reduced over TP, its hidden rows sent over PP)."""
    for r in results[layout]:
        e = r["engine"]
        assert e["fused"]
        assert r["gen_matches_reference_loop"]  # the first check's rollout too (after a GRPO step)
        for sampler in ("exact", "device"):
            assert e[f"{sampler}_equal"], sampler
            assert e[f"{sampler}_eos_and_truncated"] and e[f"{sampler}_compactions"] >= 1
        assert e["passes"] == 3 and e["passes_equal"]
        assert e["logprob_mismatch"] < 1e-4  # fp32 on CPU: the rollout / training log-prob mismatch
    a, b = (r["engine"] for r in results[layout])
    for sampler in ("exact", "device"):
        # model-parallel ranks return the same tokens; data-parallel ranks sample their own streams
        assert torch.equal(a[f"{sampler}_tokens"], b[f"{sampler}_tokens"]) == (layout != "dp2")


def test_decode_engine_tensor_parallel_pieces(results):
    """TP 2: the engine's capture-safe embedding lookup equals megatron's VocabParallelEmbedding bit for bit, and a
    model of the TransformerEngine layout (norms fused into linear_qkv / linear_fc1) samples today's tokens and
    reproduces its own full forward's log-probs."""
    for r in results["tp2"]:
        e = r["engine"]
        assert e["embedding_equal"] and e["te_has_fused_norm"] and e["te_fused"]
        assert e["te_equal"] and e["te_logprob_err"] < 2e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_calls_no_deprecated_torch_api(results, layout):
    """Building, stepping and sampling the actor raises no FutureWarning (printed to every user by default): e.g.
    the TP logits gather goes through torch.distributed.all_gather_single, not the deprecated
    all_gather_into_tensor of megatron's gather_from_tensor_model_parallel_region."""
    for r in results[layout]:
        assert [w for w in r["deprecations"] if w.startswith("FutureWarning")] == []
