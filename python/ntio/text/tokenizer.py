"""The tokenizer a GGUF file describes, built with the Rust `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's metadata keys. Two kinds are supported:

* `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen2, ...). Vocabulary and merges are stored as is; how text is cut
  into words before BPE is not stored, only a name (`tokenizer.ggml.pre`) for which llama.cpp hard-codes a list
  of split regexes. `_PRE_TOKENIZER_SPLITS` reproduces that table.
* `llama`: SentencePiece BPE (Llama 2, TinyLlama, Mistral v0.1). The file stores pieces with scores, not merges;
  as transformers' GGUF converter does, merges are derived from the scores (a piece made earlier in training has
  a higher score), and pieces missing from the vocabulary fall back to the `<0xXX>` byte tokens.

Special tokens follow llama.cpp's token types: control (3) and unknown (2) tokens are special, so they are matched
in text only when asked (`special=True`, for rendered chat prompts) and dropped by `decode(skip_special=True)`;
user-defined (4) tokens are always matched whole, as llama.cpp does.

A Hugging Face checkpoint (and a store converted from one) carries its tokenizer.json whole, which the library runs
as transformers does.
"""

from __future__ import annotations

import functools
import hashlib
import sys

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.models import BPE

from ntio.text.chat import ChatTemplate
from ntio.errors import ModelFormatError, NtioError, UnsupportedModelError
from ntio.formats.gguf_file import GGUFFile

# GGUF's key for a Hugging Face tokenizer.json, kept whole: a checkpoint's tokenizer (ntio.formats.checkpoint).
HF_TOKENIZER_KEY = "tokenizer.huggingface.json"

# llama.cpp's token types (llama_token_type in llama.h).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# The split regexes llama.cpp applies for each `tokenizer.ggml.pre` name (llm_tokenizer_bpe in llama-vocab.cpp).
# A list is applied in order, each regex cutting every piece left by the one before, with matches and the text
# between them both kept: exactly `Split(regex, "isolated")` in sequence. Where llama.cpp carries a hand-adapted
# regex for its own engine (Llama 3, Qwen2, Tekken, GPT-4o), the original from the model's tokenizer.json is used,
# since oniguruma (used by `tokenizers`) runs it as written.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: punctuation runs first, then GPT-2, then digit runs and triples.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "roberta-bpe", "gigachat", "jina-es", "jina-de",
         "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "a.x-4.0", "mellum"),
        (_GPT2,),
    ),
    # Digits one at a time, then GPT-2 (SmolLM2's tokenizer.json: Digits(individual_digits) + ByteLevel).
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
         "smaug-bpe", "chatglm-bpe", "glm4"),
        (_LLAMA3,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), (_QWEN2,)),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    "viking": (_BLOOM, r"\p{N}"),
}

# llama.cpp sets `ignore_merges` for these (a word that is itself a vocabulary entry is taken whole, as Llama 3's
# tokenizer.json also asks) and adds BOS by default.
_LLAMA3_STYLE = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "tekken"))

# Control tokens that end a turn, by text: llama.cpp adds these to its end-of-generation set because many files
# name only one of them (SmolLM2 names <|im_end|> as EOS, but a model may still close with <|endoftext|>).
_END_OF_TURN_TEXTS = frozenset(
    ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
     "<EOT>", "<｜end▁of▁sentence｜>")
)

_warned_pre: set[str] = set()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned_pre:
        _warned_pre.add(name)
        print(f"ntio: warning: {message}", file=sys.stderr)


_REQUIRED = object()
_KIND_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array"}
_ITEM_NAMES = {str: "strings", int: "integers", (int, float): "numbers"}


def _is(value: object, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except that a bool is not a number (GGUF and JSON keep the two apart)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _metadata(g: GGUFFile, key: str, kind: type, default: object = _REQUIRED, *,
              items: type | tuple[type, ...] | None = None) -> object:
    """Tokenizer metadata `key`, checked to be a `kind` (a list of `items`, when given): a value of the wrong type is
    one line naming the key, not a failure deep inside the tokenizer library."""
    if default is not _REQUIRED and key not in g.metadata:
        return default
    value = g.require(key)
    if not _is(value, kind):
        raise ModelFormatError(f"{g.path}: metadata key {key!r} must be {_KIND_NAMES[kind]}, got {repr(value)[:40]}")
    for i, item in enumerate(value if items is not None else ()):
        if not _is(item, items):
            raise ModelFormatError(
                f"{g.path}: metadata key {key!r} must be an array of {_ITEM_NAMES[items]}; element {i} is "
                f"{repr(item)[:40]}"
            )
    return value


def _byte_level_pre_tokenizer(g: GGUFFile) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The split for `tokenizer.ggml.pre`, and whether llama.cpp treats it as Llama-3 style."""
    name = _metadata(g, "tokenizer.ggml.pre", str, None)
    splits = _PRE_TOKENIZER_SPLITS.get(name)
    if splits is None:
        _warn_once(
            str(name),
            f"{g.path}: unknown pre-tokenizer {name!r} (tokenizer.ggml.pre); splitting text with the GPT-2 regex, "
            "so tokens may differ from the model's own tokenizer",
        )
        splits = (_GPT2,)
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    # The regexes did the splitting; ByteLevel only maps bytes to the printable alphabet the vocabulary is spelled in.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), name in _LLAMA3_STYLE


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by SentencePiece scores, in the order transformers' `generate_merges` gives.

    Every way to cut a piece into two pieces that are both in the vocabulary is a merge producing it; merges are
    ranked by the produced piece's score (highest first), then by the lengths of the left and right parts
    (longest first). Python's sort is stable, so ties keep vocabulary order, as they do in transformers: the two
    rank every merge identically.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        local.sort(key=lambda m: (ids[m[0]], ids[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def vocabulary_fingerprint(g: GGUFFile) -> str:
    """A digest of every `tokenizer.ggml.*` key and a checkpoint's tokenizer.json (tokens, merges, types, special ids, pre-tokenizer): two files with
    the same fingerprint tokenize alike, whatever their chat templates."""
    h = hashlib.sha256()
    for key in sorted(k for k in g.metadata if k.startswith("tokenizer.ggml.") or k == HF_TOKENIZER_KEY):
        h.update(repr((key, g.metadata[key])).encode())
    return h.hexdigest()


class Tokenizer:
    """Text <-> token ids for one model, plus its special ids and chat template."""

    def __init__(self, backend: _RustTokenizer, *, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool, stop_ids: frozenset[int], chat_template: str | None,
                 special_tokens: dict[str, str], source: str, source_file: GGUFFile | None = None) -> None:
        self._backend = backend
        self._source_file = source_file  # for `serves`: the vocabulary is fingerprinted only when a companion asks
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        # Exposed, not applied by encode: ntio encodes prompts to continue, and a trailing EOS would end them.
        self.add_eos = add_eos
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self._template = (
            ChatTemplate(chat_template, source=source, special_tokens=special_tokens) if chat_template else None
        )
        self._source = source

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> Tokenizer:
        if "tokenizer.ggml.tokens" not in g.metadata and HF_TOKENIZER_KEY in g.metadata:
            return cls._from_huggingface(g)
        kind = _metadata(g, "tokenizer.ggml.model", str)
        tokens = list(_metadata(g, "tokenizer.ggml.tokens", list, items=str))
        n = len(tokens)
        if n == 0:
            raise ModelFormatError(f"{g.path}: metadata key 'tokenizer.ggml.tokens' is an empty vocabulary")
        types = list(_metadata(g, "tokenizer.ggml.token_type", list, [1] * n, items=int))
        if len(types) != n:
            raise ModelFormatError(
                f"{g.path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens"
            )
        vocab = {t: i for i, t in enumerate(tokens)}

        if kind == "gpt2":
            backend, llama3_style = cls._byte_level(g, vocab)
            # llama.cpp adds no BOS to a byte-level vocabulary unless the file or a Llama-3 style pre-tokenizer asks.
            default_bos = llama3_style
            default_ids: dict[str, int] = {}
        elif kind == "llama":
            backend = cls._sentencepiece(g, tokens, vocab)
            default_bos = True
            # llama.cpp's defaults for SentencePiece files that predate these keys (Llama 2's layout).
            default_ids = {"bos": 1, "eos": 2, "unknown": 0}
        else:
            raise UnsupportedModelError(
                f"{g.path}: tokenizer type {kind!r} (tokenizer.ggml.model) is not supported; "
                "ntio reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) tokenizers"
            )

        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (_CONTROL, _UNKNOWN)
        ]
        user_defined = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                        if ty == _USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user_defined)

        end_of_turn = {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _END_OF_TURN_TEXTS}
        return cls._with_settings(g, backend, n, default_ids=default_ids, default_bos=default_bos,
                                  end_of_turn=end_of_turn)

    @classmethod
    def _with_settings(cls, g: GGUFFile, backend: _RustTokenizer, n: int, *, default_ids: dict[str, int],
                       default_bos: bool, end_of_turn: set[int]) -> Tokenizer:
        """The tokenizer over `backend` (n ids) with `g`'s special ids, BOS/EOS rules and chat template (GGUF keys,
        `default_ids` where absent); generation stops at EOS, EOT, EOM and the `end_of_turn` control tokens."""

        def special_id(name: str) -> int | None:
            key = f"tokenizer.ggml.{name}_token_id"
            value = _metadata(g, key, int, default_ids.get(name))
            if value is None:
                return None
            if not 0 <= value < n:
                raise ModelFormatError(f"{g.path}: {key} = {value} is outside the vocabulary (size {n})")
            return value

        def token_text(token_id: int | None) -> str:
            return "" if token_id is None else backend.id_to_token(token_id) or ""

        bos_id, eos_id = special_id("bos"), special_id("eos")
        stop = {i for i in (eos_id, special_id("eot"), special_id("eom")) if i is not None} | end_of_turn
        return cls(
            backend,
            vocab_size=n,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=_metadata(g, "tokenizer.ggml.add_bos_token", bool, default_bos),
            add_eos=_metadata(g, "tokenizer.ggml.add_eos_token", bool, False),
            stop_ids=frozenset(stop),
            chat_template=_metadata(g, "tokenizer.chat_template", str, None),
            special_tokens={
                "bos_token": token_text(bos_id),
                "eos_token": token_text(eos_id),
                "unk_token": token_text(special_id("unknown")),
                "pad_token": token_text(special_id("padding")),
            },
            source=str(g.path),
            source_file=g,
        )

    @classmethod
    def _from_huggingface(cls, g: GGUFFile) -> Tokenizer:
        """A checkpoint's fast tokenizer (tokenizer.json, kept whole under HF_TOKENIZER_KEY), as transformers runs it;
        special ids and the BOS rule come from tokenizer_config.json under GGUF's keys (`ntio.formats.checkpoint`)."""
        try:
            backend = _RustTokenizer.from_str(_metadata(g, HF_TOKENIZER_KEY, str))
        except Exception as e:  # the tokenizers library raises a bare Exception for a tokenizer.json it cannot read
            raise ModelFormatError(f"{g.path}: {HF_TOKENIZER_KEY} is not a tokenizer the tokenizers library reads "
                                   f"({str(e)[:80]})") from None
        n = backend.get_vocab_size(with_added_tokens=True)
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        backend.decoder = backend.decoder or decoders.ByteLevel()
        return cls._with_settings(g, backend, n, default_ids={}, default_bos=False,
                                  end_of_turn={backend.token_to_id(t) for t in specials & _END_OF_TURN_TEXTS})

    @functools.cached_property
    def vocabulary(self) -> str:
        """vocabulary_fingerprint of the file it was built from ("" if unknown)."""
        return vocabulary_fingerprint(self._source_file) if self._source_file is not None else ""

    def serves(self, g: GGUFFile) -> bool:
        """Whether this tokenizer maps text to the ids model file `g` was trained on (same vocabulary and rules)."""
        return bool(self.vocabulary) and self.vocabulary == vocabulary_fingerprint(g)

    @staticmethod
    def _byte_level(g: GGUFFile, vocab: dict[str, int]) -> tuple[_RustTokenizer, bool]:
        lines = _metadata(g, "tokenizer.ggml.merges", list, items=str)
        # Checked in bulk (set operations), line by line only to name a bad one: Qwen2.5's 151,387 merges took
        # 0.44 s one at a time, ~0.2 s so.
        merges = [tuple(line.split(" ")) for line in lines]
        if not (all(len(pair) == 2 for pair in merges) and vocab.keys() >= {part for pair in merges for part in pair}
                and vocab.keys() >= {first + second for first, second in merges}):
            i, line = next((i, line) for i, (line, pair) in enumerate(zip(lines, merges))
                           if len(pair) != 2 or any(part not in vocab for part in pair) or "".join(pair) not in vocab)
            raise ModelFormatError(
                f"{g.path}: tokenizer.ggml.merges[{i}] = {line!r} is not two tokens of the vocabulary merging "
                "into a third"
            )
        pre, llama3_style = _byte_level_pre_tokenizer(g)
        backend = _RustTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=llama3_style))
        backend.pre_tokenizer = pre
        backend.decoder = decoders.ByteLevel()
        return backend, llama3_style

    @staticmethod
    def _sentencepiece(g: GGUFFile, tokens: list[str], vocab: dict[str, int]) -> _RustTokenizer:
        scores = [float(s) for s in _metadata(g, "tokenizer.ggml.scores", list, items=(int, float))]
        if len(scores) != len(tokens):
            raise ModelFormatError(
                f"{g.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        unk_id = _metadata(g, "tokenizer.ggml.unknown_token_id", int, 0)
        backend = _RustTokenizer(
            BPE(
                vocab=vocab,
                merges=_sentencepiece_merges(tokens, scores),
                unk_token=tokens[unk_id] if 0 <= unk_id < len(tokens) else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        # SentencePiece writes spaces as U+2581 and, with add_space_prefix, puts one before the text. It does so even
        # when the text already starts with a space (" hi" -> "▁▁hi"), and llama.cpp again after every special token.
        # A normalizer runs on each stretch of text between special tokens and always prepends, which is both;
        # transformers' GGUF converter uses a Metaspace pre-tokenizer instead, which skips the prefix when the text
        # already starts with a space and after special tokens (see tests/test_tokenizer.py).
        add_prefix = _metadata(g, "tokenizer.ggml.add_space_prefix", bool, True)
        steps = [normalizers.Prepend("▁")] if add_prefix else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            # Undo the prefix space on the first piece only, as llama.cpp's detokenizer does.
            decode_steps.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(decode_steps)
        return backend

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids for `text`.

        add_bos: None follows the model file. special: True matches special-token strings (`<|im_start|>`) in
        the text, for rendered chat prompts; False reads them as plain characters, for raw text. A prompt that
        already starts with BOS (a template that writes it) gets no second one.
        """
        try:
            text.encode("utf-8")  # (`tokenizers` raises a TypeError on a lone surrogate: from JSON, or argv's bytes)
        except UnicodeEncodeError as e:
            raise NtioError(f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                            f"{e.start}") from None
        # encode_special_tokens=True is the `tokenizers` switch for "do not match special tokens in the text". It is
        # state on the shared backend, so one Tokenizer must not encode from two threads at once.
        self._backend.encode_special_tokens = not special
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def stream(self, *, skip_special: bool = False) -> TextStream:
        return TextStream(self, skip_special=skip_special)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise NtioError(f"{self._source}: the model has no chat template (tokenizer.chat_template)")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt)


class TextStream:
    """Incremental detokenizer: `push(token_id)` returns the text that token adds, possibly "".

    Text is never emitted token by token: a token may hold half of a UTF-8 character (byte-level and byte-fallback
    tokens), and SentencePiece drops the space of only the first piece. So each push decodes a short window
    starting at the last point where text was released, and releases what the window adds beyond its already
    released part, holding back while the text ends in U+FFFD (an incomplete character). `finish()` releases
    what is held (bytes that never formed a character), so that the pushes plus finish equal `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # _ids is the window: its first _read tokens are released and decode to _released (the tail of the text
        # released so far); the rest are held back.
        self._ids: list[int] = []
        self._read = 0
        self._released = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special=self._skip_special)
        if text.endswith("\ufffd") or len(text) <= len(self._released):
            return ""
        return self._release(text)

    def finish(self) -> str:
        """Whatever is held back at the end of generation (invalid UTF-8 shows as U+FFFD, as decode shows it)."""
        text = self._tokenizer.decode(self._ids, skip_special=self._skip_special)
        return self._release(text) if len(text) > len(self._released) else ""

    def _release(self, text: str) -> str:
        new = text[len(self._released):]
        # The next window starts at the first unreleased token, so decoding stays short however long the stream.
        self._ids = self._ids[self._read:]
        self._released = self._tokenizer.decode(self._ids, skip_special=self._skip_special)
        self._read = len(self._ids)
        return new
