"""The compiled step's weights on its device: each tensor in the form the kernels read it (the lowered graphs'
``weight`` arguments name it), uploaded once and shared by every graph bound on the step (and by the compiled DSpark
drafter: ``CompiledStep.shared_weight``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ds4c.progress import progress_bar
from ds4c.quant import GGMLType


class StepWeights:
    """The device copies of a model file's tensors, keyed ``(GGUF name, form)``.

    Args:
        mf: the model file (a :class:`~ds4c.gguf_file.ModelFile`, or a synthetic source that makes its tensors on
            the device: ``generates_on_device``).
        types: each tensor's storage type (GGUF name -> :class:`~ds4c.quant.GGMLType`).
        dev: the step's CUDA device.

    Attributes: ``tensors`` (``(name, form) -> device tensor``), ``stats`` (what the last :meth:`load` measured:
    ``bytes``, ``seconds``, ``gb_per_s``; empty before one).
    """

    def __init__(self, mf: Any, types: dict[str, GGMLType], dev: torch.device):
        self.mf, self.types, self.dev = mf, types, dev
        self.tensors: dict[tuple[str, str], torch.Tensor] = {}
        self.stats: dict[str, float] = {}

    def get(self, name: str, form: str) -> torch.Tensor:
        """Weight ``name`` in ``form`` on the device (converted and uploaded now if no graph read it yet)."""
        key = (name, form)
        if key not in self.tensors:
            dev = self.dev if getattr(self.mf, "generates_on_device", False) else None
            self.tensors[key] = self.convert(name, form, dev).to(self.dev).contiguous()
        return self.tensors[key]

    def convert(self, name: str, form: str, device: torch.device | None = None) -> torch.Tensor:
        """A weight in the form a kernel reads, on the host (``raw``: the stored bytes, no copy), or made on
        ``device`` by a source that generates there (``generates_on_device``: the synthetic source)."""
        if form == "raw" or (form == "bf16" and self.types.get(name) == GGMLType.BF16):
            t = self.mf.stored(name, device)
            return t if form == "raw" else t.view(torch.bfloat16).reshape(self.mf.specs[name].shape)
        if form == "bf16":
            return self.mf.tensor(name, device=device).to(torch.bfloat16)
        return self.mf.tensor(name, device=device)  # f32, i64

    def load(self, forms: dict[str, str], progress: bool = True, staging_bytes: int = 64 << 20) -> dict[str, float]:
        """Upload the weights ``forms`` names (GGUF name -> the form kernels read it in, from the lowered
        graphs' arguments), streaming the stored bytes from the memory map through two pinned staging buffers: the
        host copies chunk i+1 into one while the device copies chunk i out of the other (a side stream, events
        between), so page-cache reads and PCIe transfers overlap. Weights read in a converted form (fp32 norms and
        HC parameters, bf16 of a non-BF16 tensor, int64 tid2eid) are converted on the host first. A source that
        makes its tensors on the device (``generates_on_device``: ``synthetic:...``) generates each weight
        straight into device memory instead (nothing staged on the host). The current device must be the step's.

        Returns (and keeps as :attr:`stats`): ``bytes``, ``seconds``, ``gb_per_s`` of this call.
        """
        todo = [(n, f) for n, f in forms.items() if (n, f) not in self.tensors]
        if getattr(self.mf, "generates_on_device", False):
            return self._generate(todo, progress)
        hosts = [(n, f, self.convert(n, f)) for n, f in todo]
        total = sum(h.numel() * h.element_size() for _n, _f, h in hosts)
        stage = [torch.empty(staging_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        free = [torch.cuda.Event() for _ in range(2)]
        stream = torch.cuda.Stream(self.dev)
        turn = 0
        t0 = time.perf_counter()
        with progress_bar(total, "weights", "B", unit_scale=True, disable=not progress or total < (256 << 20)) as bar:
            for name, form, h in hosts:
                dst = torch.empty(h.shape, dtype=h.dtype, device=self.dev)
                src, out = h.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
                for off in range(0, src.numel(), staging_bytes):
                    n = min(staging_bytes, src.numel() - off)
                    free[turn].synchronize()                 # the device is done with this buffer
                    stage[turn][:n].copy_(src[off:off + n])  # page cache -> pinned (host)
                    with torch.cuda.stream(stream):
                        out[off:off + n].copy_(stage[turn][:n], non_blocking=True)  # pinned -> device
                        free[turn].record(stream)
                    turn ^= 1
                    bar.update(n)
                self.tensors[(name, form)] = dst
        stream.synchronize()
        dt = time.perf_counter() - t0
        self.stats = {"bytes": float(total), "seconds": dt, "gb_per_s": total / dt / 1e9 if dt > 0 else 0.0}
        return self.stats

    def _generate(self, todo: list[tuple[str, str]], progress: bool) -> dict[str, float]:
        """:meth:`load` of a source that makes its tensors on the device (the synthetic source): each
        weight is generated straight into device memory, nothing staged on the host."""
        t0 = time.perf_counter()
        total = 0
        with progress_bar(len(todo), "weights (generated)", "tensor", disable=not progress or len(todo) < 64) as bar:
            for name, form in todo:
                w = self.convert(name, form, self.dev).contiguous()
                self.tensors[(name, form)] = w
                total += w.numel() * w.element_size()
                bar.update(1)
        torch.cuda.synchronize(self.dev)
        dt = time.perf_counter() - t0
        self.stats = {"bytes": float(total), "seconds": dt, "gb_per_s": total / dt / 1e9 if dt > 0 else 0.0}
        return self.stats
