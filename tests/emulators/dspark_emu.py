"""Run the DSpark drafter's new kernels on the CPU (no GPU): the Markov head (``runtime/families/dspark.py``: every
``depth`` launch, ``final`` and ``conf``) and the ``dspark`` kind of the sparse-attention family, rendered for CUDA
and compiled as host C++20 on the experts emulator's host prelude (:mod:`emulators.experts_emu`: every GPU thread of a
block an OS thread, the grid's blocks one after another). Shared arrays become function statics, which the threads
of the one running block share, as a block shares its shared memory.

It checks the kernels' own logic (the chain across launches, the per-block argmax partials and their reduction,
the ring / block list, the chunked softmax) on small shapes; not the compiler or timing. Used by
``tests/test_dspark_compiled.py``; runnable by hand: ``python tests/emulators/dspark_emu.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: tests/, for emulators.*
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from ds4c.runtime.families import attention as A  # noqa: E402
from ds4c.runtime.families import dspark as D  # noqa: E402
from ds4c.runtime.targets import target as make_target  # noqa: E402
from emulators.experts_emu import compile_host, host_body, run_host  # noqa: E402

SHARED_STATIC = "#undef DS4C_SHARED\n#define DS4C_SHARED static\n"
NAN_F32 = "std::numeric_limits<float>::quiet_NaN()"


def build_markov(spec: D.MarkovSpec, workdir: Path) -> Path:
    """Compile the emulator of ``spec``'s head (all parts) into ``workdir/emu``."""
    srcs = D.render_markov(spec, make_target("sm_90"), "emu")
    la = D.launch_shapes(spec)
    B, V = spec.rows, spec.vocab
    parts = "".join(f"namespace {p}_ns {{\n{SHARED_STATIC}{host_body(s)}\n}}\n" for p, s in srcs.items())
    conf = ""
    if spec.confidence:
        bias = "(const float*)bias.data(), " if spec.bias else ""
        conf = f"""
  auto hx = load(d, "hx"), proj = load(d, "proj"){', bias = load(d, "bias")' if spec.bias else ''};
  std::vector<float> cf({B}, {NAN_F32});
  run_grid({la['conf'].grid[0]}, 1, {spec.threads}, [&] {{
    conf_ns::{srcs['conf'].entry}((const u16*)hx.data(), (const u16*)w1.data(), (const float*)proj.data(), {bias}
                                  (const i64*)tok.data(), drafts.data(), cf.data());
  }});
  save(d, "conf", cf.data(), cf.size() * 4);"""
    final = "" if spec.sampled else (f"  run_grid(1, 1, {spec.threads}, [&] {{ final_ns::{srcs['final'].entry}"
                                      f"(part.data(), drafts.data()); }});")
    given = ('  auto given = load(d, "drafts"); std::memcpy(drafts.data(), given.data(), drafts.size() * 8);'
             if spec.sampled else "")
    main = f"""
#include <limits>
{parts}
int main(int argc, char** argv) {{
  const char* d = argv[1];
  auto base = load(d, "base"), w1 = load(d, "w1"), w2 = load(d, "w2"), tok = load(d, "tokens");
  std::vector<u32> part(2 * {B} * {spec.n_blocks}, 0x7fc00001u);
  std::vector<float> logits({B} * {V}, {NAN_F32});
  std::vector<i64> drafts({B}, -7);
{given}
  for (int depth = 0; depth < {B}; ++depth)
    run_grid({la['depth'].grid[0]}, 1, {spec.threads}, [&] {{
      depth_ns::{srcs['depth'].entry}((const float*)base.data(), (const u16*)w1.data(), (const u16*)w2.data(),
                                      (const i64*)tok.data(), part.data(), logits.data(), drafts.data(), depth);
    }});
{final}
{conf}
  save(d, "logits", logits.data(), logits.size() * 4);
  save(d, "drafts", drafts.data(), drafts.size() * 8);
  return 0;
}}
"""
    return compile_host(main, workdir, "dspark_emu")


def run_markov(spec: D.MarkovSpec, inputs: dict[str, torch.Tensor], workdir: Path,
               exe: Path | None = None) -> dict[str, torch.Tensor]:
    """Emulate one draft's head on CPU ``inputs``: ``base`` f32 [B, V], ``w1`` / ``w2`` bf16 [V, R], ``tokens``
    i64 [B] (``tokens[0]`` the anchor); with the confidence head ``hx`` bf16 [B, D], ``proj`` f32 [D + R] and
    ``bias`` f32 [1]. Returns ``drafts`` i64 [B], ``logits`` f32 [B, V] (NaN-poisoned before the run) and ``conf``
    f32 [B]. With ``spec.sampled`` also ``drafts`` i64 [B] (the drawn ids the chain reads; returned unchanged).
    """
    run_host(exe or build_markov(spec, workdir), workdir, inputs, "dspark_emu")
    rd = lambda n, dt: torch.from_numpy(np.frombuffer((workdir / n).read_bytes(), dtype=dt).copy())  # noqa: E731
    out = {"drafts": rd("drafts", np.int64), "logits": rd("logits", np.float32).view(spec.rows, spec.vocab)}
    if spec.confidence:
        out["conf"] = rd("conf", np.float32)
    return out


def build_attention(spec: A.AttentionSpec, workdir: Path) -> Path:
    """Compile the emulator of a ``dspark`` attention ``spec`` (main and, when split, combine)."""
    if spec.kind != "dspark":
        raise RuntimeError(f"dspark_emu: emulates the dspark attention kind, not {spec.kind}")
    srcs = A.render_attention(spec, make_target("sm_90"), "emu")
    shapes = A.launch_shapes(spec)
    n_out = spec.q * spec.heads * spec.head_dim
    ws = A.workspace_floats(spec)
    main_out = "ws.data()" if spec.splits > 1 else "out.data()"
    comb = ""
    if spec.splits > 1:
        comb = f"""
  run_grid({shapes[1].grid[0]}, {shapes[1].grid[1]}, {shapes[1].block[0]}, [&] {{
    comb_ns::{srcs[1].entry}(ws.data(), (const float*)sink.data(), out.data());
  }});"""
    ns = f"namespace main_ns {{\n{SHARED_STATIC}{host_body(srcs[0])}\n}}\n"
    if spec.splits > 1:
        ns += f"namespace comb_ns {{\n{SHARED_STATIC}{host_body(srcs[1])}\n}}\n"
    main = f"""
#include <limits>
{ns}
int main(int argc, char** argv) {{
  const char* d = argv[1];
  auto q = load(d, "q"), ring = load(d, "ring"), kv = load(d, "kv_new"), sink = load(d, "sink"), pos = load(d, "pos");
  std::vector<u16> out({n_out}, (u16)0x7fc1);
  std::vector<float> ws({max(ws, 1)}, {NAN_F32});
  run_grid({shapes[0].grid[0]}, {shapes[0].grid[1]}, {shapes[0].block[0]}, [&] {{
    main_ns::{srcs[0].entry}((const u16*)q.data(), (const u16*)ring.data(), (const u16*)kv.data(),
                             (const float*)sink.data(), {main_out}, (const i64*)pos.data());
  }});{comb}
  save(d, "out", out.data(), out.size() * 2);
  return 0;
}}
"""
    return compile_host(main, workdir, "dspark_emu")


def run_attention(spec: A.AttentionSpec, inputs: dict[str, torch.Tensor], workdir: Path,
                  exe: Path | None = None) -> torch.Tensor:
    """Emulate one ``dspark`` attention launch: ``q`` bf16 [q, H, hd], ``ring`` bf16 [W, hd], ``kv_new`` bf16
    [q, hd], ``sink`` f32 [H], ``pos`` i64 [1]. Returns bf16 [q, H, hd] (NaN-poisoned before the run)."""
    run_host(exe or build_attention(spec, workdir), workdir, inputs, "dspark_emu")
    a = np.frombuffer((workdir / "out").read_bytes(), dtype=np.int16).copy()
    return torch.from_numpy(a).view(torch.bfloat16).view(spec.q, spec.heads, spec.head_dim)


def markov_inputs(spec: D.MarkovSpec, t0: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of :func:`run_markov` (logit scale ~ the synthetic models')."""
    g = torch.Generator().manual_seed(seed)
    B, V, R = spec.rows, spec.vocab, spec.rank
    ins = {"base": torch.randn(B, V, generator=g) * 2, "w1": (torch.randn(V, R, generator=g) * 0.3).to(torch.bfloat16),
           "w2": (torch.randn(V, R, generator=g) * 0.3).to(torch.bfloat16),
           "tokens": torch.tensor([t0] + [0] * (B - 1), dtype=torch.int64)}
    if spec.confidence:
        ins["hx"] = torch.randn(B, spec.hidden, generator=g).to(torch.bfloat16)
        ins["proj"] = (torch.randn(spec.hidden + R, generator=g) * 0.05).to(torch.bfloat16).float()
        if spec.bias:
            ins["bias"] = torch.randn(1, generator=g)
    return ins


def main() -> int:
    spec = D.MarkovSpec(4, 1000, 64, 256, True, True, rows_per_block=96)
    ins = markov_inputs(spec, 17)
    with tempfile.TemporaryDirectory() as d:
        got = run_markov(spec, ins, Path(d))
    want = D.reference(ins["base"], 17, ins["w1"], ins["w2"], ins["hx"], ins["proj"], ins["bias"])
    print("drafts", got["drafts"].tolist(), want[0].tolist())
    print("logits max abs err", float((got["logits"] - want[1]).abs().max()), "conf", got["conf"].tolist(),
          want[2].tolist())
    return 0 if torch.equal(got["drafts"], want[0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
