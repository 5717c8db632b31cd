"""Read and write Hugging Face checkpoint directories (safetensors, single file or sharded with an index)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Iterator

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# files copied next to an exported checkpoint so that it loads as a complete HF model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "added_tokens.json")


class LazySafetensors(Mapping):
    """A read-only mapping name -> tensor over a HF checkpoint directory; tensors are read on access
    (each rank of a sharded model reads only its own pieces)."""

    def __init__(self, path: str):
        from safetensors import safe_open  # noqa: F401  (fail early with a clear ImportError)

        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            self._where = {}
            for fn in files:
                with safe_open(os.path.join(path, fn), framework="pt") as f:
                    for k in f.keys():
                        self._where[k] = os.path.join(path, fn)
        self._handles: dict[str, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a HF checkpoint directory, in memory."""
    lazy = LazySafetensors(path)
    return {k: lazy[k] for k in lazy}


def save_safetensors_dir(path: str, state_dict: Mapping[str, torch.Tensor], config: dict | str | None = None,
                         max_shard_bytes: int = 5 * 1024**3, copy_from: str | None = None) -> list[str]:
    """Write ``state_dict`` as a HF checkpoint directory (``model.safetensors`` or shards + index).

    config: a dict written as config.json, or a directory/config.json path copied; copy_from: a checkpoint
    directory whose tokenizer/generation files are copied too. Returns the written weight files."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    items = [(k, v.detach().to("cpu").contiguous()) for k, v in state_dict.items()]
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for k, v in items:
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((k, v))
        size += nbytes
    files = []
    if len(shards) == 1:
        save_file(dict(shards[0]), os.path.join(path, SINGLE), metadata={"format": "pt"})
        files.append(SINGLE)
        if os.path.exists(os.path.join(path, INDEX)):
            os.remove(os.path.join(path, INDEX))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(dict(shard), os.path.join(path, fn), metadata={"format": "pt"})
            files.append(fn)
            weight_map.update({k: fn for k, _ in shard})
        total = sum(v.numel() * v.element_size() for _, v in items)
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if isinstance(config, dict):
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    elif isinstance(config, str):
        src = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if os.path.abspath(src) != os.path.abspath(os.path.join(path, "config.json")):
            shutil.copyfile(src, os.path.join(path, "config.json"))
    if copy_from:
        for fn in TOKENIZER_FILES:
            src = os.path.join(copy_from, fn)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, fn)):
                shutil.copyfile(src, os.path.join(path, fn))
    return files
