"""The GGUF tokenizer of DeepSeek-V4: byte-level BPE read from ``tokenizer.ggml.*`` metadata.

llama.cpp's converter (``conversion/base.py`` ``_set_vocab_gpt2``) writes DeepSeek-V4's vocabulary as a
gpt2-style tokenizer: ``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre = "deepseek-v3"``, the token
texts (``tokens``, byte-level encoded for normal tokens, raw text for added tokens), their ``token_type``
(gguf ``TokenType``: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), the ``merges``
(``"left right"`` in rank order), the bos/eos/padding ids, ``add_bos_token`` / ``add_eos_token`` and
``tokenizer.chat_template``.

:class:`Tokenizer` turns that metadata into a HuggingFace ``tokenizers`` pipeline (no hand-written BPE):

* model: ``BPE(vocab, merges)``, no unknown token, no byte fallback (every byte is a token);
* pre-tokenizer: the ``deepseek-v3`` splits of ``src/llama-vocab.cpp`` (``LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM``),
  three regexes applied in sequence, each ``Split(..., "isolated")``: digit runs of at most 3
  (``\\p{N}{1,3}``), CJK / hiragana / katakana runs, then the big word/punctuation/whitespace regex; then
  ``ByteLevel(add_prefix_space=False, use_regex=False)`` (bytes -> the gpt2 printable alphabet);
* decoder: ``ByteLevel``;
* control / unknown tokens are special added tokens (matched whole in text when ``parse_special``; skipped by
  ``decode(skip_special=True)``), user-defined tokens are non-special added tokens (always matched whole,
  always decoded) - llama.cpp's ``tokenizer_st_partition`` / ``token_to_piece`` rules.

Decoding maps each id to the bytes llama.cpp's ``llama_token_to_piece`` gives it (normal: byte-level chars ->
bytes; control / user-defined: the raw text; unused: nothing) and decodes the concatenation as UTF-8, so
:class:`StreamDecoder` (streaming) and :meth:`Tokenizer.decode` agree byte for byte.

:func:`synthetic_vocab` builds the same metadata for synthetic models: a real, deterministic byte-level BPE
vocabulary of any size >= :data:`MIN_SYNTHETIC_VOCAB`, with DeepSeek's special tokens and a DeepSeek-V4-style
chat template.
"""

from __future__ import annotations

import codecs
import heapq
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ds4c.errors import Ds4cError

__all__ = [
    "TokenizerError", "TokenType", "Tokenizer", "StreamDecoder", "has_tokenizer", "synthetic_vocab",
    "DEEPSEEK_V3_SPLITS", "MIN_SYNTHETIC_VOCAB", "SYNTHETIC_SPECIALS", "SYNTHETIC_CHAT_TEMPLATE",
    "V4_TOOLS_HEADER", "V4_TOOLS_FOOTER",
]


class TokenizerError(Ds4cError):
    """The tokenizer metadata is missing, unsupported or inconsistent, or a tokenizer call got bad input
    (a token id outside the vocabulary, a vocabulary size too small to build)."""


class TokenType(IntEnum):
    """gguf-py ``TokenType`` (``tokenizer.ggml.token_type`` values)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# GGUF keys (gguf-py constants.py Keys.Tokenizer)
KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_TYPES = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_PAD = "tokenizer.ggml.padding_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"

SUPPORTED_MODEL = "gpt2"
SUPPORTED_PRE = "deepseek-v3"

#: The ``deepseek-v3`` pre-tokenizer of llama.cpp (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM),
#: applied in this order; the same three splits as DeepSeek-V3/V4's tokenizer.json.
DEEPSEEK_V3_SPLITS: tuple[str, ...] = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    # the C++ literal of llama-vocab.cpp, character for character (CR / LF are real characters here too)
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)

_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)           # skipped by decode(skip_special=True)
_ADDED_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)  # matched whole in text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet): printable latin-1 bytes map to
    themselves, the other 68 to U+0100.. in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_TO_CHAR: dict[int, str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}
_TO_LATIN1 = str.maketrans({c: chr(b) for b, c in BYTE_TO_CHAR.items()})  # byte-level text -> latin-1 text
_FROM_LATIN1 = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})
_BYTES_TO_CHARS = [BYTE_TO_CHAR[b] for b in range(256)]


def _byte_level(text: str) -> str:
    """The byte-level (gpt2 alphabet) form of ``text``'s UTF-8 bytes."""
    return text.encode("utf-8").decode("latin-1").translate(_FROM_LATIN1)


def _unbyte_level(token: str) -> bytes:
    """The bytes a byte-level token stands for; a character outside the alphabet stands for its own UTF-8
    bytes (what tokenizers' ByteLevel decoder does for such a token)."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in token)


def _deepseek_v3_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in DEEPSEEK_V3_SPLITS]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def has_tokenizer(meta: Mapping[str, Any]) -> bool:
    """Whether GGUF metadata carries a tokenizer at all (``tokenizer.ggml.model`` and ``tokens``); files
    written by ds4c before the tokenizer existed have neither."""
    return KEY_MODEL in meta and KEY_TOKENS in meta


# ----------------------------------------------------------------------------------------------------------
class Tokenizer:
    """A DeepSeek-V4 (gpt2 / deepseek-v3) byte-level BPE tokenizer.

    Build it with :meth:`from_metadata` from a GGUF's metadata (``ModelFile.metadata``, or any mapping of key
    -> Python value such as :func:`synthetic_vocab`'s), or directly from the vocabulary::

        Tokenizer(tokens, token_types, merges, bos_id=0, eos_id=1, add_bos=True)

    Args:
        tokens: the token texts, id order (normal tokens byte-level encoded, added tokens raw).
        token_types: one :class:`TokenType` value per token (``None``: all normal, as llama.cpp assumes when
            the key is absent).
        merges: ``"left right"`` strings in rank order (llama.cpp splits at the first space after the first
            character).
        bos_id / eos_id / pad_id: special ids or ``None``.
        add_bos / add_eos: what :meth:`encode` does when its ``add_bos`` / ``add_eos`` are ``None``.
        chat_template: the Jinja chat template or ``None``.
        model / pre: checked to be ``"gpt2"`` / ``"deepseek-v3"``.
        source: names the input in error messages (a file path).

    Raises:
        TokenizerError: unsupported model or pre-tokenizer, tokens/types of different lengths, an unknown
            token type, repeated token texts, a malformed merge or one whose parts or result are not tokens,
            a special id outside the vocabulary.
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int] | None, merges: Sequence[str], *,
                 bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 model: str = SUPPORTED_MODEL, pre: str = SUPPORTED_PRE, source: str = "<tokenizer>"):
        self._source = source
        if model != SUPPORTED_MODEL:
            raise TokenizerError(f"{source}: unsupported tokenizer model {KEY_MODEL} = {model!r}; ds4c reads "
                                 f"{SUPPORTED_MODEL!r} (byte-level BPE) vocabularies only")
        if pre != SUPPORTED_PRE:
            raise TokenizerError(f"{source}: unsupported pre-tokenizer {KEY_PRE} = {pre!r}; expected "
                                 f"{SUPPORTED_PRE!r} (DeepSeek-V3/V4's split rules)")
        tokens = _str_list(tokens, KEY_TOKENS, source)
        n = len(tokens)
        if n == 0:
            raise TokenizerError(f"{source}: {KEY_TOKENS} is empty; expected the vocabulary's token texts")
        if token_types is None:
            types = [int(TokenType.NORMAL)] * n
        else:
            types = _int_list(token_types, KEY_TYPES, source)
            if len(types) != n:
                raise TokenizerError(f"{source}: {KEY_TYPES} has {len(types)} entries, {KEY_TOKENS} has {n}; "
                                     f"expected one type per token")
            valid = {int(t) for t in TokenType}
            for i, t in enumerate(types):
                if t not in valid:
                    raise TokenizerError(f"{source}: token {i} {tokens[i]!r} has type {t}; expected one of "
                                         f"{sorted(valid)} (gguf TokenType)")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            j = vocab.setdefault(t, i)
            if j != i:
                raise TokenizerError(f"{source}: token {i} {t!r} repeats token {j}; expected unique token texts "
                                     f"(llama.cpp rejects such a vocabulary too)")
        pairs = _parse_merges(merges, vocab, source)
        self._bos = _opt_id(bos_id, "bos", n, source)
        self._eos = _opt_id(eos_id, "eos", n, source)
        self._pad = _opt_id(pad_id, "padding", n, source)
        self._tokens = tokens
        self._types = tuple(types)
        self._vocab = vocab
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos)
        self._chat_template = None if chat_template is None else str(chat_template)
        self._model = model
        self._pre = pre
        self._specials = {tokens[i]: i for i in range(n) if types[i] in _ADDED_TYPES}
        self._special_ids = frozenset(i for i in range(n) if types[i] in _SPECIAL_TYPES)
        self._pieces = [_piece(tokens[i], types[i]) for i in range(n)]
        self._merges = pairs
        self._hf = self._build_hf(encode_special=False)
        self._hf_plain: _HFTokenizer | None = None   # parse_special=False twin, built on first use

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "<metadata>") -> Tokenizer:
        """Build the tokenizer from GGUF metadata (full key -> Python value, e.g. ``ModelFile.metadata``).

        Reads ``tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id, eos_token_id,
        padding_token_id, add_bos_token, add_eos_token}`` and ``tokenizer.chat_template``; model, pre, tokens
        and merges are required, the rest optional (``add_bos_token`` defaults to false, llama.cpp's default for
        gpt2 vocabularies).

        Raises:
            TokenizerError: a required key is missing, or the values are unsupported or inconsistent (see the
                class); the message starts with ``source``.
        """
        for key in (KEY_MODEL, KEY_PRE, KEY_TOKENS, KEY_MERGES):
            if key not in meta:
                hint = (" (the file has no tokenizer; rewrite it with a current ds4c, or use token ids)"
                        if not has_tokenizer(meta) else "")
                raise TokenizerError(f"{source}: missing tokenizer metadata key {key!r}{hint}")
        tmpl = meta.get(KEY_CHAT_TEMPLATE)
        if tmpl is not None and not isinstance(tmpl, str):
            raise TokenizerError(f"{source}: {KEY_CHAT_TEMPLATE} is a {type(tmpl).__name__}; expected a string")
        return cls(meta[KEY_TOKENS], meta.get(KEY_TYPES), meta[KEY_MERGES],
                   bos_id=meta.get(KEY_BOS), eos_id=meta.get(KEY_EOS), pad_id=meta.get(KEY_PAD),
                   add_bos=bool(meta.get(KEY_ADD_BOS, False)), add_eos=bool(meta.get(KEY_ADD_EOS, False)),
                   chat_template=tmpl, model=str(meta[KEY_MODEL]), pre=str(meta[KEY_PRE]), source=source)

    def _build_hf(self, encode_special: bool) -> _HFTokenizer:
        try:
            bpe = models.BPE(vocab=dict(self._vocab), merges=list(self._merges), unk_token=None,
                             fuse_unk=False, byte_fallback=False)
        except Exception as e:  # tokenizers raises a plain Exception on inconsistent merges
            raise TokenizerError(f"{self._source}: the BPE vocabulary and merges are inconsistent ({e})") from None
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = _deepseek_v3_pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        specials, added = [], []
        for text, i in self._specials.items():
            if not text:
                continue
            if self._types[i] == TokenType.USER_DEFINED:
                added.append(AddedToken(text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                        special=False))
            else:
                specials.append(AddedToken(text, single_word=False, lstrip=False, rstrip=False,
                                           normalized=False, special=True))
        if specials:
            tok.add_special_tokens(specials)
        if added:
            tok.add_tokens(added)
        tok.encode_special_tokens = encode_special
        return tok

    # ------------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text (any Unicode).
            add_bos / add_eos: prepend bos / append eos; ``None``: the metadata's ``add_bos_token`` /
                ``add_eos_token``.
            parse_special: match control tokens (``<｜User｜>``...) written in the text as single ids; when
                false they are tokenized as plain text. User-defined tokens are matched either way (llama.cpp).

        Returns:
            ids, each in ``0..vocab_size-1``.

        Raises:
            TokenizerError: ``text`` is not a str, it cannot be encoded as UTF-8 (lone surrogates), or bos/eos
                is asked for and the vocabulary has none.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode: expected a str, found {type(text).__name__}")
        hf = self._hf if parse_special else self._plain()
        try:
            ids = hf.encode(text, add_special_tokens=False).ids
        except Exception as e:
            raise TokenizerError(f"encode: cannot tokenize the text ({type(e).__name__}: {e})") from None
        if self._add_bos if add_bos is None else add_bos:
            if self._bos is None:
                raise TokenizerError(f"{self._source}: encode with add_bos, but the vocabulary has no "
                                     f"{KEY_BOS}")
            ids.insert(0, self._bos)
        if self._add_eos if add_eos is None else add_eos:
            if self._eos is None:
                raise TokenizerError(f"{self._source}: encode with add_eos, but the vocabulary has no "
                                     f"{KEY_EOS}")
            ids.append(self._eos)
        return ids

    def _plain(self) -> _HFTokenizer:
        if self._hf_plain is None:
            self._hf_plain = self._build_hf(encode_special=True)
        return self._hf_plain

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of ``ids``: the concatenated bytes of :meth:`token_to_piece` decoded as UTF-8, invalid
        sequences replaced by U+FFFD.

        Args:
            ids: token ids (ints, numpy or torch integer scalars).
            skip_special: leave out control and unknown tokens (bos, eos, ``<｜User｜>``...).

        Raises:
            TokenizerError: an id outside ``0..vocab_size-1``.
        """
        return self._bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """The raw bytes of ``ids`` (what :meth:`decode` decodes; may end inside a UTF-8 character).

        Raises:
            TokenizerError: an id outside ``0..vocab_size-1``.
        """
        return self._bytes(ids, skip_special)

    def _bytes(self, ids: Iterable[int], skip_special: bool) -> bytes:
        pieces, skip = self._pieces, self._special_ids if skip_special else ()
        out = []
        for t in ids:
            i = self._check_id(t, "decode")
            if i not in skip:
                out.append(pieces[i])
        return b"".join(out)

    def _check_id(self, t: Any, what: str) -> int:
        try:
            i = int(t)
        except (TypeError, ValueError):
            raise TokenizerError(f"{what}: expected an integer token id, found {t!r}") from None
        if not 0 <= i < len(self._tokens):
            raise TokenizerError(f"{what}: token id {i} is outside the vocabulary 0..{len(self._tokens) - 1}")
        return i

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes token ``token_id`` contributes to decoded text (llama.cpp's ``llama_token_to_piece``):
        a normal token's byte-level text as bytes (possibly part of a UTF-8 character), a control /
        user-defined token's raw text (a control or unknown token gives ``b""`` when ``special`` is false),
        ``b""`` for an unused token.

        Raises:
            TokenizerError: an id outside ``0..vocab_size-1``.
        """
        i = self._check_id(token_id, "token_to_piece")
        if not special and i in self._special_ids:
            return b""
        return self._pieces[i]

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary text of a token (byte-level for normal tokens, e.g. ``"Ġworld"``).

        Raises:
            TokenizerError: an id outside ``0..vocab_size-1``.
        """
        return self._tokens[self._check_id(token_id, "id_to_token")]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary text (byte-level form for normal tokens, raw text for added ones), or
        ``None``."""
        return self._vocab.get(token)

    def token_type(self, token_id: int) -> TokenType:
        """The :class:`TokenType` of a token.

        Raises:
            TokenizerError: an id outside ``0..vocab_size-1``.
        """
        return TokenType(self._types[self._check_id(token_id, "token_type")])

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the ``deepseek-v3`` pre-tokenizer splits ``text`` into (raw text, before the byte-level
        mapping and BPE; added tokens are not extracted). ``"".join(pieces) == text``."""
        return [text[a:b] for _, (a, b) in self._hf.pre_tokenizer.pre_tokenize_str(text)]

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        """A new :class:`StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)

    # ------------------------------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        """``tokenizer.ggml.bos_token_id`` (None when absent)."""
        return self._bos

    @property
    def eos_id(self) -> int | None:
        """``tokenizer.ggml.eos_token_id`` (None when absent)."""
        return self._eos

    @property
    def pad_id(self) -> int | None:
        """``tokenizer.ggml.padding_token_id`` (None when absent)."""
        return self._pad

    @property
    def add_bos(self) -> bool:
        """``tokenizer.ggml.add_bos_token`` (false when absent)."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """``tokenizer.ggml.add_eos_token`` (false when absent)."""
        return self._add_eos

    @property
    def vocab_size(self) -> int:
        """Number of tokens (``len(tokenizer.ggml.tokens)``)."""
        return len(self._tokens)

    @property
    def specials(self) -> dict[str, int]:
        """Text -> id of every token matched whole in text: control, unknown and user-defined tokens (a copy)."""
        return dict(self._specials)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control and unknown tokens (those ``decode(skip_special=True)`` leaves out)."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """``tokenizer.chat_template`` (None when absent)."""
        return self._chat_template

    @property
    def model(self) -> str:
        """``tokenizer.ggml.model`` (always ``"gpt2"``)."""
        return self._model

    @property
    def pre(self) -> str:
        """``tokenizer.ggml.pre`` (always ``"deepseek-v3"``)."""
        return self._pre

    @property
    def hf(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (control tokens parsed as specials)."""
        return self._hf

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self._model!r}, pre={self._pre!r}, vocab_size={len(self._tokens)}, "
                f"specials={len(self._specials)}, bos_id={self._bos}, eos_id={self._eos}, "
                f"chat_template={'yes' if self._chat_template else 'no'})")


class StreamDecoder:
    """Incremental detokenizer for streaming generation.

    ``push(id)`` returns the text that became complete with this token: bytes of a UTF-8 character split over
    several tokens are held back until the character is complete, so a returned piece never ends in a broken
    character; bytes that can never form a character come out as U+FFFD. ``flush()`` returns what is held back
    (as U+FFFD) at the end of the stream. For any ids, ``"".join(push(i) for i in ids) + flush()`` equals
    ``tokenizer.decode(ids, skip_special)``.

    Raises (from ``push``):
        TokenizerError: an id outside the vocabulary.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one token id; return the newly complete text (possibly ``""``)."""
        return self._dec.decode(self._tok.token_to_piece(token_id, special=not self._skip), final=False)

    def push_many(self, ids: Iterable[int]) -> str:
        """Feed several ids; return the newly complete text."""
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: return the held-back bytes (an incomplete character becomes U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending(self) -> int:
        """Number of bytes held back (0..3)."""
        return len(self._dec.getstate()[0])


# ----------------------------------------------------------------------------------------------------------
def _str_list(v: Any, key: str, source: str) -> list[str]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise TokenizerError(f"{source}: {key} is a {type(v).__name__}; expected a list of strings")
    out = list(v)
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise TokenizerError(f"{source}: {key}[{i}] is a {type(s).__name__}; expected a string")
    return out


def _int_list(v: Any, key: str, source: str) -> list[int]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise TokenizerError(f"{source}: {key} is a {type(v).__name__}; expected a list of integers")
    try:
        return [int(x) for x in v]
    except (TypeError, ValueError):
        raise TokenizerError(f"{source}: {key} holds a non-integer; expected a list of integers") from None


def _opt_id(v: Any, what: str, n: int, source: str) -> int | None:
    if v is None:
        return None
    try:
        i = int(v)
    except (TypeError, ValueError):
        raise TokenizerError(f"{source}: the {what} token id is {v!r}; expected an integer") from None
    if not 0 <= i < n:
        raise TokenizerError(f"{source}: the {what} token id {i} is outside the vocabulary 0..{n - 1}")
    return i


def _parse_merges(merges: Any, vocab: Mapping[str, int], source: str) -> list[tuple[str, str]]:
    """``"left right"`` -> (left, right), split at the first space after the first character (llama.cpp);
    both parts and their concatenation must be tokens."""
    out = []
    for i, m in enumerate(_str_list(merges, KEY_MERGES, source)):
        pos = m.find(" ", 1)
        if pos < 0:
            raise TokenizerError(f"{source}: {KEY_MERGES}[{i}] = {m!r}; expected 'left right'")
        a, b = m[:pos], m[pos + 1:]
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerError(f"{source}: {KEY_MERGES}[{i}] = {m!r} needs token {part!r}, which is not "
                                     f"in {KEY_TOKENS}")
        out.append((a, b))
    return out


def _piece(text: str, ttype: int) -> bytes:
    if ttype in _ADDED_TYPES:
        return text.encode("utf-8")
    if ttype == TokenType.UNUSED:
        return b""
    return _unbyte_level(text)


# ==========================================================================================================
# Synthetic vocabularies
# ==========================================================================================================
#: DeepSeek-V3/V4 special tokens of a synthetic vocabulary: (text, type). The first three take ids 0, 1, 2
#: (bos, eos, pad as in DeepSeek's tokenizer), the rest the last ids. ``<think>`` / ``</think>`` are added
#: tokens with ``"special": false`` in DeepSeek's R1-era tokenizer_config.json (V4's was not at hand), which the
#: converter writes as user-defined (type 4: always matched, always decoded, so reasoning stays visible);
#: ``｜DSML｜`` (V4's tool-call markup, a preserved token in llama.cpp's DeepSeek-V4 chat parser) likewise. The
#: others are control tokens (type 3; ``<｜...｜>`` texts, which the converter marks control in any case).
SYNTHETIC_SPECIALS: tuple[tuple[str, TokenType], ...] = (
    ("<｜begin▁of▁sentence｜>", TokenType.CONTROL),
    ("<｜end▁of▁sentence｜>", TokenType.CONTROL),
    ("<｜▁pad▁｜>", TokenType.CONTROL),
    ("<｜User｜>", TokenType.CONTROL),
    ("<｜Assistant｜>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
    ("<｜fim▁hole｜>", TokenType.CONTROL),
    ("<｜fim▁begin｜>", TokenType.CONTROL),
    ("<｜fim▁end｜>", TokenType.CONTROL),
    ("｜DSML｜", TokenType.USER_DEFINED),
)
_N_HEAD_SPECIALS = 3
_INF = 1 << 62

#: Smallest vocabulary :func:`synthetic_vocab` builds: the 256 byte tokens and the specials.
MIN_SYNTHETIC_VOCAB = 256 + len(SYNTHETIC_SPECIALS)

#: DeepSeek-V4's model-facing texts, as its official encoding writes them (``encoding_dsv4.py`` of the model release
#: and llama.cpp's DeepSeek-V4 templates): the tools block appended to the system prompt (:data:`V4_TOOLS_HEADER`,
#: the tools' JSON one a line, :data:`V4_TOOLS_FOOTER`).
V4_TOOLS_HEADER = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    "writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n")
V4_TOOLS_FOOTER = "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
def _jinja_str(text: str) -> str:
    """``text`` as a Jinja string literal (JSON's escapes are a subset of the ones Jinja's lexer decodes)."""
    return json.dumps(text)


#: The chat template of synthetic vocabularies: DeepSeek-V4's chat as its official encoding renders it. Variables:
#: ``messages`` (roles system / user / developer / assistant / tool; an assistant's ``reasoning_content`` and
#: ``tool_calls``), ``tools`` (OpenAI function tools, appended to the system prompt), ``add_generation_prompt``,
#: ``bos_token``, ``thinking`` (or ``enable_thinking``), ``reasoning_effort`` (``"high"`` / ``"max"`` in thinking
#: mode: a one-line ``Reasoning Effort: high.`` stand-in for the official instructions, which are 80-100 tokens and
#: would slow every CPU test that asks for an effort; the real model's GGUF carries its own template). Turn markup: ``<｜User｜>`` (a run of user / developer / tool messages is one turn, tool results as
#: ``<tool_result>...</tool_result>``), ``<｜Assistant｜>``, ``</think>`` (non-thinking) or ``<think>`` (thinking)
#: after it, ``<｜end▁of▁sentence｜>``; tool calls as DSML (``<｜DSML｜tool_calls>``, ``invoke``, ``parameter``
#: with ``string="true"`` for str values, JSON otherwise). It uses the ``tojson`` / ``from_json`` filters as
#: HuggingFace and llama.cpp define them (``json.dumps(..., ensure_ascii=False)`` / ``json.loads``), which
#: :meth:`ds4c.api.Model.apply_chat_template` provides.
SYNTHETIC_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = false -%}{%- endif -%}\n"
    "{%- if not thinking is defined -%}\n"
    "  {%- if enable_thinking is defined -%}{%- set thinking = enable_thinking -%}"
    "{%- else -%}{%- set thinking = false -%}{%- endif -%}\n"
    "{%- endif -%}\n"
    "{%- set dsml = '｜DSML｜' -%}\n"
    "{%- set ns = namespace(system='', first=true, last_user=-1, tool_results=false) -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] == 'system' -%}\n"
    "    {%- set ns.system = ns.system + ('' if ns.first else '\\n\\n') + (message['content'] or '') -%}\n"
    "    {%- set ns.first = false -%}\n"
    "  {%- elif message['role'] in ['user', 'developer', 'tool'] -%}{%- set ns.last_user = loop.index0 -%}\n"
    "    {%- if message['role'] == 'tool' -%}{%- set ns.tool_results = true -%}{%- endif -%}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set has_tools = tools is defined and tools -%}\n"
    "{%- if has_tools -%}\n"
    "  {%- set ts = namespace(schemas='') -%}\n"
    "  {%- for tool in tools -%}{%- if tool['type'] == 'function' -%}"
    "{%- set ts.schemas = ts.schemas + (tool['function'] | tojson) + '\\n' -%}{%- endif -%}{%- endfor -%}\n"
    "  {%- set block = " + _jinja_str(V4_TOOLS_HEADER) + " + ts.schemas + " + _jinja_str(V4_TOOLS_FOOTER) + " -%}\n"
    "  {%- set ns.system = (ns.system + '\\n\\n' if ns.system else '') + block -%}\n"
    "{%- endif -%}\n"
    "{{- bos_token -}}\n"
    "{%- if thinking and reasoning_effort is defined and reasoning_effort in ['high', 'max'] -%}\n"
    "  {{- 'Reasoning Effort: ' + reasoning_effort + '.\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- ns.system -}}\n"
    "{%- set turn = namespace(user=false) -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] in ['user', 'developer', 'tool'] -%}\n"
    "    {{- '\\n\\n' if turn.user else '<｜User｜>' -}}{%- set turn.user = true -%}\n"
    "    {%- if message['role'] == 'tool' -%}{{- '<tool_result>' + (message['content'] or '') + '</tool_result>' -}}\n"
    "    {%- else -%}{{- message['content'] or '' -}}{%- endif -%}\n"
    "  {%- elif message['role'] == 'assistant' -%}\n"
    "    {%- set turn.user = false -%}\n"
    "    {{- '<｜Assistant｜>' -}}\n"
    "    {%- if thinking and (has_tools or ns.tool_results or loop.index0 > ns.last_user) -%}\n"
    "      {{- '<think>' + (message['reasoning_content'] or '') + '</think>' -}}\n"
    "    {%- else -%}{{- '</think>' -}}{%- endif -%}\n"
    "    {{- message['content'] or '' -}}\n"
    "    {%- if message['tool_calls'] -%}\n"
    "      {{- '\\n\\n<' + dsml + 'tool_calls>\\n' -}}\n"
    "      {%- for call in message['tool_calls'] -%}\n"
    "        {%- set args = call['function']['arguments'] -%}\n"
    "        {%- if args is string -%}{%- set args = args | from_json -%}{%- endif -%}\n"
    "        {{- '<' + dsml + 'invoke name=\"' + call['function']['name'] + '\">\\n' -}}\n"
    "        {%- for key, value in args.items() -%}\n"
    "          {{- '<' + dsml + 'parameter name=\"' + key + '\" string=\"' + ('true' if value is string else 'false')"
    " + '\">' + (value if value is string else value | tojson) + '</' + dsml + 'parameter>\\n' -}}\n"
    "        {%- endfor -%}\n"
    "        {{- '' if args else '\\n' -}}\n"
    "        {{- '</' + dsml + 'invoke>\\n' -}}\n"
    "      {%- endfor -%}\n"
    "      {{- '</' + dsml + 'tool_calls>' -}}\n"
    "    {%- endif -%}\n"
    "    {{- '<｜end▁of▁sentence｜>' -}}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') -}}\n"
    "{%- endif -%}\n"
)

# The built-in training corpus of synthetic vocabularies (English prose, Python, C/CUDA, shell, JSON,
# Chinese, Japanese). Changing it changes every synthetic model's vocabulary.
_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of tokens, and each
token is a small piece of a word, a whole word, a number or a run of punctuation. The tokenizer turns the text
into numbers before the model sees it, and turns the numbers back into text after the model has written them.
When the model generates an answer, it produces one token at a time: the next token depends on every token that
came before it, so the first tokens of a reply are computed while the rest of the reply does not exist yet.
This is why streaming output appears word by word, and why a long answer takes longer than a short one.

In the beginning there was a question, and the question was simple: how fast can a computer read? The answer
depends on the memory, on the number of cores, on the size of the cache and on the way the program walks
through its data. A good program reads each byte once and does as much work as it can with it while the byte
is still close to the processor. The best programs are also the simplest ones to understand, because a person
who understands a program can make it faster, and a person who does not will only make it different.

Mixture-of-experts models route every token to a few experts out of many. The router computes a score for each
expert, picks the top ones, and the output is the weighted sum of their answers. Attention looks back over the
context: recent tokens through a sliding window, older ones through compressed summaries of blocks of tokens.
The key and value caches grow with the context, and the decode step is bound by how quickly the weights and the
caches stream out of memory. Speculative decoding guesses several tokens and verifies them in a single step.

Dear team, thank you for the report. We have reproduced the problem on our side and we are working on a fix.
Please find attached the logs of the failing run, the configuration file and the exact command line. The error
happens only when the input is longer than four thousand tokens and the cache is full; shorter inputs work. We
will let you know as soon as the new version is ready. Best regards, and have a nice weekend!

Q: What is the capital of France? A: Paris. Q: How many days are there in a leap year? A: 366. Q: Who wrote
"Hamlet"? A: William Shakespeare, around 1600. Q: What is 12 times 12? A: 144. Q: Is it raining today? A: I
don't know; I can't see outside, but I can help you find a weather forecast for your city.

def tokenize(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """Split text into pieces, then merge the bytes of each piece by rank."""
    ranks = {pair: i for i, pair in enumerate(merges)}
    ids = []
    for piece in pre_tokenize(text):
        symbols = list(piece.encode("utf-8"))
        while len(symbols) > 1:
            pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids.extend(vocab[s] for s in symbols)
    return ids


class Cache:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.items.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.items) >= self.capacity:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value


if __name__ == "__main__":
    import sys
    for line in sys.stdin:
        print(len(tokenize(line, {}, [])), file=sys.stderr)

#include <stdio.h>
#include <stdint.h>

__global__ void scale_kernel(const float* __restrict__ x, float* __restrict__ y, float alpha, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = alpha * x[i];
    }
}

static int64_t sum_array(const int32_t* values, size_t count) {
    int64_t total = 0;
    for (size_t i = 0; i < count; ++i) {
        total += values[i];
    }
    return total;
}

int main(int argc, char** argv) {
    printf("hello, world: %d arguments\n", argc);
    return 0;
}

$ git clone https://github.com/example/project.git && cd project
$ python -m pip install -e . && python -m pytest -q tests/
$ export CUDA_VISIBLE_DEVICES=0; ./build/bin/run --threads 8 --ctx-size 4096 --file prompt.txt

{"model": "deepseek4", "vocab_size": 129280, "hidden_size": 4096, "layers": 43, "experts": 256, "top_k": 6,
 "dtype": "bfloat16", "rope_theta": 10000.0, "max_position": 1048576, "enabled": true, "name": null}

| id | name | value |
|----|------|-------|
| 1 | alpha | 0.5 |
| 2 | beta | 1.25 |

人工智能是计算机科学的一个分支，它试图理解智能的本质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。
语言模型把文本切分成词元，然后预测下一个词元。今天天气很好，我们一起去公园散步吧。这个问题的答案是什么？
中国的首都是北京，上海是最大的城市。学习编程需要耐心和练习，每天写一点代码，慢慢就会进步。谢谢你的帮助！
深度学习模型需要大量的数据和计算资源。我们使用混合专家模型来降低推理成本，同时保持模型的能力。

日本語の文章も少し入れておきます。今日はとても良い天気ですね。東京の桜は三月の終わりに咲きます。
このプログラムはテキストをトークンに分割します。カタカナとひらがなと漢字が混ざっています。ありがとうございました。

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 512 1000 2024 3.14159 2.71828 -1 +7 1e-6 0x1F 65536 99.9%.
Dates and times: 2025-01-31 12:30:45, 1999/12/31, 07:00 am. Prices: $19.99, 5 EUR, 1,234,567 people.
Emoji and symbols: ✓ ✗ → ← ≤ ≥ ± × ÷ ° © ® € £ ¥ 😀 🚀 👍 ❤️ ★ ☆ ♪ ∞ π Σ λ.
'''


def _corpus_pieces(pre: pre_tokenizers.PreTokenizer, text: str) -> list[tuple[str, int]]:
    """Byte-level pieces of ``text`` with their counts, most frequent first (ties: first occurrence)."""
    counts: dict[str, int] = {}
    for piece, _ in pre.pre_tokenize_str(text):
        counts[piece] = counts.get(piece, 0) + 1
    order = {p: i for i, p in enumerate(counts)}
    return sorted(counts.items(), key=lambda kv: (-kv[1], order[kv[0]]))


class _VocabBuilder:
    """Grows a byte-level BPE vocabulary: merges in rank order, each creating one new token."""

    def __init__(self, reserved: Iterable[str], limit: int):
        self.ranks: dict[tuple[str, str], int] = {}
        self.merges: list[str] = []
        self.new_tokens: list[str] = []
        self.known = set(_BYTES_TO_CHARS) | set(reserved)
        self.limit = limit   # number of merges wanted
        self.segs: dict[str, list[str]] = {}  # piece -> its last final segmentation (grow)

    @property
    def full(self) -> bool:
        return len(self.merges) >= self.limit

    def add(self, a: str, b: str) -> None:
        t = a + b
        self.ranks[(a, b)] = len(self.merges)
        self.merges.append(f"{a} {b}")
        self.new_tokens.append(t)
        self.known.add(t)

    def bpe(self, syms: list[str], r: list[int] | None = None) -> list[str]:
        """BPE of one piece (as a list of symbols, changed in place) under the merges so far: merge the
        lowest-rank adjacent pair (leftmost on a tie) until none is a merge - tokenizers' and llama.cpp's rule.
        Starting from a segmentation that was final under fewer merges gives the same result as starting
        from the bytes, since every later merge ranks after all earlier ones. ``r``: the ranks of the adjacent
        pairs (``_INF``: not a merge) when the caller has them; updated in place."""
        if len(syms) < 2:
            return syms
        ranks, inf = self.ranks, _INF
        if r is None:
            r = [ranks.get(p, inf) for p in zip(syms, syms[1:])]
        while r:
            m = min(r)
            if m == inf:
                break
            i = r.index(m)
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
            del r[i]
            if i > 0:
                r[i - 1] = ranks.get((syms[i - 1], syms[i]), inf)
            if i < len(r):
                r[i] = ranks.get((syms[i], syms[i + 1]), inf)
        return syms

    def train(self, pieces: list[tuple[str, int]]) -> None:
        """Classic BPE training on (piece, count): merge the most frequent adjacent pair (ties: the smallest
        pair in code-point order) while it occurs at least twice; a pair whose concatenation is already a token
        is never merged."""
        words = [list(p) for p, _ in pieces]
        counts = [c for _, c in pieces]
        pair_count: dict[tuple[str, str], int] = {}
        where: dict[tuple[str, str], set[int]] = {}
        for wi, w in enumerate(words):
            for q in zip(w, w[1:]):
                pair_count[q] = pair_count.get(q, 0) + counts[wi]
                where.setdefault(q, set()).add(wi)
        heap = [(-c, q) for q, c in pair_count.items()]
        heapq.heapify(heap)
        banned: set[tuple[str, str]] = set()
        while heap and not self.full:
            negc, q = heapq.heappop(heap)
            c = pair_count.get(q, 0)
            if c != -negc or q in banned:
                continue          # stale entry, or a pair never merged
            if c < 2:
                break
            a, b = q
            t = a + b
            if t in self.known:
                banned.add(q)
                continue
            self.add(a, b)
            changed: set[tuple[str, str]] = set()
            for wi in sorted(where.pop(q, ())):
                w, cw = words[wi], counts[wi]
                for p in zip(w, w[1:]):
                    pair_count[p] -= cw
                    changed.add(p)
                new, i = [], 0
                while i < len(w):
                    if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                        new.append(t)
                        i += 2
                    else:
                        new.append(w[i])
                        i += 1
                words[wi] = new
                for p in zip(new, new[1:]):
                    pair_count[p] = pair_count.get(p, 0) + cw
                    where.setdefault(p, set()).add(wi)
                    changed.add(p)
            for p in sorted(changed):
                if pair_count[p] > 0 and p not in banned:
                    heapq.heappush(heap, (-pair_count[p], p))

    def extend(self, pieces: Iterable[str]) -> None:
        """Make each piece one token (in order) by merging adjacent pairs of its current BPE segmentation,
        leftmost first; every merge added this way fires when that piece is encoded."""
        for piece in pieces:
            if self.full:
                return
            syms = self.bpe(list(piece))
            while len(syms) > 1 and not self.full:
                for i in range(len(syms) - 1):
                    if syms[i] + syms[i + 1] not in self.known:
                        break
                else:
                    break         # every pair's concatenation is already a token
                self.add(syms[i], syms[i + 1])
                syms = self.bpe(syms)

    def grow(self, pieces: Iterable[str], per_piece: int) -> None:
        """Up to ``per_piece`` merges per piece (in order): each time, of the piece's current BPE segmentation,
        the adjacent pair with the shortest concatenation (leftmost on a tie) whose concatenation is new.
        Frequent short units become tokens first, as in BPE training; each merge fires when that piece is
        encoded."""
        cache, known = self.segs, self.known
        for piece in pieces:
            if self.full:
                return
            seg = cache.get(piece)
            syms = self.bpe(list(seg if seg is not None else piece))
            for _ in range(per_piece):
                best, bi = 0, -1
                for i in range(len(syms) - 1):
                    n = len(syms[i]) + len(syms[i + 1])
                    if (bi < 0 or n < best) and syms[i] + syms[i + 1] not in known:
                        best, bi = n, i
                if bi < 0 or self.full:
                    break
                a, b = syms[bi], syms[bi + 1]
                self.add(a, b)
                # The segmentation was final and the new merge ranks last, so BPE now joins every (a, b),
                # left to right, and stops: no merge has the new token as a part yet.
                out, i = [], 0
                while i < len(syms):
                    if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                        out.append(a + b)
                        i += 2
                    else:
                        out.append(syms[i])
                        i += 1
                syms = out
            cache[piece] = syms


_ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w",
           "y", "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "ph", "pl", "pr", "sc", "sh",
           "sl", "sp", "st", "str", "th", "tr", "wh")
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "y", "ai", "au", "ea", "ee", "ei", "ie", "io", "oa",
           "oo", "ou", "ue")
_CODAS = ("", "", "", "", "b", "ck", "d", "ft", "g", "l", "ld", "ll", "lt", "m", "mp", "n", "nd", "ng", "nk",
          "nt", "p", "r", "rd", "rk", "rm", "rn", "rs", "rt", "s", "sk", "ss", "st", "t", "th", "x", "z")
# punctuation / layout pieces, each one whole pre-tokenizer piece on its own
_PUNCT = (",", ".", ":", ";", "!", "?", " (", ")", " =", " ==", " ->", "();", " {", "}", " [", "]", " \"", "\"",
          "...", " -", ",\n", ".\n", " //", " #", " *", " +", " <", " >", "_", "::", " &&", " ||", " /", "/",
          "@", " $", "%", " '", "'", "\n", "\n\n", "\n\n\n", ").", "),", "\");", "]);", " {}", " =>", " !=")
_PREFIXES = (".", "_", "#", "$", "@", "\\", "-", "/", "(", "[", "{", "<", "'", "\"", "*", "&", "%", ":")
_CJK_RANGES = ((0x4E00, 0x9FA5), (0x3041, 0x3096), (0x30A1, 0x30FA))


def _pseudo_pieces(seed: int, n: int) -> list[str]:
    """``n`` deterministic pseudo-text pieces in byte-level form, each one whole ``deepseek-v3`` pre-tokenizer
    piece on its own: made-up words (lower, capitalized, upper; with or without a leading space or a
    punctuation prefix), numbers of 1..3 digits, CJK / kana runs, punctuation and space runs. Drawn with
    ``random.Random(seed).getrandbits`` only (stable across Python versions)."""
    bits = random.Random(seed).getrandbits
    onsets, nuclei, codas = _ONSETS, _NUCLEI, _CODAS
    no, nn, nc = len(onsets), len(nuclei), len(codas)
    out: list[str] = []
    for _ in range(n):
        r = bits(8)
        if r < 20:                                   # a number of 1..3 digits
            p = str(bits(32) % (10 ** (1 + bits(2) % 3)))
        elif r < 48:                                 # a CJK / kana run of 1..4 characters
            lo, hi = _CJK_RANGES[0] if bits(2) else _CJK_RANGES[1 + bits(1)]
            p = "".join(chr(lo + bits(32) % (hi - lo + 1)) for _ in range(1 + bits(2)))
        elif r < 64:                                 # punctuation / layout
            p = _PUNCT[bits(32) % len(_PUNCT)] if bits(3) else " " * (1 + bits(4))
        else:                                        # a made-up word of 1..4 syllables
            w = "".join(onsets[bits(32) % no] + nuclei[bits(32) % nn] + codas[bits(32) % nc]
                        for _ in range(1 + bits(2) % 3 + bits(1)))
            s = bits(4)
            if s < 3:
                w = w.capitalize()
            elif s == 3:
                w = w.upper()
            k = bits(4)
            p = (" " + w) if k < 11 else (_PREFIXES[bits(32) % len(_PREFIXES)] + w) if k < 13 else w
        out.append(_byte_level(p))
    return out


def synthetic_vocab(vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """GGUF tokenizer metadata of a deterministic byte-level BPE vocabulary of exactly ``vocab_size`` tokens.

    Layout (ids): 0 ``<｜begin▁of▁sentence｜>`` (bos), 1 ``<｜end▁of▁sentence｜>`` (eos), 2 ``<｜▁pad▁｜>`` (pad);
    3..258 the 256 byte tokens (byte order, gpt2 alphabet); then one token per merge in rank order; the last
    ``len(SYNTHETIC_SPECIALS) - 3`` ids are the other :data:`SYNTHETIC_SPECIALS`. The merges are, in order:

    1. classic BPE training (most frequent pair first, while it occurs at least twice) on a built-in corpus of
       English, code, Chinese and Japanese, split by the ``deepseek-v3`` pre-tokenizer;
    2. the rest of the corpus' pieces made whole (most frequent first);
    3. up to 3 merges per piece of a pseudo-text drawn from ``seed`` (made-up words, numbers, CJK / kana runs,
       punctuation; shortest new pair of the piece's current segmentation first).

    Each merge joins two existing tokens inside one pre-tokenizer piece and creates a new token, which that
    piece's encoding produces. Only part 3 depends on ``seed``; the training is this module's own Python
    (``tokenizers`` only splits the corpus), so the result depends on neither the ``tokenizers`` version's
    trainer nor hash seeds. About 1.3 s for 129280 tokens on 2 cores.

    Args:
        vocab_size: total number of tokens, >= :data:`MIN_SYNTHETIC_VOCAB` (267).
        seed: picks the pseudo-text (vocabularies small enough for the corpus alone are the same for all seeds).

    Returns:
        ``tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id, eos_token_id,
        padding_token_id, add_bos_token, add_eos_token}`` and ``tokenizer.chat_template`` -> Python values
        (lists of str / int, int, bool, str), ready for :meth:`Tokenizer.from_metadata` or a GGUF writer.

    Raises:
        TokenizerError: ``vocab_size`` below the minimum.
    """
    vocab_size = int(vocab_size)
    if vocab_size < MIN_SYNTHETIC_VOCAB:
        raise TokenizerError(f"synthetic vocabulary of {vocab_size} tokens: expected at least {MIN_SYNTHETIC_VOCAB} "
                             f"(256 byte tokens + {len(SYNTHETIC_SPECIALS)} special tokens)")
    n_merges = vocab_size - MIN_SYNTHETIC_VOCAB
    specials = [t for t, _ in SYNTHETIC_SPECIALS]
    b = _VocabBuilder(reserved=specials, limit=n_merges)
    pre = _deepseek_v3_pre_tokenizer()
    pieces = _corpus_pieces(pre, _CORPUS)
    b.train(pieces)
    b.extend(p for p, _ in pieces)
    round_ = 0
    while not b.full:
        b.grow(_pseudo_pieces(seed * 1_000_003 + round_, 20_000), per_piece=3)
        round_ += 1
        if round_ > 10_000:  # pragma: no cover - the pseudo-text space is far larger than any vocabulary
            raise TokenizerError(f"synthetic vocabulary of {vocab_size} tokens: the pseudo-text ran dry")

    head = SYNTHETIC_SPECIALS[:_N_HEAD_SPECIALS]
    tail = SYNTHETIC_SPECIALS[_N_HEAD_SPECIALS:]
    tokens = [t for t, _ in head] + _BYTES_TO_CHARS + b.new_tokens + [t for t, _ in tail]
    types = ([int(k) for _, k in head] + [int(TokenType.NORMAL)] * (256 + len(b.new_tokens))
             + [int(k) for _, k in tail])
    assert len(tokens) == vocab_size == len(types)
    return {
        KEY_MODEL: SUPPORTED_MODEL,
        KEY_PRE: SUPPORTED_PRE,
        KEY_TOKENS: tokens,
        KEY_TYPES: types,
        KEY_MERGES: list(b.merges),
        KEY_BOS: 0,
        KEY_EOS: 1,
        KEY_PAD: 2,
        KEY_ADD_BOS: True,
        KEY_ADD_EOS: False,
        KEY_CHAT_TEMPLATE: SYNTHETIC_CHAT_TEMPLATE,
    }
