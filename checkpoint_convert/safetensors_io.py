"""Memory-mapped reading of Hugging Face safetensors checkpoints (single file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gspo_mcore.errors import CheckpointError


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
