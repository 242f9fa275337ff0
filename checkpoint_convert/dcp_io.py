"""Streaming reader and writer of Megatron-Core `torch_dist` checkpoints.

The format is PyTorch Distributed Checkpoint (DCP) as Megatron's torch_dist strategy writes
it: `*.distcp` files of `torch.save`d tensor chunks and `torch.save`d lists of objects, a
pickled `.metadata` (global shape and chunk list per key, file/offset/length per chunk),
`common.pt` and `metadata.json`. Writing it directly, one chunk at a time, needs neither
model parallelism nor the whole model in memory; DCP loading reshards any chunking to
whatever TP/PP/EP layout reads it.
"""

from __future__ import annotations

import io
import json
import pickle
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from gspo_mcore.common.errors import CheckpointError

# What megatron.core.dist_checkpointing writes to metadata.json for this backend.
BACKEND_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


class DCPWriter:
    """Append chunks to `.distcp` files, then write the metadata in `finish`."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True)
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._objects: set[str] = set()
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._file = None
        self._file_count = 0

    def start_file(self) -> None:
        """Later chunks go to a new file (one per layer keeps files of bounded size)."""
        if self._file is not None:
            self._file.close()
        self._file_name = f"__{self._file_count}_0.distcp"
        self._file = open(self.dir / self._file_name, "wb")
        self._file_count += 1

    def _append(self, write) -> _StorageInfo:
        if self._file is None:
            self.start_file()
        offset = self._file.tell()
        write(self._file)
        return _StorageInfo(self._file_name, offset, self._file.tell() - offset)

    def write_tensor(self, key: str, global_shape, offsets, tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()  # torch.save would write the whole base storage
        meta = self._tensors.setdefault(
            key, TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), torch.Size(global_shape), [])
        )
        if meta.properties.dtype != tensor.dtype or meta.size != torch.Size(global_shape):
            raise ValueError(f"{key}: chunks of different dtype or global shape")
        meta.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape))
        self._storage[MetadataIndex(key, torch.Size(offsets))] = self._append(lambda f: torch.save(tensor, f))

    def write_object(self, key: str, obj) -> None:
        """A Megatron ShardedObject: stored as the torch.save'd list of its data."""
        buffer = io.BytesIO()
        torch.save([obj], buffer)
        self._objects.add(key)
        self._storage[MetadataIndex(key)] = self._append(lambda f: f.write(buffer.getbuffer()))

    def finish(self, common_state: dict) -> None:
        if self._file is not None:
            self._file.close()
        metadata = Metadata(
            state_dict_metadata={**self._tensors, **{key: BytesStorageMetadata() for key in self._objects}},
            planner_data=None,
            storage_data=self._storage,
            storage_meta=StorageMeta(checkpoint_id=str(self.dir), save_id=str(uuid.uuid4())),
            version="1.0.0",
        )
        with open(self.dir / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        torch.save(common_state, self.dir / "common.pt")
        (self.dir / "metadata.json").write_text(json.dumps(BACKEND_CONFIG))


# What a torch_dist `.metadata` pickle holds (read off checkpoints written by the converter and
# by Megatron-Core 0.16.1's trainer save), and nothing else: a crafted file naming any other
# global (os.system, ...) is refused instead of run.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not a torch_dist metadata type")


def load_metadata(path: Path):
    """A torch_dist `.metadata`, unpickled with only the types such metadata holds."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


class DCPReader:
    """Read any region of any tensor of a torch_dist checkpoint, whatever its chunking."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        try:
            config = json.loads((self.dir / "metadata.json").read_text())
            self.metadata: Metadata = load_metadata(self.dir / ".metadata")
        except (OSError, ValueError, pickle.UnpicklingError, EOFError) as err:
            raise CheckpointError(f"{self.dir}: not a Megatron-Core torch_dist checkpoint ({err})") from None
        if config.get("sharded_backend") != "torch_dist":
            raise CheckpointError(f"{self.dir}/metadata.json: sharded_backend {config.get('sharded_backend')!r} is not torch_dist")
        self._chunk_files: dict[str, list[tuple[ChunkStorageMetadata, _StorageInfo]]] = {}
        for index, info in self.metadata.storage_data.items():
            if index.offset is not None:
                meta = self.metadata.state_dict_metadata[index.fqn]
                chunk = next(c for c in meta.chunks if c.offsets == index.offset)
                self._chunk_files.setdefault(index.fqn, []).append((chunk, info))

    def shape(self, key: str) -> torch.Size:
        meta = self.metadata.state_dict_metadata.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{self.dir}: missing tensor '{key}'")
        return meta.size

    def _load(self, info: _StorageInfo) -> torch.Tensor:
        path = self.dir / info.relative_path
        try:
            with open(path, "rb") as f:
                # torch.load reads the chunk's storage straight into the new tensor.
                return torch.load(_FileSlice(f, info.offset, info.length), weights_only=True)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
            raise CheckpointError(f"{path}: unreadable chunk ({err})") from None

    def read(self, key: str, start: tuple[int, ...] = (), size: tuple[int, ...] = ()) -> torch.Tensor:
        """The region [start, start + size) of tensor `key`; `start`/`size` give leading
        dims, the rest run to the end (read(key) is the whole tensor)."""
        shape = self.shape(key)
        start = tuple(start) + (0,) * (len(shape) - len(start))
        size = tuple(size) + tuple(shape[i] - start[i] for i in range(len(size), len(shape)))
        dtype = self.metadata.state_dict_metadata[key].properties.dtype
        out = torch.empty(size, dtype=dtype)
        covered = 0
        for chunk, info in self._chunk_files.get(key, []):
            lo = [max(s, o) for s, o in zip(start, chunk.offsets)]
            hi = [min(s + n, o + c) for s, n, o, c in zip(start, size, chunk.offsets, chunk.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            data = self._load(info)
            src = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, chunk.offsets))
            dst = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, start))
            out[dst] = data[src]
            covered += out[dst].numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.dir}: tensor '{key}' region {start}+{size} is not fully stored")
        return out


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0
        file.seek(0, io.SEEK_END)
        if file.tell() < offset + length:
            raise EOFError("file shorter than its metadata says")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        n = self._file.readinto(memoryview(buffer)[:n])
        self._pos += n
        return n
