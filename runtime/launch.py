"""Load compiled CUDA kernels (cubin) and launch them on torch's current stream, through the CUDA driver
API of ``cuda.bindings`` (a GPU machine only; importing this module needs no GPU).

Launches go on ``torch.cuda.current_stream()``, so they are captured by ``torch.cuda.graph`` like torch's
own kernels. Every driver call's result is checked.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

from ds4c.errors import Ds4cError


class LaunchError(Ds4cError):
    """A driver call failed (the message names the call and the CUDA error)."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - GPU machines only
        raise LaunchError(f"cuda.bindings is not importable ({e}); install cuda-bindings on the GPU machine") from None
    return driver


def _check(res: Any, what: str) -> Any:
    err = res[0] if isinstance(res, tuple) else res
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise LaunchError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class CudaModule:
    """A loaded cubin. ``function(entry)`` gives a :class:`CudaKernel`."""

    def __init__(self, image: bytes):
        import torch

        torch.empty(1, device="cuda")  # makes torch's primary context current for the driver calls
        drv = _driver()
        self._image = image
        self.module = _check(drv.cuModuleLoadData(image), "cuModuleLoadData")
        self._funcs: dict[str, CudaKernel] = {}

    def function(self, entry: str, dynamic_smem: int = 0) -> "CudaKernel":
        if entry not in self._funcs:
            drv = _driver()
            f = _check(drv.cuModuleGetFunction(self.module, entry.encode()), f"cuModuleGetFunction({entry})")
            if dynamic_smem > 48 * 1024:
                _check(drv.cuFuncSetAttribute(
                    f, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem),
                    f"cuFuncSetAttribute({entry}, max dynamic smem {dynamic_smem})")
            self._funcs[entry] = CudaKernel(entry, f)
        return self._funcs[entry]


class CudaKernel:
    """One kernel function. Call with ``grid``, ``block`` and the arguments: torch tensors become device
    pointers; Python ints become ``int`` (32-bit) unless given as ``("i64", v)``; floats become ``float``."""

    def __init__(self, entry: str, func: Any):
        self.entry, self.func = entry, func

    def __call__(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], smem: int = 0,
                 programmatic: bool = False) -> None:
        self.launch_packed(grid, block, self.pack(args), smem, programmatic)

    def pack(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        """The driver's argument array for ``args`` (checked and converted once): a launch whose arguments
        never change (bound tensors) keeps it and calls :meth:`launch_packed`, skipping the per-launch
        conversion (hundreds of arguments for a 43-layer rollback kernel)."""
        import torch

        holders: list[Any] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if not a.is_cuda:
                    raise LaunchError(f"{self.entry}: tensor argument on {a.device}, expected a CUDA tensor")
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, tuple) and a[0] == "i64":
                holders.append(ctypes.c_int64(int(a[1])))
            elif isinstance(a, bool) or isinstance(a, int):
                holders.append(ctypes.c_int32(int(a)))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            else:
                raise LaunchError(f"{self.entry}: unsupported argument type {type(a).__name__}")
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        return holders, ptrs

    def launch_packed(self, grid: Sequence[int], block: Sequence[int], packed: tuple[list[Any], Any],
                      smem: int = 0, programmatic: bool = False) -> None:
        """Launch on torch's current stream with a :meth:`pack` result (whose tensors must still be alive).

        ``programmatic``: launch with programmatic stream serialization (``cuLaunchKernelEx``), so the kernel
        may be scheduled before the previous kernel of the stream finishes; only for a kernel that waits on
        that kernel itself (``KernelSource.programmatic_launch``). Captured into a CUDA graph as a
        programmatic dependency edge."""
        import torch

        drv = _driver()
        _holders, ptrs = packed
        g = list(grid) + [1] * (3 - len(grid))
        b = list(block) + [1] * (3 - len(block))
        stream = torch.cuda.current_stream().cuda_stream
        if not programmatic:
            _check(drv.cuLaunchKernel(self.func, g[0], g[1], g[2], b[0], b[1], b[2], smem, stream,
                                      ctypes.addressof(ptrs), 0), f"cuLaunchKernel({self.entry})")
            return
        _check(drv.cuLaunchKernelEx(programmatic_config(g, b, smem, stream), self.func, ctypes.addressof(ptrs), 0),
               f"cuLaunchKernelEx({self.entry}, programmatic stream serialization)")


def programmatic_config(grid: Sequence[int], block: Sequence[int], smem: int, stream: int) -> Any:
    """The ``CUlaunchConfig`` of a launch with programmatic stream serialization allowed (grid and block as
    3-tuples, dynamic shared memory in bytes, the stream handle as an int)."""
    drv = _driver()
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in block)
    cfg.sharedMemBytes = int(smem)
    cfg.hStream = drv.CUstream(stream)
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class HostFlag:
    """A 32-bit counter in pinned, device-mapped host memory that a stream can wait on
    (``cuStreamWaitValue32``): work enqueued after :meth:`wait` runs only once the host has :meth:`release`\\ d
    a value at least the one waited for (cyclic comparison). Lets the host enqueue a launch ahead of the data
    it needs and start it later with one store, no driver call (the speculative loop's pipelined submission,
    ``ds4c.runtime.spec_pipeline``).

    Raises:
        LaunchError: the device cannot map the host page or has no stream memory operations.
    """

    def __init__(self) -> None:
        import torch

        drv = _driver()
        torch.empty(1, device="cuda")  # torch's primary context current for the driver calls
        self.value = 0
        self._host = torch.zeros(16, dtype=torch.int32).pin_memory()  # one word used; 64 bytes of the page
        self._np: np.ndarray = self._host.numpy()
        self._dptr = _check(drv.cuMemHostGetDevicePointer(self._host.data_ptr(), 0), "cuMemHostGetDevicePointer")
        self.wait(0)  # already satisfied: raises at once where stream memory operations are not supported
        torch.cuda.current_stream().synchronize()

    def wait(self, value: int) -> None:
        """Make torch's current stream wait until the counter reaches ``value`` (before the work enqueued next)."""
        import torch

        drv = _driver()
        stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(drv.cuStreamWaitValue32(stream, self._dptr, value & 0xFFFFFFFF,
                                       drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def release(self, value: int) -> None:
        """Store ``value`` (after every store the host made before it: x86 keeps store order, and the pinned
        page is coherent with the device's reads)."""
        self.value = int(value)
        self._np.view(np.uint32)[0] = self.value & 0xFFFFFFFF
