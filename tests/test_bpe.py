"""tfcore.bpe (chapter 24): our byte-level BPE equals the `tokenizers` library's, and each planted bug
(a merge applied out of rank order, a tie broken the other way, counts not updated after a merge, the
pre-tokeniser without the leading-space rule) breaks that equality."""

import json
import random

import pytest
from tokenizers import ByteLevelBPETokenizer
from tokenizers.pre_tokenizers import ByteLevel

from tfcore import bpe
from tfcore.speculative import decoding_tokenizer_and_texts

AWKWARD = ["Attention is all you need 🙂", "Die Größenordnung überrascht.", "naïve café", "变压器模型",
           "mask = torch.tril(x) != 0\n\tif a:\n\t\treturn b", "a   b\n\n\n  c   ", "12345 67,890.5 1e-9",
           "I'm we've they'll it's don't CAN'T", "", " ", "\u200b\u00a0x", "👩\u200d👩\u200d👧"]


def library_merges(tokenizer):
    return [tuple(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]


@pytest.fixture(scope="module")
def corpus():
    library, texts = decoding_tokenizer_and_texts()  # chapter 14's tokenizer and split
    return library, texts, bpe.train(texts["train"], vocab_size=1000, min_frequency=2)


def test_merges_and_vocabulary_equal_the_library(corpus):
    library, _, ours = corpus
    assert len(ours.merges) == 744
    assert ours.merges == library_merges(library)  # the same merges, in the same order
    assert {token: i for i, token in enumerate(ours.vocab)} == library.get_vocab()


def test_ids_equal_the_library_and_round_trip(corpus):
    library, texts, ours = corpus
    for text in [texts["validation"], texts["test"], *AWKWARD]:
        assert ours.encode(text) == library.encode(text).ids, text[:40]
        assert ours.decode(ours.encode(text)) == text


def test_random_small_corpora_with_many_ties_give_the_library_merges():
    rng = random.Random(1)  # the test's own fixed seed
    for _ in range(200):
        letters = "abcd"[:rng.randrange(2, 5)]
        words = ["".join(rng.choice(letters) for _ in range(rng.randrange(1, 9)))
                 for _ in range(rng.randrange(2, 12))]
        corpus = [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 40))) for _ in range(rng.randrange(1, 4))]
        vocab_size, min_frequency = rng.randrange(258, 300), rng.choice([0, 1, 2, 3])
        library = ByteLevelBPETokenizer()
        library.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False)
        ours = bpe.train(corpus, vocab_size, min_frequency)
        assert ours.merges == library_merges(library), corpus
        assert bpe.train_naive(corpus, vocab_size, min_frequency).merges == ours.merges, corpus


def test_random_strings_equal_the_library_and_round_trip(corpus):
    library, _, ours = corpus
    rng = random.Random(0)  # the test's own fixed seed
    blocks = [(0, 32), (32, 127), (160, 700), (0x0600, 0x0700), (0x4E00, 0x4F00), (0x1F600, 0x1F650)]
    for _ in range(300):
        text = "".join(chr(rng.randrange(*rng.choice(blocks))) for _ in range(rng.randrange(0, 40)))
        assert ours.encode(text) == library.encode(text).ids, repr(text)
        assert ours.decode(ours.encode(text)) == text


def test_pre_tokenizer_equals_the_library(corpus):
    _, texts, _ = corpus
    reference = ByteLevel(add_prefix_space=False)
    for text in texts["train"] + [texts["validation"], texts["test"]] + AWKWARD:
        assert bpe.pre_tokenize(text) == [word for word, _ in reference.pre_tokenize_str(text)]


def test_byte_table_and_byte_ids():
    table = bpe.bytes_to_unicode()
    assert len(set(table.values())) == 256 and table[32] == "Ġ" and table[65] == "A"
    assert sorted(table.values()) == sorted(ByteLevel.alphabet())
    ours = bpe.train(["abc"], vocab_size=256)
    assert ours.vocab.index("!") == 0 and ours.vocab.index("A") == 32 and ours.vocab.index("Ā") == 188


def test_naive_trainer_gives_the_same_first_merges(corpus):
    _, texts, ours = corpus
    naive = bpe.train_naive(texts["train"][:3], vocab_size=1000, min_frequency=2, max_merges=40)
    fast = bpe.train(texts["train"][:3], vocab_size=1000, min_frequency=2)
    assert naive.merges == fast.merges[:40]


def test_special_tokens_and_min_frequency_match_the_library(corpus):
    _, texts, _ = corpus
    library = ByteLevelBPETokenizer()
    library.train_from_iterator(texts["train"], vocab_size=1000, min_frequency=2,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    ours = bpe.train(texts["train"], vocab_size=1000, min_frequency=2, special_tokens=["<|endoftext|>"])
    assert ours.merges == library_merges(library) and len(ours.merges) == 743
    assert ours.vocab[0] == "<|endoftext|>" == library.id_to_token(0)
    text = "one.<|endoftext|>Two <|endoftext|><|endoftext|> x"
    assert ours.encode(text) == library.encode(text).ids and ours.decode(ours.encode(text)) == text
    # A special token written in the training text: the library counts its characters as ordinary text.
    joined = ["<|endoftext|>".join(texts["train"][:4]) + "<|endoftext|>"] * 3
    library = ByteLevelBPETokenizer()
    library.train_from_iterator(joined, vocab_size=600, min_frequency=2, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    assert bpe.train(joined, 600, 2, special_tokens=["<|endoftext|>"]).merges == library_merges(library)
    assert bpe.train(joined, 600, 2, special_tokens=["<|endoftext|>"], cut_special=True).merges != library_merges(library)
    tiny = ["low lower lowest", "newer newest wider"]
    for min_frequency in (1, 2, 3):
        library = ByteLevelBPETokenizer()
        library.train_from_iterator(tiny, vocab_size=400, min_frequency=min_frequency, show_progress=False)
        assert bpe.train(tiny, 400, min_frequency).merges == library_merges(library)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least 256"):
        bpe.train(["abc"], vocab_size=255)
    with pytest.raises(ValueError, match="1 special"):
        bpe.train(["abc"], vocab_size=256, special_tokens=["<|endoftext|>"])
    with pytest.raises(TypeError, match="list of strings"):
        bpe.train("abc", vocab_size=300)
    with pytest.raises(TypeError, match="reads text"):
        bpe.train([b"abc"], vocab_size=300)
    tokenizer = bpe.train(["abc abc"], vocab_size=300)
    with pytest.raises(TypeError, match="reads text"):
        tokenizer.encode(42)
    with pytest.raises(ValueError, match="must lie in"):
        tokenizer.decode([300])
    with pytest.raises(ValueError, match="tie_break"):
        bpe.train(["abc"], vocab_size=300, tie_break="random")


# ------------------------------------------------------------------------------------------------
# Planted bugs: each must break the equality with the library.


class OutOfRankOrder(bpe.ByteLevelBPE):
    """Planted bug: apply the first mergeable pair from the left, whatever its rank."""

    def encode_word(self, word):
        symbols = list(word)
        while True:
            spots = [i for i in range(len(symbols) - 1) if (symbols[i], symbols[i + 1]) in self.ranks]
            if not spots:
                return symbols
            i = spots[0]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]


def test_planted_merge_out_of_rank_order_is_caught(corpus):
    library, texts, ours = corpus
    broken = OutOfRankOrder(ours.vocab, ours.merges)
    assert broken.encode(texts["test"]) != library.encode(texts["test"]).ids


def test_planted_bytes_numbered_by_value_are_caught(corpus):
    library, texts, ours = corpus
    by_value = [bpe.BYTE_TO_CHAR[byte] for byte in range(256)] + ours.vocab[256:]
    broken = bpe.ByteLevelBPE(by_value, ours.merges)
    assert broken.decode(broken.encode(texts["test"])) == texts["test"]  # it still round-trips ...
    assert broken.encode(texts["test"]) != library.encode(texts["test"]).ids  # ... but the ids are not GPT-2's


def test_planted_tie_broken_the_other_way_is_caught(corpus):
    library, texts, _ = corpus
    other = bpe.train(texts["train"], vocab_size=1000, min_frequency=2, tie_break="strings")
    assert other.merges != library_merges(library)


def test_planted_counts_not_updated_is_caught(corpus, monkeypatch):
    library, texts, _ = corpus

    def merge_without_counting(words, counts, pairs, where, pair, new_id):
        for w in where.get(pair, ()):
            words[w] = bpe.merge_word(words[w], pair, new_id)
        return set(), 0

    monkeypatch.setattr(bpe, "apply_merge", merge_without_counting)
    assert bpe.train(texts["train"], vocab_size=1000, min_frequency=2).merges != library_merges(library)


def test_planted_pattern_without_leading_space_is_caught(corpus):
    library, texts, _ = corpus
    no_space = bpe.GPT2_PATTERN.replace(" ?", "")
    reference = ByteLevel(add_prefix_space=False)
    assert bpe.pre_tokenize(texts["test"], no_space) != [w for w, _ in reference.pre_tokenize_str(texts["test"])]
    other = bpe.train(texts["train"], vocab_size=1000, min_frequency=2, pattern=no_space)
    assert other.merges != library_merges(library)
