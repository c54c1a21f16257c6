"""Tune chapter 14's GPT into chapter 25's assistant on the five graded tasks, once, for chapter 26.

    OMP_NUM_THREADS=1 .venv/bin/python tools/train_book_chat.py     # about 5 s on one thread

Chapter 25's recipe (§25.4) on a larger instruction set: chapter 14's stored GPT
(``tfcore.instruct.load_book_gpt``) with the three chat tokens (``add_chat_tokens``), the loss on the
answer tokens only, 200 steps of 32 examples, AdamW at 6e-3 after 20 warm-up steps with a linear
decay, gradients clipped to 1, every weight trained (``train_instructions``), seed 0. The tasks are
chapter 25's three and two more (``GRADED_TASKS``: sort the digits, add them up), split by number as
chapter 25 splits them. The weights are stored in float32 in ``tfcore/data/book_chat.safetensors``
(under 1 MB); the metadata holds the config, the recipe, the tasks, and the greedy exact match on the
test problems of each task, measured here by decoding. Chapter 26 loads it with
``tfcore.grpo.load_book_chat`` and measures that exact match again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import tfcore
from tfcore.grpo import evaluate
from tfcore.instruct import (GRADED_TASKS, add_chat_tokens, instruction_splits, load_book_gpt, make_batch,
                             train_instructions)
from tfcore.speculative import decoding_data

DATA = Path(__file__).resolve().parent.parent / "tfcore" / "data"
RECIPE = dict(steps=200, batch_size=32, warmup=20, lr=6e-3)


def main(seed: int = 0) -> None:
    base, _ = load_book_gpt()
    tokenizer = decoding_data(base.config.max_position_embeddings)["tokenizer"]
    ids, chat = add_chat_tokens(tokenizer, base)
    splits = instruction_splits(tasks=GRADED_TASKS)
    tfcore.setup(seed)
    train_instructions(chat, make_batch(tokenizer, ids, splits["train"]), RECIPE["steps"], lr=RECIPE["lr"],
                       warmup=RECIPE["warmup"], seed=seed, batch_size=RECIPE["batch_size"])
    test = [(task, n) for task, n, _, _ in splits["test"]]
    right = evaluate(chat, tokenizer, ids, test)["greedy"]
    exact = {task: right[[t == task for t, _ in test]].float().mean().item() for task in GRADED_TASKS}
    state = {k: v.detach().contiguous() for k, v in chat.state_dict().items() if k != "lm_head.weight"}  # tied
    metadata = {"config": json.dumps(vars(chat.config)), "recipe": json.dumps(RECIPE | {"seed": seed}),
                "tasks": json.dumps(GRADED_TASKS), "exact_match": json.dumps(exact)}
    path = DATA / "book_chat.safetensors"
    save_file(state, str(path), metadata=metadata)
    print(f"exact match {exact}, {path.stat().st_size:,} bytes -> {path}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
