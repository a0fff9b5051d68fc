"""Tokenizer and chat template built from GGUF metadata, checked against transformers' GGUF tokenizer.

transformers builds its tokenizer from the same metadata by its own code (integrations/gguf), so agreement is
evidence that ntio reads the file as the model's tooling does. Loading it takes seconds, hence module fixtures.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ntio.errors import ModelFormatError, NtioError, UnsupportedModelError
from ntio.formats.gguf_file import GGUFFile
from ntio.text.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see what they've done!",
    "def f(x):\n    if x:\n\treturn [x * 2 for _ in range(3)]  # comment\n\n\nprint(f(1))\n",
    "Numbers: 1234567, 3.14159, -42, 1e10, 2024-01-01, $19.99, 100%",
    "Ünïcödé àccents — “quotes” naïve café, 日本語のテキスト, 中文文本, 한국어, Ελληνικά, Русский",
    "Emoji: 🎉🚀 👩‍👩‍👧 🇫🇷 ❤️ 😀",
    "multiple   spaces\t\ttabs\n\n\nnewlines \r\n crlf",
    "   leading and trailing whitespace   ",
    "\n\nstarts with newlines",
    "",
    " ",
    "<|im_start|>user plain text that looks special<|im_end|>",
]

CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2 + 2? Answer in one word."},
    ],
    "user-only": [{"role": "user", "content": "Hello! Write a haiku about the sea 🌊."}],
}


def _hf_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_ids(hf, text: str) -> list[int]:
    # split_special_tokens: special-token strings in the text are plain text, as for ntio's special=False.
    return hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _write_gguf(path: Path, metadata: dict, arch: str = "llama") -> Path:
    """A GGUF holding only metadata: enough for both tokenizers, which read no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (byte-level BPE, pre-tokenizer "smollm")


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


@pytest.fixture(scope="module")
def smol_hf(smollm2_path: Path):
    return _hf_tokenizer(smollm2_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(smol: Tokenizer, smol_hf, text: str) -> None:
    assert smol.encode(text, add_bos=False) == _hf_ids(smol_hf, text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(smol: Tokenizer, smol_hf, text: str) -> None:
    ids = smol.encode(text, add_bos=False)
    # Only where the reference round-trips too (byte-level BPE is lossless, so that should be every text).
    assert smol_hf.decode(ids, clean_up_tokenization_spaces=False) == text
    assert smol.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text, add_bos=False)
    ts = smol.stream()
    pieces = [ts.push(i) for i in ids]
    assert "".join(pieces) + ts.finish() == smol.decode(ids)
    # No piece carries half a character (decoded alone it would show as U+FFFD).
    assert all("\ufffd" not in p for p in pieces)


def test_stream_holds_back_split_emoji(smol: Tokenizer) -> None:
    ids = smol.encode("🎉", add_bos=False)
    # The emoji's four UTF-8 bytes are spread over several tokens, so the test exercises the split case.
    assert len(ids) > 1
    ts = smol.stream()
    pieces = [ts.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🎉"
    assert ts.finish() == ""


def test_stream_finish_releases_incomplete_bytes(smol: Tokenizer) -> None:
    # A generation that stops mid-character: the held bytes come out as decode shows them.
    ids = smol.encode("a🎉", add_bos=False)[:-1]
    ts = smol.stream()
    streamed = "".join(ts.push(i) for i in ids)
    assert streamed == "a"
    assert streamed + ts.finish() == smol.decode(ids)


def test_special_ids_and_flags(smol: Tokenizer, smol_hf) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_id == smol_hf.convert_tokens_to_ids("<|im_start|>") == 1
    assert smol.eos_id == smol_hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert smol.add_bos is False
    # <|im_end|> is the EOS; <|endoftext|> also ends a turn (llama.cpp's end-of-generation set).
    assert smol.stop_ids == frozenset({2, 0})
    assert smol.encode("hi") == smol.encode("hi", add_bos=False)
    assert smol.encode("hi", add_bos=True)[0] == 1


def test_special_flag(smol: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = smol.encode(text, special=True, add_bos=False)
    assert parsed[0] == 1 and 2 in parsed
    plain = smol.encode(text, add_bos=False)
    assert 1 not in plain and 2 not in plain
    assert smol.decode(parsed) == smol.decode(plain) == text
    assert smol.decode(parsed, skip_special=True) == "user\nhi"


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_matches_transformers(smol: Tokenizer, smol_hf, name: str) -> None:
    messages = CONVERSATIONS[name]
    rendered = smol.render_chat(messages)
    assert rendered == smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    expected_ids = smol_hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert smol.encode(rendered, special=True) == expected_ids
    without = smol.render_chat(messages, add_generation_prompt=False)
    assert without == smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


# ---------------------------------------------------------------------------------------------------------------
# Small synthetic files


def _byte_level_metadata(pre: str | None) -> dict:
    """A byte-level vocabulary: the 256 byte symbols, a few merges, and one control token."""
    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ 4", "Ġ4 5", "4 5", "Ġ 1", "Ġ1 2",
              "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "' s", "o n", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens = ["<|endoftext|>", *alphabet, *("".join(m.split(" ")) for m in merges)]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


BYTE_LEVEL_TEXTS = ["the world's 12345 and 4545 in\n\n\n  the  end", "Hello World'S 123ABC\r\n\tx", "  1245 45 ", ""]


# Pre-tokenizers both llama.cpp and transformers' GGUF converter know (transformers' fallback is GPT-2's regex).
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "tekken", "gpt-4o"])
def test_pre_tokenizer_regex_matches_transformers(tmp_path: Path, pre: str) -> None:
    path = _write_gguf(tmp_path / f"bpe-{pre}.gguf", _byte_level_metadata(pre))
    ours, hf = Tokenizer.from_gguf(GGUFFile(path)), _hf_tokenizer(path)
    for text in BYTE_LEVEL_TEXTS:
        assert ours.encode(text, add_bos=False) == _hf_ids(hf, text), text


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text, add_bos=False)]


def test_smollm_splits_digits_and_unknown_pre_warns_once(tmp_path: Path, capsys) -> None:
    smollm = Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "s.gguf", _byte_level_metadata("smollm"))))
    # llama.cpp's "smollm" cuts digits apart before the GPT-2 regex, so the merges " 1", "12", ... never apply.
    assert _pieces(smollm, " 123 45") == [" ", "1", "2", "3", " ", "4", "5"]
    assert capsys.readouterr().err == ""

    path = _write_gguf(tmp_path / "u.gguf", _byte_level_metadata("no-such-pre"))
    unknown = Tokenizer.from_gguf(GGUFFile(path))
    err = capsys.readouterr().err
    assert "no-such-pre" in err and "tokenizer.ggml.pre" in err
    # The GPT-2 fallback keeps " 123" and " 45" as words, so the merges "12 3" and "Ġ4 5" apply.
    assert _pieces(unknown, " 123 45") == [" ", "123", " 45"]
    Tokenizer.from_gguf(GGUFFile(path))
    assert capsys.readouterr().err == ""


# SentencePiece-style ("llama") vocabulary: control tokens, the 256 byte tokens, then pieces with scores.
_WORDS = [
    "▁the", "▁a", "▁and", "▁of", "▁to", "▁in", "▁is", "▁it", "▁that", "▁hello", "▁world", "▁token", "▁cat",
    "▁sat", "▁on", "▁mat", "▁there", "▁then", "▁they", "▁with", "▁for", "▁this", "▁spaces", "▁two", "▁leading",
    "▁trailing", "▁space", "▁numbers", "▁tabs", "▁new", "▁lines", "▁emoji", "▁caf", "▁na", "▁ve", "▁x",
    "in", "er", "ing", "ation", "th", "he", "an", "re", "on", "at", "en", "ed", "es", "or", "st", "ll", "ines",
    "▁▁", "▁▁▁▁", "12", "123", "45", ".", ",", "!", "'s",
]
_CHARS = list("▁abcdefghijklmnopqrstuvwxyz0123456789.,!?'-") + ["é"]


# Block tags on their own indented lines (trim_blocks and lstrip_blocks decide the whitespace), a loop control,
# tojson, and raise_exception.
_SPM_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {{ raise_exception('system messages are not supported') }}
    {% endif %}
    {% if m['content'] == 'skip' %}
        {% continue %}
    {% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}"""


def _sentencepiece_metadata() -> dict:
    pieces: list[str] = []
    for word in _WORDS:
        # Every prefix too, so that each piece can be built by merging two pieces, as in a trained vocabulary.
        for end in range(2, len(word) + 1):
            if word[:end] not in pieces:
                pieces.append(word[:end])
    pieces = [p for p in pieces if p not in _CHARS]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + pieces + _CHARS
    # As in Llama's tokenizer.model: a piece made earlier in training scores higher; single characters score last.
    scores = [0.0] * (len(specials) + len(byte_tokens)) + [-float(i) for i in range(len(pieces) + len(_CHARS))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(_CHARS)),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": _SPM_TEMPLATE,
    }



SPM_TEXTS = [
    "the cat sat on the mat, then they sat there.",
    "hello world's tokenization 12345!",
    "Thé naïve café — Capitals are not in the vocabulary",
    "你好 🎉 emoji fall back to bytes",
    "tabs\tand\nnew lines",
    "two  spaces    four spaces",
    "trailing space ",
    "x",
    "",
]
# Text starting with whitespace: SentencePiece (and llama.cpp) still add the prefix space; transformers' GGUF
# "llama" build (a Metaspace pre-tokenizer) does not, so these are compared with its "phi3" build only.
SPM_LEADING_SPACE_TEXTS = [" the cat", "  two leading spaces", "\tthe tab", "\nnew line first", "   "]


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory) -> dict[str, Path]:
    # One directory per file: transformers loads a GGUF by directory and file name.
    files = {}
    for arch in ("llama", "phi3"):
        d = tmp_path_factory.mktemp(arch)
        files[arch] = _write_gguf(d / "spm.gguf", _sentencepiece_metadata(), arch=arch)
    return files


@pytest.fixture(scope="module")
def spm(spm_files) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(spm_files["llama"]))


@pytest.fixture(scope="module")
def spm_hf(spm_files) -> dict:
    return {arch: _hf_tokenizer(path) for arch, path in spm_files.items()}


def test_sentencepiece_vocabulary_size(spm: Tokenizer, spm_hf) -> None:
    # A few hundred pieces besides the 3 specials and 256 bytes.
    assert spm.vocab_size == len(_sentencepiece_metadata()["tokenizer.ggml.tokens"]) == len(spm_hf["llama"])
    assert spm.vocab_size > 3 + 256 + 150


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_encode_matches_transformers(spm: Tokenizer, spm_hf, text: str) -> None:
    ours = spm.encode(text, add_bos=False)
    assert ours == _hf_ids(spm_hf["llama"], text)
    assert ours == _hf_ids(spm_hf["phi3"], text)


@pytest.mark.parametrize("text", SPM_LEADING_SPACE_TEXTS)
def test_sentencepiece_leading_space_keeps_prefix(spm: Tokenizer, spm_hf, text: str) -> None:
    # transformers' phi3 GGUF build is SentencePiece with the prefix as a normalizer (Prepend("▁") then spaces to
    # "▁"), the form of Llama 2's own tokenizer.json, so " the" is "▁▁the" as sentencepiece makes it.
    ours = spm.encode(text, add_bos=False)
    assert ours == _hf_ids(spm_hf["phi3"], text)
    if text.startswith(" "):
        # The sentencepiece definition: spaces become "▁" and one more "▁" goes in front.
        assert "".join(spm_hf["phi3"].convert_ids_to_tokens(ours)) == "▁" + text.replace(" ", "▁")


@pytest.mark.parametrize("text", SPM_TEXTS + SPM_LEADING_SPACE_TEXTS)
def test_sentencepiece_decode_and_stream(spm: Tokenizer, text: str) -> None:
    ids = spm.encode(text, add_bos=False)
    assert spm.decode(ids) == text
    ts = spm.stream()
    assert "".join(ts.push(i) for i in ids) + ts.finish() == text


def test_sentencepiece_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("x🎉", add_bos=False)
    assert ids[-4:] == [3 + b for b in "🎉".encode()]  # <0xF0> <0x9F> <0x8E> <0x89>, ids offset by 3 specials
    assert spm.decode(ids) == "x🎉"


def test_sentencepiece_bos_and_specials(spm: Tokenizer, spm_hf) -> None:
    # No add_bos_token key: llama.cpp (and transformers) add BOS to a SentencePiece vocabulary by default.
    assert spm.add_bos is True
    assert spm.encode("hello world") == spm_hf["llama"].encode("hello world")
    assert spm.encode("hello world")[0] == 1
    # A prompt that already starts with BOS gets no second one.
    assert spm.encode("<s>hello", special=True) == spm.encode("hello")
    assert spm.encode("<s>hello")[1] != 1
    assert spm.stop_ids == frozenset({2})


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_environment_matches_transformers(spm: Tokenizer, spm_hf, add_generation_prompt: bool) -> None:
    messages = [
        {"role": "user", "content": "hi <there> & \"you\""},
        {"role": "assistant", "content": "skip"},
        {"role": "user", "content": "naïve ☕"},
    ]
    rendered = spm.render_chat(messages, add_generation_prompt=add_generation_prompt)
    expected = spm_hf["llama"].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert '"naïve ☕"' in rendered and "<there> &" in rendered


def test_chat_template_raise_exception(spm: Tokenizer) -> None:
    with pytest.raises(NtioError, match="system messages are not supported"):
        spm.render_chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "t.gguf", _byte_level_metadata("gpt-2"))))
    assert tok.chat_template is None
    with pytest.raises(NtioError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "drop, key",
    [
        ("tokenizer.ggml.tokens", "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.model", "tokenizer.ggml.model"),
        ("tokenizer.ggml.merges", "tokenizer.ggml.merges"),
    ],
)
def test_missing_key_names_file_and_key(tmp_path: Path, drop: str, key: str) -> None:
    md = _byte_level_metadata("gpt-2")
    del md[drop]
    path = _write_gguf(tmp_path / "missing.gguf", md)
    with pytest.raises(ModelFormatError) as e:
        Tokenizer.from_gguf(GGUFFile(path))
    assert key in str(e.value) and "missing.gguf" in str(e.value)


@pytest.mark.parametrize("bad", ["Ġt", "Ġ t he", "Ġ q", "Ġ h"])
def test_a_merge_that_is_not_two_tokens_is_named(tmp_path: Path, bad: str) -> None:
    """A merge is two tokens of the vocabulary, one space apart, whose join is one too (not "Ġh"); else one line
    names the file and the merge."""
    md = _byte_level_metadata("gpt-2")
    md["tokenizer.ggml.merges"] = md["tokenizer.ggml.merges"][:5] + [bad] + md["tokenizer.ggml.merges"][5:]
    md["tokenizer.ggml.tokens"] = [t for t in md["tokenizer.ggml.tokens"] if t != "q"]
    md["tokenizer.ggml.token_type"] = [3] + [1] * (len(md["tokenizer.ggml.tokens"]) - 1)
    with pytest.raises(ModelFormatError) as e:
        Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "bad.gguf", md)))
    assert "bad.gguf" in str(e.value) and f"tokenizer.ggml.merges[5] = {bad!r}" in str(e.value)


def test_missing_scores_for_sentencepiece(tmp_path: Path) -> None:
    md = _sentencepiece_metadata()
    del md["tokenizer.ggml.scores"]
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "t.gguf", md)))


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    md = _byte_level_metadata("gpt-2") | {"tokenizer.ggml.model": "bert"}
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "t.gguf", md)))


def test_special_id_outside_vocabulary(tmp_path: Path) -> None:
    md = _byte_level_metadata("gpt-2") | {"tokenizer.ggml.bos_token_id": 10**6}
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.bos_token_id"):
        Tokenizer.from_gguf(GGUFFile(_write_gguf(tmp_path / "t.gguf", md)))
