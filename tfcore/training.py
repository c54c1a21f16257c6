"""Training loops (chapters 8, 10 and 11) and the book's small data sets.

The classifier loop of chapter 8: AdamW, cross-entropy, one line per epoch; frozen sub-modules stay
in eval mode while the rest trains (``train_mode``).

Data are tuples of tensors ``(*inputs, labels)`` with the examples along the first axis, for
example ``(input_ids [N, L], attention_mask [N, L], labels [N])`` for a whole classifier, or
``(features [N, hidden], labels [N])`` for a head trained on frozen features.
"""

from __future__ import annotations

import csv
import math
import numbers
from pathlib import Path

import torch
import torch.nn.functional as F

from .runtime import shifted

WORD_SENSES = Path(__file__).parent / "data" / "word_senses.csv"
BOOK_PROSE = Path(__file__).parent / "data" / "book_prose.txt"
SPLITS = ("train", "validation", "test")


def load_word_senses(split: str) -> tuple[list[str], list[str], list[str]]:
    """The book's word-sense dataset: ``(texts, labels, label_names)`` for one split.

    360 sentences written for this book, 60 for each sense of "flies" (verb/noun), "apple"
    (fruit/company) and "bank" (river/finance). Each sense has 36 sentences in "train", 9 in
    "validation" (watched while training, to choose settings) and 15 in "test" (scored once, at
    the end). A label is ``"word/sense"``; ``label_names`` is the sorted list of all six.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    with WORD_SENSES.open(newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    label_names = sorted({f"{row['word']}/{row['sense']}" for row in rows})
    chosen = [row for row in rows if row["split"] == split]
    return [row["text"] for row in chosen], [f"{row['word']}/{row['sense']}" for row in chosen], label_names


def load_book_prose() -> dict[str, str]:
    """The prose of this book, frozen for chapter 14: ``{document name: text}``, in reading order.

    The markdown of chapters 1-13 and of the book's intro pages, without code, HTML or link
    targets (``tools/book_prose.py`` made it; MIT, like the book). About 290,000 characters.
    """
    documents, name = {}, None
    for line in BOOK_PROSE.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("=== ") and line.rstrip().endswith(" ==="):
            name = line.strip()[4:-4]
            documents[name] = ""
        else:
            documents[name] += line
    return {name: text.strip() + "\n" for name, text in documents.items()}


@torch.no_grad()
def accuracy(model, *data, batch_size: int = 64) -> float:
    """Share of correct argmax predictions of ``model(*inputs)`` on ``data = (*inputs, labels)``."""
    model.eval()
    *inputs, labels = data
    correct = 0
    for start in range(0, len(labels), batch_size):
        batch = slice(start, start + batch_size)
        logits = model(*(x[batch] for x in inputs))
        correct += (logits.argmax(-1) == labels[batch]).sum().item()
    return correct / len(labels)


def train_mode(model, frozen_in_eval: bool = True):
    """``model.train()``, except that every sub-module whose parameters are all frozen stays in eval mode.

    A sub-module counts as frozen when it has parameters and none of them requires a gradient
    (``requires_grad_(False)``); it goes to eval mode with everything inside it, its dropout
    included. So a frozen encoder computes in training exactly what it computes at inference,
    while the dropout of the trainable head stays on. ``frozen_in_eval=False`` is plain
    ``model.train()``, PyTorch's behaviour: dropout on everywhere, frozen or not.
    """
    model.train()
    if frozen_in_eval:
        for module in model.modules():
            parameters = list(module.parameters())
            if parameters and not any(p.requires_grad for p in parameters):
                module.eval()
    return model


def train_classifier(model, train, validation, epochs: int, lr: float, batch_size: int = 32,
                     seed: int = 0, log=print, frozen_in_eval: bool = True, warmup_steps: int = 0) -> dict:
    """Train the parameters of ``model`` that require gradients; return the history.

    ``train`` and ``validation`` are ``(*inputs, labels)``. After each epoch it logs the mean
    training loss and the train and validation accuracies. Those are trajectory values (they
    differ in the last digits from one machine to another), so the line shows them inside
    ``[this run: ...]``, which the book's nbval settings do not compare. The test set is not
    seen here: score it once, after training. The order of the batches is seeded
    (``shifted(seed)``: ``$TFCORE_SEED`` moves it).

    During training the model is in training mode (dropout on), except its frozen sub-modules
    (all parameters ``requires_grad=False``, e.g. a frozen encoder), which stay in eval mode
    (``train_mode``): a head trained on features computed once by the frozen encoder in eval
    mode is then the same model as this one (chapter 8). ``frozen_in_eval=False`` switches
    dropout on in the frozen parts too.

    ``warmup_steps`` > 0 raises the learning rate linearly over the first steps: step ``k``
    (from 1) uses ``lr * min(1, k / warmup_steps)``, then ``lr`` to the end (chapter 8's model A;
    chapter 10 builds a warm-up with a decay). 0, the default, uses ``lr`` from the first step.
    """
    for name, value, least in (("epochs", epochs, 0), ("batch_size", batch_size, 1),
                               ("warmup_steps", warmup_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    *inputs, labels = train
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("no parameter of the model requires a gradient, so there is nothing to train. "
                         "Fix: unfreeze the part to train, e.g. model.classifier.requires_grad_(True)")
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    order = torch.Generator().manual_seed(shifted(seed))
    history = {"loss": [], "train_accuracy": [], "validation_accuracy": []}
    step = 0
    for epoch in range(1, epochs + 1):
        train_mode(model, frozen_in_eval)
        losses = []
        for batch in torch.randperm(len(labels), generator=order).split(batch_size):
            batch = batch.to(labels.device)
            step += 1
            if warmup_steps:
                optimizer.param_groups[0]["lr"] = lr * min(1.0, step / warmup_steps)
            loss = F.cross_entropy(model(*(x[batch] for x in inputs)), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        history["loss"].append(sum(losses) / len(losses))
        history["train_accuracy"].append(accuracy(model, *train))
        history["validation_accuracy"].append(accuracy(model, *validation))
        if log is not None:
            log(f"epoch {epoch:2d}/{epochs}  [this run: loss {history['loss'][-1]:.2f}, "
                f"accuracy: train {history['train_accuracy'][-1]:.2f}, "
                f"validation {history['validation_accuracy'][-1]:.2f}]")
    return history


# The toy translation task of chapter 10: reverse a sequence of 4 to 10 digits.
PAD, BOS, EOS = 0, 1, 2
DIGITS = 10  # digit d is token d + 3


def digit_reversal(n: int, min_len: int = 4, max_len: int = 10, seed: int = 0):
    """``n`` random digit sequences and their reversals: ``(src [n, max_len], tgt [n, max_len + 2])``.

    ``src`` is the digits then PAD; ``tgt`` is BOS, the reversed digits, EOS, then PAD.
    """
    for name, value in (("n", n), ("min_len", min_len), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if min_len > max_len:
        raise ValueError(f"min_len ({min_len}) must not exceed max_len ({max_len})")
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
    digits = torch.randint(3, 3 + DIGITS, (n, max_len), generator=generator)
    src = torch.full((n, max_len), PAD)
    tgt = torch.full((n, max_len + 2), PAD)
    tgt[:, 0] = BOS
    for i, length in enumerate(lengths.tolist()):
        src[i, :length] = digits[i, :length]
        tgt[i, 1:length + 1] = digits[i, :length].flip(0)
        tgt[i, length + 1] = EOS
    return src, tgt


SCHEDULES = ("linear", "inverse_sqrt")


def lr_factor(step: int, steps: int, warmup: int, schedule: str = "linear") -> float:
    """The learning rate of optimizer step ``step + 1``, as a fraction of the peak rate.

    Both schedules rise linearly for ``warmup`` steps to the peak. Then ``"linear"`` falls in a
    straight line to a tenth of the peak at the last step, and ``"inverse_sqrt"`` falls like
    ``1/sqrt(step)``: the schedule of Vaswani et al. (2017, §5.3), ``d_model^-0.5 *
    min(step^-0.5, step * warmup^-1.5)``, scaled so that its peak is 1. (``step`` counts from 0,
    as ``torch.optim.lr_scheduler.LambdaLR`` calls it.) ``warmup=0`` starts at the peak.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more steps, got {warmup!r}; warmup=0 starts at the peak rate")
    rise = math.inf if warmup == 0 else (step + 1) / warmup
    if schedule == "linear":
        return min(rise, 1.0 - 0.9 * max(0, step - warmup) / max(1, steps - warmup))
    if schedule == "inverse_sqrt":
        return min(rise, (max(warmup, 1) / (step + 1)) ** 0.5)
    raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")


def label_smoothed_nll(log_probs, target, epsilon: float, ignore_index: int = PAD) -> torch.Tensor:
    """Cross-entropy against a smoothed target, averaged over the tokens that are not ``ignore_index``.

    ``log_probs [N, V]``, ``target [N]``. The smoothed target puts ``1 - epsilon`` on the right
    token and spreads ``epsilon`` evenly over all ``V`` tokens (as
    ``F.cross_entropy(..., label_smoothing=epsilon)`` does), so the loss is
    ``(1 - epsilon) * NLL + epsilon * mean over the vocabulary of -log p``. Even a perfect model
    cannot push it to 0: its floor is the entropy of the smoothed target.
    ``epsilon`` lies in [0, 1); at least one target must not be ``ignore_index`` (else there is
    nothing to average: a ValueError, not NaN).
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon (the smoothing) must lie in [0, 1), got {epsilon!r}; 0 is plain cross-entropy")
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or not log_probs.is_floating_point():
        got = tuple(log_probs.shape) if isinstance(log_probs, torch.Tensor) else type(log_probs).__name__
        raise ValueError(f"log_probs must be floating-point [N, V] (flatten the batch first), got {got}")
    if not isinstance(target, torch.Tensor) or target.shape != log_probs.shape[:1] or target.is_floating_point():
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target must be integer token ids [N] with N = {log_probs.shape[0]}, got {got}")
    keep = target != ignore_index
    if not keep.any():
        raise ValueError(f"every target is ignore_index ({ignore_index}): no token to score")
    if not 0 <= int(target[keep].min()) <= int(target[keep].max()) < log_probs.shape[1]:
        raise ValueError(f"target ids must lie in 0..{log_probs.shape[1] - 1} (the vocabulary of log_probs)")
    log_probs, target = log_probs[keep], target[keep]
    nll = -log_probs.gather(1, target[:, None]).squeeze(1)
    return ((1.0 - epsilon) * nll - epsilon * log_probs.mean(dim=1)).mean()


def train_seq2seq(model, src, tgt, steps: int, lr: float = 1e-3, batch_size: int = 64,
                  warmup: int = 100, seed: int = 0, log_every: int = 100, log=print,
                  label_smoothing: float = 0.0, schedule: str = "linear") -> list[float]:
    """Teacher forcing: the decoder reads ``tgt[:, :-1]`` and learns to predict ``tgt[:, 1:]``.

    Adam (betas 0.9, 0.98) with the learning rate ``lr * lr_factor(...)``: a linear warm-up over
    ``warmup`` steps, then ``schedule``. The loss is the cross-entropy, against a smoothed target
    when ``label_smoothing`` > 0 (``label_smoothed_nll``); PAD is masked out of the attention
    (source) and of the loss. Returns the loss of every step; logs the mean loss every
    ``log_every`` steps inside ``[this run: ...]`` (a trajectory value, not compared by nbval).
    The batches are drawn with ``shifted(seed)``: ``$TFCORE_SEED`` moves them.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("log_every", log_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if src.dim() != 2 or tgt.dim() != 2 or len(src) != len(tgt) or len(src) == 0 or tgt.shape[1] < 2:
        raise ValueError(f"src [N, Ls] and tgt [N, Lt] must hold the same N >= 1 pairs, with Lt >= 2 "
                         f"(BOS and at least one token to predict); got {tuple(src.shape)} and "
                         f"{tuple(tgt.shape)}")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    rate = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup, schedule))
    order = torch.Generator().manual_seed(shifted(seed))
    losses = []
    model.train()
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(src), (batch_size,), generator=order).to(src.device)
        source, target = src[batch], tgt[batch]
        log_probs = model.generator(model(source, target[:, :-1], (source != PAD).unsqueeze(1)))
        if label_smoothing:
            loss = label_smoothed_nll(log_probs.flatten(0, 1), target[:, 1:].flatten(), label_smoothing)
        else:
            loss = F.nll_loss(log_probs.flatten(0, 1), target[:, 1:].flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rate.step()
        losses.append(loss.item())
        if log is not None and step % log_every == 0:
            log(f"step {step:4d}/{steps}  [this run: loss {sum(losses[-log_every:]) / log_every:.3f}]")
    model.eval()
    return losses
