"""Train chapter 26's GRPO runs once: the main recipe and one intervention at a time, three seeds each.

    OMP_NUM_THREADS=1 .venv/bin/python tools/train_grpo.py     # about 10 minutes on two cores

Every run starts from chapter 25's assistant on the five graded tasks (``tfcore.grpo.load_book_chat``)
and trains with ``tfcore.grpo.train_grpo`` on the training problems (chapter 25's split by number):
``STEPS`` steps of 32 problems with a group of 8 completions each, up to 20 new tokens, AdamW at 1e-3,
gradients clipped to 1, the reference frozen at the starting model. ``RUNS`` lists each run's
changes from the main recipe (``GRPO``: loss_type "grpo", advantages standardised within the group,
beta 0.04, one gradient step per batch, the ratio clipped at 0.2, reward = correct + 0.1 x format).
After training, each model is evaluated on the 750 test problems: greedy exact match, and pass@1
and pass@8 from 8 samples at temperature 1 (seed 0). The histories and evaluations go to
``tfcore/data/grpo_runs.json``; the models of the runs in ``KEPT`` to ``tfcore/data/book_grpo.safetensors``
(keys prefixed ``"GRPO.seed0."`` and so on; float32, about 4 MB). Chapter 26 reads both and measures
the stored models again.
"""

from __future__ import annotations

import copy
import json
import time
from multiprocessing import Pool
from pathlib import Path

import torch
from safetensors.torch import save_file

import tfcore
from tfcore.grpo import evaluate, load_book_chat, train_grpo
from tfcore.instruct import GRADED_TASKS, instruction_splits

DATA = Path(__file__).resolve().parent.parent / "tfcore" / "data"
STEPS, SEEDS = 80, (0, 1, 2)
RECIPE = dict(prompts_per_step=32, group_size=8, max_new_tokens=20, lr=1e-3, beta=0.04)
RUNS = {
    "GRPO": {},
    "no std": {"scale": "none"},
    "no group mean": {"center": False},
    "beta 0": {"beta": 0.0},
    "beta 0.4": {"beta": 0.4},
    "4 steps per batch, clipped": {"iterations": 4},
    "4 steps per batch, unclipped": {"iterations": 4, "clip": False},
    "lax grader": {"reward": "contains"},
    "Dr. GRPO": {"loss_type": "dr_grpo", "scale": "none"},
    "DAPO": {"loss_type": "dapo", "epsilon_high": 0.28, "beta": 0.0},
}
KEPT = ("GRPO", "lax grader")  # the runs whose models are stored


def problems(split):
    return [(task, n) for task, n, _, _ in instruction_splits(tasks=GRADED_TASKS)[split]]


def summary(model, tokenizer, ids):
    result = evaluate(model, tokenizer, ids, problems("test"), samples=8)
    greedy = result.pop("greedy")
    tasks = [task for task, _ in problems("test")]
    result["exact match"] = greedy.float().mean().item()
    result["by task"] = {t: greedy[[x == t for x in tasks]].float().mean().item() for t in GRADED_TASKS}
    return result


def run(job):
    name, seed = job
    torch.set_num_threads(1)
    tokenizer, ids, start, _ = load_book_chat()
    tfcore.setup(seed)
    policy = copy.deepcopy(start)
    clock = time.time()
    history = train_grpo(policy, start, tokenizer, ids, problems("train"), STEPS, seed=seed,
                         **(RECIPE | RUNS[name]))
    seconds = time.time() - clock
    result = summary(policy, tokenizer, ids)
    print(f"{name:30} seed {seed}: {seconds:5.1f} s, exact match {result['exact match']:.3f}, "
          f"pass@1 {result['pass@1']:.3f}, pass@8 {result['pass@8']:.3f}", flush=True)
    state = {k: v.detach().contiguous() for k, v in policy.state_dict().items() if k != "lm_head.weight"}
    return name, seed, {"history": history, "evaluation": result}, state


def main() -> None:
    tokenizer, ids, start, _ = load_book_chat()
    before = summary(start, tokenizer, ids)
    with Pool(2) as pool:
        results = pool.map(run, [(name, seed) for name in RUNS for seed in SEEDS], chunksize=1)
    runs = {name: {} for name in RUNS}
    weights = {}
    for name, seed, result, state in results:
        runs[name][str(seed)] = result
        if name in KEPT:
            weights |= {f"{name}.seed{seed}.{k}": v for k, v in state.items()}
    out = {"recipe": RECIPE | {"steps": STEPS, "seeds": list(SEEDS)}, "changes": RUNS, "before": before,
           "runs": runs}
    (DATA / "grpo_runs.json").write_text(json.dumps(out, indent=1) + "\n")
    save_file(weights, str(DATA / "book_grpo.safetensors"), metadata={"recipe": json.dumps(out["recipe"])})
    print("before:", before)


if __name__ == "__main__":
    main()
