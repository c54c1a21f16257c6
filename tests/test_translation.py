"""Chapter 11's pieces: the number-words data, vocabularies, scores, label smoothing, the schedules,
beam search with a length penalty, and the cross-attention weights."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tfcore import beam_search, make_model
from tfcore.decoder import cross_attention_weights, length_penalty
from tfcore.training import BOS, EOS, PAD, SCHEDULES, label_smoothed_nll, lr_factor, train_seq2seq
from tfcore.translation import (UNK, Vocab, characters, join_words, number_pairs, number_words,
                                split_numbers, translation_scores, words)


def test_number_words_in_both_languages():
    assert number_pairs([342, 21]) == [("dreihundertzweiundvierzig", "three hundred and forty-two"),
                                       ("einundzwanzig", "twenty-one")]
    assert number_words(1234, "en") == "one thousand, two hundred and thirty-four"
    for bad in (-1, 2.5, True, "7"):
        with pytest.raises(ValueError, match="non-negative int"):
            number_words(bad, "de")


def test_the_splits_are_disjoint_cover_the_range_and_are_seeded():
    splits = split_numbers(1, 999, validation=100, test=200, seed=0)
    sizes = {name: len(numbers) for name, numbers in splits.items()}
    assert sizes == {"train": 699, "validation": 100, "test": 200}
    assert sorted(itertools.chain(*splits.values())) == list(range(1, 1000))
    assert splits == split_numbers(1, 999, validation=100, test=200, seed=0)
    assert splits["test"] != split_numbers(1, 999, validation=100, test=200, seed=1)["test"]
    with pytest.raises(ValueError, match="fewer than the 10 numbers"):
        split_numbers(1, 10, validation=5, test=5)


def test_english_words_round_trip():
    for n in range(0, 10000):
        text = number_words(n, "en")
        assert join_words(words(text)) == text
    assert words("one thousand, two hundred and thirty-four") == [
        "one", "thousand", ",", "two", "hundred", "and", "thirty", "-", "four"]


def test_vocab_encodes_decodes_and_marks_unknown_tokens():
    vocab = Vocab(["zwei", "drei"], characters)
    assert vocab.tokens[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert vocab.tokens[4:] == sorted(set("zweidrei"))
    assert Vocab(["drei", "zwei"], characters).tokens == vocab.tokens  # the order of the texts does not matter
    ids = vocab.encode("drei")
    assert ids[0] == BOS and ids[-1] == EOS and vocab.decode(ids[1:]) == "drei"
    assert vocab.encode("elf")[1:-1] == [vocab.ids["e"], UNK, UNK]
    assert vocab.decode(vocab.encode("elf")[1:]) == "e<unk><unk>"
    batch = vocab.batch(["zwei", "dr"], with_bos=False)
    assert batch.shape == (2, 5) and batch[1].tolist()[2:] == [EOS, PAD, PAD]
    english = Vocab(["forty-two"], words, join_words)
    assert english.decode(english.encode("forty-two")[1:]) == "forty-two"


def test_scores_of_perfect_partial_and_mismatched_output():
    refs = ["forty-two", "three hundred and one"]
    assert translation_scores(refs, refs) == pytest.approx({"BLEU": 100.0, "chrF": 100.0, "exact": 1.0})
    partial = translation_scores(["forty-two", "three hundred and two"], refs)
    assert partial["exact"] == 0.5 and 0 < partial["BLEU"] < 100 and 50 < partial["chrF"] < 100
    with pytest.raises(ValueError, match="1 hypotheses for 2 references"):
        translation_scores(["x"], refs)


def test_label_smoothing_matches_pytorch_and_has_a_floor():
    torch.manual_seed(0)
    log_probs = torch.randn(6, 9).log_softmax(-1)
    target = torch.tensor([3, 4, PAD, 8, PAD, 5])
    for epsilon in (0.0, 0.1, 0.3):
        ours = label_smoothed_nll(log_probs, target, epsilon)
        theirs = F.cross_entropy(log_probs, target, ignore_index=PAD, label_smoothing=epsilon)
        torch.testing.assert_close(ours, theirs)
    # the best a model can do is to predict the smoothed target itself: the loss is then its entropy
    epsilon, vocab = 0.1, 9
    smoothed = torch.full((1, vocab), epsilon / vocab)
    smoothed[0, 4] += 1 - epsilon
    floor = -(smoothed * smoothed.log()).sum()
    torch.testing.assert_close(label_smoothed_nll(smoothed.log(), torch.tensor([4]), epsilon), floor)
    assert label_smoothed_nll(log_probs, target, epsilon) > floor


def test_schedules():
    steps, warmup = 1500, 100
    old = [min((s + 1) / warmup, 1.0 - 0.9 * max(0, s - warmup) / max(1, steps - warmup)) for s in range(steps)]
    assert [lr_factor(s, steps, warmup) for s in range(steps)] == old  # chapter 10's schedule, unchanged
    factors = [lr_factor(s, steps, warmup, "inverse_sqrt") for s in range(steps)]
    assert max(factors) == 1.0 == factors[warmup - 1]
    d_model = 128
    paper = [d_model ** -0.5 * min(n ** -0.5, n * warmup ** -1.5) for n in range(1, steps + 1)]
    for ours, theirs in zip(factors, paper):  # the same curve, scaled to a peak of 1
        assert ours == pytest.approx(theirs / max(paper), rel=1e-12)
    with pytest.raises(ValueError, match="'linear', 'inverse_sqrt'"):
        lr_factor(0, steps, warmup, "cosine")
    # no warm-up: both schedules start at the peak and fall from the first step (it divided by zero)
    for schedule in SCHEDULES:
        factors = [lr_factor(s, steps, 0, schedule) for s in range(steps)]
        assert factors[0] == 1.0 and all(a > b for a, b in zip(factors, factors[1:]))
    with pytest.raises(ValueError, match="warmup must be 0 or more"):
        lr_factor(0, steps, -1)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return make_model(7, 7, N=1, d_model=16, d_ff=32, h=2, dropout=0.0, verbose=False).eval()


def test_train_seq2seq_rejects_bad_options(small):
    src, tgt = torch.tensor([[3, 4]]), torch.tensor([[BOS, 4, EOS]])
    with pytest.raises(ValueError, match="schedule must be one of"):
        train_seq2seq(small, src, tgt, steps=1, schedule="cosine", log=None)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        train_seq2seq(small, src, tgt, steps=1, label_smoothing=1.0, log=None)
    for option in ({"steps": 0}, {"batch_size": 0}, {"log_every": 0}, {"steps": 2.5}):
        name = next(iter(option))
        with pytest.raises(ValueError, match=f"{name} must be a whole number >= 1"):
            train_seq2seq(small, src, tgt, **({"steps": 1} | option), log=None)
    with pytest.raises(ValueError, match="lr must be > 0"):
        train_seq2seq(small, src, tgt, steps=1, lr=0.0, log=None)
    with pytest.raises(ValueError, match="must hold the same N >= 1 pairs"):
        train_seq2seq(small, src, torch.cat([tgt, tgt]), steps=1, log=None)
    with pytest.raises(ValueError, match="must hold the same N >= 1 pairs"):
        train_seq2seq(small, src, tgt[:, :1], steps=1, log=None)


def test_digit_reversal_rejects_bad_sizes():
    from tfcore.training import digit_reversal

    with pytest.raises(ValueError, match="min_len \\(5\\) must not exceed max_len \\(4\\)"):
        digit_reversal(3, min_len=5, max_len=4)
    for option in ({"n": 0}, {"min_len": 0}, {"max_len": 2.0}):
        with pytest.raises(ValueError, match=f"{next(iter(option))} must be a whole number >= 1"):
            digit_reversal(**({"n": 3} | option))


def test_translation_helpers_reject_bad_input():
    with pytest.raises(ValueError, match=r"low \(9\) must not exceed high \(1\)"):
        split_numbers(9, 1, validation=0, test=0)
    with pytest.raises(ValueError, match="test must be a whole number >= 0"):
        split_numbers(1, 99, validation=1, test=-1)
    vocab = Vocab(["elf"], characters)
    with pytest.raises(ValueError, match="id 40 is not in this vocabulary of 7 ids"):
        vocab.decode([4, 40])
    with pytest.raises(ValueError, match="batch needs at least one text"):
        vocab.batch([])
    with pytest.raises(ValueError, match="no hypotheses to score"):
        translation_scores([], [])


def test_length_penalty():
    lengths = torch.tensor([1, 5, 10])
    assert torch.equal(length_penalty(lengths, 0.0), torch.ones(3))
    torch.testing.assert_close(length_penalty(lengths, 1.0), (5 + lengths) / 6)


def test_a_batch_is_searched_as_each_item_alone(small):
    torch.manual_seed(1)
    src = torch.randint(3, 7, (5, 6))
    src[1, 4:] = PAD
    mask = (src != PAD).unsqueeze(1)
    for alpha in (0.0, 1.0):
        together, scores = beam_search(small, src, mask, max_len=6, start_symbol=BOS, beam_size=3,
                                       end_symbol=EOS, return_scores=True, alpha=alpha)
        for b in range(5):
            alone, score = beam_search(small, src[b:b + 1], mask[b:b + 1], max_len=6, start_symbol=BOS,
                                       beam_size=3, end_symbol=EOS, return_scores=True, alpha=alpha)
            n = alone.shape[1]
            assert torch.equal(together[b, :n], alone[0]) and (together[b, n:] == EOS).all()
            torch.testing.assert_close(scores[b], score[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
def test_a_wide_beam_finds_the_best_normalised_sequence(small, alpha):
    """With a beam as wide as every sequence of 2 tokens, the search is exhaustive: it must return
    the sequence with the best log P / length_penalty, where [BOS, EOS] has length 1."""
    torch.manual_seed(2)
    src = torch.randint(3, 7, (4, 5))
    mask = (src != PAD).unsqueeze(1)
    found = beam_search(small, src, mask, max_len=3, start_symbol=BOS, beam_size=49, end_symbol=EOS, alpha=alpha)
    with torch.no_grad():
        for b in range(4):
            first = small.generator(small(src[b:b + 1], torch.tensor([[BOS]]), mask[b:b + 1]))[0, -1]
            best, best_rank = None, -math.inf
            for x, y in itertools.product(range(7), repeat=2):
                if x == EOS:
                    sequence, log_p, length = [BOS, EOS], first[EOS].item(), 1
                else:
                    second = small.generator(small(src[b:b + 1], torch.tensor([[BOS, x]]), mask[b:b + 1]))[0, -1]
                    sequence, log_p, length = [BOS, x, y], first[x].item() + second[y].item(), 2
                rank = log_p / ((5 + length) / 6) ** alpha
                if rank > best_rank + 1e-6:
                    best, best_rank = sequence, rank
            n = len(best)
            assert found[b, :n].tolist() == best, (alpha, b, found[b], best)


def test_a_length_penalty_lets_a_longer_sequence_win(small):
    """Plant a model that ends at once with p = 0.4, or writes one token and ends with p = 0.35."""
    class Planted(torch.nn.Module):
        def encode(self, src, src_mask=None):
            return torch.zeros(src.shape[0], 1, 1)

        def decode(self, memory, src_mask, tgt, tgt_mask=None):
            return tgt.float().unsqueeze(-1)

        def generator(self, hidden):
            p = torch.full((*hidden.shape[:-1], 7), 1e-9)
            first = hidden[..., 0] == BOS
            p[first, EOS], p[first, 3] = 0.4, 0.35
            p[~first, EOS] = 1.0
            return p.log()

    src = torch.tensor([[3]])
    assert beam_search(Planted(), src, None, 4, BOS, beam_size=2, end_symbol=EOS).tolist() == [[BOS, EOS]]
    assert beam_search(Planted(), src, None, 4, BOS, beam_size=2, end_symbol=EOS, alpha=1.0).tolist() == [[BOS, 3, EOS]]


def test_cross_attention_weights(small):
    src = torch.tensor([[3, 4, 5, PAD], [6, 5, 4, 3]])
    tgt = torch.tensor([[BOS, 4, 5], [BOS, 3, 3]])
    mask = (src != PAD).unsqueeze(1)
    before = small(src, tgt, mask)
    weights = cross_attention_weights(small, src, tgt, mask)
    assert weights.shape == (2, 1, 2, 3, 4)  # [B, layers, heads, Lt, Ls]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 1, 2, 3))
    assert (weights[0, ..., 3] == 0).all()  # no weight on the padded source position
    assert not small.decoder.layers[0].cross_attention._forward_pre_hooks  # the hooks are gone
    torch.testing.assert_close(small(src, tgt, mask), before, atol=0, rtol=0)
