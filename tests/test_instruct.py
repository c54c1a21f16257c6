"""tfcore.instruct: the split by number, the chat tokens (three distinct rows near the mean), the loss mask on the answer tokens (masked
positions give exactly zero gradient), exact match equal to greedy decoding, the stored book GPT; each
check shown to catch a planted bug."""

import copy

import pytest
import torch

import tfcore
import tfcore.instruct as instruct

CONFIG = dict(vocab_size=1000, max_position_embeddings=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def chat():
    from tfcore.speculative import decoding_tokenizer_and_texts

    tokenizer, _ = decoding_tokenizer_and_texts()
    torch.manual_seed(0)
    ids, model = instruct.add_chat_tokens(tokenizer, tfcore.GPT(tfcore.GPTConfig(**CONFIG)).eval())
    return tokenizer, ids, model


EXAMPLES = [("digits", 342, *instruct.make_instruction("digits", 342)), ("words", 17, *instruct.make_instruction("words", 17)),
            ("reverse", 905, *instruct.make_instruction("reverse", 905))]


def test_instructions_and_split_by_number():
    assert instruct.make_instruction("digits", 342) == ("in digits: three hundred and forty-two", "342")
    assert instruct.make_instruction("reverse", 120) == ("reverse: 120", "021")
    splits = instruct.instruction_splits()
    assert {k: len(v) for k, v in splits.items()} == {"train": 2100, "validation": 450, "test": 450}
    numbers = {k: {n for _, n, _, _ in v} for k, v in splits.items()}
    assert not (numbers["train"] & numbers["test"]) and not (numbers["train"] & numbers["validation"])
    assert splits == instruct.instruction_splits()  # the data set's own seed: the same split every time


def test_chat_tokens_and_new_rows(chat):
    tokenizer, ids, model = chat
    assert ids == {"<|user|>": 1000, "<|assistant|>": 1001, "<|end|>": 1002}
    rows = model.token_embeddings.weight
    assert rows.shape == (1003, 16) and model.lm_head.weight is rows
    assert _new_rows_are_distinct_and_near_the_mean(model)
    with pytest.raises(ValueError, match="add the chat tokens once"):
        instruct.add_chat_tokens(tokenizer, model)


class _StubTokenizer:
    """Just what add_chat_tokens asks of a tokenizer: 1,000 tokens, then the ones it adds."""

    def __init__(self):
        self.added = []

    def token_to_id(self, token):
        return 1000 + self.added.index(token) if token in self.added else None

    def get_vocab_size(self):
        return 1000 + len(self.added)

    def add_special_tokens(self, tokens):
        self.added += tokens


def _new_rows_are_distinct_and_near_the_mean(model):
    """The three new rows differ pairwise (by more than 1e-3 of the rows' spread), and each lies
    within half the rows' spread (per dimension, on average) of the old rows' mean."""
    rows = model.token_embeddings.weight.detach()
    old, new = rows[:1000], rows[1000:]
    spread = old.std(0)
    apart = min((new[i] - new[j]).abs().div(spread).max().item() for i, j in ((0, 1), (0, 2), (1, 2)))
    near = (new - old.mean(0)).abs().div(spread).mean(1).max().item()
    return apart > 1e-3 and near < 0.5


def test_new_rows_are_seeded_noise_around_the_mean():
    torch.manual_seed(0)
    base = tfcore.GPT(tfcore.GPTConfig(**CONFIG)).eval()
    _, first = instruct.add_chat_tokens(_StubTokenizer(), base)
    torch.manual_seed(1)  # the global generator does not enter: the noise has its own seed
    _, again = instruct.add_chat_tokens(_StubTokenizer(), base)
    assert torch.equal(first.token_embeddings.weight, again.token_embeddings.weight)
    assert _new_rows_are_distinct_and_near_the_mean(first)
    # the scale: a tenth of the rows' spread, so the noise's std over the 3 x 16 draws is near 0.1
    rows = first.token_embeddings.weight.detach()
    z = (rows[1000:] - rows[:1000].mean(0)) / rows[:1000].std(0)
    assert 0.05 < z.std().item() < 0.2
    with pytest.raises(ValueError, match="noise"):
        instruct.add_chat_tokens(_StubTokenizer(), base, noise=-1.0)


def test_planted_bug_identical_new_rows_are_caught():
    base = tfcore.GPT(tfcore.GPTConfig(**CONFIG)).eval()
    _, tied = instruct.add_chat_tokens(_StubTokenizer(), base, noise=0.0)  # one mean row, three times
    assert not _new_rows_are_distinct_and_near_the_mean(tied)
    _, far = instruct.add_chat_tokens(_StubTokenizer(), base, noise=3.0)  # distinct, but far from the mean
    assert not _new_rows_are_distinct_and_near_the_mean(far)


def _answer_targets_are_right(tokenizer, ids):
    inputs, targets, mask = instruct.make_batch(tokenizer, ids, EXAMPLES)
    for row, (_, _, _, answer) in enumerate(EXAMPLES):
        if targets[row][mask[row]].tolist() != tokenizer.encode(answer).ids + [ids["<|end|>"]]:
            return False
    return True


def test_the_mask_selects_the_answer_and_end_tokens(chat):
    tokenizer, ids, _ = chat
    assert _answer_targets_are_right(tokenizer, ids)


def test_planted_bug_mask_shifted_by_one_is_caught(chat, monkeypatch):
    tokenizer, ids, _ = chat
    original = instruct.loss_mask
    monkeypatch.setattr(instruct, "loss_mask", lambda length, start, answer_only=True: original(length, start + 1, answer_only))
    assert not _answer_targets_are_right(tokenizer, ids)


def _masked_targets_give_no_gradient(model, batch, loss_fn):
    inputs, targets, mask = batch

    def gradient(t):
        model.zero_grad()
        loss_fn(model(inputs), t, mask).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    scrambled = torch.where(mask, targets, (targets + 1 + torch.arange(targets.numel()).view_as(targets) % 5) % 1003)
    return torch.equal(gradient(targets), gradient(scrambled))


def test_masked_positions_give_exactly_zero_gradient(chat):
    tokenizer, ids, model = chat
    batch = instruct.make_batch(tokenizer, ids, EXAMPLES)
    assert _masked_targets_give_no_gradient(copy.deepcopy(model), batch, instruct.masked_loss)


def test_planted_bug_loss_that_ignores_the_mask_is_caught(chat):
    tokenizer, ids, model = chat
    batch = instruct.make_batch(tokenizer, ids, EXAMPLES)
    plain = lambda logits, targets, mask: torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
    assert not _masked_targets_give_no_gradient(copy.deepcopy(model), batch, plain)


def test_masked_loss_refuses_an_empty_mask():
    with pytest.raises(ValueError, match="selects no position"):
        instruct.masked_loss(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool))


def test_exact_match_is_greedy_decoding():
    """On a random model: the model's own greedy continuation is an exact match; one changed token is not."""
    torch.manual_seed(0)
    model = tfcore.GPT(tfcore.GPTConfig(**{**CONFIG, "vocab_size": 30})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    prompt = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(1))
    full = tfcore.generate(model, prompt, 5)  # [4, 11]
    inputs, targets = full[:, :-1], full[:, 1:]
    answer_mask = torch.zeros_like(targets, dtype=torch.bool)
    answer_mask[:, 5:] = True  # the 5 generated tokens
    assert instruct.exact_match(model, inputs, targets, answer_mask).all()
    wrong = targets.clone()
    wrong[1, 7] = (wrong[1, 7] + 1) % 30
    assert instruct.exact_match(model, inputs, wrong, answer_mask).tolist() == [True, False, True, True]


def test_the_stored_book_gpt():
    model, metadata = instruct.load_book_gpt()
    assert metadata["config"] == instruct.BOOK_GPT["config"]
    assert sum(p.numel() for p in model.parameters()) == 168_192
    assert metadata["losses"]["test"] < 4.5  # perplexity under 90 on the held-out chapter


def _framed_targets(tokenizer, ids):
    """The target tokens that the chat-template figure frames as in the loss, left to right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfcore import diagrams

    fig = diagrams.chat_template_figure(tokenizer, ids, "reverse: 342", "243")
    ax = fig.axes[0]
    frames = [p for p in ax.patches if p.get_linewidth() > 2]  # the loss targets' thick frames
    texts = {round(t.get_position()[0], 6): t.get_text() for t in ax.texts if t.get_position()[1] < 0.5}
    framed = [texts[round(p.get_x() + p.get_width() / 2, 6)] for p in sorted(frames, key=lambda p: p.get_x())]
    plt.close(fig)
    return framed


def test_chat_template_figure_frames_the_answer_and_end(chat):
    tokenizer, ids, _ = chat
    assert _framed_targets(tokenizer, ids) == ["2", "4", "3", "<|end|>"]


def test_planted_bug_figure_with_a_shifted_mask_is_caught(chat, monkeypatch):
    tokenizer, ids, _ = chat
    monkeypatch.setattr(instruct, "loss_mask", lambda length, start, answer_only=True:
                        torch.arange(length - 1) >= start)  # on the inputs: leaves the first answer token out
    assert _framed_targets(tokenizer, ids) != ["2", "4", "3", "<|end|>"]
