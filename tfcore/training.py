"""A plain training loop for the classifier of chapter 8: AdamW, cross-entropy, one line per epoch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def accuracy(model, input_ids, attention_mask, labels, batch_size: int = 64) -> float:
    """Share of correct argmax predictions; ``input_ids``/``attention_mask`` ``[N, L]``, ``labels [N]``."""
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch_size):
        batch = slice(start, start + batch_size)
        logits = model(input_ids[batch], attention_mask[batch])
        correct += (logits.argmax(-1) == labels[batch]).sum().item()
    return correct / len(labels)


def train_classifier(model, train, test, epochs: int, lr: float, batch_size: int = 32,
                     seed: int = 0, log=print) -> dict:
    """Train the parameters of ``model`` that require gradients; return the history.

    ``train`` and ``test`` are ``(input_ids [N, L], attention_mask [N, L], labels [N])``.
    After each epoch it logs the mean training loss and the train and test accuracies, rounded
    so that the line is stable from run to run. The order of the batches is seeded.
    """
    input_ids, attention_mask, labels = train
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    order = torch.Generator().manual_seed(seed)
    history = {"loss": [], "train_accuracy": [], "test_accuracy": []}
    for epoch in range(1, epochs + 1):
        model.train()
        losses = []
        for batch in torch.randperm(len(labels), generator=order).split(batch_size):
            batch = batch.to(labels.device)
            loss = F.cross_entropy(model(input_ids[batch], attention_mask[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        history["loss"].append(sum(losses) / len(losses))
        history["train_accuracy"].append(accuracy(model, *train))
        history["test_accuracy"].append(accuracy(model, *test))
        if log is not None:
            log(f"epoch {epoch:2d}/{epochs}  loss {history['loss'][-1]:.2f}  "
                f"train accuracy {history['train_accuracy'][-1]:.2f}  "
                f"test accuracy {history['test_accuracy'][-1]:.2f}")
    return history
