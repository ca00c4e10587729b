"""The Python API: :class:`Model`, shaped like llama-cpp-python's ``Llama`` and vLLM's ``LLM``.

::

    import ds4c

    m = ds4c.Model("model.gguf")                       # or Model() for the built-in default model
    c = m.generate("The quick brown fox", max_new_tokens=32, stop=["\\n\\n"])
    print(c.text, c.stop_reason, c.timings.decode_tokens_per_s)

    s = m.generate("Once upon a time", max_new_tokens=64, temperature=0.8, top_p=0.95, seed=7, stream=True)
    for piece in s:                                    # complete UTF-8 text as tokens arrive
        print(piece, end="", flush=True)
    print(s.completion.stop_reason)

    ids = m.tokenize("hello")                          # bos + the text's ids
    m.detokenize(ids)

The engine (reference or compiled step, device, artifact) is chosen by :func:`ds4c.engine.open_engine`; the
token loop is :func:`ds4c.generate.stream`; text comes from the file's GGUF tokenizer (:mod:`ds4c.tokenizer`).
Files without tokenizer keys (written by ds4c before 0.2) take token ids only.
"""

from __future__ import annotations

import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4c.chat import render_chat
from ds4c.default_model import default_model_path
from ds4c.engine import open_engine, resolve_engine, resolve_needs
from ds4c.engine_protocol import CompiledEngine, drafter_name, drafter_needs
from ds4c.errors import Ds4cError, GenerationInterrupted
from ds4c.batching import BatchConfig, BatchEngine, BatchRequest
from ds4c.generate import GenerationResult, TokenStream, check_sampling
from ds4c.generate import stream as stream_tokens
from ds4c.gguf_file import ModelFile
from ds4c.markers import held_back
from ds4c.sampling import check_seed
from ds4c.sources import open_model


@dataclass
class Timings:
    """Wall-clock seconds of a completion: opening the model (file, weights, engine: once per :class:`Model`),
    the prefill and the decode, and their rates (None when not measurable)."""

    load_s: float
    prefill_s: float
    decode_s: float
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None

    def as_dict(self) -> dict:
        return {"load_s": self.load_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class Completion:
    """The result of :meth:`Model.generate`.

    Attributes:
        text: the generated text (None when the file has no tokenizer): the decoded new ids less an ending eos
            token, cut before the first stop string.
        ids: the new token ids (an eos that ended the run is the last; at a stop string, up to the token that
            completed it).
        prompt_ids: the prompt's ids (with bos for a text prompt).
        stop_reason: ``"eos"`` (the eos token), ``"stop"`` (a stop string, or the stream was closed early),
            ``"length"`` (``max_new_tokens``) or ``"interrupted"`` (Ctrl-C: :class:`~ds4c.errors.GenerationInterrupted`,
            ``CompletionStream.close(interrupted=True)``).
        timings: :class:`Timings`.
        result: the underlying :class:`~ds4c.generate.GenerationResult` (per-step times in ``step_s``).
        speculative: with a drafter, the speculative-decoding report (:meth:`ds4c.speculative.SpecStats.as_dict`:
            steps, tokens, tokens per step, acceptance by depth, widths, policy); None without one.
    """

    text: str | None
    ids: list[int]
    prompt_ids: list[int]
    stop_reason: str
    timings: Timings
    result: GenerationResult = field(repr=False)

    @property
    def speculative(self) -> dict | None:
        return self.result.speculative

    def as_dict(self) -> dict:
        return {"text": self.text, "ids": self.ids, "prompt_ids": self.prompt_ids, "stop_reason": self.stop_reason,
                **self.timings.as_dict(), **({"speculative": self.speculative} if self.speculative else {})}


class CompletionStream:
    """What :meth:`Model.generate` returns with ``stream=True``: an iterator of text pieces (each complete
    UTF-8 text; their concatenation is the completion's ``text``).

    :attr:`completion` is the :class:`Completion` once the stream has ended; reading it before that runs the
    generation to its end first (the pieces not yet read are then only in ``completion.text``). :meth:`close`
    ends the generation early (``stop_reason`` ``"stop"``, ``text`` the pieces delivered so far).

    The stream holds its :class:`Model` (other threads' generations wait) until it has ended: read to its end,
    closed, or garbage-collected.
    """

    def __init__(self, run: Iterator[str], holder: dict[str, Any], end: Callable[[], None]):
        self._run, self._holder, self._end = run, holder, end
        weakref.finalize(self, end)  # a stream dropped unfinished ends its generation (the Model's turn with it)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return next(self._run)
        except KeyboardInterrupt:  # Ctrl-C inside a step: the run has ended (as closed early), interrupted
            self._end()
            self._interrupted()
            raise

    @property
    def done(self) -> bool:
        """Whether the generation has ended."""
        return "completion" in self._holder

    @property
    def n_tokens(self) -> int:
        """New tokens generated so far (pieces may hold several: a UTF-8 character split over tokens, text that
        may begin a stop string)."""
        return self._holder.get("n_tokens", 0)

    @property
    def completion(self) -> Completion:
        """The final :class:`Completion` (runs the rest of the generation when it has not ended yet)."""
        for _ in self._run:
            pass
        return self._holder["completion"]

    def close(self, interrupted: bool = False) -> Completion:
        """Stop generating now; returns the final :class:`Completion`. ``interrupted``: the stop is a Ctrl-C (a
        KeyboardInterrupt while reading the stream): ``stop_reason`` ``"interrupted"`` unless it had ended."""
        ended = self.done
        self._run.close()
        self._end()  # closed before its first piece: the generation never started
        if interrupted and not ended:
            self._interrupted()
        return self._holder["completion"]

    def _interrupted(self) -> None:
        c = self._holder["completion"]
        c.stop_reason = c.result.stop_reason = "interrupted"


def _nothing() -> None:
    """No turn to give back (a generation in the batch engine holds none)."""


def check_stops(stop: Any) -> list[str]:
    """The stop strings of a request (``stop`` of :meth:`Model.generate`, ``--stop`` of ``ds4c generate``) as a
    list: a str is one, None none.

    Raises:
        Ds4cError: ``stop`` is not a str or a list / tuple of str; an empty stop string.
    """
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise Ds4cError(f"stop: expected a str or a list of str, found {type(stop).__name__} {stop!r:.80}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    odd = [s for s in stops if not isinstance(s, str)]
    if odd:
        raise Ds4cError(f"stop: expected a str or a list of str, found a {type(odd[0]).__name__} in {stops!r:.80}")
    if any(not s for s in stops):
        raise Ds4cError(f"stop strings (--stop) must be non-empty str, found {stops!r}")
    return stops


def _earliest(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class _Turns:
    """Whose turn it is to generate on a :class:`Model`: one thread's generations at a time (they share the
    engine's sequence state).

    :meth:`take` (one per generation) returns at once when no generation is unfinished or when the calling
    thread holds the turn (its own unfinished stream, which the new generation then ends, or a generation
    started from inside another's run); any other thread waits until every generation of the holder has ended.
    The release may come from any thread (a stream read to its end elsewhere, or garbage-collected)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()   # held while the holder has an unfinished generation
        self._guard = threading.Lock()  # guards _owner and _n
        self._owner: threading.Thread | None = None
        self._n = 0

    def take(self) -> Callable[[], None]:
        """Wait for the turn; returns its release for this generation (idempotent, callable from any thread)."""
        me = threading.current_thread()
        with self._guard:
            mine = self._owner is me
            if mine:
                self._n += 1
        if not mine:
            self._lock.acquire()
            with self._guard:
                self._owner, self._n = me, 1
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):
                with self._guard:
                    self._n -= 1
                    if self._n == 0:
                        self._owner = None
                        self._lock.release()

        return release


class Model:
    """A DeepSeek-V4-Flash model opened for generation.

    Threads: a Model runs one generation at a time, in call order per thread. A :meth:`generate` (or
    :meth:`chat`) called from another thread while one is unfinished waits its turn: a completion holds the Model
    while it runs, a stream until it is read to its end, closed or garbage-collected. On the thread that holds it,
    a new generation starts at once and ends that thread's unfinished stream (whose next read raises a one-line
    StepError). So a thread must not wait for another thread's generation on the same Model while it keeps an
    unfinished stream of its own (close it first). :meth:`tokenize`, :meth:`detokenize` and
    :meth:`apply_chat_template` do not wait.

    Args:
        path: a GGUF file (or an opened :class:`~ds4c.gguf_file.ModelFile`), or ``"synthetic:PRESET[:FORMATS[:SEED]]"``
            (no file: the tensors are generated on the device, docs/synthetic.md); None: the built-in default
            model (the ``tiny`` preset, seed 0, written on first use under ``$DS4C_HOME``).
        device: ``"cpu"`` or ``"cuda"``.
        artifact: a ``ds4c compile`` folder whose kernels the compiled engine runs (nothing is compiled).
        max_ctx: positions a sequence may hold (prompt + new tokens); with an artifact at most its ``max_ctx``;
            None: the artifact's, else 4096. The compiled engine compiles, loads and captures every graph up to
            it here, before the first prompt (``stepper.prepare_stats`` has the costs).
        engine: ``"auto"`` (compiled on cuda, reference on cpu), ``"reference"`` or ``"compiled"``.
        quant_emulation: activation FP8, KV FP8 and indexer FP4 emulation (off for comparing with ports).
        threads: torch CPU threads for the reference (``torch.set_num_threads``, process-wide).
        dataflow: the reference's activation rounding, ``"bf16"`` (the spec) or ``"fp32"`` (as ports that keep
            fp32 activations; see :class:`~ds4c.reference.Reference`).
        devices, layer_split: a layer split over devices (``["cuda:0", "cuda:1"]`` / ``"cuda:0,cuda:1"`` and
            layers per shard such as ``[22, 21]``; :func:`ds4c.engine.shard_plan`): either engine runs shard by
            shard, the HC state handed between them. A device may repeat (a virtual split); ``layer_split``
            alone splits on ``device``; ``devices`` alone places layers from the memory plan.
        draft: the drafter :meth:`generate` runs when it is given none (a spelling such as ``"mtp"``,
            ``"dspark:PATH"``, ``"oracle:0.8"``, a drafter file path, or a :class:`~ds4c.engine_protocol.Drafter`;
            a spelling is made into a drafter per request, with the request's seed, as :meth:`generate`'s ``draft``
            is). What it needs of the engine (the DSpark taps, the MTP drafter's final HC state) is resolved when
            the engine opens (:func:`ds4c.engine.resolve_needs`), so ``taps`` / ``record_hc`` need not be given.
        taps: compiled engine: the DSpark tap layers its graphs record (a drafter file's ``taps``; default: those
            ``draft`` needs), so ``generate(draft=...)`` with that DSpark drafter runs it compiled
            (:class:`~ds4c.runtime.dspark_exec.CompiledDSpark`); the reference records taps itself.
        record_hc: compiled engine: its graphs record the final HC state (spec 7.5's ``X_main``; default: whether
            ``draft`` needs it), so ``generate(draft="mtp")`` (or ``"mtp:PATH"``) runs the MTP drafter on the
            compiled target; the reference records it itself.
        prefill_chunks: compiled engine: prefill chunk graph sizes (e.g. ``(256, 2048)`` or ``"256,2048"``):
            prompts are then prefilled in chunks (``CompiledStep.prefill``, docs/prefill.md); empty: verify steps; not
            with a split, taps or ``record_hc``. None (the default): an ``artifact``'s own chunk sizes (those it
            was compiled with, ``ds4c compile --prefill``), else empty (the chunk graphs are not yet validated on
            a GPU). With an artifact, explicit sizes must be among its chunk sizes
            (:func:`ds4c.engine.open_engine`).
        lanes: run generations of many threads together (continuous batching, docs/batching.md): the number of
            sequences a step holds (or a :class:`~ds4c.batching.BatchConfig`). :meth:`generate` calls from several
            threads then run at once, each request's tokens equal to the same request run alone; prompts that
            begin with a prefix an earlier request left start from it (the reference's page pool; the compiled step's
            slot snapshots). Either engine, on one device; a ``draft`` on the reference only (speculative rows in
            the batch: the oracle, the MTP block or DSpark); on the compiled
            step decode lanes run
            as one CUDA graph and prompts are prefilled beside them (:mod:`ds4c.batch_slots`). None (the default):
            one generation at a time.

    Attributes:
        file: the :class:`~ds4c.gguf_file.ModelFile`; ``config``: its config; ``tokenizer``: the
        :class:`~ds4c.tokenizer.Tokenizer` or None; ``stepper``: the engine's stepper; ``engine``: its name;
        ``draft``: the default drafter (as given; None: none); ``load_s``: seconds spent opening it all;
        ``batch``: the :class:`~ds4c.batching.BatchEngine` with ``lanes`` (None without).

    Raises:
        Ds4cError: a ``path`` of another type (an int, bytes...); what :func:`~ds4c.sources.open_model`,
            :func:`~ds4c.engine.open_engine` and the tokenizer raise (a missing or corrupt file, no CUDA device, an
            artifact that does not serve the model...); a ``draft`` :meth:`generate` would refuse, or whose needs
            the engine cannot serve (:func:`ds4c.engine.resolve_needs`).
    """

    def __init__(self, path: str | os.PathLike[str] | ModelFile | None = None, device: str = "cpu",
                 artifact: str | os.PathLike[str] | None = None, max_ctx: int | None = 4096, engine: str = "auto",
                 quant_emulation: bool = True, threads: int | None = None, dataflow: str = "bf16",
                 devices: str | Sequence[str] | None = None, layer_split: str | Sequence[int] | None = None,
                 taps: Sequence[int] = (), record_hc: bool = False, prefill_chunks: Any = None,
                 draft: str | os.PathLike[str] | Any | None = None, lanes: int | BatchConfig | None = None):
        from ds4c.tokenizer import Tokenizer, has_tokenizer

        t0 = time.perf_counter()
        if not (path is None or isinstance(path, (str, os.PathLike, ModelFile))):
            raise Ds4cError(f"path: expected a GGUF file path (str or os.PathLike), a 'synthetic:...' spec, an opened "
                            f"ModelFile or None (the built-in model), found {type(path).__name__} {str(path)[:80]}")
        self.engine = resolve_engine(device, engine, dataflow)
        self.device = device
        self._artifact = artifact
        self._split = devices is not None or layer_split is not None  # as resolve_needs counts a layer split
        if isinstance(path, ModelFile):
            mf = path
        else:
            if path is None:
                path = default_model_path()
            mf = open_model(path if str(path).startswith("synthetic:") else Path(path))
        self.file = mf
        self.tokenizer = Tokenizer.from_metadata(mf.metadata, source=str(mf.path)) \
            if has_tokenizer(mf.metadata) else None
        self.draft = draft
        drafter = None if draft is None else self._drafter(draft, 0)
        if drafter is not None:  # refused in the user's spelling (--draft NAME) before the engine starts
            self._check_needs(draft, drafter)
        self.stepper = open_engine(mf, device=device, engine=engine, artifact=artifact, max_ctx=max_ctx,
                                   quant_emulation=quant_emulation, threads=threads, dataflow=dataflow,
                                   devices=devices, layer_split=layer_split, taps=tuple(taps),
                                   record_hc=bool(record_hc), prefill_chunks=prefill_chunks, draft=drafter)
        self.max_ctx: int = max_ctx if max_ctx is not None else self.stepper.max_ctx
        self._turns = _Turns()
        self.batch: BatchEngine | None = None
        if lanes is not None:
            self.batch = self._open_batch(lanes)
        self.load_s = time.perf_counter() - t0

    def _open_batch(self, lanes: Any) -> BatchEngine:
        if isinstance(lanes, bool) or not isinstance(lanes, (int, BatchConfig)):
            raise Ds4cError(f"lanes: expected an int >= 1 (sequences per step) or a BatchConfig, found {lanes!r}")
        if isinstance(lanes, int) and lanes < 1:
            raise Ds4cError(f"lanes: expected an int >= 1 (sequences per step) or a BatchConfig, found {lanes!r}")
        cfg = lanes if isinstance(lanes, BatchConfig) else BatchConfig(max_lanes=lanes, max_rows=max(16, lanes))
        if self.draft is not None:
            if self.engine != "reference":
                raise Ds4cError(f"lanes: speculative rows inside the batch run on the reference engine; the "
                                f"{self.engine} step's batch decodes one row per sequence (open the Model without "
                                f"draft, or with engine='reference')")
            self._drafter(self.draft, 0)  # a spelling the batch cannot serve fails here, before the model opens it
        if self._split:
            raise Ds4cError("lanes: continuous batching runs on one device (not with devices / layer_split)")
        return BatchEngine(self.stepper, self.max_ctx, cfg)

    def close(self) -> None:
        """End the batch engine's running and waiting generations (``lanes``); a Model without lanes has nothing to
        close."""
        if self.batch is not None:
            self.batch.close()

    # ------------------------------------------------------------------------------------------ properties
    @property
    def config(self):
        """The model's :class:`~ds4c.config.Ds4Config`."""
        return self.file.config

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def memory_plan(self):
        """The compiled engine's :class:`~ds4c.runtime.memory_plan.MemoryPlan` (checked before loading), or None
        (the reference engine)."""
        return self.stepper.memory_plan if isinstance(self.stepper, CompiledEngine) else None

    @property
    def eos_id(self) -> int:
        """The end-of-sequence id generation stops at (the tokenizer's, else the config's)."""
        tok = self.tokenizer
        return tok.eos_id if tok is not None and tok.eos_id is not None else self.config.eos_id

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __repr__(self) -> str:
        return (f"Model({str(self.path)!r}, device={self.device!r}, engine={self.engine!r}, max_ctx={self.max_ctx}, "
                f"tokenizer={'yes' if self.tokenizer else 'no'})")

    # ------------------------------------------------------------------------------------------ text
    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise Ds4cError(f"{self.path}: {what} needs a tokenizer, but the file has no tokenizer.ggml.* keys "
                            f"(written by ds4c before 0.2?): pass token ids instead, or write the model again "
                            f"with ds4c make-model")
        return self.tokenizer

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of ``text``: bos first when ``add_bos`` (and the vocabulary has one); ``special`` matches
        control tokens written in the text (``<｜User｜>``...) as single ids.

        Raises:
            Ds4cError: the file has no tokenizer; ``text`` is not a str.
        """
        tok = self._need_tokenizer("tokenize (a text prompt)")
        ids = tok.encode(text, add_bos=False, parse_special=special)
        if add_bos and tok.bos_id is not None:
            ids.insert(0, tok.bos_id)
        return ids

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids`` (``skip_special`` leaves out control tokens such as bos / eos).

        Raises:
            Ds4cError: the file has no tokenizer; an id outside the vocabulary.
        """
        return self._need_tokenizer("detokenize").decode(ids, skip_special=skip_special)

    # ------------------------------------------------------------------------------------------ generate
    def _drafter(self, draft: Any, seed: int) -> Any:
        """``draft`` as a drafter: a spelling or a drafter file path made into one
        (:func:`ds4c.drafters.factory.make_drafter`, with ``seed``); anything else as it is."""
        if isinstance(draft, os.PathLike):  # a drafter file given as a path
            draft = os.fspath(draft)
        if not isinstance(draft, str):
            return draft
        # the drafters (their file formats and reference models) are imported when one is asked for: start-up speed
        from ds4c.drafters.factory import make_drafter

        return make_drafter(draft, self.config.vocab_size, seed, config=self.config, target_file=self.file)

    def _check_needs(self, given: Any, drafter: Any) -> None:
        """Refuse ``drafter`` (made from ``given``: a spelling, a path or the drafter itself) where this Model's
        engine cannot serve what it needs (:func:`ds4c.engine.resolve_needs`, its messages naming the drafter as
        ``given``: ``--draft dspark:PATH: ...``)."""
        name = os.fspath(given) if isinstance(given, (str, os.PathLike)) else drafter_name(drafter)
        resolve_needs(drafter_needs(drafter), self.engine, self._split, self._artifact, name=name)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The ids a prompt runs as: a str is tokenized with bos (unless it already begins with bos); ids are
        checked to be ints in the vocabulary.

        Raises:
            Ds4cError: a str on a file without tokenizer; an empty prompt; an id that is not an int (a bool
                included) or is outside ``0..vocab_size-1``.
        """
        if isinstance(prompt, str):
            tok = self._need_tokenizer("a text prompt")
            ids = tok.encode(prompt, add_bos=False)
            if tok.bos_id is not None and (tok.add_bos or not ids) and (not ids or ids[0] != tok.bos_id):
                ids.insert(0, tok.bos_id)
        else:
            if isinstance(prompt, (bytes, bytearray)):
                raise Ds4cError("prompt: expected a str or a list of token ids, found bytes")
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise Ds4cError(f"prompt: expected a str or a list of int token ids, found "
                                f"{type(prompt).__name__} {str(prompt)[:80]}") from None
            flags = [i for i, t in enumerate(prompt) if isinstance(t, bool)]
            if flags:  # operator.index(True) is 1: a bool is an int to Python, never a token id
                raise Ds4cError(f"prompt: expected int token ids, found a bool at index {flags[0]}")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise Ds4cError(f"prompt token ids must be in 0..{self.vocab_size - 1}, found {bad[0]}")
        if not ids:
            raise Ds4cError("the prompt must hold at least one token")
        return ids

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | str | None = None,
                 ignore_eos: bool = False, stream: bool = False, draft: str | Any | None = None,
                 spec_width: int | str = 5, on_prefill: Callable[[int, int], Any] | None = None,
                 cancel: threading.Event | None = None) -> Completion | CompletionStream:
        """Generate after ``prompt`` (text or token ids) on a fresh sequence.

        Args:
            prompt: a str (tokenized with bos) or token ids.
            max_new_tokens: at most this many new tokens (prompt + new tokens <= ``max_ctx``).
            temperature: 0 = greedy; else seeded sampling (spec P12) after ``top_k`` / ``top_p`` filtering.
            top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
            seed: the sampling seed (reproducible on each engine; the compiled step samples on the GPU with its
                own noise, equal in distribution to the CPU's).
            stop: stop strings: generation ends when the text contains one; the text stops before it.
            ignore_eos: do not stop at the eos token.
            stream: return a :class:`CompletionStream` of text pieces instead of a :class:`Completion`.
            draft: speculative decoding with this drafter (``"oracle:ALPHA"``, ``"dspark:PATH"``, ``"mtp"`` (this
                file's own MTP block), ``"mtp:PATH"`` (an MTP file), see :func:`ds4c.drafters.factory.make_drafter`,
                or a :class:`~ds4c.engine_protocol.Drafter`); None: the Model's ``draft`` (none when opened without
                one); ``result.speculative`` reports steps and acceptance. On the compiled engine the DSpark drafter
                needs the Model opened with its taps, the MTP drafter with the final HC recording: open it with
                ``draft=`` (or ``taps`` / ``record_hc=True``; a one-line StepError otherwise).
            spec_width: verify rows per speculative step (1..5: the last token and up to 4 drafts), or
                ``"auto"``: chosen per step from the acceptance so far and each width's measured cost.
            on_prefill: called as the prompt is ingested with ``(tokens done, prompt tokens)``, after each prefill
                step (the last call has them equal): e.g. a progress bar of a long prompt (``ds4c generate``'s).
            cancel: with ``lanes``, an event another thread sets to end this generation before the batch's next
                step (``stop_reason`` ``"stop"``; the server sets it when a client goes away).

        Raises:
            Ds4cError: a bad prompt (see :meth:`prompt_ids`), sampling values out of range, stop strings or
                ``stream`` on a file without tokenizer, a stop that is not a str or a list of str, an empty stop
                string, prompt + ``max_new_tokens`` past
                ``max_ctx``; a drafter this Model's engine cannot serve (:func:`ds4c.engine.resolve_needs`: a DSpark
                drafter on a layer split or, compiled, from an artifact; the MTP drafter on a split reference).
            GenerationInterrupted: Ctrl-C during the run (a KeyboardInterrupt; its ``completion`` holds the tokens
                and text so far, ``stop_reason`` ``"interrupted"``). A stream: see :meth:`CompletionStream.close`.
        """
        ids = self.prompt_ids(prompt)
        check_sampling(temperature, top_k, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise Ds4cError(f"max_new_tokens must be an int >= 0, found {max_new_tokens!r}")
        stops = check_stops(stop)
        if stops:
            self._need_tokenizer("stop strings")
        if stream:
            self._need_tokenizer("streaming text (stream=True)")
        if len(ids) + max_new_tokens > self.max_ctx:
            raise Ds4cError(f"the prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed max_ctx "
                            f"{self.max_ctx}; open the Model with a larger max_ctx")
        if on_prefill is not None and not callable(on_prefill):
            raise Ds4cError(f"on_prefill: expected a callable (done, total), found {type(on_prefill).__name__}")
        stop_ids = () if ignore_eos else (self.eos_id,)
        given = self.draft if draft is None else draft
        draft = self._drafter(given, seed)
        if draft is not None:  # what it needs of this Model's engine (the step records it, or a one-line refusal)
            self._check_needs(given, draft)
        ts: TokenStream | BatchRequest
        if cancel is not None and (self.batch is None or not isinstance(cancel, threading.Event)):
            raise Ds4cError("cancel: a threading.Event, with a Model opened with lanes (one generation at a time ends "
                            "with CompletionStream.close())")
        if self.batch is not None:  # lanes: this generation joins the running batch, no turn to wait for
            check_seed(seed)
            release = _nothing
            ts = self.batch.submit(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                   stop_ids=stop_ids, cancel=cancel, on_prefill=on_prefill, draft=draft,
                                   spec_width=spec_width)
        else:
            release = self._turns.take()  # another thread's unfinished generation: wait for it (class docstring)
            try:
                ts = stream_tokens(self.stepper, ids, max_new_tokens, temperature=temperature, seed=seed,
                                   top_k=top_k, top_p=top_p, stop_ids=stop_ids, draft=draft, spec_width=spec_width,
                                   on_end=release, on_prefill=on_prefill)
            except BaseException:
                release()
                raise
        holder: dict[str, Any] = {}
        if stream:
            def end() -> None:  # closed before its first piece, or dropped: the generation ends
                if "completion" not in holder:
                    holder["completion"] = self._completion("", ts.stop(), "stop", 0)

            return CompletionStream(self._text_run(ts, stops, holder), holder, end)
        try:
            if self.tokenizer is None:
                res = ts.run()
                return self._completion(None, res, res.stop_reason)
            for _ in self._text_run(ts, stops, holder):
                pass
            return holder["completion"]
        except KeyboardInterrupt as e:  # Ctrl-C: what was made so far, in the exception (the CLI prints it)
            c = holder.get("completion") or self._completion(None, ts.stop(), "stop")
            c.stop_reason = c.result.stop_reason = "interrupted"
            raise GenerationInterrupted(c) from e
        finally:
            release()

    # ------------------------------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            thinking: bool | None = None, reasoning_effort: str | None = None,
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation: the file's ``tokenizer.chat_template`` rendered by
        :func:`ds4c.chat.render_chat` (its rules: roles system, user, assistant and tool, each shown in the prompt;
        tool calls and ``tools`` only where the template renders them; a ``reasoning_effort`` the prompt must show,
        so with thinking on for DeepSeek-V4's template). ``tools``: OpenAI's function tools.

        Raises:
            Ds4cError: no tokenizer or no chat template; what :func:`~ds4c.chat.render_chat` raises.
        """
        return render_chat(self._need_tokenizer("chat"), messages, add_generation_prompt, thinking, reasoning_effort,
                           source=str(self.path), tools=tools)

    def chat(self, messages: Sequence[dict[str, Any]], max_new_tokens: int = 256, thinking: bool | None = None,
             reasoning_effort: str | None = None, tools: Sequence[dict[str, Any]] | None = None,
             **kw: Any) -> Completion | CompletionStream:
        """Generate the assistant's reply to ``messages`` (:meth:`apply_chat_template` with the generation
        prompt and ``tools``, then :meth:`generate` with ``kw``: temperature, top_k, top_p, seed, stop, ignore_eos,
        stream). Generation stops at the eos token that ends the assistant's turn. The reply is the model's raw
        text (reasoning and DSML tool calls included); ``ds4c serve`` parses them into OpenAI's fields."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=True, thinking=thinking,
                                          reasoning_effort=reasoning_effort, tools=tools)
        return self.generate(prompt, max_new_tokens=max_new_tokens, **kw)

    def _completion(self, text: str | None, res: GenerationResult, reason: str, n_ids: int | None = None) -> Completion:
        res.stop_reason = reason
        if n_ids is not None:
            res.tokens = res.tokens[:n_ids]
        t = Timings(self.load_s, res.prefill_s, res.decode_s, res.prefill_tokens_per_s, res.decode_tokens_per_s)
        return Completion(text, list(res.tokens), list(res.prompt), reason, t, res)

    def _text_run(self, ts: TokenStream, stops: list[str], holder: dict[str, Any]) -> Iterator[str]:
        """Text pieces of ``ts``'s tokens: complete UTF-8, never a piece that may begin a stop string; sets
        ``holder["completion"]`` at the end (also when closed early)."""
        assert self.tokenizer is not None
        dec = self.tokenizer.stream()
        acc, sent, n = "", 0, 0
        try:
            for t in ts:
                n += 1
                holder["n_tokens"] = n
                if ts.result is not None and ts.result.stop_reason == "eos":
                    break  # the eos token ends the text; it is not part of it
                acc += dec.push(t)
                cut = _earliest(acc, stops, sent) if stops else None
                if cut is not None:
                    if cut > sent:
                        yield acc[sent:cut]
                    sent = cut
                    holder["completion"] = self._completion(acc[:cut], ts.stop(), "stop", n)
                    return
                safe = len(acc) - (held_back(acc, stops) if stops else 0)
                if safe > sent:
                    piece, sent = acc[sent:safe], safe
                    yield piece
            acc += dec.flush()
            cut = _earliest(acc, stops, sent) if stops else None
            reason = ts.result.stop_reason if ts.result is not None else "length"
            if cut is not None:
                acc, reason = acc[:cut], "stop"
            if len(acc) > sent:
                piece, sent = acc[sent:], len(acc)
                yield piece
            holder["completion"] = self._completion(acc, ts.result or ts.stop(), reason)
        finally:
            if "completion" not in holder:  # closed early by the consumer
                holder["completion"] = self._completion(acc[:sent], ts.stop(), "stop", n)
            ts.stop()  # close the run now (at eos it is still open): the Model's turn ends with it
