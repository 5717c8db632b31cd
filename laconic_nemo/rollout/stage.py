"""One pipeline stage of a megatron-core ``GPTModel`` as the decode engine runs it: its own submodules called in
``TransformerLayer.forward``'s order (the list and the megatron-core lines are in :mod:`laconic_nemo.rollout.engine`),
the prefill and the one-token decode step over the static KV cache, and the TP / PP communication of a step.

:class:`Stage` owns this rank's part of the model (its layers, head layout, dtypes, device, TP / PP groups, RoPE
tables and fused layers); :class:`laconic_nemo.rollout.engine.DecodeEngine` composes it with the KV cache and the
per-row :class:`~laconic_nemo.rollout.slots.Slots`, which its methods are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laconic_nemo.rollout.fused import FusedLayer, column, rope_table, rotate, row_into
from laconic_nemo.rollout.fused import unsupported as why_not_fused
from laconic_nemo.rollout.kv_cache import StaticKVCache
from laconic_nemo.rollout.slots import Slots


def gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    """The TP shards of ``t`` side by side: [..., n] on each of the tp ranks of ``group`` -> [..., tp * n] (rank r's
    shard in columns r*n..(r+1)*n), megatron's ``_gather_along_last_dim`` (megatron-core 0.11,
    ``tensor_parallel/mappings.py:79-97``, what ``output_layer(..., runtime_gather_output=True)`` runs) through
    torch's ``all_gather_single``: torch 2.13 deprecates the ``all_gather_into_tensor`` megatron calls (older torch
    has only that). A copy of bytes, so the logits are megatron's bit for bit."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
    return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()


@dataclass
class PrefillPlan:
    """The prompts of a pass de-duplicated (GRPO repeats each prompt G times) and cut into forwards of at most
    ``prefill_tokens`` padded tokens, longest first (each forward as wide as its first prompt).

    texts: the distinct prompts; of_slot: the distinct prompt of each row; chunks: indices into ``texts`` per
    forward."""

    texts: list[tuple[int, ...]]
    of_slot: list[int]
    chunks: list[list[int]]

    @classmethod
    def of(cls, prompts: list[list[int]], prefill_tokens: int) -> PrefillPlan:
        uniq: dict[tuple[int, ...], int] = {}
        of_slot = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        texts = list(uniq)
        order = sorted(range(len(texts)), key=lambda u: -len(texts[u]))
        chunks, cur = [], []
        for u in order:  # longest first: each chunk is as wide as its first prompt
            if cur and (len(cur) + 1) * len(texts[cur[0]]) > prefill_tokens:
                chunks.append(cur)
                cur = []
            cur.append(u)
        chunks.append(cur)
        return cls(texts, of_slot, chunks)


class Stage:
    """This rank's stage of a megatron-core ``GPTModel``: embedding, RoPE, layers, final norm and logits; the prefill
    and the decode compute over a given KV cache and slots; the broadcasts and point-to-point hand-offs between
    ranks (no-ops at TP 1 / PP 1).

    model: the ``GPTModel`` (unwrapped); vocab_size: the real vocabulary (logits past it are dropped); fused: use
    the fused decode step (:mod:`laconic_nemo.rollout.fused`) where it serves the model (``EngineSettings.fused``).
    The TP / PP groups are megatron's ``parallel_state`` at construction."""

    def __init__(self, model, vocab_size: int, fused: bool = True):
        from megatron.core import parallel_state as ps

        self.model, self.vocab_size = model, int(vocab_size)
        m, cfg = model, model.config
        unsupported = [name for name, on in (
            ("multi_latent_attention", getattr(cfg, "multi_latent_attention", False)),
            ("num_moe_experts", getattr(cfg, "num_moe_experts", None)),
            ("context_parallel_size > 1", getattr(cfg, "context_parallel_size", 1) > 1),
            ("flash_decode", getattr(cfg, "flash_decode", False)),
            ("fp8", getattr(cfg, "fp8", None)),
        ) if on]
        if unsupported:
            raise ValueError(f"the decode engine does not support {', '.join(unsupported)}")
        self.layers = list(m.decoder.layers)
        if not self.layers:
            raise ValueError("the decode engine needs at least one transformer layer on every pipeline stage")
        attn = self.layers[0].self_attention
        self.heads = int(attn.num_attention_heads_per_partition)
        self.groups = int(attn.num_query_groups_per_partition)
        self.head_dim = int(attn.hidden_size_per_attention_head)
        self.scale = float(cfg.softmax_scale) if cfg.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.hidden = int(cfg.hidden_size)
        self.kv_dtype = attn.linear_qkv.weight.dtype
        self.hidden_dtype = torch.float32 if cfg.fp32_residual_connection else self.kv_dtype
        self.device = attn.linear_qkv.weight.device
        self.first, self.last = bool(m.pre_process), bool(m.post_process)
        self.final_norm = getattr(m.decoder, "final_layernorm", None) if self.last else None
        self.rope = m.position_embedding_type == "rope"
        self.max_positions = int(getattr(m, "max_position_embeddings", 0) or 0)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        if self.tp > 1:
            self._tp_group, self._tp_src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
        if self.pp > 1:
            self._pp_group = ps.get_pipeline_model_parallel_group()
            self._pp_last = ps.get_pipeline_model_parallel_last_rank()
            self._next = None if self.last else ps.get_pipeline_model_parallel_next_rank()
            self._prev = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        # the fused decode step (laconic_nemo/rollout/fused.py) where it serves the model, else the module calls
        self.unfused_reason = why_not_fused(m) if fused else "EngineSettings.fused = False"
        self.fused = self.unfused_reason is None
        self._fused_layers = [FusedLayer(layer) for layer in self.layers] if self.fused else []
        self._rope_cos: torch.Tensor | None = None  # [positions, rotary dim] float32
        self._rope_sin: torch.Tensor | None = None
        self._rope_tab: torch.Tensor | None = None  # [positions, 2, 2, rot]: fused.rope_table
        per = self.heads // self.groups
        self._slot_sel = torch.tensor([0] * (per + 1) + [1], dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ RoPE tables
    def set_rope(self, positions: int) -> None:
        """The RoPE tables of ``positions`` positions from the model's table (``GPTModel.rotary_pos_emb``: float32
        angles [positions, 1, 1, rot]): cos / sin for the prefill and the module path, the fused step's factors.
        Nothing for a model without RoPE."""
        if not self.rope:
            return
        freqs = self.model.rotary_pos_emb(positions).reshape(positions, -1)
        self._rope_cos, self._rope_sin = torch.cos(freqs), torch.sin(freqs)
        if self.fused:
            self._rope_tab = rope_table(freqs, bool(self.model.config.rotary_interleaved), self.kv_dtype)

    def free(self) -> None:
        """Drop the RoPE tables (:meth:`set_rope` builds them again)."""
        self._rope_cos = self._rope_sin = self._rope_tab = None

    # ------------------------------------------------------------------ the model's pieces
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, s] -> hidden [s, b, H] (``LanguageModelEmbedding.forward`` in eval mode)."""
        emb = self.model.embedding
        if self.tp == 1:
            return emb(input_ids=tokens, position_ids=positions)
        x = self.lookup(tokens)
        if emb.add_position_embedding:
            x = x + emb.position_embeddings(positions)
        x = x.transpose(0, 1).contiguous()
        if self.model.config.fp32_residual_connection:
            x = x.float()
        return emb.embedding_dropout(x)

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """Word embeddings of ``tokens`` (any shape) -> [..., H]: ``F.embedding`` at TP 1 (what
        ``VocabParallelEmbedding.forward`` runs there); at TP > 1 this rank's shard rows, zero for tokens outside it,
        all-reduced (capture-safe: no boolean indexing)."""
        we = self.model.embedding.word_embeddings
        if self.tp == 1:
            return F.embedding(tokens, we.weight)
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        local = tokens - we.vocab_start_index
        inside = (local >= 0) & (local < we.num_embeddings_per_partition)
        out = F.embedding(local.clamp(0, we.num_embeddings_per_partition - 1), we.weight)
        out = torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return reduce_from_tensor_model_parallel_region(out)

    def _rope(self, pos: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
        """(cos, sin) of the model's RoPE table at positions ``pos``, viewed as ``shape`` + (rotary dim,), in
        ``dtype``: once per step for every layer (megatron's ``_apply_rotary_pos_emb_bshd`` takes the cosine and
        sine of the same float32 angles in every call, ``rope_utils.py:118-119``)."""
        if self._rope_cos is None:
            return None
        d = self._rope_cos.shape[-1]
        return (self._rope_cos[pos].to(dtype).view(*shape, d), self._rope_sin[pos].to(dtype).view(*shape, d))

    def _rotate(self, t: torch.Tensor, rope) -> torch.Tensor:
        """megatron's ``_apply_rotary_pos_emb_bshd`` (``rope_utils.py:88-122``, not multi-latent) with the cosine
        and sine given: the same arithmetic, so the same bits."""
        if rope is None:
            return t
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half

        cos, sin = rope
        rot = cos.shape[-1]
        t, t_pass = t[..., :rot], t[..., rot:]
        t = (t * cos) + (_rotate_half(t, self.model.config.rotary_interleaved) * sin)
        return torch.cat((t, t_pass), dim=-1) if t_pass.shape[-1] else t

    def layer(self, layer, h: torch.Tensor, rope, attend) -> torch.Tensor:
        """One TransformerLayer on hidden [s, b, H] through its own modules; ``rope``: (cos, sin) or None;
        ``attend(q, k, v)`` -> context [s, b, heads * head_dim]."""
        fused = self.model.config.bias_dropout_fusion
        residual = h
        x = layer.input_layernorm(h)
        q, k, v = layer.self_attention.get_query_key_value_tensors(x)
        ctx = attend(self._rotate(q, rope), self._rotate(k, rope), v)
        h = layer.self_attn_bda(False, fused)(layer.self_attention.linear_proj(ctx), residual, layer.hidden_dropout)
        residual = h
        h = layer.mlp_bda(False, fused)(layer.mlp(layer.pre_mlp_layernorm(h)), residual, layer.hidden_dropout)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, H] -> float32 logits [s, b, V] over the real vocabulary, gathered over TP."""
        if self.final_norm is not None:
            h = self.final_norm(h)
        m = self.model
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight, runtime_gather_output=False)  # this rank's [s, b, V / TP]
        if self.tp > 1:
            logits = gather_last_dim(logits, self._tp_group)
        return logits[..., : self.vocab_size].float()

    # ------------------------------------------------------------------ communication (no-ops at TP 1 / PP 1)
    def tp_broadcast(self, b: int, tensors: list[torch.Tensor]) -> None:
        """Rows [0, b) of each of ``tensors`` from the TP group's source rank to the others (in place)."""
        if self.tp > 1:
            import torch.distributed as dist

            for t in tensors:
                dist.broadcast(t[:b], src=self._tp_src, group=self._tp_group)

    def pp_broadcast(self, b: int, tensors: list[torch.Tensor]) -> None:
        """Rows [0, b) of each of ``tensors`` from the last pipeline stage to the others (in place)."""
        if self.pp > 1:
            import torch.distributed as dist

            for t in tensors:
                dist.broadcast(t[:b], src=self._pp_last, group=self._pp_group)

    def send(self, t: torch.Tensor) -> None:
        """``t`` to the next pipeline stage."""
        import torch.distributed as dist

        dist.send(t.contiguous(), dst=self._next)

    def recv(self, t: torch.Tensor) -> None:
        """Into ``t`` from the previous pipeline stage."""
        import torch.distributed as dist

        dist.recv(t, src=self._prev)

    # ------------------------------------------------------------------ prefill
    def prefill(self, plan: PrefillPlan, b: int, pad: int, cache: StaticKVCache) -> torch.Tensor | None:
        """Fill the cache rows [0, n) (n = ``len(plan.of_slot)``) with the prompts' keys / values, one forward per
        ``plan.chunks``; return the logits [b, V] of each row's last prompt position on the last stage (zeros for
        slots >= n), None elsewhere."""
        texts, of_slot, n = plan.texts, plan.of_slot, len(plan.of_slot)
        logits_all = torch.zeros(b, self.vocab_size, dtype=torch.float32, device=self.device) if self.last else None
        for chunk in plan.chunks:
            where = {u: i for i, u in enumerate(chunk)}
            width = len(texts[chunk[0]])
            dest = [j for j in range(n) if of_slot[j] in where]
            dest_t = torch.tensor(dest, dtype=torch.long, device=self.device)
            src_t = torch.tensor([where[of_slot[j]] for j in dest], dtype=torch.long, device=self.device)
            U = len(chunk)
            if self.first:
                tok = torch.full((U, width), pad, dtype=torch.long)
                for i, u in enumerate(chunk):
                    tok[i, : len(texts[u])] = torch.tensor(texts[u], dtype=torch.long)
                tok = tok.to(self.device)
                h = self.embed(tok, torch.arange(width, device=self.device).unsqueeze(0).expand(U, width))
            else:
                h = torch.empty(width, U, self.hidden, dtype=self.hidden_dtype, device=self.device)
                self.recv(h)
            rope = self._rope(torch.arange(width, device=self.device), (width, 1, 1), self.kv_dtype)
            for li, layer in enumerate(self.layers):
                h = self.layer(layer, h, rope, self._prefill_attention(cache, li, dest_t, src_t))
            if not self.last:
                self.send(h)
                continue
            last_pos = torch.tensor([len(texts[u]) - 1 for u in chunk], device=self.device)
            h_last = h[last_pos, torch.arange(U, device=self.device)].unsqueeze(0)  # [1, U, H]
            logits_all[dest_t] = self.logits(h_last)[0][src_t]
        return logits_all

    def _prefill_attention(self, cache: StaticKVCache, li: int, dest: torch.Tensor, src: torch.Tensor):
        def attend(q, k, v):  # q [s, U, heads, d], k / v [s, U, groups, d]
            cache.write_prefix(li, dest, k.transpose(0, 1)[src], v.transpose(0, 1)[src])
            s, U = q.shape[0], q.shape[1]
            out = F.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True,
                scale=self.scale, enable_gqa=self.heads != self.groups)  # [U, heads, s, d]
            return out.permute(2, 0, 1, 3).reshape(s, U, self.heads * self.head_dim)

        return attend

    # ------------------------------------------------------------------ decode
    def decode(self, b: int, kv: int, slots: Slots, cache: StaticKVCache) -> torch.Tensor | None:
        """This stage's part of one decode step for slots [0, b) (their tokens, positions and cache rows; the
        received hidden state ``slots.hidden_in`` after the first stage), attention over positions [0, kv): logits
        [b, V] on the last stage; otherwise the hidden state goes to ``slots.hidden_out``. The fused step where it
        serves the model (:mod:`laconic_nemo.rollout.fused`), else the model's modules."""
        if self.fused:
            return self._decode_fused(b, kv, slots, cache)
        s = slots
        pos = s.pos[:b]
        if self.first:
            h = self.embed(s.tokens[:b].unsqueeze(1), pos.unsqueeze(1))  # [1, b, H]
        else:
            h = s.hidden_in[:b].unsqueeze(0)
        rope = self._rope(pos, (1, b, 1), self.kv_dtype)
        mask = (s.arange[:kv].unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, kv)
        rows = s.rows[:b]
        for li, layer in enumerate(self.layers):
            h = self.layer(layer, h, rope, self._decode_attention(cache, li, rows, pos, mask, b, kv))
        if not self.last:
            s.hidden_out[:b].copy_(h[0])
            return None
        return self.logits(h)[0]

    def _decode_attention(self, cache: StaticKVCache, li: int, rows, pos, mask, b: int, kv: int):
        g, per = self.groups, self.heads // self.groups

        def attend(q, k, v):  # q [1, b, heads, d], k / v [1, b, groups, d]
            cache.write(li, rows, pos, k[0], v[0])
            keys = cache.keys(li)[:b, :kv].transpose(1, 2)  # [b, groups, kv, d]
            vals = cache.values(li)[:b, :kv].transpose(1, 2)
            # megatron's GQA: query head i reads key-value group i // (heads / groups), so the heads of a group
            # become that group's query rows (one kernel call, no key / value expansion)
            qq = q[0].reshape(b, g, per, self.head_dim)
            out = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask, scale=self.scale)
            return out.reshape(1, b, self.heads * self.head_dim)

        return attend

    # ------------------------------------------------------------------ the fused decode step
    def _decode_fused(self, b: int, kv: int, slots: Slots, cache: StaticKVCache) -> torch.Tensor | None:
        """:meth:`decode` through :mod:`laconic_nemo.rollout.fused`: hidden [b, H] rows, the RoPE factors of the
        step's positions gathered once ([b, 1, heads per group + 2, rot]), an additive mask [b, 1, 1, kv] built
        once, each layer's residual updated in place."""
        s = slots
        pos, rows = s.pos[:b], s.rows[:b]
        if self.first:
            h = self.lookup(s.tokens[:b])
            emb = self.model.embedding
            if emb.add_position_embedding:
                h = h + emb.position_embeddings(pos)
        else:
            h = s.hidden_in[:b].clone()  # updated in place below; the received state stays for a graph's warm-up
        rope = None
        if self._rope_tab is not None:
            f = self._rope_tab[pos].index_select(2, self._slot_sel)  # [b, 2, slots, rot]
            rope = (f[:, 0].unsqueeze(1), f[:, 1].unsqueeze(1))
        mask = torch.zeros(b, kv, dtype=self.kv_dtype, device=self.device)
        mask.masked_fill_(s.arange[:kv].unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
        mask = mask.view(b, 1, 1, kv)
        for li, fl in enumerate(self._fused_layers):
            self._fused_layer(cache, li, fl, h, rope, mask, rows, pos, b, kv)
        if not self.last:
            s.hidden_out[:b].copy_(h)
            return None
        return self._fused_logits(h)

    def _fused_layer(self, cache: StaticKVCache, li: int, fl: FusedLayer, h: torch.Tensor, rope, mask, rows, pos,
                     b: int, kv: int) -> None:
        """One layer on hidden [b, H], in place (see :mod:`laconic_nemo.rollout.fused`)."""
        g, per, d = self.groups, self.heads // self.groups, self.head_dim
        x = h if fl.in_norm is None else fl.in_norm(h)
        qkv = column(fl.qkv, x).view(b, g, per + 2, d)  # megatron's per-group [q heads, k, v] layout
        if fl.q_norm is not None or fl.k_norm is not None:
            q, k, v = qkv[:, :, :per], qkv[:, :, per : per + 1], qkv[:, :, per + 1 :]
            qkv = torch.cat((q if fl.q_norm is None else fl.q_norm(q), k if fl.k_norm is None else fl.k_norm(k), v),
                            dim=2)
        r = qkv if rope is None else rotate(qkv, *rope, bool(self.model.config.rotary_interleaved))
        cache.write_kv(li, rows, pos, r[:, :, per:].permute(2, 0, 1, 3))  # [2, b, g, d]
        keys = cache.keys(li)[:b, :kv].transpose(1, 2)  # [b, g, kv, d]
        vals = cache.values(li)[:b, :kv].transpose(1, 2)
        ctx = F.scaled_dot_product_attention(r[:, :, :per], keys, vals, attn_mask=mask, scale=self.scale)
        row_into(fl.proj, ctx.reshape(b, self.heads * d), h, self.tp)
        fl.mlp_into(h if fl.pre_norm is None else fl.pre_norm(h), h, self.tp)

    def _fused_logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [b, H] -> float32 logits [b, V] over the real vocabulary, gathered over TP: one GEMM with the
        output (or tied embedding) weight where ``output_layer`` is megatron's bias-free ``ColumnParallelLinear``."""
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        if self.final_norm is not None:
            h = self.final_norm(h)
        m = self.model
        out = m.output_layer
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        if type(out) is ColumnParallelLinear and out.bias is None:
            logits = torch.mm(h, (out.weight if weight is None else weight).t())
        else:
            logits = out(h.unsqueeze(0), weight=weight, runtime_gather_output=False)[0][0]
        if self.tp > 1:
            logits = gather_last_dim(logits, self._tp_group)
        return logits[..., : self.vocab_size].float()
