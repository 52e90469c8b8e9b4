"""A deterministic, built-in training corpus for the tiny tokenizers.

The corpus mixes English prose, source code and multi-byte text (accented Latin, Japanese, Chinese,
Cyrillic, emoji) so that the trained byte-level BPE has merges for multi-byte UTF-8 sequences: tests
of incremental detokenization need tokens that end in the middle of a character.
"""

from __future__ import annotations

import random
from collections.abc import Callable


def _split(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(","))


_SUBJECTS = _split(
    "the server, a scheduler, my friend, the old cat, every request, our team, the model, "
    "a small robot, the teacher, this function, the river, a curious child, the engine, "
    "the kernel, each worker, the city, a tired student, the library"
)
_VERBS = _split(
    "reads, writes, schedules, finds, builds, sends, returns, watches, explains, computes, "
    "remembers, caches, loads, opens, closes, answers, paints, counts"
)
_OBJECTS = _split(
    "the tokens, a long story, three apples, the blocks, every message, the weather, a new plan, "
    "the results, two questions, the cache, a quiet song, the numbers, the images, "
    "an audio clip, the answer, a bright window, the map, its memory"
)
_ADVERBS = _split(
    "quickly, slowly, again, carefully, today, at night, without errors, in order, "
    "every morning, before lunch, for a while, twice, on time, with care"
)
_NAMES = _split(
    "compute, schedule, load_weights, parse, encode, decode, allocate, free_block, merge, "
    "hash_prompt, sample, forward, step, update, render, tokenize"
)
_QUESTIONS = (
    "What is the capital of France?",
    "How many blocks are free?",
    "Why is the sky blue?",
    "Can you write a short poem?",
    "Where did the request go?",
    "Who wrote this code?",
    "When does the train leave?",
    "Which model is the fastest?",
    "How do I sort a list?",
)
_VARS = ("x", "y", "items", "tokens", "block_ids", "count", "result", "value", "prompt", "n")
_WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star table
need court oil situation cost industry figure street image phone data picture practice piece land
product doctor wall patient worker news test movie north love support technology step baby computer
type attention film tree source organization hair window evidence population truth song energy
memory token block cache kernel tensor layer weight batch queue stream socket buffer thread server
client engine request response prefix suffix vector matrix scalar gradient optimizer scheduler
green blue red yellow purple orange silver golden bright dark quiet loud happy sad simple complex
fast slow early late small large ancient modern famous hidden careful gentle brave clever honest
run walk jump swim think know believe create destroy measure improve explain discover imagine
""".split()
_MULTIBYTE = (
    "Café au lait, s'il vous plaît. Voilà, très bien !",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus München, schön!",
    "Les élèves étudient à l'école; l'été est déjà là. Noël, naïve, façade, cœur.",
    "El niño comió piña en la mañana. ¿Dónde está la estación? ¡Olé!",
    "日本語のテキストです。今日はいい天気ですね。東京へ行きましょう。",
    "私は学生です。猫が好きです。ありがとうございます。",
    "这是一个中文句子。我们一起学习模型服务。你好，世界！",
    "Привет, мир! Как дела? Сегодня хорошая погода.",
    "Γειά σου κόσμε. Η γλώσσα είναι όμορφη.",
    "Emoji time: 🙂 😀 🚀 ✨ 🎉 👍 ❤️ 🔥 🐍 🌍",
    "Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159, 5 € or £3 or ¥100.",
    "Naïve café résumé — “quoted” ‘text’ … and ñ, ü, é, ø, å.",
)


def _sentence(rng: random.Random) -> str:
    text = " ".join(rng.choice(words) for words in (_SUBJECTS, _VERBS, _OBJECTS, _ADVERBS))
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


def _word_salad(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(6, 16))
    return " ".join(words).capitalize() + rng.choice((".", ",", ";", "!", "?"))


def _prose(rng: random.Random) -> str:
    parts = [_sentence(rng) for _ in range(rng.randint(1, 3))]
    parts += [_word_salad(rng) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts.append(rng.choice(_QUESTIONS))
    if rng.random() < 0.3:
        price, year = f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}", rng.randint(1990, 2030)
        parts.append(f"It costs {price} dollars in {year}.")
    return " ".join(parts)


def _python(rng: random.Random) -> str:
    name = f"{rng.choice(_NAMES)}_{rng.choice(_WORDS)}"
    a, b = rng.choice(_VARS), rng.choice(_WORDS)
    lines = [
        f"def {name}({a}: list[int], {b}: int = {rng.randint(0, 64)}) -> int:",
        f'    """{_sentence(rng)}"""',
        "    total = 0",
        f"    for i in range(len({a})):",
        f"        if {a}[i] % {rng.randint(2, 9)} == 0:",
        f"            total += {a}[i] * {b}",
        "    return total",
    ]
    return "\n".join(lines)


def _other_code(rng: random.Random) -> str:
    key, num = rng.choice(_VARS), rng.randint(0, 4096)
    return rng.choice(
        (
            f'{{"{key}": {num}, "name": "{rng.choice(_NAMES)}", "ok": true, "tags": ["a", "b"]}}',
            f"for (int i = 0; i < {num}; ++i) {{ sum += {key}[i]; }}",
            f"$ python -m pytest -x -q tests/test_{rng.choice(_NAMES)}.py --maxfail={num % 5 + 1}",
            f"SELECT {key}, COUNT(*) FROM requests WHERE id > {num} GROUP BY {key};",
            f"const {key} = await fetch(`/v1/{rng.choice(_NAMES)}?n={num}`);",
            f'<div class="{key}">{_sentence(rng)}</div>',
        )
    )


def _multibyte(rng: random.Random) -> str:
    return " ".join(rng.sample(_MULTIBYTE, k=rng.randint(1, 3)))


_GENERATORS: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (_prose, 5),
    (_python, 2),
    (_other_code, 2),
    (_multibyte, 2),
)


def build_corpus(num_documents: int = 3000, seed: int = 0) -> list[str]:
    """Return `num_documents` varied documents; the same arguments always give the same corpus."""
    rng = random.Random(seed)
    generators = [gen for gen, weight in _GENERATORS for _ in range(weight)]
    return [rng.choice(generators)(rng) for _ in range(num_documents)]
