"""The PyTorch reference over a layer split (docs/layer-split.md): one :class:`~ds4c.reference.Reference` per
shard of a :class:`~ds4c.shard_plan.ShardPlan`, run in order, with the stepper interface of the generation
loop (``reset``, ``verify``, ``decode``, ``rollback``, ``snapshot`` / ``restore``, ``max_ctx``, ``cfg``).

What a shard owns, on its own device (``plan.devices[k]``), shared with no other shard:

* the weights of its blocks ``[start, stop)`` (docs/model.md 5.2) and their routed experts; shard 0 also
  the token embedding (5.1), the last shard the HC head, output norm and LM head (5.4);
* the sequence state of its layers (section 4: window ring, compressed rows, compressor and indexer state),
  its position and its undo journal (section 6, Rollback);
* its RoPE tables;
* the DSpark taps (spec 5.2(q)) of the tap layers it holds (:meth:`ShardedReference.set_taps`), gathered across the
  shards by :meth:`ShardedReference.main_hidden`.

The boundary between shard k and k + 1 is the HC state of the step's rows after layer ``stop - 1``: act
dtype (bf16 in the spec's dataflow, fp32 in the fp32 one) ``[q, hc_mult, hidden]``, copied to the next
shard's device (a copy also when the device is the same: a plan may name one device several times, a
*virtual* split). The token ids go to every shard (hash-routed layers route by token id, 5.2 (o)). Every
shard runs exactly the unsplit reference's arithmetic on its layers, so the logits, the states and the
rollbacks equal the unsplit reference's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4c.config import Ds4Config
from ds4c.errors import StepError
from ds4c.gguf_file import ModelFile
from ds4c.reference.model import Reference
from ds4c.reference.state import SequenceState
from ds4c.reference.weights import ReferenceWeights
from ds4c.shard_plan import ShardPlan, ShardPlanError, validate


class ShardedReference:
    """The reference run as the shards of a layer split, one sequence at a time.

    Usage::

        plan = parse_plan("cpu,cpu", "3,3", mf.config.n_layers)
        ref = ShardedReference.load(mf, plan, max_ctx=4096)
        logits = ref.verify([t0, t1, t2], pos=0)   # fp32 [3, vocab] on the last shard's device
        ref.rollback(2); logits = ref.decode(t2b, pos=2)

    Args:
        shards: one :class:`Reference` per shard, in layer order, whose ``layer_range`` s tile
            ``[0, n_layers)``, of one config, ``max_ctx`` and dataflow (:meth:`load` makes them).

    Raises:
        ShardPlanError: no shard, ranges that are not contiguous from 0 to ``n_layers``, shards of different
            configs, ``max_ctx`` or dataflows, or two shards holding the same weights object.
    """

    def __init__(self, shards: Sequence[Reference]):
        shards = list(shards)
        if not shards:
            raise ShardPlanError("a sharded reference needs at least one shard")
        cfg = shards[0].cfg
        at = 0
        for k, s in enumerate(shards):
            a, b = s.layer_range
            if a != at:
                raise ShardPlanError(f"shard {k} holds layers [{a},{b}): expected it to start at layer {at}")
            if s.cfg != cfg or s.max_ctx != shards[0].max_ctx or s.dataflow != shards[0].dataflow:
                raise ShardPlanError(f"shard {k}: expected the config, max_ctx and dataflow of shard 0 "
                                     f"(max_ctx {shards[0].max_ctx}, {shards[0].dataflow}), found max_ctx "
                                     f"{s.max_ctx}, {s.dataflow}{'' if s.cfg == cfg else ', another config'}")
            at = b
        if at != cfg.n_layers:
            raise ShardPlanError(f"the shards end at layer {at}: expected them to cover the model's {cfg.n_layers}")
        if len({id(s.w) for s in shards}) != len(shards):
            raise ShardPlanError("two shards hold the same weights object: expected one load per shard")
        self.shards: list[Reference] = shards
        self.cfg: Ds4Config = cfg
        self.max_ctx: int = shards[0].max_ctx
        self.dataflow: str = shards[0].dataflow
        self.plan: ShardPlan = validate(ShardPlan(tuple(str(s.device) for s in shards),
                                                  tuple(s.layer_range[1] - s.layer_range[0] for s in shards)),
                                        cfg.n_layers)
        self.taps: tuple[int, ...] = ()
        """The DSpark tap layers recorded (:meth:`set_taps`), in ``main_hidden`` order."""

    @classmethod
    def load(cls, mf: ModelFile, plan: ShardPlan, max_ctx: int = 4096, dataflow: str = "bf16",
             quant_emulation: bool = True, threads: int | None = None,
             cache_experts: int | None = None) -> "ShardedReference":
        """Load every shard of ``plan`` from ``mf``: shard k's weights and state on ``plan.devices[k]``.

        Args:
            mf: the opened model file.
            plan: the layer split (checked against the model with :func:`ds4c.shard_plan.validate`).
            max_ctx: positions every shard's state holds.
            dataflow: ``"bf16"`` (the spec) or ``"fp32"`` (see :class:`Reference`).
            quant_emulation: activation FP8, KV FP8 and indexer FP4 emulation (spec); off for comparing with
                ports.
            threads: ``torch.set_num_threads`` for a CPU plan (process-wide); None leaves torch's setting.
            cache_experts: per shard, as :meth:`ReferenceWeights.load` (default: its range's experts when
                under 1 GiB of fp32, else 64).

        Raises:
            ShardPlanError: an invalid plan or one whose layer counts do not sum to the model's layers; a
                CUDA device that is not present.
            StepError: ``max_ctx`` outside 1..max_position, an unknown dataflow, ``threads`` < 1.
        """
        plan = validate(plan, mf.config.n_layers)
        for d in plan.devices:
            if d != "cpu":
                n = torch.cuda.device_count() if torch.cuda.is_available() else 0
                idx = torch.device(d).index or 0
                if idx >= n:
                    raise ShardPlanError(f"device {d} of the plan: expected one of the {n} CUDA devices present")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise StepError(f"threads must be an int >= 1, found {threads!r}")
            if plan.kind == "cpu":
                torch.set_num_threads(threads)
        if dataflow not in ("bf16", "fp32"):
            raise StepError(f"dataflow must be 'bf16' or 'fp32', found {dataflow!r}")
        shards = []
        for dev, rng in zip(plan.devices, plan.ranges):
            w = ReferenceWeights.load(mf, dev, cache_experts=cache_experts, dataflow=dataflow, layers=rng)
            if not quant_emulation:
                w.config = w.config.replace(quant_emulation=False)
            shards.append(Reference(w, max_ctx=max_ctx, dataflow=dataflow))
        out = cls(shards)
        out.plan = plan  # as given (e.g. "cuda" rather than the shards' "cuda:0")
        return out

    # ---------------------------------------------------------------------------------------------- API
    @property
    def device(self) -> torch.device:
        """The last shard's device: where the logits are."""
        return self.shards[-1].device

    @property
    def devices(self) -> list[torch.device]:
        """Every shard's device, in layer order."""
        return [s.device for s in self.shards]

    @property
    def pos(self) -> int:
        """The sequence's next position."""
        return self.shards[0].state.pos

    @property
    def states(self) -> list[SequenceState]:
        """Every shard's sequence state (layers ``[start, stop)`` each), in layer order."""
        return [s.state for s in self.shards]

    @property
    def state(self) -> SequenceState:
        """A view of the whole sequence state: every shard's layer states (the same tensors, on their shards'
        devices; not copies) in layer order, at :attr:`pos`. For inspection and comparisons
        (:meth:`SequenceState.equal` with an unsplit state on the same device); steps go through this object."""
        return SequenceState(self.cfg, self.max_ctx, [ls for s in self.shards for ls in s.state.layers], self.pos)

    def set_taps(self, layers: Sequence[int]) -> None:
        """Record the DSpark taps of ``layers`` from now on (spec 5.2(q); :meth:`Reference.set_taps`): each shard
        records those of its layer range; :meth:`main_hidden` concatenates them in ``layers`` order. Empty: none.

        Raises:
            StepError: a layer that is not an int in 0..n_layers-1, or a repeated one.
        """
        from ds4c.ir.builder import check_taps

        taps = check_taps(self.cfg, layers)
        for s in self.shards:
            a, b = s.layer_range
            s.set_taps([l for l in taps if a <= l < b])
        self.taps = taps

    def main_hidden(self, start: int, stop: int) -> torch.Tensor:
        """``main_hidden`` of the committed positions ``start .. stop - 1`` (spec 5.2(q)): tap j from the shard holding
        layer ``taps[j]``, concatenated in ``taps`` order: act dtype ``[stop - start, len(taps) * hidden]`` on the last
        shard's device (a new tensor), equal to the unsplit :meth:`Reference.main_hidden` bit for bit.

        Raises:
            StepError: no taps are recorded, or the range is not inside ``0 .. pos``.
        """
        if not self.taps:
            raise StepError("main_hidden: this reference records no taps (ShardedReference.set_taps)")
        if not 0 <= start <= stop <= self.pos:
            raise StepError(f"main_hidden: positions {start}..{stop - 1} are not all committed (the sequence is at "
                            f"position {self.pos})")
        parts = []
        for layer in self.taps:
            s = next(s for s in self.shards if s.layer_range[0] <= layer < s.layer_range[1])
            parts.append(s.tap_rows[start:stop, s.taps.index(layer)].to(self.device))
        return torch.cat(parts, dim=1)

    def reset(self) -> None:
        """Start a new sequence on every shard (state buffers at their initial values, pos = 0)."""
        for s in self.shards:
            s.reset()

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1). Returns fp32 logits [1, vocab] on the last shard's device.

        Raises:
            StepError: as :meth:`verify`.
        """
        return self.verify([token], pos)

    def verify(self, tokens: list[int] | torch.Tensor, pos: int) -> torch.Tensor:
        """A verify step of ``q = len(tokens)`` rows at positions ``pos .. pos+q-1`` through every shard.

        Returns fp32 logits [q, vocab] on the last shard's device, equal bit for bit to the unsplit
        :meth:`Reference.verify`.

        Raises:
            StepError: q outside 1..5, ``pos`` not the sequence's next position, positions past ``max_ctx``, a
                token id outside 0..vocab-1 (all checked before any shard runs); shards not at one position
                (an earlier step failed inside a shard: :meth:`reset`); non-finite logits.
        """
        toks = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if len({s.state.pos for s in self.shards}) != 1:
            raise StepError(f"the shards are at positions {[s.state.pos for s in self.shards]}: expected one "
                            f"position (a step failed inside a shard; call reset())")
        x = None  # shard 0 checks the width, position and token ids before any layer runs
        for k, s in enumerate(self.shards):
            x = s.run(toks, pos, x)
            if k + 1 < len(self.shards):
                x = x.to(self.shards[k + 1].device, copy=True)  # the boundary: never shared between shards
        assert x is not None
        return x

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last verify step on every shard; undo the rest.

        Raises:
            StepError: no step open, or ``accepted`` outside 0..rows (no shard is changed then).
        """
        for s in self.shards:
            s.rollback(accepted)

    def snapshot(self) -> list[SequenceState]:
        """A copy of every shard's state (each on its shard's device), in layer order."""
        return [s.snapshot() for s in self.shards]

    def restore(self, snap: Sequence[SequenceState]) -> None:
        """Restore a :meth:`snapshot`.

        Raises:
            StepError: not one snapshot per shard, or one of another layer range, model or max_ctx.
        """
        snap = list(snap)
        if len(snap) != len(self.shards):
            raise StepError(f"restore: expected {len(self.shards)} shard snapshots, found {len(snap)}")
        for s, st in zip(self.shards, snap):
            if st.layer_range != s.layer_range:
                raise StepError(f"restore: expected a snapshot of layers {list(s.layer_range)}, found "
                                f"{list(st.layer_range)}")
        for s, st in zip(self.shards, snap):
            s.restore(st)

    def __repr__(self) -> str:
        return f"ShardedReference({self.plan.describe()}, max_ctx={self.max_ctx}, dataflow={self.dataflow!r})"
