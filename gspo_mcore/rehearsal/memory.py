"""What is live on the rehearsed device, storage by storage, and its peak per phase by kind and by
the op and project line that made it.

Every storage an op returns is registered once (views share it) with a finalizer on its Python
object: torch keeps a storage's Python object alive exactly as long as the storage (PyObject
preservation), so the count is the bytes a caching allocator would have handed out and not yet
got back (its `memory_allocated`; no rounding to its 512-byte blocks, no fragmentation). Kinds:
weights, gradients (the DDP buffers) and optimizer state by identity (`mark_static`), activations
(a storage autograd saved for backward: saved-tensor hooks), temporaries (everything else made
during the phase).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

KINDS = ("weights", "gradients", "optimizer", "other static", "activations", "temporaries")
_BY_SITE = ("other static", "activations", "temporaries")  # the kinds counted by the line that made them
_COUNTER: "Counter | None" = None


def current_counter() -> "Counter":
    if _COUNTER is None:
        raise RuntimeError("rehearsal: no memory counter is installed")
    return _COUNTER


@dataclass
class Peak:
    bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_site: dict[str, int] = field(default_factory=dict)


class _Entry:
    __slots__ = ("nbytes", "kind", "site", "storage")

    def __init__(self, nbytes, kind, site, storage):
        self.nbytes, self.kind, self.site, self.storage = nbytes, kind, site, storage


class Counter:
    """Live storages of `device_type` ("cuda": the rehearsed GPU; "cpu": the host's fake tensors,
    an offloaded optimizer's)."""

    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type
        self.entries: dict[int, _Entry] = {}
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.by_site: dict[str, int] = {}
        self.live = 0
        self.peak = Peak()
        self.static: dict[int, str] = {}  # storage key -> kind, from mark_static

    def install(self) -> "Counter":
        global _COUNTER
        _COUNTER = self
        return self

    # ------------------------------------------------------------ registration

    def register(self, storage, site: str) -> None:
        key = storage._cdata
        if key in self.entries:
            return
        nbytes = storage.nbytes()
        kind = self.static.get(key, "temporaries")
        entry = _Entry(nbytes, kind, site, weakref.ref(storage))
        self.entries[key] = entry
        weakref.finalize(storage, self._free, key)
        self._add(entry, nbytes)

    def _add(self, entry: _Entry, nbytes: int) -> None:
        self.live += nbytes
        self.by_kind[entry.kind] += nbytes
        if entry.kind in _BY_SITE:
            site = f"{entry.kind}: {entry.site}"
            self.by_site[site] = self.by_site.get(site, 0) + nbytes
        if self.live > self.peak.bytes:
            self.peak = Peak(self.live, dict(self.by_kind), dict(self.by_site))

    def _remove(self, entry: _Entry) -> None:
        self.live -= entry.nbytes
        self.by_kind[entry.kind] -= entry.nbytes
        if entry.kind in _BY_SITE:
            site = f"{entry.kind}: {entry.site}"
            left = self.by_site[site] - entry.nbytes
            if left:
                self.by_site[site] = left
            else:
                del self.by_site[site]

    def _free(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._remove(entry)

    def saved(self, storage) -> None:
        """A storage autograd saved for backward: an activation from now on."""
        entry = self.entries.get(storage._cdata)
        if entry is not None and entry.kind == "temporaries":
            self._remove(entry)
            entry.kind = "activations"
            self._add(entry, entry.nbytes)

    # ------------------------------------------------------------ phases

    def refresh(self) -> None:
        """Sizes read again (a storage resized to 0 and back: DDP's offloaded gradient buffers)."""
        for entry in list(self.entries.values()):
            storage = entry.storage()
            nbytes = storage.nbytes() if storage is not None else 0
            if nbytes != entry.nbytes:
                self._remove(entry)
                entry.nbytes = nbytes
                self._add(entry, nbytes)

    def mark_static(self, kinds: dict[int, str]) -> None:
        """Storage keys of the weights, gradients and optimizer state; every other storage live now
        is `other static` (made before the phase and kept through it)."""
        self.static = dict(kinds)
        for key, entry in self.entries.items():
            kind = kinds.get(key, "other static")
            if kind != entry.kind:
                self._remove(entry)
                entry.kind = kind
                self._add(entry, entry.nbytes)

    def start_phase(self) -> None:
        self.refresh()
        self.reset_peak()

    def live_bytes(self) -> int:
        return self.live

    def peak_bytes(self) -> int:
        return self.peak.bytes

    def reset_peak(self) -> None:
        self.peak = Peak(self.live, dict(self.by_kind), dict(self.by_site))


class RealCounting:
    """The same count over real tensors of `counter.device_type` (a dispatch mode; every tensor
    made inside it, its inputs too): what shows the count exact against the host allocator's own
    record at a tiny shape (tests/test_rehearsal.py, against torch.profiler's memory events)."""

    def __init__(self, counter: Counter):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in tree_flatten(out)[0]:
                    if hasattr(tensor, "untyped_storage") and tensor.device.type == counter.device_type:
                        counter.register(tensor.untyped_storage(), func.__name__)
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
