"""Group relative policy optimisation (GRPO; Shao et al., 2024) on tasks the code can grade
(chapter 26).

For each prompt the policy samples a group of ``G`` completions; a reward function scores each; the
advantage of completion ``i`` is its reward standardised within its group,

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)      (std with Bessel's correction, as trl 1.16)

and every token of completion ``i`` shares it. With the ratio ``rho = pi(token) / pi_old(token)``
(``pi_old``: the policy that sampled the group) each completion token gets PPO's clipped loss
(Schulman et al., 2017) plus a penalty towards a frozen reference ``pi_ref``:

    l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta * (exp(q) - q - 1),  q = log pi_ref - log pi

(``exp(q) - q - 1 >= 0`` is Schulman's "k3" estimate of KL(pi || pi_ref) from the sampled token;
trl 1.16 multiplies it by the ratio unless ``use_bias_correction_kl=False``, the setting under
which chapter 26 and ``tests/test_grpo.py`` check the two equal).
``loss_type`` says how the per-token losses become one number (``grpo_loss``); ``"cispo"`` changes
the per-token loss itself. Shapes: per-token tensors ``[B, C]`` over the ``C`` completion positions,
``mask [B, C]`` True on real completion tokens (up to and including ``<|end|>``), rewards and
advantages ``[B]`` with the ``G`` completions of one prompt in consecutive rows.
"""

from __future__ import annotations

import json
from importlib.resources import files
from math import comb

import torch

from .generation import generate
from .instruct import ASSISTANT, END, SPECIAL_TOKENS, USER, make_instruction

__all__ = ["LOSS_TYPES", "load_book_chat", "grade", "score", "group_advantages", "sample_groups",
           "completion_logprobs", "grpo_loss", "pass_at_k", "train_grpo", "evaluate"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def load_book_chat():
    """An assistant made as chapter 25's was (chapter 14's GPT with the chat tokens, §25.4's recipe),
    tuned on the five graded tasks (``tools/train_book_chat.py``): returns
    ``(tokenizer with the chat tokens, {token: id}, model in eval mode, the file's metadata)``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .gpt import GPT, GPTConfig
    from .speculative import decoding_data

    path = files("tfcore") / "data" / "book_chat.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = {key: json.loads(value) for key, value in f.metadata().items()}
    config = GPTConfig(**metadata["config"])
    tokenizer = decoding_data(config.max_position_embeddings)["tokenizer"]
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    model = GPT(config)
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    if missing != ["lm_head.weight"] or unexpected:  # the head is tied to the token embeddings
        raise ValueError(f"{path.name} does not match the model: missing {missing}, unexpected {unexpected}")
    return tokenizer, ids, model.eval(), metadata


# ---------------------------------------------------------------------------------------------
# Rewards: a grader for each task, and a format reward for the end token


def grade(task: str, n: int, text: str) -> bool:
    """Is ``text`` the right answer to ``task`` on the number ``n``? The answer is computed, not
    looked up: the digits sorted, their sum, the number reversed, in digits or in words."""
    return text == make_instruction(task, n)[1]


def score(tokenizer, ids: dict, problems, completions: torch.Tensor, mask: torch.Tensor) -> dict:
    """Grade each completion ``completions [B, C]`` (``mask [B, C]``: its real tokens) of
    ``problems`` (``B`` pairs ``(task, n)``): ``{"correct": [B], "format": [B]}`` as floats 0/1.

    ``format`` is 1 when the completion closes with ``<|end|>`` (within the ``C`` tokens allowed);
    ``correct`` is 1 when it does and the text before ``<|end|>`` is the right answer. Also
    ``"contains"``, a lax grader that chapter 26 shows being gamed: 1 when the right answer appears
    anywhere in the text, closed or not."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems for {len(completions)} completions: give one "
                         f"(task, n) per completion row (repeat each prompt's problem G times)")
    correct, ended, contains = [], [], []
    for (task, n), row, real in zip(problems, completions.tolist(), mask.tolist()):
        tokens = [t for t, keep in zip(row, real) if keep]
        closed = bool(tokens) and tokens[-1] == ids[END]
        text = tokenizer.decode(tokens[:-1] if closed else tokens)
        ended.append(float(closed))
        correct.append(float(closed and grade(task, n, text)))
        contains.append(float(make_instruction(task, n)[1] in text))
    return {"correct": torch.tensor(correct), "format": torch.tensor(ended), "contains": torch.tensor(contains)}


# ---------------------------------------------------------------------------------------------
# Advantages within a group


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """``rewards [B]`` (``B / group_size`` groups in consecutive rows) -> advantages ``[B]``: each
    reward minus its group's mean, divided by ``std + 1e-4`` (Bessel-corrected) of its group
    (``scale="group"``, GRPO), of the whole batch (``"batch"``), or not at all (``"none"``, Dr. GRPO).
    A group whose rewards are all equal gets zero advantages: its rewards teach nothing."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if rewards.dim() != 1 or group_size < 2 or len(rewards) % group_size:
        raise ValueError(f"rewards must be [B] with B a multiple of group_size >= 2, got shape "
                         f"{tuple(rewards.shape)} and group_size={group_size}: a group needs two "
                         f"completions to compare")
    groups = rewards.view(-1, group_size)  # [B / G, G]
    advantages = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        return advantages / (groups.std(dim=1).repeat_interleave(group_size) + 1e-4)
    if scale == "batch":
        return advantages / (rewards.std() + 1e-4)
    return advantages


# ---------------------------------------------------------------------------------------------
# Sampling a group per prompt, and the completion's log-probabilities


@torch.no_grad()
def sample_groups(model, tokenizer, ids: dict, problems, group_size: int, max_new_tokens: int,
                  temperature: float = 1.0, generator: torch.Generator | None = None) -> dict:
    """For each ``(task, n)`` in ``problems``, ``group_size`` completions drawn from ``model`` after
    ``<|user|> prompt <|assistant|>``. Returns ``prompt_ids [B, P]`` (left-padded), ``prompt_mask``,
    ``completion_ids [B, C]`` and ``completion_mask [B, C]`` (True up to and including the first
    ``<|end|>``, False after it), and ``problems`` repeated: ``B = len(problems) * group_size``."""
    heads = [[ids[USER]] + tokenizer.encode(make_instruction(task, n)[0]).ids + [ids[ASSISTANT]]
             for task, n in problems]
    width = max(len(h) for h in heads)
    prompt_ids = torch.full((len(heads), width), ids[END])
    prompt_mask = torch.zeros(len(heads), width, dtype=torch.bool)
    for row, head in enumerate(heads):
        prompt_ids[row, width - len(head):] = torch.tensor(head)
        prompt_mask[row, width - len(head):] = True
    device = model.token_embeddings.weight.device
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0).to(device)
    out = generate(model, prompt_ids, max_new_tokens, temperature=temperature, generator=generator,
                   attention_mask=prompt_mask.long())
    completion_ids = out[:, width:]  # [B, C]
    is_end = completion_ids == ids[END]
    after_end = (is_end.long().cumsum(dim=1) - is_end.long()) > 0  # a token after the first <|end|>
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": ~after_end,
            "problems": [p for p in problems for _ in range(group_size)]}


def completion_logprobs(model, batch: dict) -> torch.Tensor:
    """``[B, C]``: log pi(completion token | prompt and the completion before it), from one forward pass
    over prompt and completion (padding masked out). Gradients flow if the model's do."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # [B, P + C]
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    logits = model(input_ids, attention_mask=attention)[:, -width - 1:-1]  # the positions that predict them
    return logits.log_softmax(dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# The loss


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              loss_type: str = "grpo", ref_logps: torch.Tensor | None = None, beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: float | None = None,
              max_completion_length: int | None = None, clip: bool = True) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of one batch and a few statistics; ``logps, old_logps, ref_logps, mask [B, C]``,
    ``advantages [B]``. ``old_logps`` and ``ref_logps`` are constants (no gradient flows into them).

    The per-token loss is the clipped surrogate (``clip=False``: the ratio unclipped) plus
    ``beta`` times the k3 estimate of the KL to the reference; ``epsilon_high`` defaults to
    ``epsilon_low`` (DAPO's "clip-higher" sets it larger). ``loss_type`` averages it:

    - ``"grpo"``: each completion's mean over its tokens, then the mean over completions;
    - ``"bnpo"``: the mean over every completion token of the batch;
    - ``"dr_grpo"``: the sum over tokens divided by ``B * max_completion_length``, a constant;
    - ``"dapo"``: the sum over tokens divided by the number of completion tokens in the batch
      (trl 1.16 divides by that count over the whole generation batch: the same for one process,
      one accumulation step and ``steps_per_generation=1``);
    - ``"cispo"``: the per-token loss is ``-min(rho, epsilon_high).detach() * A * log pi``, the
      weight clipped but every token's gradient kept, then ``"dapo"``'s average.

    The statistics: ``clipped``, the share of tokens whose clipped term is the one in force (it
    passes no gradient), or for ``"cispo"`` whose weight is capped and whose advantage is positive
    (trl's ``cispo_clip_ratio``; capped tokens keep their gradient);
    ``kl``, the mean k3 estimate over tokens.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    shapes = {name: tuple(t.shape) for name, t in (("logps", logps), ("old_logps", old_logps), ("mask", mask))}
    if ref_logps is not None:
        shapes["ref_logps"] = tuple(ref_logps.shape)
    if len(set(shapes.values())) != 1 or logps.dim() != 2 or tuple(advantages.shape) != (logps.shape[0],):
        raise ValueError(f"grpo_loss needs per-token tensors of one shape [B, C] and advantages [B], got "
                         f"{shapes} and advantages {tuple(advantages.shape)}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} weighs a KL penalty to the reference: pass ref_logps (or beta=0)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("dr_grpo divides by B * max_completion_length: pass max_completion_length")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)  # [B, 1]: every token of a completion shares it
    ratio = torch.exp(logps - old_logps.detach())  # [B, C]
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
        in_force = (ratio > epsilon_high) & (advantages > 0)
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) if clip else ratio
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        in_force = ((ratio < 1 - epsilon_low) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
        in_force &= clip
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        q = ref_logps.detach() - logps
        kl = torch.exp(q) - q - 1
    per_token = per_token + beta * kl
    tokens = mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo" or loss_type in ("dapo", "cispo"):
        loss = (per_token * mask).sum() / tokens
    else:  # dr_grpo
        loss = (per_token * mask).sum() / (logps.shape[0] * max_completion_length)
    stats = {"clipped": ((in_force * mask).sum() / tokens).item(), "kl": ((kl * mask).sum() / tokens).item()}
    return loss, stats


# ---------------------------------------------------------------------------------------------
# pass@k, training, evaluation


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are right (Chen et al., 2021):
    the chance that ``k`` of the ``n``, drawn without replacement, include a right one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def train_grpo(policy, reference, tokenizer, ids: dict, problems, steps: int, seed: int = 0,
               prompts_per_step: int = 16, group_size: int = 8, max_new_tokens: int = 20,
               lr: float = 1e-3, loss_type: str = "grpo", scale: str = "group", beta: float = 0.04,
               epsilon_low: float = 0.2, epsilon_high: float | None = None, clip: bool = True,
               iterations: int = 1, reward: str = "correct+format", format_weight: float = 0.1,
               center: bool = True) -> list[dict]:
    """GRPO on ``policy`` (trained in place; ``reference`` stays frozen): each step samples
    ``group_size`` completions for each of ``prompts_per_step`` problems drawn from ``problems``
    (``(task, n)`` pairs; the draws are seeded by ``seed``), scores them, and takes ``iterations``
    AdamW steps on that batch (``pi_old`` is the policy that sampled it: with one iteration the ratio
    is 1 and clipping does nothing). ``reward``: ``"correct+format"`` is correctness plus
    ``format_weight`` times the format reward; ``"contains"`` is the lax grader of ``score``.
    ``center=False`` skips ``group_advantages``: each completion's advantage is its raw reward.
    Returns, for each step, a dict of the batch's mean ``reward``, ``correct``, ``format`` and
    ``contains`` (the lax grader's score, whatever the reward), the mean completion ``length``
    (tokens, ``<|end|>`` included), and ``grpo_loss``'s ``kl`` and ``clipped`` (of the last
    iteration)."""
    from .runtime import shifted

    if reward not in ("correct+format", "contains"):
        raise ValueError(f"reward must be 'correct+format' or 'contains', got {reward!r}")
    generator = torch.Generator().manual_seed(shifted(seed))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    reference.eval().requires_grad_(False)
    history = []
    for _ in range(steps):
        rows = torch.randint(len(problems), (prompts_per_step,), generator=generator).tolist()
        batch = sample_groups(policy, tokenizer, ids, [problems[r] for r in rows], group_size,
                              max_new_tokens, generator=generator)
        scores = score(tokenizer, ids, batch["problems"], batch["completion_ids"], batch["completion_mask"])
        if reward == "contains":
            rewards = scores["contains"]
        else:
            rewards = scores["correct"] + format_weight * scores["format"]
        advantages = group_advantages(rewards, group_size, scale) if center else rewards
        mask = batch["completion_mask"]
        with torch.no_grad():
            policy.eval()
            old_logps = completion_logprobs(policy, batch)
            ref_logps = completion_logprobs(reference, batch)
        policy.train()
        for _ in range(iterations):
            loss, stats = grpo_loss(completion_logprobs(policy, batch), old_logps, advantages, mask,
                                    loss_type, ref_logps, beta, epsilon_low, epsilon_high,
                                    max_new_tokens, clip)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
        policy.eval()
        history.append({"reward": rewards.mean().item(), "correct": scores["correct"].mean().item(),
                        "format": scores["format"].mean().item(), "contains": scores["contains"].mean().item(),
                        "length": mask.sum(dim=1).float().mean().item(), **stats})
    return history


@torch.no_grad()
def evaluate(model, tokenizer, ids: dict, problems, samples: int = 0, max_new_tokens: int = 20,
             seed: int = 0, ks=(1, 8)) -> dict:
    """Greedy exact match on ``problems`` (``(task, n)`` pairs; ``"greedy"``: ``[len(problems)]``
    booleans) and, with ``samples`` draws per problem at temperature 1, the mean pass@k for each k
    in ``ks`` (the draws seeded by ``seed``) and the mean completion length of the draws."""
    greedy = sample_groups(model, tokenizer, ids, problems, 1, max_new_tokens, temperature=0.0)
    result = {"greedy": score(tokenizer, ids, problems, greedy["completion_ids"],
                              greedy["completion_mask"])["correct"].bool()}
    if samples:
        generator = torch.Generator().manual_seed(seed)
        drawn = sample_groups(model, tokenizer, ids, problems, samples, max_new_tokens, generator=generator)
        right = score(tokenizer, ids, drawn["problems"], drawn["completion_ids"], drawn["completion_mask"])
        counts = right["correct"].view(-1, samples).sum(dim=1).long().tolist()
        for k in ks:
            result[f"pass@{k}"] = sum(pass_at_k(samples, c, k) for c in counts) / len(counts)
        result["length"] = drawn["completion_mask"].sum(dim=1).float().mean().item()
    return result
