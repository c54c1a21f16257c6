"""tfcore.dpo: the DPO loss equals the paper's eq. 7 written independently, and trl's loss on the same
batch; the reference model never gets a gradient; each check shown to catch a planted bug."""

import copy
import math
import tempfile

import pytest
import torch

import tfcore
import tfcore.dpo as dpo

CONFIG = dict(vocab_size=30, max_position_embeddings=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _paper_eq7(pc, pr, rc, rr, beta):
    """Rafailov et al. (2023), eq. 7, for one pair, in plain Python floats."""
    z = beta * ((pc - rc) - (pr - rr))
    return -math.log(1 / (1 + math.exp(-z)))


def _matches_paper(loss_fn):
    g = torch.Generator().manual_seed(0)
    logps = [torch.randn(6, generator=g) * 5 for _ in range(4)]
    for beta in (0.1, 0.5, 2.0):
        loss, chosen, rejected = loss_fn(*logps, beta=beta)
        expected = sum(_paper_eq7(*(float(v[i]) for v in logps), beta) for i in range(6)) / 6
        if abs(loss.item() - expected) > 1e-5:
            return False
        if not torch.allclose(chosen, beta * (logps[0] - logps[2])):
            return False
    return True


def test_loss_is_the_papers_equation():
    assert _matches_paper(dpo.dpo_loss)


def test_planted_bug_flipped_margin_sign_is_caught():
    def flipped(pc, pr, rc, rr, beta=0.1):
        loss = -torch.nn.functional.logsigmoid(-beta * ((pc - rc) - (pr - rr))).mean()
        return loss, beta * (pc - rc), beta * (pr - rr)

    assert not _matches_paper(flipped)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    policy, reference = tfcore.GPT(tfcore.GPTConfig(**CONFIG)), tfcore.GPT(tfcore.GPTConfig(**CONFIG))
    ids = torch.randint(0, 30, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[:, 5:] = True
    return policy, reference, (ids[:, :-1], ids[:, 1:], mask)


def test_sequence_logprobs_sum_the_masked_tokens(models):
    policy, _, (inputs, targets, mask) = models
    got = dpo.sequence_logprobs(policy, inputs, targets, mask)
    logp = policy(inputs).log_softmax(-1)
    expected = torch.stack([sum(logp[b, t, targets[b, t]] for t in range(9) if mask[b, t]) for b in range(4)])
    assert torch.allclose(got, expected, atol=1e-5)


def _reference_stays_without_gradient(policy, reference, batch):
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    half = batch[0].shape[0] // 2
    chosen = [t[:half] for t in batch]
    rejected = [t[half:] for t in batch]
    loss, _, _ = dpo.dpo_loss(dpo.sequence_logprobs(policy, *chosen), dpo.sequence_logprobs(policy, *rejected),
                              dpo.reference_logprobs(reference, *chosen), dpo.reference_logprobs(reference, *rejected))
    loss.backward()
    return all(p.grad is None for p in reference.parameters()) and any(p.grad is not None for p in policy.parameters())


def test_the_reference_gets_no_gradient(models):
    assert _reference_stays_without_gradient(*models)


def test_planted_bug_reference_logprobs_with_gradients_is_caught(models, monkeypatch):
    monkeypatch.setattr(dpo, "reference_logprobs", dpo.sequence_logprobs)  # no torch.no_grad()
    assert not _reference_stays_without_gradient(*models)


def test_kl_is_zero_for_the_same_model_and_matches_a_direct_sum(models):
    policy, reference, (inputs, _, mask) = models
    assert dpo.kl_from_reference(policy, copy.deepcopy(policy), inputs, mask) == pytest.approx(0.0, abs=1e-7)
    p, q = policy(inputs).softmax(-1), reference(inputs).softmax(-1)
    direct = (p * (p / q).log()).sum(-1)[mask].mean().item()
    assert dpo.kl_from_reference(policy, reference, inputs, mask) == pytest.approx(direct, rel=1e-4)
    assert direct > 0


def test_preference_stats_and_errors():
    stats = dpo.preference_stats(torch.tensor([1.0, 0.0, 2.0, -1.0]), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert stats == {"margin": 0.0, "accuracy": 0.5}
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo.dpo_loss(*(torch.zeros(2) for _ in range(4)), beta=0.0)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # trl 1.16 passes transformers 5.23 a deprecated argument
def test_loss_equals_trl_on_the_same_batch():
    """trl 1.16's DPOTrainer._compute_loss on one batch of its own collator, against ours on ported models."""
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    policy, reference = GPT2LMHeadModel(config).eval(), GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # a wide spread: log-probabilities far from uniform, a loss far from log 2
        for p in list(policy.parameters()) + list(reference.parameters()):
            if p.dim() == 2:
                p.normal_(0, 1.5)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1")
    g = torch.Generator().manual_seed(3)

    def text(n):
        return " ".join(f"w{i}" for i in torch.randint(2, 40, (n,), generator=g).tolist())

    rows = [{"prompt": text(3 + i % 3), "chosen": " " + text(2 + i % 2) + " w1", "rejected": " " + text(3) + " w1"} for i in range(6)]
    with tempfile.TemporaryDirectory() as scratch:
        trainer = DPOTrainer(model=policy, ref_model=reference, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(rows),
                             args=DPOConfig(output_dir=scratch, beta=0.2, bf16=False, use_cpu=True, report_to="none",
                                            per_device_train_batch_size=6, disable_tqdm=True))
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
        theirs = trainer._compute_loss(trainer.model, batch, return_outputs=False).item()
    ids, completion = batch["input_ids"], batch["completion_mask"].bool()
    step = (ids[:, :-1], ids[:, 1:], completion[:, 1:])
    pol, ref = tfcore.GPT.from_transformers(policy), tfcore.GPT.from_transformers(reference)
    lp, rp = dpo.sequence_logprobs(pol, *step), dpo.reference_logprobs(ref, *step)
    ours, _, _ = dpo.dpo_loss(lp[:6], lp[6:], rp[:6], rp[6:], beta=0.2)
    assert abs(theirs - math.log(2)) > 0.05
    assert ours.item() == pytest.approx(theirs, abs=1e-5)
