"""Tests of ds4c.tokenizer and ds4c.synth_vocab: the deepseek-v3 pre-tokenizer splits (known answers read off the regexes of
llama.cpp's src/llama-vocab.cpp, not produced by the code), encode/decode round trips (ASCII, code, CJK, emoji,
control characters), special / user-defined tokens, the streaming detokenizer on split and invalid UTF-8,
synthetic vocabularies (exact sizes, determinism across processes, BPE validity, the chat template), GGUF
metadata read back through gguf-py, and the errors for bad metadata."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ds4c.config import preset
from ds4c.errors import Ds4cError
from ds4c.synth_vocab import MIN_SYNTHETIC_VOCAB, SYNTHETIC_CHAT_TEMPLATE, synthetic_vocab
from ds4c.tokenizer import (
    BYTE_TO_CHAR,
    DEEPSEEK_V3_SPLITS,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    TokenType,
    has_tokenizer,
)

TINY_VOCAB = preset("tiny").vocab_size
FLASH_VOCAB = preset("flash").vocab_size
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x * 2  # doubles\n\n\tif x >= 10 and y != 3: pass\r\n",
    "#include <stdio.h>\nint main() { printf(\"%d\\n\", 42); return 0; }",
    "人工智能是计算机科学的一个分支。你好，世界！",
    "日本語のテキスト、カタカナとひらがな。",
    "emoji 😀🚀👍🏽 ❤️ flags 🇫🇷 and ZWJ 👩‍💻",
    "numbers 1234567890 3.14159 -42 1e-6 0x1F 2025-01-31",
    "   leading and trailing spaces   \n\n\n  ",
    "controls \x00\x01\x7f and combining e\u0301 and Ω≈ç√∫ and \u200b zero width",
    "",
]


@pytest.fixture(scope="module")
def tiny_meta() -> dict:
    return synthetic_vocab(TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny(tiny_meta: dict) -> Tokenizer:
    return Tokenizer.from_metadata(tiny_meta, source="tiny")


@pytest.fixture(scope="module")
def flash_meta() -> dict:
    return synthetic_vocab(FLASH_VOCAB)


@pytest.fixture(scope="module")
def flash(flash_meta: dict) -> Tokenizer:
    return Tokenizer.from_metadata(flash_meta, source="flash")


def _digest(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """The ids of the single-byte tokens spelling ``data``."""
    return [tok.token_to_id(BYTE_TO_CHAR[b]) for b in data]


# ----------------------------------------------------------------------------------- pre-tokenizer splits
@pytest.mark.parametrize("text, pieces", [
    # digits first, in runs of at most 3 (\p{N}{1,3}), then letters with one optional leading space
    ("Hello world123456", ["Hello", " world", "123", "456"]),
    ("1234567", ["123", "456", "7"]),
    ("abc123def", ["abc", "123", "def"]),
    ("2+2=4", ["2", "+", "2", "=", "4"]),
    # the space before a digit run is left alone: "\s+(?!\S)" at the end of the "a " fragment
    ("a 1", ["a", " ", "1"]),
    # CJK / kana runs are isolated before the big regex; fullwidth punctuation is \p{P}
    ("你好，世界", ["你好", "，", "世界"]),
    ("中文English日本語テスト", ["中文", "English", "日本語テスト"]),
    ("ひらがなとカタカナ", ["ひらがなとカタカナ"]),
    # one ASCII punctuation character glued to the letters after it
    (".append(x)", [".append", "(x", ")"]),
    ("don't", ["don", "'t"]),
    ("$x", ["$x"]),
    ("€x", ["€", "x"]),                      # € is \p{Sc} but not in the ASCII class: a symbol run
    # punctuation runs take one leading space and trailing newlines
    ("foo!!! bar", ["foo", "!!!", " bar"]),
    ("x = y;\n", ["x", " =", " y", ";\n"]),
    ("😀😀 ok", ["😀😀", " ok"]),
    # whitespace: newline runs, spaces before a word keep one for the word, trailing runs whole
    ("a\n\n  b", ["a", "\n\n", " ", " b"]),
    ("x  \n y", ["x", "  \n", " y"]),
    ("   a", ["  ", " a"]),
    ("end   ", ["end", "   "]),
    ("tab\tx", ["tab", "\tx"]),              # a tab is a valid one-character prefix of a letter run
    ("café cafe\u0301", ["café", " cafe\u0301"]),  # \p{M} combining marks stay with the letters
])
def test_pre_tokenizer_known_splits(tiny: Tokenizer, text: str, pieces: list[str]) -> None:
    assert tiny.pre_tokenize(text) == pieces


def test_pre_tokenizer_is_lossless_and_byte_level(tiny: Tokenizer) -> None:
    rng = random.Random(5)
    alphabet = "aZ 09\n\t.,;!?'\"()[]{}<>=+-_/\\$€中文ひカ😀é\u0301\r"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert "".join(tiny.pre_tokenize(text)) == text
    # after the splits, ByteLevel maps each piece's bytes to the gpt2 alphabet (space -> Ġ, newline -> Ċ)
    pieces = [p for p, _ in tiny.hf.pre_tokenizer.pre_tokenize_str("a b\n中")]
    assert pieces == ["a", "Ġb", "Ċ", "ä¸Ń"]


def test_splits_are_llama_cpp_regexes() -> None:
    # the third regex exactly as the C++ string literal reads once unescaped (CR and LF as characters)
    assert DEEPSEEK_V3_SPLITS[0] == "\\p{N}{1,3}"
    assert DEEPSEEK_V3_SPLITS[1] == "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
    assert DEEPSEEK_V3_SPLITS[2] == (
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")


def test_byte_alphabet_is_gpt2s() -> None:
    from tokenizers import pre_tokenizers

    assert sorted(BYTE_TO_CHAR.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert BYTE_TO_CHAR[ord(" ")] == "Ġ" and BYTE_TO_CHAR[ord("\n")] == "Ċ" and BYTE_TO_CHAR[ord("A")] == "A"
    assert BYTE_TO_CHAR[0] == "Ā" and BYTE_TO_CHAR[0xAD] == "Ń" and BYTE_TO_CHAR[0xFF] == "ÿ"


# ----------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_round_trips(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")
        # the library's own ByteLevel decoder agrees on normal tokens
        assert tok.hf.decode(ids, skip_special_tokens=False) == text
        if text:
            assert ids, text
    rng = random.Random(1)
    for _ in range(100):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0x2FFF),
                                       rng.randrange(0x4E00, 0x9FA6), rng.randrange(0x1F300, 0x1FAFF)]))
                       for _ in range(rng.randrange(1, 30)))
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_add_bos_follows_metadata(tiny: Tokenizer, tiny_meta: dict) -> None:
    assert tiny.add_bos and not tiny.add_eos
    ids = tiny.encode("hi")
    assert ids[0] == tiny.bos_id == 0
    assert ids[1:] == tiny.encode("hi", add_bos=False)
    assert tiny.decode(ids) == BOS + "hi"
    assert tiny.decode(ids, skip_special=True) == "hi"
    assert tiny.encode("hi", add_eos=True)[-1] == tiny.eos_id == 1
    no_bos = Tokenizer.from_metadata({**tiny_meta, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hi") == tiny.encode("hi", add_bos=False)
    absent = {k: v for k, v in tiny_meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert not Tokenizer.from_metadata(absent).add_bos      # llama.cpp's default for gpt2 vocabularies


def test_flash_vocab_merges_into_long_tokens(flash: Tokenizer) -> None:
    # a big vocabulary really merges: frequent corpus words are single tokens, and text gets much shorter
    # in tokens than in bytes
    assert flash.encode(" the", add_bos=False) == [flash.token_to_id("Ġthe")]
    assert len(flash.encode(" model", add_bos=False)) == 1
    text = TEXTS[0] + TEXTS[1] + TEXTS[3]
    assert len(flash.encode(text, add_bos=False)) < len(text.encode()) / 2.5


def test_bpe_matches_an_independent_rank_order_bpe(flash: Tokenizer, flash_meta: dict) -> None:
    """tokenizers' BPE applies the GGUF merges in rank order (lowest rank, leftmost pair first) on each
    pre-tokenizer piece, as llama.cpp's llm_tokenizer_bpe_session does."""
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(flash_meta["tokenizer.ggml.merges"])}

    def bpe(piece: str) -> list[str]:
        syms = [BYTE_TO_CHAR[b] for b in piece.encode("utf-8")]
        while len(syms) > 1:
            best = min(range(len(syms) - 1), key=lambda i: (ranks.get((syms[i], syms[i + 1]), 1 << 60), i))
            if (syms[best], syms[best + 1]) not in ranks:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        return syms

    rng = random.Random(3)
    words = TEXTS[0].split() + TEXTS[1].split() + ["人工智能", "カタカナ", "tokenizer", "123456", "😀"]
    for _ in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        want = [flash.token_to_id(s) for p in flash.pre_tokenize(text) for s in bpe(p)]
        assert flash.encode(text, add_bos=False) == want, text


# ---------------------------------------------------------------------------------------- special tokens
def test_special_tokens_matched_whole(tiny: Tokenizer) -> None:
    user, asst = tiny.specials[USER], tiny.specials[ASSISTANT]
    think, end_think = tiny.specials["<think>"], tiny.specials["</think>"]
    ids = tiny.encode(f"{USER}hi{ASSISTANT}<think>x</think>ok{EOS}", add_bos=False)
    assert ids[0] == user and asst in ids and ids[-1] == tiny.eos_id
    assert ids.index(think) + 2 == ids.index(end_think)
    assert tiny.decode(ids) == f"{USER}hi{ASSISTANT}<think>x</think>ok{EOS}"
    # skip_special drops control tokens only; user-defined ones (<think>) stay, as in llama.cpp
    assert tiny.decode(ids, skip_special=True) == "hi<think>x</think>ok"
    assert tiny.token_to_piece(user) == USER.encode() and tiny.token_to_piece(user, special=False) == b""
    assert tiny.token_to_piece(think, special=False) == b"<think>"
    # a special token glued to text on both sides
    ids = tiny.encode(f"a{USER}b", add_bos=False)
    assert ids == tiny.encode("a", add_bos=False) + [user] + tiny.encode("b", add_bos=False)


def test_parse_special_false_tokenizes_control_text_as_text(tiny: Tokenizer) -> None:
    text = f"{USER}hi{ASSISTANT}<think>"
    ids = tiny.encode(text, add_bos=False, parse_special=False)
    assert not set(ids) & tiny.special_ids
    assert tiny.specials["<think>"] in ids            # user-defined tokens are matched either way
    assert tiny.decode(ids) == text
    assert len(ids) > 3
    # the default tokenizer is unchanged by the plain twin
    assert tiny.encode(text, add_bos=False)[0] == tiny.specials[USER]


def test_unused_tokens_decode_to_nothing(tiny_meta: dict) -> None:
    meta = dict(tiny_meta)
    types = list(meta["tokenizer.ggml.token_type"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-1], types[-1] = "[PAD511]", int(TokenType.UNUSED)   # the converter's filler for unused ids
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    assert tok.decode([tok.vocab_size - 1]) == "" and tok.token_to_piece(tok.vocab_size - 1) == b""
    assert tok.vocab_size - 1 not in tok.encode("[PAD511]", add_bos=False)


# -------------------------------------------------------------------------------------- stream decoding
def test_stream_decoder_never_splits_a_character(tiny: Tokenizer) -> None:
    held_back = 0
    for text in TEXTS:
        ids = tiny.encode(text, add_bos=False)
        dec = tiny.stream()
        parts = [dec.push(i) for i in ids]
        held_back += sum(1 for p in parts if p == "")
        assert all("\ufffd" not in p for p in parts)
        assert "".join(parts) + dec.flush() == text
        # after each push, the text so far is all the bytes so far but an incomplete character (< 4 bytes)
        done, shown = b"", ""
        for i, p in zip(ids, parts):
            done += tiny.token_to_piece(i)
            shown += p
            assert done.startswith(shown.encode()) and len(done) - len(shown.encode()) < 4
    assert held_back > 10        # the tiny vocabulary splits CJK and emoji into byte tokens


def test_stream_decoder_known_byte_sequences(tiny: Tokenizer) -> None:
    zh = "中".encode()                       # e4 b8 ad
    dec = tiny.stream()
    assert [dec.push(i) for i in _byte_ids(tiny, zh)] == ["", "", "中"]
    # an incomplete character followed by ASCII: the maximal invalid prefix becomes one U+FFFD
    assert [dec.push(i) for i in _byte_ids(tiny, b"\xe4\xb8a")] == ["", "", "\ufffda"]
    # a lone continuation byte is invalid at once
    assert dec.push(_byte_ids(tiny, b"\x80")[0]) == "\ufffd"
    # a truncated 4-byte emoji at the end of the stream comes out of flush
    assert [dec.push(i) for i in _byte_ids(tiny, "😀".encode()[:2])] == ["", ""]
    assert dec.pending == 2
    assert dec.flush() == "\ufffd" and dec.pending == 0
    assert dec.push(_byte_ids(tiny, b"x")[0]) == "x"
    assert tiny.decode(_byte_ids(tiny, b"\xe4\xb8a\x80\xf0\x9f")) == "\ufffda\ufffd\ufffd"


def test_stream_decoder_equals_decode_on_random_ids(tiny: Tokenizer) -> None:
    rng = random.Random(11)
    for skip in (False, True):
        for _ in range(300):
            ids = [rng.randrange(tiny.vocab_size) for _ in range(rng.randrange(0, 25))]
            dec = StreamDecoder(tiny, skip_special=skip)
            out = [dec.push(i) for i in ids]
            assert "".join(out) + dec.flush() == tiny.decode(ids, skip_special=skip)
            for p in out:                    # nothing returned ends inside a character
                p.encode("utf-8")


# ---------------------------------------------------------------------------------- synthetic vocabularies
@pytest.mark.parametrize("n", [MIN_SYNTHETIC_VOCAB, TINY_VOCAB, 1000, FLASH_VOCAB])
def test_synthetic_vocab_exact_size_and_layout(n: int, tiny_meta: dict, flash_meta: dict) -> None:
    meta = {TINY_VOCAB: tiny_meta, FLASH_VOCAB: flash_meta}.get(n) or synthetic_vocab(n)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = meta["tokenizer.ggml.merges"]
    assert len(tokens) == len(types) == n
    assert len(set(tokens)) == n
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "deepseek-v3"
    assert tokens[:3] == [BOS, EOS, PAD] and types[:3] == [3, 3, 3]
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
            meta["tokenizer.ggml.padding_token_id"]) == (0, 1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert tokens[3:259] == [BYTE_TO_CHAR[b] for b in range(256)]
    tail = tokens[n - 8:]
    assert tail == [USER, ASSISTANT, "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>",
                    "｜DSML｜"]
    assert types[n - 8:] == [3, 3, 4, 4, 3, 3, 3, 4]
    assert types[3:n - 8] == [1] * (n - 11)
    # merge r creates token 259 + r out of two earlier tokens
    assert len(merges) == n - MIN_SYNTHETIC_VOCAB
    index = {t: i for i, t in enumerate(tokens)}
    for r, m in enumerate(merges):
        a, b = m.split(" ")
        assert tokens[259 + r] == a + b
        assert 3 <= index[a] < 259 + r and 3 <= index[b] < 259 + r


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_synthetic_tokens_are_reachable_single_pieces(which: str, request: pytest.FixtureRequest) -> None:
    """Every normal token whose bytes are whole UTF-8 text is one pre-tokenizer piece and encodes to itself:
    the vocabulary is real BPE, not padding."""
    tok: Tokenizer = request.getfixturevalue(which)
    ids, texts = [], []
    for i in range(tok.vocab_size):
        if tok.token_type(i) == TokenType.NORMAL:
            try:
                texts.append(tok.token_to_piece(i).decode("utf-8"))
                ids.append(i)
            except UnicodeDecodeError:
                pass                           # part of a multi-byte character
    assert len(ids) > tok.vocab_size // 2
    encs = tok.hf.encode_batch(texts, add_special_tokens=False)
    assert [e.ids for e in encs] == [[i] for i in ids]
    step = 1 if which == "tiny" else 37
    assert all(len(tok.pre_tokenize(t)) == 1 for t in texts[::step])


def test_synthetic_vocab_is_deterministic(tiny_meta: dict, flash_meta: dict) -> None:
    assert _digest(synthetic_vocab(TINY_VOCAB)) == _digest(tiny_meta)
    assert _digest(synthetic_vocab(FLASH_VOCAB, seed=0)) == _digest(flash_meta)
    # the seed only picks the pseudo-text past the corpus; small vocabularies come from the corpus alone
    assert _digest(synthetic_vocab(TINY_VOCAB, seed=7)) == _digest(tiny_meta)
    other = synthetic_vocab(20000, seed=1)
    assert _digest(other) != _digest(synthetic_vocab(20000, seed=0))
    assert other["tokenizer.ggml.tokens"][:1000] == synthetic_vocab(20000)["tokenizer.ggml.tokens"][:1000]


def test_synthetic_vocab_same_bytes_in_another_process(tiny_meta: dict) -> None:
    """No dependence on hash seeds or process state (tokenizers' and Python's hashes are per process)."""
    code = ("import hashlib, json; from ds4c.synth_vocab import synthetic_vocab; "
            f"m = synthetic_vocab({TINY_VOCAB}); m2 = synthetic_vocab(5000, seed=3); "
            "print(hashlib.sha256(json.dumps([m, m2], sort_keys=True, ensure_ascii=False).encode()).hexdigest())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": "/usr/bin:/bin"}).stdout.strip() for s in (1, 2)}
    here = hashlib.sha256(json.dumps([tiny_meta, synthetic_vocab(5000, seed=3)], sort_keys=True,
                                     ensure_ascii=False).encode()).hexdigest()
    assert outs == {here}


def test_synthetic_vocab_minimum() -> None:
    assert MIN_SYNTHETIC_VOCAB == 256 + 11
    tok = Tokenizer.from_metadata(synthetic_vocab(MIN_SYNTHETIC_VOCAB))
    assert tok.decode(tok.encode("bytes only: 中😀", add_bos=False)) == "bytes only: 中😀"
    assert len(tok.encode("abc", add_bos=False)) == 3
    with pytest.raises(TokenizerError, match=r"synthetic vocabulary of 266 tokens: expected at least 267"):
        synthetic_vocab(MIN_SYNTHETIC_VOCAB - 1)


def test_synthetic_chat_template_renders() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tmpl = ImmutableSandboxedEnvironment().from_string(SYNTHETIC_CHAT_TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    out = tmpl.render(messages=msgs, bos_token=BOS, add_generation_prompt=True)
    assert out == f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello.{EOS}{USER}2+2?{ASSISTANT}</think>"
    out = tmpl.render(messages=msgs[:2], bos_token=BOS, add_generation_prompt=True, thinking=True,
                      reasoning_effort="high")
    assert out == f"{BOS}Reasoning Effort: high.\n\nBe brief.{USER}Hi{ASSISTANT}<think>"
    out = tmpl.render(messages=msgs[1:2], bos_token=BOS, add_generation_prompt=True, enable_thinking=True)
    assert out == f"{BOS}{USER}Hi{ASSISTANT}<think>"
    out = tmpl.render(messages=msgs[1:2] + [{"role": "assistant", "content": "4", "reasoning_content": "sum"}],
                      bos_token=BOS, thinking=True)
    assert out == f"{BOS}{USER}Hi{ASSISTANT}<think>sum</think>4{EOS}"
    # llama.cpp recognises it as a DeepSeek-V3-style template (src/llama-chat.cpp)
    assert all(s in SYNTHETIC_CHAT_TEMPLATE for s in (ASSISTANT, USER, EOS))


# --------------------------------------------------------------------------------- GGUF metadata, errors
def test_from_gguf_metadata_round_trip(tmp_path: Path, tiny_meta: dict, tiny: Tokenizer) -> None:
    """Written the way llama.cpp's converter writes it (gguf-py), read back the way ModelFile.metadata reads
    it, the vocabulary is the same tokenizer."""
    from gguf import GGUFReader, GGUFWriter

    from ds4c.gguf_file import _field_value

    m = tiny_meta
    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(str(path), "deepseek4")
    w.add_tokenizer_model(m["tokenizer.ggml.model"])
    w.add_tokenizer_pre(m["tokenizer.ggml.pre"])
    w.add_token_list(m["tokenizer.ggml.tokens"])
    w.add_token_types(m["tokenizer.ggml.token_type"])
    w.add_token_merges(m["tokenizer.ggml.merges"])
    w.add_bos_token_id(m["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(m["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(m["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(m["tokenizer.ggml.add_bos_token"])
    w.add_add_eos_token(m["tokenizer.ggml.add_eos_token"])
    w.add_chat_template(m["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = GGUFReader(str(path))
    meta = {name: _field_value(f) for name, f in r.fields.items() if not name.startswith("GGUF.")}
    assert has_tokenizer(meta) and not has_tokenizer({"general.architecture": "deepseek4"})
    tok = Tokenizer.from_metadata(meta, source=str(path))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (TINY_VOCAB, 0, 1, 2, True)
    assert tok.chat_template == SYNTHETIC_CHAT_TEMPLATE
    assert (tok.model, tok.pre) == ("gpt2", "deepseek-v3")
    assert tok.specials == tiny.specials
    for text in TEXTS:
        assert tok.encode(text) == tiny.encode(text)


def _err(meta: dict, **kw: object) -> str:
    with pytest.raises(TokenizerError) as ei:
        Tokenizer.from_metadata({**meta, **kw}, source="m.gguf")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("m.gguf: ")
    return msg


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges"])
def test_missing_key(tiny_meta: dict, key: str) -> None:
    meta = {k: v for k, v in tiny_meta.items() if k != key}
    with pytest.raises(TokenizerError, match=f"m.gguf: missing tokenizer metadata key '{key}'"):
        Tokenizer.from_metadata(meta, source="m.gguf")


def test_no_tokenizer_at_all() -> None:
    with pytest.raises(TokenizerError, match="the file has no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "deepseek4"}, source="old.gguf")


def test_bad_metadata_errors(tiny_meta: dict) -> None:
    m = tiny_meta
    assert issubclass(TokenizerError, Ds4cError)
    msg = _err(m, **{"tokenizer.ggml.model": "llama"})
    assert "'llama'" in msg and "'gpt2'" in msg
    msg = _err(m, **{"tokenizer.ggml.pre": "qwen2"})
    assert "'qwen2'" in msg and "'deepseek-v3'" in msg
    msg = _err(m, **{"tokenizer.ggml.token_type": m["tokenizer.ggml.token_type"][:-1]})
    assert f"token_type has {TINY_VOCAB - 1} entries, tokenizer.ggml.tokens has {TINY_VOCAB}" in msg
    msg = _err(m, **{"tokenizer.ggml.token_type": m["tokenizer.ggml.token_type"][:-1] + [9]})
    assert "has type 9" in msg
    toks = list(m["tokenizer.ggml.tokens"])
    toks[5] = toks[4]
    assert "token 5 " in _err(m, **{"tokenizer.ggml.tokens": toks}) and "repeats token 4" in _err(
        m, **{"tokenizer.ggml.tokens": toks})
    assert "expected 'left right'" in _err(m, **{"tokenizer.ggml.merges": ["nospace"]})
    assert "needs token 'zzz'" in _err(m, **{"tokenizer.ggml.merges": ["Ġ zzz"]})
    assert "bos token id 512 is outside the vocabulary 0..511" in _err(m, **{"tokenizer.ggml.bos_token_id": 512})
    assert "expected a list of strings" in _err(m, **{"tokenizer.ggml.tokens": "abc"})
    assert "is empty" in _err(m, **{"tokenizer.ggml.tokens": [], "tokenizer.ggml.token_type": []})
    assert "expected a string" in _err(m, **{"tokenizer.chat_template": 3})


def test_call_errors(tiny: Tokenizer, tiny_meta: dict) -> None:
    for bad in (TINY_VOCAB, -1, 10**9):
        with pytest.raises(TokenizerError, match=rf"decode: token id {bad} is outside the vocabulary 0\.\.511"):
            tiny.decode([1, bad])
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tiny.stream().push(bad)
    with pytest.raises(TokenizerError, match="expected an integer token id"):
        tiny.decode(["a"])
    with pytest.raises(TokenizerError, match="expected a str, found bytes"):
        tiny.encode(b"abc")  # type: ignore[arg-type]
    no_bos = {k: v for k, v in tiny_meta.items() if k != "tokenizer.ggml.bos_token_id"}
    with pytest.raises(TokenizerError, match="has no tokenizer.ggml.bos_token_id"):
        Tokenizer.from_metadata(no_bos, source="m.gguf").encode("x")
    assert tiny.decode([]) == "" and tiny.encode("", add_bos=False) == []


def test_properties(tiny: Tokenizer, flash: Tokenizer) -> None:
    assert (tiny.vocab_size, len(tiny), flash.vocab_size) == (TINY_VOCAB, TINY_VOCAB, FLASH_VOCAB)
    assert tiny.specials[BOS] == 0 and tiny.specials[EOS] == 1 and tiny.specials[PAD] == 2
    assert len(tiny.specials) == 11
    assert tiny.special_ids == {0, 1, 2, 504, 505, 508, 509, 510}
    assert tiny.id_to_token(3 + ord(" ")) == "Ġ" and tiny.token_to_id("Ġ") == 3 + ord(" ")
    assert tiny.token_type(0) == TokenType.CONTROL and tiny.token_type(506) == TokenType.USER_DEFINED
    assert tiny.token_to_piece(3 + 0xE4) == b"\xe4"
    assert "vocab_size=512" in repr(tiny)
