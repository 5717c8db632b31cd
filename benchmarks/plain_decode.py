"""A plain graphed decode step: the in-process baseline of the decode engine in ``gpu_step.py --profile``.

    python benchmarks/plain_decode.py --device cuda --rows 64,256 --kv 768   # alone: ms / step, kernels / step

What a short plain-PyTorch decoder does per token at a model's shape (random weights; bf16 on a GPU): embedding;
per layer ``F.rms_norm``, one ``addmm`` for q | k | v (+ bias), RoPE by the rotate-half formula on q and k, keys
and values written with ``index_copy_`` at the step's position, ``scaled_dot_product_attention`` over ``[0, kv)``
(GQA by ``enable_gqa``), the output projection and the SwiGLU MLP with residual adds; final norm, logits and a
Gumbel-max draw. Every row sits at the same position and the step reads a fixed KV window, so the step is one
CUDA graph, replayed. No sampling bookkeeping (EOS, lengths, output buffers), no tensor parallelism: it is the
yardstick of a graphed step of this shape, not a rollout.

On CPU the step runs eagerly (its operators are counted with ``laconic_nemo.rollout.opcount``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PlainStep:
    """Static weights and buffers of ``rows`` rows reading ``kv`` cached positions, for a ModelArch-like ``arch``."""

    def __init__(self, arch, rows: int, kv: int, device, dtype, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)  # weights drawn on the device: seconds, not minutes
        self.a, self.rows, self.kv, self.device = arch, rows, kv, torch.device(device)
        h, nq, nkv, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype)

        ones = torch.ones(h, device=device, dtype=dtype)
        self.layers = [dict(n1=ones, n2=ones, qkv=w((nq + 2 * nkv) * d, h), b=w((nq + 2 * nkv) * d) if arch.qkv_bias
                            else None, o=w(h, nq * d), gu=w(2 * arch.ffn_hidden_size, h), dn=w(h, arch.ffn_hidden_size))
                       for _ in range(arch.num_layers)]
        self.emb = w(arch.vocab_size, h)
        self.out = self.emb if arch.tie_word_embeddings else w(arch.vocab_size, h)
        self.k = torch.zeros(arch.num_layers, rows, nkv, kv, d, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        inv = 1.0 / arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = (kv - 1) * inv
        self.cos = torch.cat((ang.cos(), ang.cos())).to(device=device, dtype=dtype)
        self.sin = torch.cat((ang.sin(), ang.sin())).to(device=device, dtype=dtype)
        self.pos = torch.full((1,), kv - 1, dtype=torch.long, device=device)
        self.mask = (torch.arange(kv, device=device) <= kv - 1).view(1, 1, 1, kv)
        self.tok = torch.randint(0, arch.vocab_size, (rows,), generator=g, device=device)
        self.noise = torch.empty(rows, arch.vocab_size, device=device, dtype=torch.float32)

    def _rope(self, t):
        half = t.shape[-1] // 2
        return t * self.cos + torch.cat((-t[..., half:], t[..., :half]), -1) * self.sin

    def step(self) -> None:
        a, b = self.a, self.rows
        nq, nkv, d, eps = a.num_attention_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
        x = F.embedding(self.tok, self.emb)
        for i, L in enumerate(self.layers):
            n = F.rms_norm(x, (a.hidden_size,), L["n1"], eps)
            qkv = torch.addmm(L["b"], n, L["qkv"].t()) if L["b"] is not None else n @ L["qkv"].t()
            q = self._rope(qkv[:, : nq * d].view(b, nq, 1, d))
            k = self._rope(qkv[:, nq * d : (nq + nkv) * d].view(b, nkv, 1, d))
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, qkv[:, (nq + nkv) * d :].view(b, nkv, 1, d))
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=self.mask, enable_gqa=True)
            x = x + o.reshape(b, nq * d) @ L["o"].t()
            gate, up = (F.rms_norm(x, (a.hidden_size,), L["n2"], eps) @ L["gu"].t()).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ L["dn"].t()
        logits = (F.rms_norm(x, (a.hidden_size,), self.layers[0]["n1"], eps) @ self.out.t()).float()
        self.noise.exponential_()
        self.tok.copy_(torch.argmax(logits - self.noise.log(), -1))  # Gumbel-max

    def ops(self):
        """:class:`~laconic_nemo.rollout.opcount.OpCount` of one eager step."""
        from laconic_nemo.rollout.opcount import count_ops

        with torch.no_grad(), count_ops() as c:
            self.step()
        return c.count

    @torch.no_grad()
    def time(self, iters: int = 100) -> tuple[float, float]:
        """(ms per step, seconds to capture): one CUDA graph replayed ``iters`` times; on CPU eager steps."""
        if self.device.type != "cuda":
            self.step()
            t = time.perf_counter()
            for _ in range(iters):
                self.step()
            return 1e3 * (time.perf_counter() - t) / iters, 0.0
        torch.cuda.synchronize()
        t = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        torch.cuda.synchronize()
        capture = time.perf_counter() - t
        self.graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            self.graph.replay()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t) / iters, capture

    def kernels_per_step(self, iters: int = 10) -> float:
        """GPU kernels per replay of the captured graph (torch.profiler); call after :meth:`time`."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                self.graph.replay()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA") / iters


def main(argv=None) -> int:
    from gpu_common import SHAPES

    from laconic_nemo.bridge import ModelArch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--rows", default=None, help="comma list (default 64,256; 8,32 on cpu)")
    ap.add_argument("--kv", type=int, default=None, help="KV positions read per step (default 768; 32 on cpu)")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    arch = ModelArch(**SHAPES[args.shape or ("tiny" if cpu else "qwen2.5-1.5b")])
    dtype = torch.float32 if cpu else torch.bfloat16
    kv = args.kv or (32 if cpu else 768)
    print("| rows | KV | ms / step | tok/s | capture s | operators (kernels) / step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in [int(x) for x in (args.rows or ("8,32" if cpu else "64,256")).split(",")]:
        p = PlainStep(arch, rows, kv, args.device, dtype)
        ms, cap = p.time()
        kern = f"{p.kernels_per_step():.0f} GPU kernels" if not cpu else f"{p.ops().kernels} operators"
        print(f"| {rows} | {kv} | {ms:.2f} | {1e3 * rows / ms:,.0f} | {cap:.2f} | {kern} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
