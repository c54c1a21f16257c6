"""Direct preference optimisation (Rafailov et al., 2023), written out (chapter 25).

For a prompt x, a preferred answer y_w and a rejected one y_l, with the policy pi being trained and a
frozen reference pi_ref, the DPO loss (the paper's eq. 7) is

    -log sigmoid( beta * [ (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)) ] )

``beta * (log pi(y|x) - log pi_ref(y|x))`` is the answer's implicit reward (the paper's §5).
Log-probabilities of an answer are sums over its tokens (``sequence_logprobs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sequence_logprobs", "reference_logprobs", "dpo_loss", "preference_stats", "kl_from_reference"]


def sequence_logprobs(model, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: sum over the positions where ``mask [B, L]`` is True of log p(target | the tokens before);
    ``inputs, targets [B, L]`` (targets are the inputs shifted by one). Gradients flow if the model's do."""
    log_probs = model(inputs).log_softmax(dim=-1)  # [B, L, V]
    per_token = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, L]
    return (per_token * mask).sum(dim=1)


@torch.no_grad()
def reference_logprobs(reference, inputs, targets, mask) -> torch.Tensor:
    """``sequence_logprobs`` of the frozen reference model, without gradients (a constant in the loss)."""
    return sequence_logprobs(reference, inputs, targets, mask)


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float = 0.1):
    """The DPO loss (eq. 7), the mean over pairs, and the implicit rewards; every argument ``[B]``.

    Returns ``(loss, chosen_rewards [B], rejected_rewards [B])`` with ``reward = beta * (log pi - log pi_ref)``
    (detached: they are reported, not trained on). The four are tensors of one shape ``[B]``: entry ``i``
    of each belongs to pair ``i``.
    """
    logps = (policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    if not all(isinstance(x, torch.Tensor) for x in logps):
        raise TypeError(f"dpo_loss needs four tensors [B] of sequence log-probabilities, got "
                        f"{[type(x).__name__ for x in logps]}: use sequence_logprobs")
    shapes = [tuple(x.shape) for x in logps]
    if len(shapes[0]) != 1 or len(set(shapes)) != 1:
        raise ValueError(f"dpo_loss needs four log-probabilities of one shape [B] (one per pair), got shapes "
                         f"{shapes} (policy_chosen, policy_rejected, reference_chosen, reference_rejected): "
                         f"score the same B pairs with both models")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the strength of the pull towards the reference), got {beta}")
    chosen_logratios = policy_chosen - reference_chosen
    rejected_logratios = policy_rejected - reference_rejected
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()
    return loss, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def preference_stats(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict:
    """The reward margin (mean of chosen minus rejected) and the preference accuracy (share of pairs
    whose chosen answer gets the larger implicit reward)."""
    margins = chosen_rewards - rejected_rewards
    return {"margin": margins.mean().item(), "accuracy": (margins > 0).float().mean().item()}


@torch.no_grad()
def kl_from_reference(policy, reference, inputs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the positions where ``mask [B, L]`` is True of KL(pi || pi_ref) between the two models'
    next-token distributions (summed exactly over the vocabulary, not sampled)."""
    log_p = policy(inputs).log_softmax(dim=-1)  # [B, L, V]
    log_q = reference(inputs).log_softmax(dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [B, L]
    return ((kl * mask).sum() / mask.sum()).item()
