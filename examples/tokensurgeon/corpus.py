"""A synthetic text corpus for the tokensurgeon proof: deterministic, offline, no files to ship.

A toy language with a few thousand pseudo-words built from syllables and a grammar with strong
co-occurrences (each noun has its adjectives and verbs, each verb its objects), so a tiny model learns
real structure in minutes of CPU and embeddings carry meaning that a tokenizer transplant can keep or
lose. Word frequencies are Zipfian, so byte-level BPEs of 1,000 and 1,500 merges share most tokens
but not all (the larger one has whole words the smaller spells in pieces).
"""

from __future__ import annotations

import random

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "gl", "pl", "sk"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "th", "ck"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


class Language:
    """The toy language: word classes, their co-occurrences, and a sentence sampler."""

    def __init__(self, seed: int = 0, nouns: int = 900, verbs: int = 400, adjectives: int = 400) -> None:
        rng = random.Random(seed)
        seen: set[str] = set()

        def fresh(n: int, suffix: str) -> list[str]:
            out: list[str] = []
            while len(out) < n:
                w = _word(rng, rng.choice([1, 2, 2, 3])) + suffix
                if w not in seen:
                    seen.add(w)
                    out.append(w)
            return out

        self.nouns = fresh(nouns, "")
        self.verbs = fresh(verbs, "es")
        self.adjectives = fresh(adjectives, "y")
        self.noun_adjs = {n: rng.sample(self.adjectives, 3) for n in self.nouns}
        self.noun_verbs = {n: rng.sample(self.verbs, 3) for n in self.nouns}
        self.verb_objs = {v: rng.sample(self.nouns, 4) for v in self.verbs}
        # Zipfian weights over nouns: frequent words become whole tokens sooner
        self.noun_weights = [1.0 / (i + 1) ** 0.9 for i in range(nouns)]

    def sentence(self, rng: random.Random) -> str:
        subject = rng.choices(self.nouns, self.noun_weights)[0]
        verb = rng.choice(self.noun_verbs[subject])
        obj = rng.choice(self.verb_objs[verb])
        parts = ["the"]
        if rng.random() < 0.6:
            parts.append(rng.choice(self.noun_adjs[subject]))
        parts += [subject, verb, rng.choice(["the", "a"])]
        if rng.random() < 0.5:
            parts.append(rng.choice(self.noun_adjs[obj]))
        parts.append(obj)
        if rng.random() < 0.3:
            parts += ["and", rng.choice(self.noun_verbs[obj]), "the", rng.choice(self.verb_objs[verb])]
        return " ".join(parts) + "."

    def text(self, sentences: int, seed: int) -> str:
        rng = random.Random(seed)
        return " ".join(self.sentence(rng) for _ in range(sentences))


TRAIN_SEED = 1
HELDOUT_SEED = 2


def train_text(sentences: int = 60_000) -> str:
    return Language().text(sentences, TRAIN_SEED)


def heldout_text(sentences: int = 2_000) -> str:
    return Language().text(sentences, HELDOUT_SEED)
