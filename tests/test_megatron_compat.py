"""The calls megatron-core makes into project code, in the form of every release the project runs on
(laconic_nemo.runtime.megatron_compat: 0.11.0, 0.16.1, 0.19.2), and the installed release against its record.

Each adapter is called in every recorded form, so one written for a single release fails here whichever release is
installed; the record itself is checked against the installed release's source (its lines and the names that
stand there). The main tier runs these on 0.16.1, the ``nemo`` tier's venv on 0.11.0 (.ci/run), and GPU hosts on
0.19.2.
"""

from __future__ import annotations

import ast
import inspect
import types
import warnings
from pathlib import Path

import pytest
import torch

from laconic_nemo.runtime import megatron_compat as compat
from laconic_nemo.runtime.kernels import SDPAttention, fusion_flags

TABLES = {"core attention": compat.CORE_ATTENTION_CALL, "finalize_model_grads_func": compat.FINALIZE_CALL,
          "GPTModel.forward": compat.GPT_FORWARD, "TE spec": compat.TE_SPEC_LOOKUP, "glu": compat.GLU_PRODUCT}


@pytest.fixture(scope="module")
def dist1():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    info = init_distributed(1, 1, backend="gloo", seed=0)
    yield info
    destroy_distributed()


def megatron_source(path: str) -> Path:
    import megatron.core

    return Path(megatron.core.__file__).parent / path


def calls_in(path: str, matches) -> list[ast.Call]:
    """The calls in the installed ``megatron/core/<path>`` for which ``matches(call)`` holds, in source order."""
    tree = ast.parse(megatron_source(path).read_text())
    return sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and matches(n)), key=lambda n: n.lineno)


def test_every_release_is_recorded_and_the_installed_one_is_one_of_them():
    assert compat.installed_release() in compat.RELEASES, (
        f"megatron-core {compat.installed_release()} is installed; laconic_nemo/runtime/megatron_compat.py records "
        f"{compat.RELEASES}: read that release's sources and record its calls")
    for name, table in TABLES.items():
        assert tuple(table) == compat.RELEASES, name


def test_every_pinned_release_is_recorded():
    """pyproject's ``megatron`` extra (one pin per Python range), the ``nemo`` tier's venv and the GPU wheelhouse
    (which reads the Python >= 3.12 pin) name recorded releases only."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]
    extra = re.search(r"^megatron = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M).group(1)
    pins = dict(re.findall(r'"megatron-core==([\d.]+); python_version ([<>=]+ \'3\.12\')"', extra))
    assert set(pins.values()) == {"< '3.12'", ">= '3.12'"} and set(pins) <= set(compat.RELEASES), extra
    nemo = re.findall(r"megatron-core==([\d.]+)", (root / "containers" / "cpu_nemo_venv.sh").read_text())
    assert nemo and set(nemo) <= set(compat.RELEASES), nemo
    script = (root / "scripts" / "gpu_wheelhouse.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("pinned="))
    read = subprocess.run(["bash", "-c", f'{line}; echo "$pinned"'], cwd=root, capture_output=True, text=True)
    assert read.stdout.split() == [v for v, rng in pins.items() if rng.startswith(">=")], read


@pytest.mark.parametrize("table", list(TABLES))
def test_the_installed_release_is_where_its_record_says(table):
    """Every cited span of the installed release holds the names recorded for it (a shifted or renamed line
    fails)."""
    site = TABLES[table][compat.installed_release()]
    lines = megatron_source(site.path).read_text().splitlines()
    text = "\n".join("\n".join(lines[a - 1:b]) for a, b in site.spans)
    missing = [n for n in site.names if n not in text]
    assert not missing, (site.cite(), missing, text)


# ------------------------------------------------------------------------------------------------ (a) core attention
def _tiny_config(heads=4, groups=2, head_dim=8):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, **fusion_flags(on_gpu=False))


class _Group:
    """A process group's size (all a core attention reads of its ``pg_collection``)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _core_attention_keywords(release: str, config, tp: int) -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    values = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                  cp_comm_type=None, softmax_scale=None, pg_collection=types.SimpleNamespace(tp=_Group(tp)))
    return {k: values[k] for k in compat.CORE_ATTENTION_CALL[release].names}


@pytest.mark.parametrize("release", compat.RELEASES)
def test_sdpa_core_attention_takes_each_release_s_constructor_call(dist1, release):
    """SDPAttention built as each release's SelfAttention builds its core attention (megatron_compat's
    CORE_ATTENTION_CALL: 0.11.0 attention.py:110-118, 0.16.1 :318-326, 0.19.2 :382-390); where a
    ``pg_collection`` is handed, its TP group sets the heads per rank (here a group of 2 in a one-process world:
    half the heads)."""
    kw = _core_attention_keywords(release, _tiny_config(), tp=2)
    attn = SDPAttention(**kw)
    expect = (2, 1) if "pg_collection" in kw else (4, 2)  # heads, groups on this rank
    assert (attn.heads, attn.groups) == expect
    q, k, v = torch.randn(5, 1, attn.heads, 8), torch.randn(5, 1, attn.groups, 8), torch.randn(5, 1, attn.groups, 8)
    assert attn(q, k, v, None).shape == (5, 1, attn.heads * 8)


def test_the_installed_self_attention_builds_the_core_attention_as_recorded(dist1):
    """The installed SelfAttention's call, read from its source and made for real: the keywords are the recorded
    ones, and the SDPAttention it builds is what runs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    site = compat.CORE_ATTENTION_CALL[compat.installed_release()]

    def builds_core_attention(call):  # submodules.core_attention(config=...) or build_module(<that>, config=...)
        f = call.func
        if isinstance(f, ast.Name) and f.id == "build_module" and call.args:
            f = call.args[0]
        return isinstance(f, ast.Attribute) and f.attr == "core_attention" and "config" in {k.arg for k in
                                                                                            call.keywords}

    found = calls_in(site.path, builds_core_attention)
    assert [(c.lineno, c.end_lineno) for c in found] == list(site.spans)
    assert [tuple(k.arg for k in c.keywords) for c in found] == [site.names]

    seen = []

    class Recording(SDPAttention):
        def __init__(self, *args, **kwargs):
            seen.append((args, tuple(kwargs)))
            super().__init__(*args, **kwargs)

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = Recording
    model = GPTModel(config=_tiny_config(), transformer_layer_spec=spec, vocab_size=16, max_sequence_length=8,
                     position_embedding_type="rope")
    assert seen == [((), site.names)]
    out = model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], None)
    assert out.shape == (1, 3, 16) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------- (b) finalize_model_grads
@pytest.mark.parametrize("release", compat.RELEASES)
def test_the_grad_finalizer_takes_each_release_s_schedule_call(release):
    """The schedules' call (FINALIZE_CALL: 0.11.0 schedules.py:493-495,1475-1477,1877-1879 with two positional
    arguments; 0.16.1 :680-685,1919-1924,2311-2316 and 0.19.2 :839-844,2065-2070,2459-2464 adding
    ``pg_collection=`` and ``force_all_reduce=``) reaches megatron's finalize with no token count (gradients stay
    summed) and the keywords handed on."""
    got = []
    finalize = compat.summed_grads_finalizer(lambda model, num_tokens, **kw: got.append((model, num_tokens, kw)))
    chunks = [torch.nn.Linear(1, 1)]
    keywords = {name: object() for name in compat.FINALIZE_CALL[release].names}
    finalize(chunks, torch.tensor(17), **keywords)
    assert got == [(chunks, None, keywords)]


def test_the_installed_schedules_call_the_finalizer_as_recorded():
    site = compat.FINALIZE_CALL[compat.installed_release()]
    found = calls_in(site.path, lambda c: isinstance(c.func, ast.Attribute)
                     and c.func.attr == "finalize_model_grads_func")
    assert [(c.lineno, c.end_lineno) for c in found] == list(site.spans)
    assert {(len(c.args), tuple(k.arg for k in c.keywords)) for c in found} == {(2, site.names)}
    # megatron's own finalize_model_grads takes what its schedules pass
    from megatron.core.distributed import finalize_model_grads

    params = inspect.signature(finalize_model_grads).parameters
    assert set(site.names) <= set(params) and list(params)[:2] == ["model", "num_tokens"]


# ------------------------------------------------------------------------------------ (c) forward with a KV cache
class _Forward011(torch.nn.Module):
    """GPTModel.forward's parameters in 0.11.0 (gpt_model.py:195-205): the cache as ``inference_params``."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_params=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None):
        return ("cache", inference_params, "gathered", runtime_gather_output)


class _Forward016(torch.nn.Module):
    """GPTModel.forward's parameters in 0.16.1 (gpt_model.py:470-482; 0.19.2 :519-531 has the same ones, more
    after): ``inference_context``, ``inference_params`` deprecated with a warning (utils.py:478-486), and the gather
    asserted in inference (0.16.1 :584-586)."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None,
                *, inference_params=None, loss_mask=None):
        if inference_context is None and inference_params is not None:
            warnings.warn("`inference_params` renamed to `inference_context`", stacklevel=2)
            inference_context = inference_params
        if inference_context is not None and not self.training:
            assert runtime_gather_output, "Inference must always gather TP logits"
        return ("cache", inference_context, "gathered", runtime_gather_output)


@pytest.mark.parametrize("release", compat.RELEASES)
def test_kv_cache_forward_passes_the_cache_and_gathers_on_each_release(release):
    """The cache under the keyword each release's forward names (GPT_FORWARD) and the gather asked for, so neither
    0.16.1's assertion nor the deprecation warning is met; through a wrapper too (megatron's DDP)."""
    model = (_Forward011 if release == "0.11.0" else _Forward016)().eval()
    sig = inspect.signature(model.forward).parameters
    assert set(compat.GPT_FORWARD[release].names) <= set(sig)
    cache = object()
    class Wrapped(torch.nn.Module):  # hands everything to .module, as megatron's DDP does
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in (model, Wrapped(model)):
            assert compat.kv_cache_forward(m, torch.zeros(1, 1), torch.zeros(1, 1), None, cache) == \
                ("cache", cache, "gathered", True)


def test_kv_cache_forward_on_the_installed_gpt_model_matches_a_full_forward(dist1):
    """The installed GPTModel over megatron's own KV cache (prefill, then one position at a time) gives the last
    position's logits of a forward over the whole sequence without a cache, with no deprecation warning."""
    from megatron.core.inference_params import InferenceParams
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    cfg = _tiny_config()
    cfg.params_dtype = torch.float64
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                     max_sequence_length=16, position_embedding_type="rope").double().eval()
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    n, prompt = tokens.shape[1], 4
    with torch.no_grad():
        full = model(tokens, torch.arange(n)[None], None)[0, :, :].float()
        cache = InferenceParams(max_batch_size=1, max_sequence_length=n)
        steps = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
            for start, stop in [(0, prompt)] + [(i, i + 1) for i in range(prompt, n)]:
                out = compat.kv_cache_forward(model, tokens[:, start:stop], torch.arange(start, stop)[None], None,
                                              cache)
                cache.sequence_len_offset += stop - start
                steps.append(out[0, -1].float())
    torch.testing.assert_close(torch.stack(steps), full[prompt - 1:], rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------ (d) the TE spec
def test_the_te_spec_reads_the_stand_ins_where_the_installed_release_looks_and_restores_them():
    """The spec takes TE's classes from the module TE_SPEC_LOOKUP records for the installed release (gpt_layer_specs
    in 0.11.0; TESpecProvider's module in 0.16.1 and 0.19.2); every patched name is restored afterwards."""
    import importlib
    import importlib.util

    import megatron.core.models.gpt.gpt_layer_specs as specs

    site = compat.TE_SPEC_LOOKUP[compat.installed_release()]
    provider = site.path == "extensions/transformer_engine_spec_provider.py"
    assert (importlib.util.find_spec(compat.TE_SPEC_PROVIDER) is not None) == provider
    target = importlib.import_module(compat.TE_SPEC_PROVIDER) if provider else specs
    before = {n: getattr(target, n, None) for n in (*compat.TE_SPEC_NAMES, "is_te_min_version")}
    spec_before = getattr(specs, "TESpecProvider", "absent")
    markers = {n: type(n, (), {}) for n in compat.TE_SPEC_NAMES}
    attn = compat.transformer_engine_layer_spec(markers).submodules.self_attention.submodules
    assert (attn.linear_qkv, attn.core_attention, attn.linear_proj) == (
        markers["TELayerNormColumnParallelLinear"], markers["TEDotProductAttention"], markers["TERowParallelLinear"])
    assert {n: getattr(target, n, None) for n in before} == before
    assert getattr(specs, "TESpecProvider", "absent") == spec_before


# ------------------------------------------------------------------------------------------------ (e) the unfused glu
@pytest.mark.parametrize("release", compat.RELEASES)
def test_the_glu_offset_sum_follows_each_release_s_config(release):
    """Each release's TransformerConfig has glu_linear_offset exactly where its glu adds it (the recorded source),
    and the adapter reads that from the config alone."""
    adds = "glu_linear_offset" in " ".join(compat.GLU_PRODUCT[release].names)
    config = types.SimpleNamespace(glu_linear_offset=0.0) if adds else types.SimpleNamespace()
    assert compat.glu_keeps_offset_sum(config) is adds
    assert adds == (release != "0.11.0")


def test_the_installed_glu_keeps_the_offset_sum_as_the_adapter_says(dist1):
    """On the installed release: the unfused gated MLP's forward keeps one more tensor of the MLP's width when the
    adapter says it adds the offset (autograd's saved tensors of MLP.forward, bias_activation_fusion off)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    config = _tiny_config()
    config.gated_linear_unit, config.activation_func, config.ffn_hidden_size = True, F.silu, 24
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(5, 1, config.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    ffn = 5 * config.ffn_hidden_size * 4  # one [5, 1, ffn] float32 tensor
    width = sum(n for n in seen.values() if n != x.numel() * 4) / ffn  # the fc1 output (2 ffn), the factors
    assert width == 4 + int(compat.glu_keeps_offset_sum(config)), (seen, width)
