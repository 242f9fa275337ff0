"""Hugging Face safetensors checkpoints: memory-mapped reading (single file or sharded),
and writing in shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from gspo_mcore.errors import CheckpointError


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class HFCheckpointReader:
    """`reader[name]` -> tensor, read lazily from the shard that holds it."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._handles: dict[Path, object] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
            self._shard_of = {name: self.dir / shard for name, shard in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no *.safetensors files")
            self._shard_of = {}
            for file in files:
                for name in self._open(file).keys():
                    self._shard_of[name] = file

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{file}: unreadable safetensors file ({err})") from None
        return self._handles[file]

    def release(self) -> None:
        """Drop the open files: their memory maps count toward RSS while open."""
        self._handles.clear()

    def shape(self, name: str) -> list[int]:
        """From the file header, without reading the data."""
        if name not in self._shard_of:
            raise CheckpointError(f"{self.dir}: missing tensor '{name}'")
        return list(self._open(self._shard_of[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._shard_of:
            raise CheckpointError(f"{self.dir}: missing tensor '{name}'")
        code = self._open(self._shard_of[name]).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"{self.dir}: tensor '{name}' has unsupported dtype {code}")
        return _DTYPES[code]

    def keys(self) -> list[str]:
        return list(self._shard_of)

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shard_of:
            raise CheckpointError(f"{self.dir}: missing tensor '{name}'")
        file = self._shard_of[name]
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: tensor '{name}' unreadable ({err})") from None


class HFCheckpointWriter:
    """Write `model-0000N-of-0000M.safetensors` shards as they come, then the index."""

    def __init__(self, directory: Path, num_shards: int):
        self.dir, self.num_shards = Path(directory), num_shards
        self.dir.mkdir(parents=True, exist_ok=True)
        self._weight_map: dict[str, str] = {}
        self._total_size = 0
        self._written = 0

    def write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        self._written += 1
        name = f"model-{self._written:05d}-of-{self.num_shards:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.dir / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            self._weight_map[key] = name
            self._total_size += tensor.numel() * tensor.element_size()

    def finish(self) -> None:
        if self._written != self.num_shards:
            raise ValueError(f"wrote {self._written} shards, announced {self.num_shards}")
        index = {"metadata": {"total_size": self._total_size}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
