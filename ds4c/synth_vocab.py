"""Synthetic vocabularies: the GGUF tokenizer metadata of synthetic models (:func:`synthetic_vocab`), a real,
deterministic byte-level BPE vocabulary of any size >= :data:`MIN_SYNTHETIC_VOCAB`, trained on a built-in corpus
(English, code, Chinese, Japanese) and grown from a seeded pseudo-text, with DeepSeek's special tokens and a
DeepSeek-V4-style chat template. :class:`ds4c.tokenizer.Tokenizer` reads it as it reads a real model's.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Iterable
from typing import Any

from tokenizers import pre_tokenizers

from ds4c.tokenizer import (BYTE_TO_CHAR, KEY_ADD_BOS, KEY_ADD_EOS, KEY_BOS, KEY_CHAT_TEMPLATE, KEY_EOS, KEY_MERGES,
                            KEY_MODEL, KEY_PAD, KEY_PRE, KEY_TOKENS, KEY_TYPES, SUPPORTED_MODEL, SUPPORTED_PRE,
                            TokenizerError, TokenType, deepseek_v3_pre_tokenizer)

__all__ = ["synthetic_vocab", "MIN_SYNTHETIC_VOCAB", "SYNTHETIC_SPECIALS", "SYNTHETIC_CHAT_TEMPLATE", "TOOLS_HEADER",
           "TOOLS_FOOTER"]

_FROM_LATIN1 = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})  # latin-1 text -> byte-level text
_BYTES_TO_CHARS = [BYTE_TO_CHAR[b] for b in range(256)]


def _byte_level(text: str) -> str:
    """The byte-level (gpt2 alphabet) form of ``text``'s UTF-8 bytes."""
    return text.encode("utf-8").decode("latin-1").translate(_FROM_LATIN1)


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

#: The tools block the synthetic template appends to the system prompt: :data:`TOOLS_HEADER`, the tools' JSON one a
#: line, :data:`TOOLS_FOOTER`. DeepSeek-V4's official encoding (``encoding_dsv4.py`` of the model release) puts the
#: tools there the same way, between a header that explains the DSML markup with an example and a footer asking
#: the model to follow the schemas; those instructions are some 700 tokens in a synthetic vocabulary, which the CPU
#: reference would prefill for every request with tools, so the synthetic template has this one-line stand-in
#: (as it has for the reasoning-effort instructions). The real model's GGUF carries the official template.
TOOLS_HEADER = "## Tools\n\nCall tools with a <｜DSML｜tool_calls> block.\n\n### Available Tool Schemas\n\n"
TOOLS_FOOTER = "\nFollow the tool schemas.\n"


def _jinja_str(text: str) -> str:
    """``text`` as a Jinja string literal (JSON's escapes are a subset of the ones Jinja's lexer decodes)."""
    return json.dumps(text)


#: The chat template of synthetic vocabularies: DeepSeek-V4's chat as its official encoding renders it (with the
#: stand-ins for its tools and reasoning-effort instructions). Variables:
#: ``messages`` (roles system / user / assistant / tool; an assistant's ``reasoning_content`` and ``tool_calls``),
#: ``tools`` (OpenAI function tools, appended to the system prompt), ``add_generation_prompt``, ``bos_token``,
#: ``thinking`` (or ``enable_thinking``), ``reasoning_effort`` (``"high"`` / ``"max"`` in thinking mode: a one-line
#: ``Reasoning Effort: high.`` stand-in for the official instructions, which are 80-100 tokens and would slow every
#: CPU test that asks for an effort; the real model's GGUF carries its own template). Turn markup: ``<｜User｜>`` (a
#: run of user / tool messages is one turn, tool results as ``<tool_result>...</tool_result>``), ``<｜Assistant｜>``,
#: ``</think>`` (non-thinking) or ``<think>`` (thinking) after it, ``<｜end▁of▁sentence｜>``; tool calls as DSML
#: (``<｜DSML｜tool_calls>``, ``invoke``, ``parameter`` with ``string="true"`` for str values, JSON otherwise). It
#: uses the ``tojson`` / ``from_json`` filters as HuggingFace and llama.cpp define them, which
#: :func:`ds4c.chat.render_chat` provides.
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
    "  {%- elif message['role'] in ['user', 'tool'] -%}{%- set ns.last_user = loop.index0 -%}\n"
    "    {%- if message['role'] == 'tool' -%}{%- set ns.tool_results = true -%}{%- endif -%}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set has_tools = tools is defined and tools -%}\n"
    "{%- if has_tools -%}\n"
    "  {%- set ts = namespace(schemas='') -%}\n"
    "  {%- for tool in tools -%}{%- if tool['type'] == 'function' -%}"
    "{%- set ts.schemas = ts.schemas + (tool['function'] | tojson) + '\\n' -%}{%- endif -%}{%- endfor -%}\n"
    "  {%- set block = " + _jinja_str(TOOLS_HEADER) + " + ts.schemas + " + _jinja_str(TOOLS_FOOTER) + " -%}\n"
    "  {%- set ns.system = (ns.system + '\\n\\n' if ns.system else '') + block -%}\n"
    "{%- endif -%}\n"
    "{{- bos_token -}}\n"
    "{%- if thinking and reasoning_effort is defined and reasoning_effort in ['high', 'max'] -%}\n"
    "  {{- 'Reasoning Effort: ' + reasoning_effort + '.\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- ns.system -}}\n"
    "{%- set turn = namespace(user=false) -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] in ['user', 'tool'] -%}\n"
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
    pre = deepseek_v3_pre_tokenizer()
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
