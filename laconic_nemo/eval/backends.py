"""Generation backends of the evaluation: transformers (CPU/GPU, small models, tests) and vLLM (GPU).

A backend turns prompt strings into sampled completions::

    backend.generate(prompts: list[str], n: int, settings: EvalSampling, seeds: list[int]) -> list[list[Completion]]

``result[i]`` holds ``n`` completions of ``prompts[i]``; ``seeds[i]`` makes prompt i's samples reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalSampling:
    """temperature > 0, top_p in (0, 1], max_tokens >= 1 (response limit)."""

    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 32768

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Completion:
    """text: decoded response (special tokens skipped); num_tokens: generated tokens WITHOUT the final EOS;
    finish_reason: "stop" (EOS or stop string) or "length" (hit max_tokens)."""

    text: str
    num_tokens: int
    finish_reason: str


class TransformersBackend:
    """``AutoModelForCausalLM.generate`` with sampling; for tiny models on CPU and quick checks."""

    def __init__(self, model_path: str, device: str = "cpu", batch_size: int = 8, dtype: str = "float32",
                 model=None, tokenizer=None):
        import torch
        import transformers

        self.tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(model_path)
        self.model = model or transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.device = device
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id")

    def generate(self, prompts: list[str], n: int, settings: EvalSampling, seeds: list[int]) -> list[list[Completion]]:
        import torch

        out: list[list[Completion]] = []
        for prompt, seed in zip(prompts, seeds):
            ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device)
            torch.manual_seed(seed)
            completions: list[Completion] = []
            while len(completions) < n:
                k = min(self.batch_size, n - len(completions))
                with torch.no_grad():
                    seq = self.model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=settings.temperature,
                        top_p=settings.top_p, top_k=0, max_new_tokens=settings.max_tokens, num_return_sequences=k,
                        eos_token_id=self.eos_id, pad_token_id=self.pad_id)
                for row in seq[:, ids.shape[1]:].tolist():
                    stop = row.index(self.eos_id) if self.eos_id in row else None
                    body = row if stop is None else row[:stop]
                    completions.append(Completion(self.tokenizer.decode(body, skip_special_tokens=True), len(body),
                                                  "length" if stop is None else "stop"))
            out.append(completions)
        return out


class VLLMBackend:
    """vLLM offline inference (``vllm.LLM.generate``); needs a GPU and the ``vllm`` package."""

    def __init__(self, model_path: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, dtype: str = "bfloat16", seed: int = 0):
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - GPU only
            raise ImportError("the vllm backend needs the `vllm` package (GPU); install laconic-nemo[vllm]") from exc
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_id = self.tokenizer.eos_token_id

    def generate(self, prompts: list[str], n: int, settings: EvalSampling,
                 seeds: list[int]) -> list[list[Completion]]:  # pragma: no cover - GPU only
        params = [self._vllm.SamplingParams(n=n, temperature=settings.temperature, top_p=settings.top_p,
                                            max_tokens=settings.max_tokens, seed=s) for s in seeds]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        out = []
        for r in results:
            comps = []
            for o in r.outputs:
                ids = list(o.token_ids)
                n_tok = len(ids) - (1 if ids and ids[-1] == self.eos_id else 0)
                comps.append(Completion(o.text, n_tok, "length" if o.finish_reason == "length" else "stop"))
            out.append(comps)
        return out
