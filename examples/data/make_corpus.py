"""Write ``tiny_corpus.txt``: deterministic English-like text from a small grammar.

Why generated: the examples must run offline and the repository ships no third-party text. A
grammar gives the character model real structure to learn (frequent words, agreement between a
subject and its verb, punctuation, paragraph breaks), so the loss falls visibly within a few
dozen steps, well below the ~2.9 nats of a character-unigram model.

Run ``python examples/data/make_corpus.py`` to regenerate; the output is byte-identical for a
given seed (only ``random.Random``, no hash-order dependence). Plain ASCII, so token = byte.
"""

from __future__ import annotations

import random
from pathlib import Path

ADJ = ["old", "young", "quiet", "tired", "clever", "small", "brave", "gentle", "curious",
       "grey", "busy", "patient", "honest", "proud", "careful"]
SINGULAR = ["fisherman", "baker", "teacher", "sailor", "farmer", "child", "miller", "doctor",
            "shepherd", "weaver", "captain", "gardener", "clerk", "traveller", "widow"]
PLURAL = ["fishermen", "bakers", "teachers", "sailors", "farmers", "children", "millers",
          "doctors", "shepherds", "weavers", "neighbours", "gardeners", "clerks", "travellers"]
NAMES = ["Anna", "Thomas", "Clara", "Henry", "Martha", "Samuel", "Lucy", "Edward", "Rose", "Walter"]
# (third person singular, plural/base) pairs so the grammar can make the verb agree.
VERBS = [("walks", "walk"), ("looks", "look"), ("waits", "wait"), ("sings", "sing"),
         ("works", "work"), ("rests", "rest"), ("listens", "listen"), ("returns", "return")]
TRANSITIVE = [("carries", "carry"), ("mends", "mend"), ("finds", "find"), ("sells", "sell"),
              ("paints", "paint"), ("counts", "count"), ("washes", "wash"), ("watches", "watch")]
OBJECTS = ["the nets", "a basket of apples", "the old boat", "a loaf of bread", "the letters",
           "the garden gate", "a lantern", "the sheep", "a blue coat", "the copper kettle",
           "the bells", "a wooden chair"]
PLACES = ["to the harbour", "along the river", "near the mill", "by the church", "in the market",
          "across the bridge", "under the oak tree", "at the edge of the village",
          "on the hill", "behind the bakery"]
TIMES = ["at dawn", "in the evening", "before the rain", "after supper", "every morning",
         "on sundays", "when the bells ring", "while the town sleeps", "in the winter"]
ADVERBS = ["slowly", "quietly", "happily", "carefully", "again", "alone", "together", "early"]
WEATHER = ["The wind is cold", "The sky is clear", "The rain falls softly", "The fog is thick",
           "The sun is warm", "The snow lies deep", "The river is high"]
SAYINGS = ["we will go home soon", "the boat is ready", "the bread is still warm",
           "nobody saw the lantern", "the bells are early today", "the sheep are on the hill",
           "it will rain before night", "the bridge is safe again"]


def noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """A subject and whether it is singular (the verb must agree)."""
    roll = rng.random()
    if roll < 0.25:
        return rng.choice(NAMES), True
    adj = f"{rng.choice(ADJ)} " if rng.random() < 0.6 else ""
    if roll < 0.65:
        return f"the {adj}{rng.choice(SINGULAR)}", True
    return f"the {adj}{rng.choice(PLURAL)}", False


def clause(rng: random.Random) -> str:
    subject, singular = noun_phrase(rng)
    pick = 0 if singular else 1
    if rng.random() < 0.5:
        words = [subject, rng.choice(VERBS)[pick]]
        if rng.random() < 0.5:
            words.append(rng.choice(ADVERBS))
        words.append(rng.choice(PLACES))
    else:
        words = [subject, rng.choice(TRANSITIVE)[pick], rng.choice(OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(PLACES))
    if rng.random() < 0.5:
        words.append(rng.choice(TIMES))
    return " ".join(words)


def sentence(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.12:
        text = f"{rng.choice(WEATHER)} {rng.choice(TIMES)}."
    elif roll < 0.24:
        text = f'"{rng.choice(SAYINGS).capitalize()}," said {rng.choice(NAMES)}.'
    elif roll < 0.5:
        joiner = rng.choice(["and", "but", "because", "while"])
        text = f"{clause(rng)}, {joiner} {clause(rng)}."
    else:
        text = f"{clause(rng)}."
    return text[0].upper() + text[1:]  # a quote's first char is '"', so this is a no-op there


def corpus(seed: int = 0, target_bytes: int = 80_000) -> str:
    """Paragraphs of 3-7 sentences, each paragraph one line, until ``target_bytes``."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        para = " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(para)
        size += len(para) + 1
    return "\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("tiny_corpus.txt")
    out.write_text(corpus(), encoding="ascii")
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
