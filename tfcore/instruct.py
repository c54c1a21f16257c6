"""From a language model to an assistant: a chat template, an instruction set built by code, the
loss on the answer tokens only, and exact-match evaluation (chapter 25).

The model is chapter 14's GPT (``load_book_gpt``), with three special tokens added to chapter 14's
byte-level BPE and three rows added to its embedding matrix (``add_chat_tokens``). One example is

    <|user|> prompt <|assistant|> answer <|end|>

and the loss is taken on the targets that are answer tokens or ``<|end|>`` only (``loss_mask``).
Shapes: ``input_ids [B, L]``, ``targets [B, L]`` (the next token of each position), ``mask [B, L]``.
"""

from __future__ import annotations

import json
import random
from importlib.resources import files

import torch
import torch.nn.functional as F

from .gpt import GPT, GPTConfig

__all__ = ["BOOK_GPT", "load_book_gpt", "SPECIAL_TOKENS", "add_chat_tokens", "encode_chat", "TASKS",
           "GRADED_TASKS", "make_instruction", "instruction_splits", "loss_mask", "make_batch", "masked_loss",
           "train_instructions", "exact_match", "greedy_answer", "preference_pairs", "make_pair_batch"]

# ---------------------------------------------------------------------------------------------
# Chapter 14's GPT, trained once by chapter 14's recipe (tools/train_book_gpt.py)

BOOK_GPT = {
    "config": dict(vocab_size=1000, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "recipe": dict(steps=400, batch_size=16, warmup=40, lr=3e-3, betas=[0.9, 0.95], weight_decay=0.1, clip=1.0),
}


def load_book_gpt():
    """Chapter 14's GPT trained on the book prose (§14.4's recipe), in eval mode, and the file's
    metadata (config, recipe, seed, the validation and test losses measured when it was trained)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = files("tfcore") / "data" / "book_gpt.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = {key: json.loads(value) for key, value in f.metadata().items()}
    model = GPT(GPTConfig(**metadata["config"]))
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    if missing != ["lm_head.weight"] or unexpected:  # the head is tied to the token embeddings
        raise ValueError(f"{path.name} does not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval(), metadata


# ---------------------------------------------------------------------------------------------
# The chat template

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (USER, ASSISTANT, END)


def add_chat_tokens(tokenizer, model: GPT, noise: float = 0.1, seed: int = 0) -> tuple[dict, GPT]:
    """Add the three special tokens to ``tokenizer`` (ids ``V, V+1, V+2`` after its ``V`` tokens) and
    return ``({token: id}, a GPT of vocabulary V + 3)``: the same weights, and three new embedding rows
    (also the tied output layer's rows), each the mean of the ``V`` old rows plus Gaussian noise whose
    standard deviation is ``noise`` times the old rows' own standard deviation in that dimension.

    The mean is a choice (Hewitt, 2021): a row drawn at random would start the new tokens' logits
    at arbitrary values, the mean row gives them the average token's. The noise keeps the three rows
    distinct: with one identical row and a tied output layer without bias, the three tokens get the
    same logit wherever the embeddings are frozen (LoRA, for one), and ``argmax`` gives every tie to the
    lowest id. At the default tenth of the rows' spread each new row stays near the mean. The noise
    is drawn from its own generator seeded with ``seed`` (not ``shifted``): the chat model is the
    same under any ``$TFCORE_SEED``. ``noise=0`` gives the three identical mean rows. Training
    moves the rows.
    """
    if noise < 0:
        raise ValueError(f"noise is a standard deviation's scale, >= 0; got {noise}")
    old = model.config.vocab_size
    if tokenizer.token_to_id(USER) is not None:
        raise ValueError(f"the tokenizer already has the chat tokens (id {tokenizer.token_to_id(USER)} is {USER}): "
                         f"add the chat tokens once, to chapter 14's tokenizer and model")
    if tokenizer.get_vocab_size() != old:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens and the model {old}: "
                         f"add the chat tokens once, to a tokenizer and a model that match")
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    if sorted(ids.values()) != [old, old + 1, old + 2]:
        raise ValueError(f"the special tokens got ids {ids}, expected {old}..{old + 2}")
    config = GPTConfig(**{**vars(model.config), "vocab_size": old + len(SPECIAL_TOKENS)})
    chat = GPT(config)
    state = model.state_dict()
    embeddings = state["token_embeddings.weight"]  # [V, d]
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randn(len(SPECIAL_TOKENS), embeddings.shape[1], generator=generator)
    new_rows = embeddings.mean(dim=0) + noise * embeddings.std(dim=0) * draws.to(embeddings)  # [3, d]
    state["token_embeddings.weight"] = torch.cat([embeddings, new_rows])  # [V + 3, d]
    state["lm_head.weight"] = state["token_embeddings.weight"]
    chat.load_state_dict(state)
    return ids, chat.eval()


def encode_chat(tokenizer, ids: dict, prompt: str, answer: str) -> tuple[list[int], int]:
    """The token ids of ``<|user|> prompt <|assistant|> answer <|end|>`` and the index of the first
    answer token (the prompt part is everything before it)."""
    head = [ids[USER]] + tokenizer.encode(prompt).ids + [ids[ASSISTANT]]
    return head + tokenizer.encode(answer).ids + [ids[END]], len(head)


# ---------------------------------------------------------------------------------------------
# The instruction set, built by code

TASKS = ("digits", "words", "reverse")
GRADED_TASKS = TASKS + ("sort", "sum")  # chapter 26 adds two: sort the digits, add them up
SPLIT_SEED = 23  # the data set's own seed: the split stays the same under any TFCORE_SEED


def number_words(n: int) -> str:
    from num2words import num2words

    return num2words(n)


def make_instruction(task: str, n: int) -> tuple[str, str]:
    """The (prompt, answer) of one task on the number ``n``."""
    if task == "digits":
        return f"in digits: {number_words(n)}", str(n)
    if task == "words":
        return f"in words: {n}", number_words(n)
    if task == "reverse":
        return f"reverse: {n}", str(n)[::-1]
    if task == "sort":
        return f"sort: {n}", "".join(sorted(str(n)))
    if task == "sum":
        return f"digit sum: {n}", str(sum(int(d) for d in str(n)))
    raise ValueError(f"unknown task {task!r}; choose one of {GRADED_TASKS}")


def instruction_splits(numbers: range = range(1000), fractions=(0.7, 0.15), tasks=TASKS) -> dict:
    """``{"train" | "validation" | "test": [(task, n, prompt, answer), ...]}``: every task on every
    number, split by the NUMBER (the underlying item), so that a test number is the subject of no
    training instruction of any task. It can still be a training reply: "reverse: 243" answers 342
    (chapter 25 counts these)."""
    items = list(numbers)
    random.Random(SPLIT_SEED).shuffle(items)
    n_train, n_validation = int(fractions[0] * len(items)), int(fractions[1] * len(items))
    groups = {"train": items[:n_train], "validation": items[n_train:n_train + n_validation],
              "test": items[n_train + n_validation:]}
    return {split: [(task, n, *make_instruction(task, n)) for n in sorted(group) for task in tasks]
            for split, group in groups.items()}


# ---------------------------------------------------------------------------------------------
# Batches, the loss mask, the masked loss


def loss_mask(length: int, answer_start: int, answer_only: bool = True) -> torch.Tensor:
    """``[length - 1]`` booleans over the targets ``ids[1:]`` of a sequence of ``length`` tokens:
    True where the target is an answer token or ``<|end|>`` (target index ``t`` predicts token
    ``t + 1``, so the answer's targets start at ``answer_start - 1``). ``answer_only=False``: every
    target (the plain language-model loss). ``answer_start`` (the first answer token's index) lies in
    ``1 .. length - 1``: a prompt comes before it and the sequence ends after it."""
    if not (isinstance(length, int) and isinstance(answer_start, int) and 1 <= answer_start < length):
        raise ValueError(f"loss_mask needs whole numbers with 1 <= answer_start < length, got answer_start="
                         f"{answer_start!r} and length={length!r}: answer_start is the index of the first "
                         f"answer token in a sequence of length tokens (encode_chat returns both)")
    mask = torch.zeros(length - 1, dtype=torch.bool)
    mask[(answer_start - 1) if answer_only else 0:] = True
    return mask


def make_batch(tokenizer, ids: dict, examples, answer_only: bool = True):
    """``examples``: (task, n, prompt, answer) tuples -> ``input_ids [B, L]``, ``targets [B, L]``,
    ``mask [B, L]`` (right-padded with ``<|end|>``; padded positions are never in the mask)."""
    sequences = [encode_chat(tokenizer, ids, prompt, answer) for _, _, prompt, answer in examples]
    width = max(len(s) for s, _ in sequences) - 1
    inputs = torch.full((len(sequences), width), ids[END])
    targets = torch.full((len(sequences), width), ids[END])
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, (sequence, start) in enumerate(sequences):
        n = len(sequence) - 1
        inputs[row, :n] = torch.tensor(sequence[:-1])
        targets[row, :n] = torch.tensor(sequence[1:])
        mask[row, :n] = loss_mask(len(sequence), start, answer_only)
    return inputs, targets, mask


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions where ``mask [B, L]`` is True; ``logits [B, L, V]``.
    A mask with no True position is an error (the mean of nothing)."""
    if not mask.any():
        raise ValueError("the loss mask selects no position: every example needs at least one answer token")
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # [B * L]
    return (losses * mask.flatten()).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------
# Training and exact match


def train_instructions(model, batches, steps: int, lr: float = 1e-3, warmup: int = 20, seed: int = 0,
                       batch_size: int = 32, callback=None, every: int = 20) -> list[float]:
    """AdamW on the parameters of ``model`` that require gradients, on the masked loss, with the warm-up
    and linear decay of chapter 14 (``lr_factor``) and gradients clipped to norm 1; ``batches`` is
    ``(input_ids, targets, mask)`` of the whole training set, sampled ``batch_size`` rows at a time in
    an order seeded by ``shifted(seed)``. Returns the loss of every step. ``callback(step, model)``, if
    given, runs every ``every`` steps (in eval mode; training resumes after it)."""
    from .runtime import shifted
    from .training import lr_factor

    inputs, targets, mask = batches
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup))
    generator = torch.Generator().manual_seed(shifted(seed))
    order = torch.cat([torch.randperm(len(inputs), generator=generator)
                       for _ in range(-(-steps * batch_size // len(inputs)))])
    losses = []
    model.train()
    for step in range(steps):
        rows = order[step * batch_size:(step + 1) * batch_size].to(inputs.device)
        width = int(mask[rows].nonzero()[:, 1].max()) + 1  # drop the all-padding columns
        loss = masked_loss(model(inputs[rows, :width]), targets[rows, :width], mask[rows, :width])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if callback is not None and (step + 1) % every == 0:
            model.eval()
            callback(step + 1, model)
            model.train()
    model.eval()
    return losses


@torch.no_grad()
def exact_match(model, inputs: torch.Tensor, targets: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` booleans: does greedy decoding after ``<|assistant|>`` produce exactly the answer and then
    ``<|end|>``? With the answer fed in (teacher forcing), greedy decoding reproduces it exactly when
    the argmax at every answer target is that target: one forward pass checks all of them
    (ties between logits aside). ``answer_mask`` must be the answer-only mask."""
    model.eval()
    right = model(inputs).argmax(dim=-1) == targets  # [B, L]
    return (right | ~answer_mask).all(dim=1)


@torch.no_grad()
def greedy_answer(model, tokenizer, ids: dict, prompt: str, max_new_tokens: int = 24) -> str:
    """Decode greedily after ``<|user|> prompt <|assistant|>`` until ``<|end|>`` (or ``max_new_tokens``);
    the answer's text, without ``<|end|>``."""
    from .generation import generate

    head = [ids[USER]] + tokenizer.encode(prompt).ids + [ids[ASSISTANT]]
    room = min(max_new_tokens, model.max_positions - len(head))
    out = generate(model, torch.tensor([head], device=model.token_embeddings.weight.device), room)[0, len(head):]
    out = out.tolist()
    if ids[END] in out:
        out = out[:out.index(ids[END])]
    return tokenizer.decode(out)


# ---------------------------------------------------------------------------------------------
# Preference pairs for DPO


def plausible_wrong_answer(task: str, n: int, rng: random.Random) -> str:
    """A wrong answer close to the right one: a neighbouring number (digits, words), or the digits
    copied instead of reversed (reverse; for a palindrome, a neighbour's reversal)."""
    if task == "reverse":
        if str(n) != str(n)[::-1]:
            return str(n)
        return str(n + 1)[::-1]
    wrong = n + rng.choice([-1, 1]) if n > 0 else n + 1
    return str(wrong) if task == "digits" else number_words(wrong)


def preference_pairs(examples, seed: int = SPLIT_SEED) -> list[tuple[str, str, str]]:
    """``(prompt, chosen, rejected)`` for each (task, n, prompt, answer): the right answer preferred to a
    plausible wrong one (the data set's own seed picks the neighbour)."""
    rng = random.Random(seed)
    pairs = [(prompt, answer, plausible_wrong_answer(task, n, rng)) for task, n, prompt, answer in examples]
    assert all(chosen != rejected for _, chosen, rejected in pairs)
    return pairs


def make_pair_batch(tokenizer, ids: dict, pairs):
    """``(chosen batch, rejected batch)``, each ``(input_ids, targets, answer mask)`` as ``make_batch``."""
    chosen = make_batch(tokenizer, ids, [("", 0, prompt, good) for prompt, good, _ in pairs])
    rejected = make_batch(tokenizer, ids, [("", 0, prompt, bad) for prompt, _, bad in pairs])
    return chosen, rejected
