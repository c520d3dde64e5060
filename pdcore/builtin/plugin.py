"""The core's own plugin (entry point `builtin`): registers through the same hooks as any other.

Every component is registered by "module:attr" path and imported only when chosen, so loading
this plugin imports neither torch nor any backend module; `pdserve plugins` stays fast and a
broken built-in backend cannot take the others down.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdcore.plugins import hookimpl
from pdcore.plugins.hookspecs import Register
from pdcore.plugins.lazy import importable, lazy

_B = "pdcore.builtin."

TRANSFER_BACKENDS = {
    "tcp": (_B + "tcp_backend:TcpTransferEngine",
            "pure-Python data plane over TCP sockets; works everywhere (default)"),
    "shm": (_B + "shm_backend:ShmTransferEngine",
            "same host: copies straight into the peer's KV pool (process_vm_writev / shm)"),
    "fake": (_B + "fake_backend:FakeTransferEngine",
             "moves no bytes; reports success (warm-up, benchmarks of the rest of the path)"),
}
LAZY_POOLS = {
    "shm": (_B + "shm_pool:ShmMemoryPool",
            "named POSIX shared memory, mapped by same-host peers (shm backend, segment mode)"),
    "thp": (_B + "thp_pool:ThpMemoryPool",
            "host memory in transparent huge pages (shm backend, cma mode; any host backend)"),
}
PLANNERS = {
    "default": (_B + "planner:DefaultPlanner",
                "page runs for equal TP, per-head slices for different TP"),
}


def _cuda_available() -> tuple[bool, str]:
    from pdcore.builtin.platforms import cuda_availability  # imports torch: only when asked

    return cuda_availability()


def _pinned_available() -> tuple[bool, str]:
    from pdcore.builtin.torch_pool import pinned_availability

    return pinned_availability()


def _shm_pool(env: Mapping[str, str]) -> str:
    from pdcore.builtin.shm_backend import preferred_pool  # imported only when a server starts

    return preferred_pool(env)


def _register_lazy(register: Register, table: dict[str, tuple[str, str]]) -> None:
    for name, (path, description) in table.items():
        register(name, lazy(path), description=description, availability=importable(path))


@hookimpl
def pd_register_transfer_backends(register: Register) -> None:
    for name, (path, description) in TRANSFER_BACKENDS.items():
        register(name, lazy(path), description=description, availability=importable(path),
                 memory_pool=_shm_pool if name == "shm" else None)


@hookimpl
def pd_register_memory_pools(register: Register) -> None:
    register("torch", lazy(_B + "torch_pool:make_torch_pool"),
             description="torch.zeros on the server's device (host RAM or GPU memory)")
    register("pinned", lazy(_B + "torch_pool:make_pinned_pool"),
             description="page-locked host memory (torch pin_memory)",
             availability=_pinned_available)
    _register_lazy(register, LAZY_POOLS)


@hookimpl
def pd_register_platforms(register: Register) -> None:
    register("cpu", lazy(_B + "platforms:CpuPlatform"),
             description="host CPU; torch.distributed backend gloo")
    register("cuda", lazy(_B + "platforms:CudaPlatform"),
             description="NVIDIA GPUs; device cuda:{base_gpu_id + rank}; nccl",
             availability=_cuda_available, reads=("base_gpu_id",))


@hookimpl
def pd_register_transfer_planners(register: Register) -> None:
    _register_lazy(register, PLANNERS)
