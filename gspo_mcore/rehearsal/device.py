"""Fake CUDA devices on a CPU-only torch: the C++ half built and loaded before torch is imported, the
Python half (`torch.cuda`'s API) answered as an H100 would.

The C++ half (fake_cuda.cpp) is compiled with g++ against the installed wheel's own headers and
libraries (torch/include, libc10, libtorch_cpu: ~3 s) into BUILD_DIR, named by a hash of the source
and of the wheel it was built against (another torch builds another library). Only the rehearsal
loads it (`load`, from gspo_mcore.rehearse before its first torch import); `make rehearse` builds it
ahead. Nothing here runs in a training process. On a CUDA build beside a real device (the GPU
check's section 10) nothing is built or loaded: see `load`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
# The checkout's build/ (ignored by git), or where GSPO_REHEARSAL_BUILD says.
BUILD_DIR = Path(os.environ.get("GSPO_REHEARSAL_BUILD", Path(__file__).resolve().parents[2] / "build" / "rehearsal"))
DEVICE_COUNT = 8  # c10::impl::kFakeGuardImplMaxDevices
CAPABILITY = (9, 0)  # an H100's: the torch spec's grouped GEMM path (experts.py) takes sm90
DEVICE_NAME = "NVIDIA H100 80GB HBM3 (rehearsed)"
TOTAL_MEMORY = 81_559 * 2**20  # nvidia-smi's total of an H100 80GB HBM3


class RehearsalError(RuntimeError):
    """The rehearsal cannot run here (no compiler, torch imported too early, ...): one line."""


def _torch_dir() -> Path:
    """The installed torch's folder, links resolved: the library's runpath names it, and a site folder
    of links (the GPU check's bare-machine test) must not leave a runpath that dies with it."""
    spec = importlib.util.find_spec("torch")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise RehearsalError("rehearsal: torch is not installed in this Python")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def library_path() -> Path:
    """Keyed by the source, the wheel and where it lies (the runpath built in: the same torch
    installed elsewhere builds its own)."""
    torch_dir = _torch_dir()
    wheel = torch_dir / "lib" / "libtorch_cpu.so"
    key = hashlib.sha256(SOURCE.read_bytes() + str(wheel.stat().st_size).encode() +
                         (torch_dir / "version.py").read_bytes() + str(torch_dir).encode()).hexdigest()[:12]
    return BUILD_DIR / f"libgspo_fake_cuda-{key}.so"


def build() -> Path:
    """The fake device library for the installed torch, compiled once (to a temporary name, then
    renamed: a build stopped half-way leaves nothing a later load would take)."""
    target = library_path()
    if target.is_file():
        return target
    torch_dir = _torch_dir()
    if cuda_build():
        raise RehearsalError("rehearsal: this torch is a CUDA build; the rehearsal fakes CUDA on a CPU-only torch")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w", f"-I{torch_dir / 'include'}", str(SOURCE),
               f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise RehearsalError("rehearsal: g++ is not installed (make rehearse installs it)") from None
    if done.returncode:
        partial.unlink(missing_ok=True)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
        raise RehearsalError(f"rehearsal: building {SOURCE.name} failed: {first}")
    partial.rename(target)
    return target


_loaded = False


def cuda_build() -> bool:
    """Whether the installed torch is a CUDA build (found, not imported)."""
    return (_torch_dir() / "lib" / "libtorch_cuda.so").exists()


def load() -> None:
    """Build if needed and load the fake devices into this process: before torch is imported (its
    CUDA hooks are looked up once and kept). On a CUDA build with a device (the GPU check's
    section 10) nothing is loaded: FakeTensorMode makes CUDA fake tensors natively and the real
    runtime answers torch.cuda, but for its memory figures, which are the rehearsal's count."""
    global _loaded
    if _loaded:
        return
    if cuda_build():
        import torch

        if not torch.cuda.is_available():
            raise RehearsalError("rehearsal: this torch is a CUDA build and sees no CUDA device; the rehearsal "
                                 "fakes CUDA on a CPU-only torch, or runs beside a real device")
        _loaded = True
        _answer_memory(torch.cuda)
        return
    if "torch" in sys.modules:
        raise RehearsalError("rehearsal: torch was imported before the fake CUDA devices were loaded; "
                             "run it as `python -m gspo_mcore.rehearse` (its own process)")
    ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)
    _loaded = True
    _answer_torch_cuda()


# Called where the host would wait for the device (a stream's, an event's or the device's
# synchronize): the rehearsal's mode counts each by line while it is entered (mode.Rehearsal.host_waits).
host_wait_listeners: list = []


def _host_waits() -> None:
    for listener in host_wait_listeners:
        listener()


def _stream_class():
    """torch.cuda.Stream and Event: the CPU bridge's stand-in (every wait already over: fake kernels
    run at once), one stream for all (megatron's side-stream checks compare them), timed at zero."""
    from gspo_mcore.megatron.cpu_bridge import _NoStream

    class Stream(_NoStream):
        def record_event(self, *args):
            return Stream()

        def wait(self, *args):
            pass

        def elapsed_time(self, other):
            return 0.0

        def synchronize(self):
            _host_waits()

        def __eq__(self, other):
            return isinstance(other, _NoStream)

        def __hash__(self):
            return 0

    return Stream


def _answer_torch_cuda() -> None:
    """torch.cuda's Python API as an H100 node's: a CPU build's torch.cuda reads a C extension it
    does not have. Memory figures come from the rehearsal's own count (gspo_mcore.rehearsal.memory)."""
    import torch

    from gspo_mcore.rehearsal import memory

    cuda, _Stream = torch.cuda, _stream_class()
    state = {"device": 0}
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda.init = lambda: None
    cuda._lazy_init = lambda: None
    cuda.device_count = lambda: DEVICE_COUNT
    cuda.current_device = lambda: state["device"]
    cuda.set_device = lambda device: state.update(device=torch.device("cuda", device).index
                                                  if not isinstance(device, int) else device)
    cuda.get_device_capability = lambda device=None: CAPABILITY
    cuda.get_device_name = lambda device=None: DEVICE_NAME
    cuda.get_device_properties = lambda device=None: type("Properties", (), dict(
        name=DEVICE_NAME, major=CAPABILITY[0], minor=CAPABILITY[1], total_memory=TOTAL_MEMORY,
        multi_processor_count=132))()
    cuda.synchronize = lambda device=None: _host_waits()
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: _Stream()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": None
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None
    cuda.seed = cuda.seed_all = lambda: None
    cuda.empty_cache = lambda: None
    _answer_memory(cuda)
    cuda.mem_get_info = lambda device=None: (TOTAL_MEMORY - memory.current_counter().live_bytes(), TOTAL_MEMORY)


def _answer_memory(cuda) -> None:
    """torch.cuda's memory figures from the rehearsal's count of the fake device's storages."""
    from gspo_mcore.rehearsal import memory

    cuda.memory_allocated = lambda device=None: memory.current_counter().live_bytes()
    cuda.max_memory_allocated = lambda device=None: memory.current_counter().peak_bytes()
    cuda.memory_reserved = cuda.memory_allocated
    cuda.max_memory_reserved = cuda.max_memory_allocated
    cuda.reset_peak_memory_stats = lambda device=None: memory.current_counter().reset_peak()
