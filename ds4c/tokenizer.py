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

:func:`ds4c.synth_vocab.synthetic_vocab` builds the same metadata for synthetic models.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ds4c.errors import Ds4cError

__all__ = ["TokenizerError", "TokenType", "Tokenizer", "StreamDecoder", "has_tokenizer", "DEEPSEEK_V3_SPLITS",
           "deepseek_v3_pre_tokenizer"]


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

def _unbyte_level(token: str) -> bytes:
    """The bytes a byte-level token stands for; a character outside the alphabet stands for its own UTF-8
    bytes (what tokenizers' ByteLevel decoder does for such a token)."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in token)


def deepseek_v3_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The ``deepseek-v3`` pre-tokenizer: the :data:`DEEPSEEK_V3_SPLITS` in order, each isolating its matches,
    then ``ByteLevel`` (bytes -> the gpt2 alphabet, no prefix space)."""
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
    -> Python value such as :func:`ds4c.synth_vocab.synthetic_vocab`'s), or directly from the vocabulary::

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
        #: the longest piece in bytes: a text of N characters is at least N / max_piece_bytes tokens (a character
        #: is at least one UTF-8 byte), a bound a server checks before tokenizing a huge prompt
        self.max_piece_bytes = max(1, max(map(len, self._pieces), default=1))
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
        tok.pre_tokenizer = deepseek_v3_pre_tokenizer()
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
        bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
        if bad is not None:  # what Python makes of invalid UTF-8 on the command line (surrogateescape)
            raise TokenizerError(f"the text is not valid Unicode (a lone surrogate at character {bad}: invalid "
                                 f"UTF-8 bytes in the prompt?)")
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
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TokenizerError(f"decode: expected a sequence of token ids, found {type(ids).__name__} {ids!r:.40}")
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
