"""Train chapter 14's GPT once, by chapter 14's recipe, and save it for chapter 25.

    OMP_NUM_THREADS=1 .venv/bin/python tools/train_book_gpt.py     # about 10 s on one thread

The model and the recipe are those of §14.4: the byte-level BPE of 1,000 tokens trained on the book
prose's training documents (``tfcore.speculative.decoding_tokenizer_and_texts``), 64-token blocks,
width 64, 2 blocks of 4 heads, no dropout (168,192 parameters), 400 steps of 16 blocks, AdamW
(3e-3, betas 0.9 and 0.95, weight decay 0.1), 40 warm-up steps then a linear decay
(``tfcore.lr_factor``), gradients clipped to norm 1. The weights are stored in float32 in
``tfcore/data/book_gpt.safetensors`` (under 1 MB); the metadata holds the config, the recipe, the seed
and the held-out losses measured here. Chapter 25 loads it with ``tfcore.instruct.load_book_gpt`` and
checks the held-out loss again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import tfcore
from tfcore.instruct import BOOK_GPT
from tfcore.speculative import decoding_data
from train_decoding_models import mean_loss  # tools/ is on the path when this script runs

DATA = Path(__file__).resolve().parent.parent / "tfcore" / "data"


def main(seed: int = 0) -> None:
    recipe = BOOK_GPT["recipe"]
    data = decoding_data(BOOK_GPT["config"]["max_position_embeddings"])
    tfcore.setup(seed)
    model = tfcore.GPT(tfcore.GPTConfig(**BOOK_GPT["config"]))
    steps, batch_size, warmup = recipe["steps"], recipe["batch_size"], recipe["warmup"]
    train_x, train_y = data["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=tuple(recipe["betas"]),
                                  weight_decay=recipe["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: tfcore.lr_factor(step, steps, warmup))
    order = torch.cat([torch.randperm(len(train_x)) for _ in range(math.ceil(steps * batch_size / len(train_x)))])
    for step in range(steps):
        model.train()
        batch = order[step * batch_size:(step + 1) * batch_size]
        loss = F.cross_entropy(model(train_x[batch]).flatten(0, 1), train_y[batch].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["clip"])
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f}", flush=True)
    model.eval()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    losses = {split: mean_loss(model, *data[split]) for split in ("validation", "test")}
    metadata = {"config": json.dumps(BOOK_GPT["config"]), "recipe": json.dumps(recipe | {"seed": seed}),
                "losses": json.dumps(losses)}
    path = DATA / "book_gpt.safetensors"
    save_file(state, str(path), metadata=metadata)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, losses {losses}, "
          f"{path.stat().st_size:,} bytes -> {path}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
