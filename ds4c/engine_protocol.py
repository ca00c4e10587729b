"""The engine contract: what the generation loop (:mod:`ds4c.generate`), speculative decoding (:mod:`ds4c.speculative`)
and the drafters (:mod:`ds4c.drafters`) need of the stepper that runs a model's steps, and what a drafter needs of
the engine when the model opens.

Every engine is an :class:`Engine`: the eager reference (:class:`ds4c.reference.Reference`, its layer split
:class:`ds4c.reference.sharded.ShardedReference`) and the compiled step (:class:`ds4c.runtime.step.CompiledStep`, its
layer split :class:`ds4c.runtime.sharded.ShardedStep`). Where engines differ, a capability is a protocol of its own,
checked with ``isinstance`` (they are ``runtime_checkable``: an object has a capability when it has every member of
it, so a wrapper that hides one member hides the capability):

==========================  ==========================================================  ===========================
capability                  members                                                     engines
==========================  ==========================================================  ===========================
:class:`ChunkedPrefill`     ``prefill_chunks``, ``last_prefill``, ``prefill()``         CompiledStep
:class:`DeviceLoop`         ``decode_tokens()``: sampling on the device, host-free      CompiledStep, ShardedStep
:class:`DeviceGreedyVerify` ``verify_greedy()``: acceptance and rollback on the device  CompiledStep
:class:`PipelinedVerify`    ``greedy_pipeline()``: verify steps queued ahead            CompiledStep
:class:`TapReader`          ``taps``, ``main_hidden()`` (DSpark's input, spec 5.2(q))   all four
:class:`TapsOnRequest`      + ``records_taps``, ``w``, ``set_taps()``                   Reference (CompiledReference
                                                                                        with ``records_taps`` False)
:class:`FinalHCReader`      ``records_final_hc``, ``final_hc_rows``, ``final_hc()``,    Reference, CompiledStep,
                            ``record_final_hc()`` (MTP's input, spec 7.5)               ShardedStep
:class:`BuiltRecording`     ``taps``, ``record_hc``: recording fixed when built         CompiledStep, ShardedStep
:class:`GraphHost`          the device, kernel cache and weights another compiled       CompiledStep
                            graph set shares (the compiled DSpark drafter)
==========================  ==========================================================  ===========================

:class:`CompiledEngine` is the one protocol :class:`~ds4c.runtime.step.CompiledStep` and
:class:`~ds4c.runtime.sharded.ShardedStep` both satisfy (tools, the benchmarks and the API drive either through it).

A drafter is a :class:`Drafter` (``prepare``, ``propose``); its optional parts are protocols too
(:class:`SamplingDrafter`, :class:`HostOnlyDrafter`, :class:`ConfidenceHead`, :class:`ReportsConfidence`,
:class:`DeclaresNeeds`). What it needs of the engine is an :class:`EngineNeeds` (its ``needs``), which
:func:`ds4c.engine.open_engine` resolves when the model opens (a compiled step's taps and final HC recording are
part of its graphs, so they cannot be switched on later).

Data flows one way: this module imports nothing of the engines, the loop or the drafters; they import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class EngineNeeds:
    """What a drafter needs the target engine to record, declared by the drafter (``Drafter.needs``) and resolved
    by :func:`ds4c.engine.open_engine` when the model opens.

    Attributes:
        taps: the DSpark tap layers (spec 5.2(q), the drafter file's target layers in its order; empty: none).
        final_hc: the final HC state (spec 7.5's ``X_main``, the MTP drafter's input).
    """

    taps: tuple[int, ...] = ()
    final_hc: bool = False


NO_NEEDS = EngineNeeds()
"""A drafter that needs nothing recorded (the oracle)."""


# ------------------------------------------------------------------------------------------------ engines
@runtime_checkable
class Engine(Protocol):
    """What every engine offers the generation loop and speculative decoding: one sequence, stepped by decode
    (q = 1) and verify (q rows) steps, whose last verify can be rolled back.

    Members: ``cfg`` (the model's :class:`~ds4c.config.Ds4Config`), ``max_ctx`` (positions a sequence may hold),
    ``pos`` (the sequence's next position); :meth:`reset` (a new sequence at position 0), :meth:`decode`,
    :meth:`verify` (fp32 logits ``[q, vocab]``, on the engine's device), :meth:`rollback` (keep the first
    ``accepted`` rows of the last verify). Steps raise ``StepError`` at a position that is not :attr:`pos`."""

    @property
    def cfg(self) -> Any: ...

    @property
    def max_ctx(self) -> int: ...

    @property
    def pos(self) -> int: ...

    def reset(self) -> None: ...

    def decode(self, token: int, pos: int) -> torch.Tensor: ...

    def verify(self, tokens: list[int], pos: int) -> torch.Tensor: ...

    def rollback(self, accepted: int) -> None: ...


@runtime_checkable
class Snapshots(Protocol):
    """A copy of the whole sequence state and its restore (benchmarks and timings leave the sequence as it was)."""

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...


@runtime_checkable
class ChunkedPrefill(Protocol):
    """Prompts ingested by prefill chunk graphs (the compiled step with ``prefill_chunks``; docs/prefill.md):
    the loop calls :meth:`prefill` when ``prefill_chunks`` is not empty, and reports ``last_prefill``
    (``{"chunks": [[rows, valid], ...], "verify_tokens": n}``); ``chunks``: a subset of ``prefill_chunks`` to use
    (``()``: verify steps only)."""

    prefill_chunks: tuple[int, ...]

    @property
    def last_prefill(self) -> dict[str, Any] | None: ...

    def prefill(self, tokens: list[int], pos: int, chunks: tuple[int, ...] | None = None) -> torch.Tensor: ...


@runtime_checkable
class DeviceLoop(Protocol):
    """Decoding with sampling on the device (runtime/sampler.py), host-free: :meth:`decode_tokens` yields ``n``
    ids after ``token`` at ``pos``; closing it stops launching (``pos`` says how far it went)."""

    def decode_tokens(self, token: int, pos: int, n: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, lag: int = 4) -> Iterator[int]: ...


@runtime_checkable
class DeviceGreedyVerify(Protocol):
    """A verify step with the greedy acceptance and its rollback on the device: :meth:`verify_greedy` returns the
    ids the step adds (the accepted drafts, then the target's own token)."""

    def verify_greedy(self, tokens: list[int], pos: int) -> list[int]: ...


class VerifyPipeline(Protocol):
    """Greedy verify steps queued ahead of their drafts (:class:`ds4c.runtime.spec_pipeline.GreedyPipeline`):
    what the pipelined speculative loop drives."""

    step: Any
    owner: object | None

    def check_owner(self, me: object) -> None: ...

    def enqueue(self, width: int, pos_bound: int) -> None: ...

    def release(self, tokens: list[int], pos: int, keep: int | None = None) -> None: ...

    def result(self) -> list[int]: ...

    def close(self, token: int, pos: int) -> None: ...


@runtime_checkable
class PipelinedVerify(Protocol):
    """An engine that can queue greedy verify steps before their tokens are known: :meth:`greedy_pipeline` returns
    its :class:`VerifyPipeline`, or None when it cannot run one now (the loop then steps one by one)."""

    def greedy_pipeline(self) -> VerifyPipeline | None: ...


@runtime_checkable
class TapReader(Protocol):
    """The DSpark taps of the committed positions (spec 5.2(q)): ``taps`` (the tap layers, in ``main_hidden``
    order; empty: none recorded) and :meth:`main_hidden` (``[stop - start, len(taps) * hidden]``)."""

    taps: tuple[int, ...]

    def main_hidden(self, start: int, stop: int) -> torch.Tensor: ...


@runtime_checkable
class TapsOnRequest(TapReader, Protocol):
    """An engine that records taps when asked (the reference, whose weights ``w`` the DSpark drafter's reference
    model shares): :meth:`set_taps` from now on, when ``records_taps`` is true."""

    records_taps: bool
    w: Any

    def set_taps(self, layers: tuple[int, ...] | list[int]) -> None: ...


@runtime_checkable
class FinalHCReader(Protocol):
    """The final HC state of the committed positions (spec 7.5's ``X_main``), recorded when ``records_final_hc``:
    :meth:`final_hc` (``[stop - start, hc, hidden]``); ``final_hc_rows`` is the ring (None while not recording);
    :meth:`record_final_hc` switches recording on where the engine can."""

    records_final_hc: bool

    @property
    def final_hc_rows(self) -> torch.Tensor | None: ...

    def record_final_hc(self, on: bool = True) -> None: ...

    def final_hc(self, start: int, stop: int) -> torch.Tensor: ...


@runtime_checkable
class BuiltRecording(Protocol):
    """An engine whose recording is fixed when it is built (the compiled step): ``taps`` and ``record_hc`` are
    options of its graphs (``open_engine(taps=..., record_hc=...)``, resolved from a drafter's needs)."""

    taps: tuple[int, ...]
    record_hc: bool


@runtime_checkable
class GraphHost(Protocol):
    """A compiled step that another compiled graph set on its device shares (the compiled DSpark drafter,
    :class:`ds4c.runtime.dspark_exec.CompiledDSpark`): its device ``dev``, kernel target and cache, model file
    ``mf``, its weights (:meth:`shared_weight`) and loaded binaries (:meth:`module`), and its tap ring
    (``tap_ring``: bf16 ``[window, len(taps) * hidden]``, row ``t % window`` = ``main_hidden(t)``; None without
    taps). ``artifact`` is the AOT folder its kernels come from (None: the kernel cache); ``is_split``: a shard of a
    layer split (the compiled drafter needs the whole model)."""

    dev: torch.device
    mf: Any
    target: Any
    cache: Any
    artifact: str | None
    is_split: bool
    taps: tuple[int, ...]

    @property
    def tap_ring(self) -> torch.Tensor | None: ...

    def shared_weight(self, name: str, form: str) -> torch.Tensor: ...

    def module(self, key: str, image: Any) -> Any: ...


@runtime_checkable
class CompiledEngine(Engine, Snapshots, DeviceLoop, TapReader, FinalHCReader, BuiltRecording, Protocol):
    """What :class:`~ds4c.runtime.step.CompiledStep` and :class:`~ds4c.runtime.sharded.ShardedStep` both offer: an
    engine with snapshots, the device loop, taps and final HC reads, plus its preparation and measurements:
    :meth:`prepare_all` (every graph compiled, loaded and captured before the first step; ``prepare_stats``),
    :meth:`step` (a step that cannot be rolled back), :meth:`time_replays`, the counters ``captures`` and
    ``binary_batches``, ``load_stats`` (weight upload), ``capacity`` (positions the state buffers hold),
    ``use_graphs``, ``buckets``, ``mf`` and ``memory_plan`` (set by :func:`ds4c.engine.open_engine`, else None)."""

    mf: Any
    buckets: Any
    use_graphs: bool
    prepare_stats: dict[str, Any]
    memory_plan: Any
    capacity: int
    captures: int
    binary_batches: int
    load_stats: dict[str, float]

    def prepare_all(self, widths: tuple[int, ...] | None = None, max_ctx: int | None = None,
                    progress: bool = True) -> dict[str, Any]: ...

    def step(self, tokens: list[int], pos: int) -> torch.Tensor: ...

    def time_replays(self, tokens: list[int], pos: int, repeats: int = 50) -> float: ...


# ------------------------------------------------------------------------------------------------ drafters
@runtime_checkable
class Drafter(Protocol):
    """What the speculative loop needs of a drafter: :meth:`prepare` and :meth:`propose`. Optional, each a protocol
    of its own: ``name`` (the stats' label; default the class name), :class:`SamplingDrafter`,
    :class:`HostOnlyDrafter`, :class:`ConfidenceHead`, :class:`ReportsConfidence`, :class:`DeclaresNeeds`."""

    def prepare(self, stepper: Any, prompt: list[int], max_new_tokens: int) -> None:
        """Called once per request, before the target's prefill (it may use the stepper, then must leave it
        to be reset)."""

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` draft tokens continuing ``context`` (prompt + tokens so far), and their distributions
        ``q`` (fp32 ``[k, V]``, the drafts drawn from them) or None for a deterministic drafter."""


@runtime_checkable
class SamplingDrafter(Protocol):
    """A drafter told the request's sampling once per request, before its first proposal (the DSpark and MTP
    drafters then sample their drafts from the ``q`` they return, as the exact acceptance rule needs)."""

    def configure_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           generator: torch.Generator | None = None) -> None: ...


@runtime_checkable
class HostOnlyDrafter(Protocol):
    """``host_only``: True when :meth:`Drafter.propose` does no GPU work (the oracle). A greedy request on the
    compiled step then queues each verify step before the previous one's result is back
    (:mod:`ds4c.runtime.spec_pipeline`); GPU work in ``propose`` would wait behind the queued step."""

    @property
    def host_only(self) -> bool: ...


@runtime_checkable
class ConfidenceHead(Protocol):
    """``has_confidence``: the drafter sets :attr:`ReportsConfidence.confidence` on every proposal, so an adaptive
    request trims each step's drafts by it (which the pipelined loop, widths fixed ahead, cannot do)."""

    @property
    def has_confidence(self) -> bool: ...


@runtime_checkable
class ReportsConfidence(Protocol):
    """``confidence``: after each proposal, one probability per draft (that it is accepted given the ones before
    it), or None; read by the ``auto`` width of greedy requests (:mod:`ds4c.width_policy`)."""

    confidence: list[float] | None


@runtime_checkable
class DeclaresNeeds(Protocol):
    """``needs``: what the drafter needs the target engine to record (:class:`EngineNeeds`)."""

    @property
    def needs(self) -> EngineNeeds: ...


def drafter_name(drafter: Any) -> str:
    """The drafter's ``name`` (its class name when it has none: a custom drafter may omit it)."""
    name = getattr(drafter, "name", None)
    return name if isinstance(name, str) and name else type(drafter).__name__


def drafter_needs(drafter: Any) -> EngineNeeds:
    """What ``drafter`` needs of the engine: its ``needs``, or :data:`NO_NEEDS` for a drafter that declares none
    (a custom drafter) and for no drafter (None)."""
    return drafter.needs if isinstance(drafter, DeclaresNeeds) else NO_NEEDS
