"""The IR of the DSpark drafter (docs/model.md section 7): a commit graph and a draft graph.

* :func:`build_dspark_commit` (7.1, 7.2.1, 7.4): ``n`` committed target positions ``pos .. pos+n-1``: their
  ``main_hidden`` rows (the taps, spec 5.2(q)) -> ``main_x = RMSNorm(main_proj . main_hidden; main_norm)`` (once,
  shared by the stages) -> per stage ``s``: ``mk_s = P3(RoPE(RMSNorm(wkv_s . main_x; kv_norm_s)))`` written into
  the stage's ring at slot ``t % window`` (``ring_write``). Existing ops only. The drafter's prefill (7.4) is this
  graph applied to the prompt's last ``window`` positions in chunks (the runtime's largest ``n``).
* :func:`build_dspark_draft` (7.2, 7.3): the block ``[t0, noise x (B-1)]`` at positions ``p+1 .. p+B`` through the
  stages, which are the target's own layer code (:func:`ds4c.ir.builder.build_step` of the stages' config: three
  ratio-0 score-routed blocks named ``blk.0..2`` as in the drafter file, the target's embedding and head under
  ``token_embd`` / ``output``) with two changes: every ``sparse_attention`` is of kind ``dspark`` (7.2.3: the ring
  slots in slot order, then all block rows, non-causally) and nothing writes the rings (a draft leaves no state).
  After the head (``base``, fp32 [B, V]: 7.3.1-2) come the new ops ``markov_chain`` (7.3.3, greedy) and
  ``dspark_confidence`` (7.3.4, on the pre-norm HC-head output ``hx``).

Graph inputs: commit: ``main_hidden`` bf16 [n, taps * D], ``pos`` i64 (the first position), the rings
``l{s}.ring`` bf16 [window, head_dim]; outputs the updated rings under the same names. Draft: ``tokens`` i64 [B]
(``[t0, noise, ...]``), ``pos`` i64 (= ``p + 1``: the committed positions, the block's first position), the rings;
outputs ``base`` fp32 [B, V], ``logits`` fp32 [B, V] (Markov-corrected), ``drafts`` i64 [B] and, with the
confidence head, ``confidence`` fp32 [B].

Both graphs are run by the IR interpreter (:func:`ds4c.ir.interpreter.Interpreter` with a
:class:`~ds4c.drafters.dspark_model.DSparkModel`'s ``weights``) and lowered by ``runtime/lower.py`` (``lower_step.py``) after
:data:`DRAFT_PIPELINE` / :data:`COMMIT_PIPELINE`.
"""

from __future__ import annotations

from ds4c.config import MAX_WIDTH, Ds4Config
from ds4c.errors import StepError
from ds4c.ir.builder import GraphBuilder, build_step
from ds4c.ir.graph import Graph, TensorType, Value
from ds4c.tensors import tensor_specs

FC, MAIN_NORM = "fc.weight", "enc.output_norm.weight"
MARKOV_W1, MARKOV_W2 = "markov_w1.weight", "markov_w2.weight"
CONF_PROJ, CONF_BIAS = "conf_proj.weight", "conf_proj.bias"

DRAFT_PIPELINE = "default"
"""The pass pipeline of the draft graph (the target step's)."""
COMMIT_PIPELINE = ("canonicalize", "fuse_projections", "fuse_elementwise", "partition", "plan_memory")
"""The commit graph's passes: no HC, no verify-width symbol, no compressed spans (static shapes from the start)."""
MAX_COMMIT_ROWS = 5
"""The largest commit graph: a verify step accepts at most 5 rows (the widest verify width, spec 6)."""


def ring_names(stage: Ds4Config) -> list[str]:
    """The graph input / output names of the stages' rings: ``l0.ring .. l{n-1}.ring``."""
    return [f"l{s}.ring" for s in range(stage.n_layers)]


def _rings(stage: Ds4Config) -> dict[str, Value]:
    return {n: Value(TensorType((stage.window, stage.head_dim), "bf16"), n) for n in ring_names(stage)}


def _check_stage(stage: Ds4Config) -> None:
    if any(stage.compress_ratios[:stage.n_layers]) or stage.n_hash_layers:
        raise StepError(f"DSpark stages are ratio-0 score-routed blocks; found compress ratios "
                        f"{list(stage.compress_ratios[:stage.n_layers])} and {stage.n_hash_layers} hash layers")


def build_dspark_commit(stage: Ds4Config, n_taps: int, n: int) -> Graph:
    """The commit graph of ``n`` committed positions (module docstring; 7.1, 7.2.1).

    Args:
        stage: the stages' config (:attr:`ds4c.drafters.dspark_file.DSparkFile.config`; ``quant_emulation``
            decides the fake-quant attributes, as in the target's graph).
        n_taps: tap layers (``main_hidden`` is ``[n, n_taps * hidden]``). n: rows, 1..:data:`MAX_COMMIT_ROWS`.

    Raises:
        StepError: ``n`` outside 1..5, ``n_taps`` < 1, or a stage config that is not ratio-0 / score-routed.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COMMIT_ROWS:
        raise StepError(f"DSpark commit graph rows must be in 1..{MAX_COMMIT_ROWS}, found {n!r}")
    if isinstance(n_taps, bool) or not isinstance(n_taps, int) or n_taps < 1:
        raise StepError(f"DSpark commit graph: expected n_taps >= 1, found {n_taps!r}")
    _check_stage(stage)
    cfg, b = stage, GraphBuilder()
    shapes = {s.name: s.shape for s in tensor_specs(cfg)}
    D, emu, eps = cfg.hidden_size, cfg.quant_emulation, cfg.norm_eps
    mh = Value(TensorType((n, n_taps * D), "bf16"), "main_hidden")
    inputs: dict[str, Value] = {"main_hidden": mh, "pos": Value(TensorType((), "i64"), "pos"), **_rings(cfg)}
    positions = b.op("row_positions", mh, inputs["pos"], name="positions")
    mx = b.op("linear", mh, b.param(FC, (D, n_taps * D)), mode="fp8act", act_quant=emu, name="main_proj")
    mx = b.op("rms_norm", mx, b.param(MAIN_NORM, (D,)), eps=eps, name="main_x")
    outputs: dict[str, Value] = {}
    for s in range(cfg.n_layers):
        b.layer = s
        p, L = f"blk.{s}.", f"l{s}"
        freqs = b.op("rope_freqs", base=cfg.rope_base(s), yarn=cfg.uses_yarn(s), name="freqs", rope_dim=cfg.rope_dim,
                     factor=cfg.rope_factor, orig_len=cfg.original_seq_len, beta_fast=cfg.beta_fast,
                     beta_slow=cfg.beta_slow)
        kv = b.op("linear", mx, b.param(p + "attn_kv.weight", shapes[p + "attn_kv.weight"]), mode="fp8act",
                  act_quant=emu, name=f"{L}.mk_proj")
        kv = b.op("rms_norm", kv, b.param(p + "attn_kv_a_norm.weight", shapes[p + "attn_kv_a_norm.weight"]), eps=eps,
                  name=f"{L}.mk_normed")
        kv = b.op("rope", kv, positions, freqs, inverse=False, name=f"{L}.mk_rope")
        kv = b.op("kv_fake_quant", kv, nope=cfg.nope_dim, enabled=emu, name=f"{L}.mk")
        outputs[f"{L}.ring"] = b.op("ring_write", inputs[f"{L}.ring"], kv, positions, window=cfg.window,
                                    name=f"{L}.ring_new")
    meta = {"config": cfg.name, "config_hash": cfg.hash(), "width": n, "dspark": "commit", "passes": []}
    return Graph(inputs, b.ops, outputs, meta)


def build_dspark_draft(stage: Ds4Config, block_size: int, markov_rank: int, confidence: bool = True,
                       conf_bias: bool = False) -> Graph:
    """The draft graph of one block (module docstring; 7.2, 7.3).

    Args:
        stage: the stages' config. block_size: B, the block's rows (1..5: the verify width bounds the drafts).
        markov_rank: the Markov head's rank (``markov_w1`` / ``markov_w2`` are [V, rank]).
        confidence: add the confidence head (``conf_proj`` [1, D + rank]); conf_bias: with its bias [1].

    Raises:
        StepError: ``block_size`` outside 1..5, ``markov_rank`` < 1, or a stage config that is not ratio-0 /
            score-routed.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_WIDTH:
        raise StepError(f"DSpark draft graph: block size must be in 1..{MAX_WIDTH} (the rows of one step graph), "
                        f"found {block_size!r}")
    if isinstance(markov_rank, bool) or not isinstance(markov_rank, int) or markov_rank < 1:
        raise StepError(f"DSpark draft graph: expected markov_rank >= 1, found {markov_rank!r}")
    _check_stage(stage)
    g = build_step(stage, block_size, max_ctx=stage.window)
    for op in g.ops:
        if op.kind == "sparse_attention":
            op.attrs = {**op.attrs, "kind": "dspark"}
    g.ops = [op for op in g.ops if op.kind != "ring_write"]
    for name in ring_names(stage):
        g.outputs.pop(name)
    head = g.outputs.pop("logits")  # 7.3.2: base = W_head . fp32(RMSNorm(hx; norm))
    head.name = "base"
    base_norm = head.producer.inputs[0].producer  # type: ignore[union-attr]
    hx = base_norm.inputs[0]  # 7.3.1: the HC head's pre-mix (pre-norm)
    b = GraphBuilder()
    b.ops = g.ops
    V, D = stage.vocab_size, stage.hidden_size
    tok = g.inputs["tokens"]
    w1 = b.param(MARKOV_W1, (V, markov_rank))
    drafts, logits = b.op("markov_chain", head, tok, w1, b.param(MARKOV_W2, (V, markov_rank)), name="markov")
    g.outputs.update(base=head, logits=logits, drafts=drafts)
    if confidence:
        bias = (b.param(CONF_BIAS, (1,)),) if conf_bias else ()
        proj = b.param(CONF_PROJ, (1, D + markov_rank))
        g.outputs["confidence"] = b.op("dspark_confidence", hx, tok, drafts, w1, proj, *bias, name="confidence")
    g.meta = {**g.meta, "dspark": "draft", "block_size": block_size}
    return g
