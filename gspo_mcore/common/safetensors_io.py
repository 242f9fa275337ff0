"""Hugging Face safetensors checkpoints: memory-mapped reading (single file or sharded),
and writing in shards with an index."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gspo_mcore.common.errors import CheckpointError

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


_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class HFCheckpointWriter:
    """Write `model-0000N-of-0000M.safetensors` shards, one tensor at a time.

    The shard plan (names, dtypes, shapes) is fixed up front, so each shard's header is
    written first and tensors are streamed after it: memory holds one tensor, whatever
    the shard size. Tensors must come in plan order."""

    def __init__(self, directory: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int = 4 << 30, first_shard: int = 0, total_shards: int | None = None):
        """`first_shard` / `total_shards` let several writers (ranks) share one numbering."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        for entry in plan:
            nbytes = _nbytes(entry)
            if self._shards[-1] and size + nbytes > max_shard_bytes:
                self._shards.append([])
                size = 0
            self._shards[-1].append(entry)
            size += nbytes
        if not plan:
            self._shards = []
        self._first, self._total = first_shard, total_shards if total_shards is not None else len(self._shards)
        self._order = [entry for shard in self._shards for entry in shard]
        self._next = 0
        self._file = None
        self._shard_index = -1
        self._weight_map: dict[str, str] = {}

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def weight_map(self) -> dict[str, str]:
        return dict(self._weight_map)

    def _shard_name(self, index: int) -> str:
        return f"model-{self._first + index + 1:05d}-of-{self._total:05d}.safetensors"

    def _open_next_shard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._shard_index += 1
        entries, header, offset = self._shards[self._shard_index], {}, 0
        for name, dtype, shape in entries:
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + _nbytes((name, dtype, shape))]}
            offset += _nbytes((name, dtype, shape))
            self._weight_map[name] = self._shard_name(self._shard_index)
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
        self._file = open(self.dir / self._shard_name(self._shard_index), "wb")
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._left_in_shard = len(entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(f"tensor {name} {tensor.dtype} {list(tensor.shape)} out of plan (expected {expected})")
        if self._file is None or self._left_in_shard == 0:
            self._open_next_shard()
        self._file.write(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        self._left_in_shard -= 1
        self._next += 1

    def finish(self, write_index: bool = True) -> None:
        if self._next != len(self._order):
            raise ValueError(f"wrote {self._next} of {len(self._order)} planned tensors")
        if self._file is not None:
            self._file.close()
        if write_index:
            write_index_file(self.dir, self._weight_map, sum(_nbytes(entry) for entry in self._order))


def write_index_file(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(entry) -> int:
    _, dtype, shape = entry
    return dtype.itemsize * math.prod(shape)


def copy_side_files(src_dir: Path, dst_dir: Path) -> None:
    """config.json, generation config and tokenizer files: everything but the weights."""
    for file in sorted(Path(src_dir).iterdir()):
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy2(file, Path(dst_dir) / file.name)
