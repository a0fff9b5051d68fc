"""A calibration text made of the model's own answers (self-distillation).

An exit head drafts the tokens the model itself would write next, so it is best fitted on text of that kind: the
model's greedy answers to chat prompts. SmolLM2's layer-27 head, self-speculating with prompt lookup on the
speculative bench's prompts (streamed, 64 tokens; benches/RESULTS.md): fitted on ntio's sources and docs, 3.00 /
1.80 / 5.42 tokens a verify pass on code / prose / rewriting; on its own answers to the prompts below, distilled
(ntio.decoding.self_draft.distill_heads), 4.22 / 2.62 / 5.55.

`PROMPTS` is a varied set (explanations, descriptions, advice, code, editing) that `ntio calibrate` uses when it is
given neither a corpus nor prompts. None of them is a prompt of the benches or the tests, which measure on text the
heads were not fitted on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ntio.errors import NtioError

DEFAULT_ANSWER_TOKENS = 256  # the longest answer to a prompt
PROMPT_ROOM = 256  # context positions kept for a chat-templated prompt beside its answer

_TOPICS = [
    "rivers", "volcanoes", "the moon's phases", "photosynthesis", "how a bicycle works", "why bread rises",
    "the water cycle", "how vaccines work", "tides", "rainbows", "the seasons", "how bees make honey",
    "what causes thunder", "how a compass works", "why ice floats", "how clouds form", "earthquakes",
    "the printing press", "how plants drink water", "why cats purr", "how airplanes fly", "black holes",
    "how the heart pumps blood", "why we sleep", "how glass is made", "coral reefs", "how a refrigerator works",
    "the invention of the telephone", "deserts", "why leaves are green", "how money came to be", "glaciers",
]
_FORMS = ["Explain {} to a curious child.", "Write a short paragraph about {}.", "Describe {} in simple words.",
          "Give three facts about {}."]
_TASKS = [
    "Write a Python function that sums the even numbers in a list.",
    "Write a Python class for a simple stack with push, pop and peek.",
    "Write a JavaScript function that capitalizes every word in a string.",
    "Write a Python function that reads a file and counts its lines.",
    "Write a SQL query that finds the ten largest orders in an orders table.",
    "Write a Python function that returns the factorial of n recursively.",
    "Write a Python script that prints the multiplication table up to 10.",
    "Write a C function that computes the length of a string.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a bash script that counts the files in a directory.",
    "Write a Python function that converts Celsius to Fahrenheit, with a docstring.",
    "Write a Python function that checks whether a number is prime.",
    "Write a JavaScript function that returns the largest number in an array.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the n-th row of Pascal's triangle.",
    "Write a Go function that reverses a slice of integers.",
    "Write a Python dataclass for a book with a title, an author and a year.",
    "Write a Rust function that returns the sum of a vector of integers.",
    "Summarize in two sentences what a database index is for.",
    "Make this sentence more polite: 'Send me the report now.'",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "Give four tips for writing clear emails.",
    "Write a haiku about the first snow.",
    "Tell a short story about a lost umbrella.",
]
# Each topic in two of the forms, taken in turn (64 questions).
_ASKED = [_FORMS[(i + j) % len(_FORMS)].format(topic) for i, topic in enumerate(_TOPICS) for j in (0, 1)]
# The 24 tasks spread among the questions (one after every two or three), so that a text cut short at a token budget
# holds both kinds.
PROMPTS = [p for i, task in enumerate(_TASKS) for p in (*_ASKED[i * len(_ASKED) // len(_TASKS):
                                                                (i + 1) * len(_ASKED) // len(_TASKS)], task)]


def model_answers(llm, prompts: Sequence[str], max_tokens: int, enough: int,
                  on_progress: Callable[[int, int], None] | None = None, source: str = "prompt") -> str:
    """Each prompt followed by the model's greedy answer (through its chat template where it has one; a model
    without one continues the prompt), separated by blank lines, until the text holds about `enough` tokens (each
    part counted alone) or the prompts run out. Empty prompts are skipped. max_tokens: the longest answer, less
    where the context would overflow; a prompt that leaves no room is an error naming it (`source`, then its
    1-based index among `prompts`: "FILE, line 3")."""
    chat = bool(llm.tokenizer.chat_template)
    capacity = llm.engine.kv.capacity
    numbered = [(i, p.strip()) for i, p in enumerate(prompts, 1) if p.strip()]
    if not numbered:
        raise NtioError("no prompts to answer (every one is empty)")
    parts: list[str] = []
    tokens = 0
    for done, (line, prompt) in enumerate(numbered, 1):
        ids = llm.encode_prompt(prompt, chat=chat)
        room = min(max_tokens, capacity - len(ids) - 1)
        if room < 1:
            raise NtioError(f"{source} {line}: the prompt has {len(ids)} tokens, and the context holds {capacity} "
                            f"(raise --ctx-size)")
        answer = llm.generate(ids, room)
        parts.append(f"{prompt}\n\n{answer.text.strip()}\n\n")
        tokens += len(llm.tokenizer.encode(parts[-1], add_bos=False))
        if on_progress is not None:
            on_progress(done, len(numbered))
        if tokens >= enough:
            break
    return "".join(parts)
