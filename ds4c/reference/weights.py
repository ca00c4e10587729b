"""Weights of the reference, held as the official reference holds them (spec 2.2).

FP8/FP4-role projections are dequantized to fp32 (exact for Q8_0/MXFP4/BF16 storage); ``wo_a`` is rounded
to bf16 after dequantization, as ``convert.py`` does; norm gains, compressor projections, router and head
are fp32 holding bf16-exact values; the embedding stays bf16. Routed experts stay in the memory-mapped
file and are dequantized one expert at a time when routed, with a small LRU cache.

A shard of a layer split (:mod:`ds4c.reference.sharded`) loads a contiguous range of blocks only: the token
embedding with the first layer, the HC head, output norm and LM head with the last.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ds4c.config import Ds4Config
from ds4c.gguf_file import ModelFile
from ds4c.reference.state import check_layer_range

F32, BF16 = torch.float32, torch.bfloat16


@dataclass
class Compressor:
    """One compressor (spec 5.3): wkv, wgate fp32 [c*d, D]; ape fp32 [ratio, c*d]; norm fp32 [d]."""

    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor


@dataclass
class LayerWeights:
    """The tensors of one block, named after the spec's symbols (torch order [out, in])."""

    hc_attn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn [24, hc*D], scale [3], base [24]
    hc_ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # fp32 of bf16 values, [o_groups*o_lora, hpg*hd]
    wo_b: torch.Tensor
    sink: torch.Tensor
    compressor: Compressor | None
    idx_wq_b: torch.Tensor | None
    idx_proj: torch.Tensor | None
    idx_compressor: Compressor | None
    gate: torch.Tensor  # fp32 [E, D]
    gate_bias: torch.Tensor | None  # fp32 [E] (scored layers)
    tid2eid: torch.Tensor | None  # int64 [vocab, n_active] (hash layers)
    sh_w1: torch.Tensor
    sh_w3: torch.Tensor
    sh_w2: torch.Tensor


class ExpertStore:
    """Routed expert weights, dequantized on demand from the model file.

    ``get(layer, e)`` returns ``(w1, w3, w2)`` fp32 on ``device`` ([F, D], [F, D], [D, F]); the most recently
    used ``cache_experts`` experts are kept.
    """

    def __init__(self, mf: ModelFile, device: torch.device, cache_experts: int):
        self.mf, self.device, self.cap = mf, device, cache_experts
        self._cache: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()

    def get(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (layer, e)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit  # type: ignore[return-value]
        p = f"blk.{layer}."
        w = tuple(self.mf.expert(p + n, e, device=self.device)
                  for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
        if self.cap > 0:
            self._cache[key] = w
            while len(self._cache) > self.cap:
                self._cache.popitem(last=False)
        return w  # type: ignore[return-value]


def load_tensor(mf: ModelFile, name: str, dtype: torch.dtype = F32, device: str | torch.device = "cpu",
                dataflow: str = "bf16") -> torch.Tensor:
    """One model tensor (not a routed-expert bank) as the reference holds it: dequantized to ``dtype`` on ``device``;
    ``attn_output_a.weight`` (``wo_a``) rounded to bf16 values in the ``"bf16"`` dataflow (convert.py does).

    Raises:
        ModelFileError: ``name`` is not in the file.
    """
    out = mf.tensor(name, dtype, device=torch.device(device))  # a synthetic source makes it on ``device``
    if name.endswith("attn_output_a.weight") and dataflow == "bf16":  # convert.py: wo_a rounded to bf16
        out = out.to(BF16).to(F32)
    return out


@dataclass
class ReferenceWeights:
    """All weights the reference needs (or a shard's part of them: see ``layer_range``), on one device.

    ``embed`` is None unless the range starts at layer 0; ``hc_head``, ``out_norm`` and ``head`` are None
    unless it ends at the last layer."""

    config: Ds4Config
    embed: torch.Tensor | None  # bf16 [vocab, D]
    layers: list[LayerWeights]
    experts: ExpertStore
    hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # fn [hc, hc*D], scale [1], base [hc]
    out_norm: torch.Tensor | None
    head: torch.Tensor | None  # fp32 [vocab, D]
    by_name: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every loaded tensor by GGUF name (routed experts excluded: see ``experts``)."""
    dataflow: str = "bf16"
    """``"bf16"``: held as the official reference holds them; ``"fp32"``: ``wo_a`` not rounded to bf16 (the
    weights of :class:`~ds4c.reference.Reference`'s fp32 dataflow)."""
    layer_range: tuple[int, int] | None = None
    """``(start, stop)``: ``layers[j]`` is the model's block ``start + j``; None given: every layer,
    ``(0, n_layers)``."""

    def __post_init__(self) -> None:
        if self.layer_range is None:
            self.layer_range = (0, self.config.n_layers)

    @property
    def device(self) -> torch.device:
        """The device every tensor is on (with its index: ``cuda:0``, not ``cuda``)."""
        return self.embed.device if self.embed is not None else self.layers[0].attn_norm.device

    @property
    def is_whole(self) -> bool:
        """True when these are the weights of every layer (not a shard's)."""
        return self.layer_range == (0, self.config.n_layers)

    @classmethod
    def load(cls, mf: ModelFile, device: str | torch.device = "cpu", cache_experts: int | None = None,
             dataflow: str = "bf16", layers: tuple[int, int] | None = None) -> "ReferenceWeights":
        """Load from an opened model file.

        Args:
            mf: the validated model file (its config becomes ``config``).
            device: torch device for every tensor.
            cache_experts: routed experts kept dequantized; default: all of them when that is under 1 GiB
                of fp32, else 64.
            dataflow: ``"bf16"`` (the spec) or ``"fp32"``: ``wo_a`` kept as dequantized, not rounded to bf16,
                as ports with an fp32 dataflow use it.
            layers: ``(start, stop)``: blocks ``start .. stop - 1`` only (a shard of a layer split; the
                default cache then covers that range's experts), the token embedding only when ``start == 0``,
                the HC head, output norm and LM head only when ``stop == n_layers`` (the others None). None:
                every layer.

        Raises:
            ValueError: an unknown ``dataflow``.
            ShardPlanError: ``layers`` not ints with ``0 <= start < stop <= n_layers``.
            ModelFileError: a tensor missing from the file.
        """
        if dataflow not in ("bf16", "fp32"):
            raise ValueError(f"dataflow must be 'bf16' or 'fp32', found {dataflow!r}")
        cfg = mf.config
        start, stop = check_layer_range(layers, cfg.n_layers)
        dev = torch.device(device)
        by_name: dict[str, torch.Tensor] = {}

        def t(name: str, dtype: torch.dtype = F32) -> torch.Tensor:
            by_name[name] = load_tensor(mf, name, dtype, dev, dataflow)
            return by_name[name]

        layers = []
        for i in range(start, stop):
            p = f"blk.{i}."

            def comp(prefix: str) -> Compressor:
                return Compressor(t(p + prefix + "_kv.weight"), t(p + prefix + "_gate.weight"),
                                  t(p + prefix + "_ape.weight"), t(p + prefix + "_norm.weight"))

            r = cfg.ratio(i)
            layers.append(LayerWeights(
                hc_attn=(t(p + "hc_attn_fn.weight"), t(p + "hc_attn_scale.weight"), t(p + "hc_attn_base.weight")),
                hc_ffn=(t(p + "hc_ffn_fn.weight"), t(p + "hc_ffn_scale.weight"), t(p + "hc_ffn_base.weight")),
                attn_norm=t(p + "attn_norm.weight"), ffn_norm=t(p + "ffn_norm.weight"),
                wq_a=t(p + "attn_q_a.weight"), q_norm=t(p + "attn_q_a_norm.weight"),
                wq_b=t(p + "attn_q_b.weight"), wkv=t(p + "attn_kv.weight"),
                kv_norm=t(p + "attn_kv_a_norm.weight"),
                wo_a=t(p + "attn_output_a.weight"),
                wo_b=t(p + "attn_output_b.weight"), sink=t(p + "attn_sinks.weight"),
                compressor=comp("attn_compressor") if r else None,
                idx_wq_b=t(p + "indexer.attn_q_b.weight") if r == 4 else None,
                idx_proj=t(p + "indexer.proj.weight") if r == 4 else None,
                idx_compressor=comp("indexer_compressor") if r == 4 else None,
                gate=t(p + "ffn_gate_inp.weight"),
                gate_bias=None if cfg.is_hash_layer(i) else t(p + "exp_probs_b.bias"),
                tid2eid=t(p + "ffn_gate_tid2eid.weight", torch.int64) if cfg.is_hash_layer(i) else None,
                sh_w1=t(p + "ffn_gate_shexp.weight"), sh_w3=t(p + "ffn_up_shexp.weight"),
                sh_w2=t(p + "ffn_down_shexp.weight"),
            ))
        if cache_experts is None:
            per_expert = 3 * cfg.moe_inter * cfg.hidden_size * 4
            total = (stop - start) * cfg.n_experts
            cache_experts = total if total * per_expert <= (1 << 30) else 64
        last = stop == cfg.n_layers
        return cls(
            config=cfg, embed=t("token_embd.weight", BF16) if start == 0 else None, layers=layers,
            experts=ExpertStore(mf, dev, cache_experts),
            hc_head=(t("output_hc_fn.weight"), t("output_hc_scale.weight"), t("output_hc_base.weight"))
            if last else None,
            out_norm=t("output_norm.weight") if last else None, head=t("output.weight") if last else None,
            by_name=by_name, dataflow=dataflow, layer_range=(start, stop),
        )
