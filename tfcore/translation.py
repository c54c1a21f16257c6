"""A real translation task for chapter 11: German number words into English ones.

``num2words`` writes a number in many languages: 342 is "dreihundertzweiundvierzig" in German
and "three hundred and forty-two" in English. German writes a number below a million as ONE
word, units before tens; English writes it as several words, tens before units. A model that
translates one into the other must segment the German word, reorder its parts and map each
to English.

Token ids follow chapter 10: PAD, BOS, EOS = 0, 1, 2, then UNK = 3 for a token the vocabulary
has never seen, then the vocabulary's own tokens.
"""

from __future__ import annotations

import random
import re

import torch

from .training import BOS, EOS, PAD

UNK = 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def number_words(number: int, lang: str) -> str:
    """``number`` written out in language ``lang`` ("de", "en", "fr", ...) by num2words: ``number`` is
    an int >= 0 and ``lang`` a language num2words knows (``num2words.CONVERTER_CLASSES``)."""
    from num2words import CONVERTER_CLASSES, num2words

    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"number must be a non-negative int, got {number!r}")
    if not isinstance(lang, str) or not (lang in CONVERTER_CLASSES or lang[:2] in CONVERTER_CLASSES):
        raise ValueError(f"num2words has no language {lang!r}: use a code such as 'de', 'en' or 'fr' "
                         f"(num2words.CONVERTER_CLASSES lists the {len(CONVERTER_CLASSES)} it has)")
    return num2words(number, lang=lang)


def number_pairs(numbers, source: str = "de", target: str = "en") -> list[tuple[str, str]]:
    """``[(number in words in source, same number in words in target), ...]`` for each of ``numbers``."""
    return [(number_words(n, source), number_words(n, target)) for n in numbers]


def split_numbers(low: int = 1, high: int = 9999, validation: int = 500, test: int = 1000,
                  seed: int = 0) -> dict[str, list[int]]:
    """The numbers ``low..high`` shuffled with ``seed`` and cut into train, validation and test.

    Every number is in exactly one split, so the test numbers' words were never seen as a whole
    in training: only their parts were.
    """
    for name, value in (("validation", validation), ("test", test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if low > high:
        raise ValueError(f"low ({low}) must not exceed high ({high})")
    numbers = list(range(low, high + 1))
    if validation + test >= len(numbers):
        raise ValueError(f"validation + test ({validation + test}) must be fewer than the {len(numbers)} numbers")
    random.Random(seed).shuffle(numbers)
    return {"test": sorted(numbers[:test]), "validation": sorted(numbers[test:test + validation]),
            "train": sorted(numbers[test + validation:])}


def characters(text: str) -> list[str]:
    """One token per character: "elf" -> ["e", "l", "f"]."""
    return list(text)


def words(text: str) -> list[str]:
    """Words, with a hyphen or comma as a token of its own: "forty-two" -> ["forty", "-", "two"]."""
    return re.findall(r"[^\s,-]+|[,-]", text)


def join_words(tokens: list[str]) -> str:
    """The inverse of ``words``: spaces between words, none around a hyphen or before a comma."""
    return " ".join(tokens).replace(" - ", "-").replace(" ,", ",")


class Vocab:
    """Tokens <-> ids for one language: the four specials, then the tokens of the training texts.

    ``Vocab(texts, tokenize)`` collects the tokens of ``texts`` (sorted, so the ids do not depend
    on the order of the texts); ``encode`` maps a text to ids with BOS and EOS around it (UNK for
    a token not in the vocabulary); ``decode`` maps ids back to text, stopping at the first EOS.
    """

    def __init__(self, texts, tokenize, detokenize=None):
        self.tokenize = tokenize
        self.detokenize = detokenize or "".join
        self.tokens = list(SPECIALS) + sorted({t for text in texts for t in tokenize(text)})
        self.ids = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        return [BOS] + [self.ids.get(t, UNK) for t in self.tokenize(text)] + [EOS]

    def decode(self, ids) -> str:
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == EOS:
                break
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"id {i} is not in this vocabulary of {len(self.tokens)} ids: decode ids "
                                 f"made by this Vocab (or a model whose output size is len(vocab))")
            if i >= len(SPECIALS):
                out.append(self.tokens[i])
            elif i == UNK:
                out.append(SPECIALS[UNK])
        return self.detokenize(out)

    def batch(self, texts, with_bos: bool = True) -> torch.Tensor:
        """``[N, longest + 2]`` ids, PAD on the right; without BOS (``with_bos=False``) for a source."""
        encoded = [self.encode(t)[0 if with_bos else 1:] for t in texts]
        if not encoded:
            raise ValueError("batch needs at least one text, got none")
        out = torch.full((len(encoded), max(map(len, encoded))), PAD)
        for row, ids in enumerate(encoded):
            out[row, :len(ids)] = torch.tensor(ids)
        return out


def translation_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu, default settings) and the share of exact matches.

    BLEU counts the word n-grams (1 to 4) a hypothesis shares with its reference, with a penalty
    for hypotheses shorter than the references; chrF is an F-score of character n-grams (1 to 6),
    which gives partial credit for a partly right word. Both are on a 0-100 scale; exact match is
    a share (0-1).
    """
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    if not references:
        raise ValueError("no hypotheses to score: pass at least one hypothesis and its reference")
    return {"BLEU": sacrebleu.corpus_bleu(hypotheses, [references]).score,
            "chrF": sacrebleu.corpus_chrf(hypotheses, [references]).score,
            "exact": sum(h == r for h, r in zip(hypotheses, references)) / len(references)}
