"""Train chapter 22's draft and target GPTs once, on the book prose of chapter 14, and save them.

    OMP_NUM_THREADS=1 .venv/bin/python tools/train_decoding_models.py     # a few minutes on one thread

Both models are ``tfcore.GPT``s trained exactly as in chapter 14 (§14.4: the byte-level BPE of 1,000
tokens, AdamW, warm-up then a linear decay, gradient clipping), on 128-token blocks. The target is
deep (12 blocks of 64, dropout 0.1 in training), the draft shallow (1 block of 64), so that a draft
token costs a fraction of a target token; the draft is distilled from the target (its loss is the
cross-entropy against the target's next-token probabilities), so that it agrees with it more often. The weights are stored in float16 (each file under 2 MB) in
``tfcore/data/decoding_{draft,target}.safetensors``; the file's metadata holds the model's config,
the tokenizer's settings, the split and the training recipe, and the losses the script measured.
Chapter 22 loads them with ``tfcore.speculative.load_decoding_model`` and checks the held-out loss.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import tfcore
from tfcore.speculative import DECODING_MODELS, DECODING_TOKENIZER, decoding_data, load_decoding_model

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tfcore" / "data"


@torch.no_grad()
def mean_loss(model, x, y, batch_size=32):
    model.eval()
    total = sum(F.cross_entropy(model(x[i:i + batch_size]).flatten(0, 1), y[i:i + batch_size].flatten(),
                                reduction="sum").item() for i in range(0, len(x), batch_size))
    return total / y.numel()


def train(name: str, seed: int = 0) -> None:
    spec = DECODING_MODELS[name]
    data = decoding_data()
    tfcore.setup(seed)
    dropout = {"hidden_dropout_prob": spec["dropout"], "attention_probs_dropout_prob": spec["dropout"]}
    model = tfcore.GPT(tfcore.GPTConfig(**spec["config"] | dropout))  # dropout in training only
    teacher = None
    if spec["distilled_from"]:  # learn the teacher's next-token probabilities instead of the text's tokens
        teacher, _ = load_decoding_model(spec["distilled_from"])
    steps, batch_size, warmup, lr = spec["steps"], spec["batch_size"], spec["warmup"], spec["lr"]
    train_x, train_y = data["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: tfcore.lr_factor(step, steps, warmup))
    order = torch.cat([torch.randperm(len(train_x)) for _ in range(math.ceil(steps * batch_size / len(train_x)))])
    start = time.time()
    for step in range(steps):
        model.train()
        batch = order[step * batch_size:(step + 1) * batch_size]
        if teacher is None:
            labels = train_y[batch].flatten()
        else:
            with torch.no_grad():
                labels = teacher(train_x[batch]).flatten(0, 1).softmax(dim=-1)  # soft labels [B * L, vocab]
        loss = F.cross_entropy(model(train_x[batch]).flatten(0, 1), labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
            if k != "lm_head.weight"}  # tied to token_embeddings.weight: stored once
    losses = {split: mean_loss(model, *data[split]) for split in ("validation", "test")}
    metadata = {"config": json.dumps(spec["config"]), "tokenizer": json.dumps(DECODING_TOKENIZER),
                "recipe": json.dumps({k: spec[k] for k in ("steps", "batch_size", "warmup", "lr", "dropout", "distilled_from")}
                                             | {"seed": seed}),
                "float32_losses": json.dumps(losses)}
    path = DATA / f"decoding_{name}.safetensors"
    save_file(half, str(path), metadata=metadata)
    print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, losses {losses}, "
          f"{path.stat().st_size:,} bytes -> {path}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in ("target", "draft"):  # the draft learns from the target
        train(name)
