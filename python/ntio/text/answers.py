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

import queue
from collections.abc import Callable, Sequence

from ntio.errors import NtioError

DEFAULT_ANSWER_TOKENS = 256  # the longest answer to a prompt
PROMPT_ROOM = 256  # context positions kept for a chat-templated prompt beside its answer
ANSWER_SLOTS = 8  # prompts answered at once, sharing each pass over the weights

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
    without one continues the prompt), separated by blank lines, in the prompts' order, until the text holds about
    `enough` tokens (each part counted alone) or the prompts run out. Empty prompts are skipped.

    Up to ANSWER_SLOTS prompts are answered at once, in shared passes (`serving.Scheduler`): each answer is the one
    `LLM.generate` gives (prompts of up to ops.KERNEL_ROWS tokens; see the scheduler), and a pass over the weights
    serves them all; no more are asked than the text may still need. The context (`llm.engine.kv.capacity`) is
    split among them, a slot of at least PROMPT_ROOM + max_tokens positions each. max_tokens: the longest answer,
    less where a slot would overflow; a prompt that leaves no room is an error naming it (`source`, then its 1-based
    index among `prompts`: "FILE, line 3"), raised before any answer."""
    from ntio.decoding.generation import SamplingParams
    from ntio.serving.scheduler import Request, Scheduler

    chat = bool(llm.tokenizer.chat_template)
    capacity = llm.engine.kv.capacity
    parallel = max(1, min(ANSWER_SLOTS, capacity // (PROMPT_ROOM + max_tokens)))
    slot_context = capacity // parallel
    asked = []  # (prompt, its ids, its answer's longest length, its line)
    for line, prompt in ((i, p.strip()) for i, p in enumerate(prompts, 1)):
        if not prompt:
            continue
        ids = llm.encode_prompt(prompt, chat=chat)
        room = min(max_tokens, slot_context - len(ids) - 1)
        if room < 1:
            raise NtioError(f"{source} {line}: the prompt has {len(ids)} tokens, and each of the {parallel} prompts "
                            f"answered at once has {slot_context} positions of the context (raise --ctx-size)")
        asked.append((prompt, ids, room, line))
    if not asked:
        raise NtioError("no prompts to answer (every one is empty)")

    events: queue.Queue = queue.Queue()  # (index, event...) from the engine thread
    # A queue that holds every prompt: the loop below bounds what waits. (A bound of its own could refuse one just
    # after an answer's "done", before the scheduler frees that answer's slot.)
    scheduler = Scheduler(llm, parallel, max_queue=len(asked), slot_context=slot_context)
    requests: list[Request] = []

    def ask(index: int) -> None:
        _, ids, room, _ = asked[index]
        requests.append(Request(ids, room, SamplingParams(), (), lambda *event: events.put((index, *event))))
        if not scheduler.submit(requests[-1]):
            raise RuntimeError("the scheduler refused a calibration prompt")  # its queue holds them all

    scheduler.start()
    try:
        pieces: dict[int, list[str]] = {index: [] for index in range(len(asked))}  # each answer's text so far
        parts: dict[int, str] = {}  # the finished answers' parts of the text, by prompt
        sizes: dict[int, int] = {}  # and their tokens
        joined = tokens = 0  # the parts that make the text, in order, and their tokens
        while joined < len(asked) and tokens < enough:
            # More prompts while the finished answers and those in flight, each as long as it may grow (its prompt and
            # the longest answer), fall short of `enough`: at most the slots' worth, and as many waiting for one. (At
            # the mean size so far, the short answers, which finish first, made it ask for answers never used.)
            while (len(requests) < len(asked) and len(requests) - len(parts) < 2 * parallel
                   and sum(sizes.values()) + sum(len(asked[i][1]) + asked[i][2] for i in range(len(requests))
                                                 if i not in parts) < enough):
                ask(len(requests))
            index, kind, *rest = events.get()
            if kind == "error":
                raise NtioError(f"answering {source} {asked[index][3]}: {rest[0]}")
            if kind == "text":
                pieces[index].append(rest[0])
                continue
            parts[index] = f"{asked[index][0]}\n\n{''.join(pieces.pop(index)).strip()}\n\n"
            sizes[index] = len(llm.tokenizer.encode(parts[index], add_bos=False))
            while joined in parts and tokens < enough:  # the answers finished in order join the text
                tokens += sizes[joined]
                joined += 1
                if on_progress is not None:
                    on_progress(joined, len(asked))
    finally:
        for request in requests:  # answers no longer needed
            request.cancelled.set()
        scheduler.shutdown()
    return "".join(parts[index] for index in range(joined))
