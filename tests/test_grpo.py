"""tfcore.grpo: advantages, completion log-probabilities, every loss type and one parameter gradient equal
trl 1.16's GRPOTrainer on a batch its own code built (float32 within measured noise, float64 within 1e-10);
the graders, the sampler, pass@k and the errors; a short train_grpo run. Each check is shown to catch a
planted bug."""

import copy
import functools
import itertools
import math

import pytest
import torch

import tfcore
from tfcore import grpo
from tfcore.instruct import END, GRADED_TASKS

G, MAX_LEN, BETA, EPS_LOW, EPS_HIGH = 4, 6, 0.1, 0.2, 0.28
CISPO_CAP = 1.3  # trl's cispo caps the ratio itself: clamp(coef_1, max=epsilon_high); 0.28 would cap every token
F32 = {"loss": 1e-5, "grad": 1e-6}  # measured in float32: loss gaps <= 1.2e-7, dL gaps <= 3.7e-9


# ---------------------------------------------------------------------------------------------
# trl 1.16's GRPOTrainer on a tiny random GPT-2, and the batch its own code builds


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    import warnings

    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # every parameter drawn, LayerNorm weights and biases included
        for p in model.parameters():
            p.normal_(0, 1.0) if p.dim() == 2 else p.uniform_(-0.5, 0.5)
        model.transformer.wte.weight[1] *= 3  # "w1" (eos) likely enough that some completions end early
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w0", eos_token="w1")
    # Both prompts are 3 tokens long: transformers' GPT-2 forward numbers positions 0.. over left padding
    # (no position_ids from trl), so with unequal prompts trl scores the short prompt's completion at shifted
    # positions (run: a 2- and a 3-token prompt gave log-probs 3.8 apart from ours, which count positions
    # per row, and within 1.4e-6 of a GPT-2 forward given position_ids = arange). No word "w1x" either:
    # the eos "w1" is an added token, split out of "w11" as w1 + "1".
    prompts = ["w5 w9 w3", "w7 w2 w21"]
    inputs = [{"prompt": p} for p in prompts for _ in range(G)]
    returned = []  # what the reward function gave, call by call
    draws = torch.Generator().manual_seed(5)

    def reward(completions, **kwargs):
        values = torch.randn(len(completions), generator=draws).tolist()
        returned.append(values)
        return values

    scratch = tmp_path_factory.mktemp("grpo_trl")
    model.save_pretrained(scratch / "model")  # with beta != 0, trl 1.16 builds the reference from the path
    with warnings.catch_warnings():  # trl 1.16 calls transformers 5.23 deprecated names (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        trainer = GRPOTrainer(
            model=str(scratch / "model"), reward_funcs=reward, processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
            args=GRPOConfig(output_dir=str(scratch), use_cpu=True, report_to="none", bf16=False,
                            per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=MAX_LEN,
                            beta=BETA, temperature=1.0, disable_tqdm=True, epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
                            use_bias_correction_kl=False))
        # trl 1.16 defaults to use_bias_correction_kl=True, DeepSeek-V3.2's KL term times the ratio (a different
        # gradient even at ratio 1); tfcore.grpo has GRPO's plain k3 penalty. With it on, the float64 gradients
        # differed by 1.7e-9 where the KL gradient is 1e-8 (about the ratio's spread), so it is off here
        trainer.current_gradient_accumulation_steps = 1  # the Trainer's loop sets it
        trainer.model.train()  # the training path (dropout is 0)
        batch = trainer._generate_and_score_completions([dict(x) for x in inputs])
    with torch.no_grad():  # the policy moves away from the frozen reference: a KL term that is not zero
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=draws) * 0.01)
    mask = batch["completion_mask"].bool()
    assert (~mask).any() and mask.any(dim=1).all()  # some completions end before MAX_LEN: padding to ignore
    return {"trainer": trainer, "batch": batch, "inputs": inputs, "returned": returned}


def _generate(trainer, inputs):
    import warnings

    with warnings.catch_warnings():  # trl 1.16 calls transformers 5.23's deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return trainer._generate_and_score_completions([dict(x) for x in inputs])


# ---------------------------------------------------------------------------------------------
# 1a. Advantages


def _advantages_match(advantages_fn, run, monkeypatch) -> bool:
    trainer, gaps = run["trainer"], []
    try:
        for scale in ("group", "batch", "none"):
            trainer.scale_rewards = scale
            theirs = _generate(trainer, run["inputs"])["advantages"]  # float32: trl's rewards are float32
            ours = advantages_fn(torch.tensor(run["returned"][-1]), G, scale)
            gaps.append((ours - theirs).abs().max().item())
            # float64: trl's own normalisation fed float64 rewards (_calculate_rewards returns [B, 1] per function),
            # and float64 as the default dtype: trl's nanstd computes Bessel's count / (count - 1) from integers,
            # which gives the default dtype (float32 left the gaps at 2e-8)
            rewards = torch.randn(2 * G, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            monkeypatch.setattr(trainer, "_calculate_rewards", lambda *a, r=rewards, **k: r.unsqueeze(1).clone())
            torch.set_default_dtype(torch.float64)
            try:
                theirs = _generate(trainer, run["inputs"])["advantages"]
            finally:
                torch.set_default_dtype(torch.float32)
                monkeypatch.undo()
            assert theirs.dtype == torch.float64
            gaps.append((advantages_fn(rewards, G, scale) - theirs).abs().max().item())
    finally:
        trainer.scale_rewards = "group"
    print("advantage gaps (float32, float64) x (group, batch, none):", [f"{g:.1e}" for g in gaps])
    return all(g < (1e-6 if i % 2 == 0 else 1e-10) for i, g in enumerate(gaps))  # float32 measured 1.2e-7


def test_group_advantages_equal_trl_for_every_scale(trl_run, monkeypatch):
    assert _advantages_match(grpo.group_advantages, trl_run, monkeypatch)


def test_planted_bug_batch_mean_advantages_is_caught(trl_run, monkeypatch):
    def batch_mean(rewards, group_size, scale):  # the baseline is the batch's mean, not the group's
        centred = rewards - rewards.mean()
        if scale == "group":
            return centred / (rewards.view(-1, group_size).std(dim=1).repeat_interleave(group_size) + 1e-4)
        return centred / (rewards.std() + 1e-4) if scale == "batch" else centred

    assert not _advantages_match(batch_mean, trl_run, monkeypatch)


def test_group_advantages_zero_for_a_tied_group():
    advantages = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3)
    assert advantages[:3].abs().max() == 0
    assert advantages[3:].sum().abs() < 1e-6 and advantages[4] > 0


# ---------------------------------------------------------------------------------------------
# 1b. The completion's log-probabilities


def _hf_logprobs(model, batch):
    """The transformers model's own forward, log_softmax and gather (no fused head): [B, C]."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1:-1]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _logprobs_match(logprobs_fn, run) -> bool:
    trainer, batch = run["trainer"], run["batch"]
    mask = batch["completion_mask"].bool()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        theirs = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, ids.shape[1] - batch["prompt_ids"].shape[1])[0]
        ours = logprobs_fn(tfcore.GPT.from_transformers(trainer.model), batch)
        ok = bool((ours - theirs)[mask].abs().max() < 1e-5)  # measured 4.8e-7
        # float64: trl's fused head accumulates in float32 (trl/kernels/chunked_logprob.py), so the float64
        # reference is the same GPT-2's plain forward, which equals trl's head in float32 (just above)
        ok &= bool((_hf_logprobs(trainer.model, batch) - theirs)[mask].abs().max() < 1e-5)
        try:
            trainer.model.double()
            assert trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, 2)[0].dtype == torch.float32
            ours = logprobs_fn(tfcore.GPT.from_transformers(trainer.model), batch)
            ok &= ours.dtype == torch.float64 and bool((ours - _hf_logprobs(trainer.model, batch))[mask].abs().max() < 1e-10)
        finally:
            trainer.model.float()
    return ok


def test_completion_logprobs_equal_trl(trl_run):
    assert _logprobs_match(grpo.completion_logprobs, trl_run)


def test_planted_bug_logits_off_by_one_is_caught(trl_run):
    def off_by_one(model, batch):  # the logits AT each completion token, not the ones before it
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logits = model(ids, attention_mask=attention)[:, -batch["completion_ids"].shape[1]:]
        return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)

    assert not _logprobs_match(off_by_one, trl_run)


# ---------------------------------------------------------------------------------------------
# 1c. The loss of each loss_type and its gradient in the log-probabilities


def _loss_inputs(run, dtype):
    """The batch's log-probs L, an old policy's log-probs around them (ratios spread around 1),
    the reference's and the advantages, in ``dtype``."""
    batch = run["batch"]
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        logps = _hf_logprobs(run["trainer"].model, batch).masked_fill(~mask, 0.0)
    spread = torch.randn(logps.shape, generator=torch.Generator().manual_seed(11)) * 0.4
    old = (logps - spread).masked_fill(~mask, 0.0)  # ratio = exp(spread): some beyond 1 +- eps, some inside
    return {"logps": logps.to(dtype), "old": old.to(dtype), "ref": batch["ref_per_token_logps"].to(dtype),
            "advantages": batch["advantages"].to(dtype), "mask": mask}


def _trl_loss(run, loss_type, x, monkeypatch):
    """trl's _compute_loss on the batch, with its log-probs replaced by the leaf ``x["logps"]``."""
    trainer = run["trainer"]
    leaf = x["logps"].clone().requires_grad_(True)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (leaf, torch.zeros_like(leaf.detach()), None))
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "epsilon_high", CISPO_CAP if loss_type == "cispo" else EPS_HIGH)
    inputs = dict(run["batch"], old_per_token_logps=x["old"], ref_per_token_logps=x["ref"], advantages=x["advantages"])
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = trainer._metrics["train"]
    clipped = metrics["cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"][-1]
    monkeypatch.undo()
    return loss.detach(), leaf.grad, {"clipped": clipped, "kl": metrics["kl"][-1]}


def _ours(loss_fn, loss_type, x):
    leaf = x["logps"].clone().requires_grad_(True)
    loss, stats = loss_fn(leaf, x["old"], x["advantages"], x["mask"], loss_type, ref_logps=x["ref"], beta=BETA,
                          epsilon_low=EPS_LOW, epsilon_high=CISPO_CAP if loss_type == "cispo" else EPS_HIGH,
                          max_completion_length=MAX_LEN)
    loss.backward()
    return loss.detach(), leaf.grad, stats


def _loss_gaps(loss_fn, run, loss_type, dtype, monkeypatch):
    x = _loss_inputs(run, dtype)
    theirs, their_grad, their_stats = _trl_loss(run, loss_type, x, monkeypatch)
    ours, our_grad, our_stats = _ours(loss_fn, loss_type, x)
    assert theirs.dtype == dtype and their_grad.dtype == dtype
    return (abs(ours - theirs).item(), (our_grad - their_grad).abs().max().item(),
            max(abs(our_stats[k] - their_stats[k]) for k in ("clipped", "kl")), our_stats)


def _loss_matches(loss_fn, run, loss_type, monkeypatch) -> bool:
    ok = True
    for dtype, loss_tol, grad_tol in ((torch.float32, F32["loss"], F32["grad"]), (torch.float64, 1e-10, 1e-10)):
        loss_gap, grad_gap, stat_gap, stats = _loss_gaps(loss_fn, run, loss_type, dtype, monkeypatch)
        print(f"{loss_type} {dtype}: loss gap {loss_gap:.1e}, dL gap {grad_gap:.1e}, stats gap {stat_gap:.1e}", stats)
        ok &= loss_gap < loss_tol and grad_gap < grad_tol and stat_gap < 1e-6
    return ok


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_grpo_loss_and_gradient_equal_trl(trl_run, loss_type, monkeypatch):
    _, _, _, stats = _loss_gaps(grpo.grpo_loss, trl_run, loss_type, torch.float64, monkeypatch)
    assert stats["clipped"] > 0 and 1e-3 < stats["kl"] < 1  # some tokens clipped: the clip is exercised
    x = _loss_inputs(trl_run, torch.float64)
    ratio, a = (x["logps"] - x["old"]).exp(), x["advantages"].unsqueeze(1)
    if loss_type == "cispo":  # some weights capped, some not
        assert ((ratio > CISPO_CAP) & x["mask"]).any() and ((ratio < CISPO_CAP) & x["mask"]).any()
    else:  # clipped tokens of both advantage signs
        assert ((ratio < 1 - EPS_LOW) & (a < 0) & x["mask"]).any() and ((ratio > 1 + EPS_HIGH) & (a > 0) & x["mask"]).any()
    assert _loss_matches(grpo.grpo_loss, trl_run, loss_type, monkeypatch)


@pytest.mark.parametrize("loss_type", [t for t in grpo.LOSS_TYPES if t != "cispo"])
def test_planted_bug_unclipped_ratio_is_caught(trl_run, loss_type, monkeypatch):
    assert not _loss_matches(functools.partial(grpo.grpo_loss, clip=False), trl_run, loss_type, monkeypatch)


def _reduce(per_token, mask, loss_type):
    """The five reductions, written out again: per-token [B, C] -> one number."""
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * MAX_LEN)
    return (per_token * mask).sum() / mask.sum()


def _with_kl(q_of):
    """grpo_loss without its KL term, plus beta times k3 with q = q_of(logps, ref), reduced by _reduce."""
    def loss_fn(logps, old, advantages, mask, loss_type, ref_logps, beta, **kw):
        loss, stats = grpo.grpo_loss(logps, old, advantages, mask, loss_type, **kw)
        q = q_of(logps, ref_logps)
        kl = q.exp() - q - 1
        return loss + beta * _reduce(kl, mask, loss_type), {**stats, "kl": ((kl * mask).sum() / mask.sum()).item()}
    return loss_fn


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_planted_bug_kl_the_wrong_way_is_caught(trl_run, loss_type, monkeypatch):
    # the planted variant's construction is right with the right q, so only the sign of q differs
    assert _loss_matches(_with_kl(lambda logps, ref: ref.detach() - logps), trl_run, loss_type, monkeypatch)
    assert not _loss_matches(_with_kl(lambda logps, ref: logps - ref.detach()), trl_run, loss_type, monkeypatch)


# ---------------------------------------------------------------------------------------------
# 1d. One parameter gradient end to end


def _embedding_gradients(run, loss_fn, dtype, monkeypatch):
    """The token-embedding gradient of trl's _compute_loss(model, batch) and of ours on the ported model."""
    trainer, batch = run["trainer"], run["batch"]
    x = _loss_inputs(run, dtype)
    try:
        trainer.model.to(dtype).zero_grad()
        monkeypatch.setattr(trainer, "loss_type", "dr_grpo")
        if dtype == torch.float64:  # trl's fused head rounds to float32: the plain forward (equal to it above)
            def plain(model, *args, **kwargs):
                logps = _hf_logprobs(model, batch).masked_fill(~x["mask"], 0.0)
                return logps, torch.zeros_like(logps.detach()), None
            monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", plain)
        inputs = dict(batch, old_per_token_logps=x["old"], ref_per_token_logps=x["ref"], advantages=x["advantages"])
        trainer._compute_loss(trainer.model, inputs).backward()
        theirs = trainer.model.transformer.wte.weight.grad.clone()
        monkeypatch.undo()
        gpt = tfcore.GPT.from_transformers(trainer.model)
        assert gpt.lm_head.weight is gpt.token_embeddings.weight  # tied, as GPT-2's wte and lm_head
        loss, _ = loss_fn(grpo.completion_logprobs(gpt, batch), x["old"], x["advantages"], x["mask"], "dr_grpo",
                          ref_logps=x["ref"], beta=BETA, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                          max_completion_length=MAX_LEN)
        loss.backward()
        return theirs, gpt.token_embeddings.weight.grad
    finally:
        trainer.model.float().zero_grad()


def _gradient_matches(loss_fn, run, monkeypatch, report=False) -> bool:
    ok = True
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-10)):  # float32 measured 6.3e-9
        theirs, ours = _embedding_gradients(run, loss_fn, dtype, monkeypatch)
        gap = (ours - theirs).abs().max().item()
        if report:
            print(f"{dtype}: embedding gradient gap {gap:.2e}, largest entry {theirs.abs().max().item():.2e}")
        ok &= theirs.abs().max().item() > 1e-3 and gap < tol
    return ok


def test_embedding_gradient_equals_trl_end_to_end(trl_run, monkeypatch):
    assert _gradient_matches(grpo.grpo_loss, trl_run, monkeypatch, report=True)


def test_planted_bug_padding_counted_in_the_loss_is_caught(trl_run, monkeypatch):
    def no_mask(logps, old, advantages, mask, *args, **kwargs):  # every position counts, padding too
        return grpo.grpo_loss(logps, old, advantages, torch.ones_like(mask), *args, **kwargs)

    assert not _gradient_matches(no_mask, trl_run, monkeypatch)


# ---------------------------------------------------------------------------------------------
# 2. Constants stay constant; padding does not count


def _synthetic(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(4, 5, generator=g, dtype=dtype) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    return {"logps": logps, "old": logps + torch.randn(4, 5, generator=g, dtype=dtype) * 0.3,
            "ref": logps + torch.randn(4, 5, generator=g, dtype=dtype) * 0.3,
            "advantages": torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=dtype), "mask": mask}


def _constants_get_no_gradient(loss_fn) -> bool:
    x = _synthetic()
    logps, old, ref = (x[k].clone().requires_grad_(True) for k in ("logps", "old", "ref"))
    for loss_type in grpo.LOSS_TYPES:
        loss, _ = loss_fn(logps, old, x["advantages"], x["mask"], loss_type, ref_logps=ref, beta=BETA,
                          max_completion_length=5)
        loss.backward()
    return logps.grad is not None and old.grad is None and ref.grad is None


def test_old_and_reference_logprobs_get_no_gradient():
    assert _constants_get_no_gradient(grpo.grpo_loss)


def test_planted_bug_reference_with_gradient_is_caught():
    assert not _constants_get_no_gradient(_with_kl(lambda logps, ref: ref - logps))  # no detach


def _padding_ignored(loss_fn) -> bool:
    x = _synthetic()
    ok = True
    for loss_type in grpo.LOSS_TYPES:
        changed = x["logps"].masked_fill(~x["mask"], -9.0)  # other log-probs where the mask is False
        losses, grads = [], []
        for logps in (x["logps"], changed):
            leaf = logps.clone().requires_grad_(True)
            loss, _ = loss_fn(leaf, x["old"], x["advantages"], x["mask"], loss_type, ref_logps=x["ref"],
                              beta=BETA, max_completion_length=5)
            loss.backward()
            losses.append(loss.item())
            grads.append(leaf.grad)
        ok &= losses[0] == losses[1] and bool((grads[0][~x["mask"]] == 0).all()) and bool(torch.equal(*grads))
    return ok


def test_padded_positions_do_not_count():
    assert _padding_ignored(grpo.grpo_loss)


def test_planted_bug_ignoring_the_mask_is_caught():
    def no_mask(logps, old, advantages, mask, *args, **kwargs):
        return grpo.grpo_loss(logps, old, advantages, torch.ones_like(mask), *args, **kwargs)

    assert not _padding_ignored(no_mask)


def test_grpo_loss_reductions_on_a_hand_example():
    """One token per completion clipped or not: the numbers worked out by hand."""
    logps = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]], dtype=torch.float64))  # ratios vs old = log 1
    old, mask = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    # per-token: -min(1.5 * 1, 1.2 * 1) = -1.2; -1; -min(0.5 * -1, 0.8 * -1) = 0.8 (the last is padding)
    expected = {"grpo": ((-1.2 - 1.0) / 2 + 0.8) / 2, "bnpo": (-1.2 - 1.0 + 0.8) / 3, "dapo": (-1.2 - 1.0 + 0.8) / 3,
                "dr_grpo": (-1.2 - 1.0 + 0.8) / (2 * 4)}
    for loss_type, value in expected.items():
        loss, stats = grpo.grpo_loss(logps, old, advantages, mask, loss_type, max_completion_length=4)
        assert loss.item() == pytest.approx(value, abs=1e-12)
        assert stats["clipped"] == pytest.approx(2 / 3) and stats["kl"] == 0.0


# ---------------------------------------------------------------------------------------------
# 3. Graders, scoring and sampling on the shipped model


@pytest.fixture(scope="module")
def book_chat():
    return grpo.load_book_chat()


def test_grade_accepts_the_right_answer_only():
    cases = {  # (task, n): (right, [wrong ones: another answer, extra space, leading zero...])
        ("digits", 307): ("307", ["308", "307 ", " 307", "0307", "three hundred and seven"]),
        ("words", 307): ("three hundred and seven", ["three hundred seven", "three hundred and seven ", "307"]),
        ("reverse", 120): ("021", ["21", "120", "021 "]),  # a reversed number keeps its leading zero
        ("sort", 307): ("037", ["37", "730", "0 3 7"]),
        ("sum", 307): ("10", ["010", "9", " 10"]),
    }
    assert {task for task, _ in cases} == set(GRADED_TASKS)
    for (task, n), (right, wrong) in cases.items():
        assert grpo.grade(task, n, right), (task, n, right)
        for text in wrong:
            assert not grpo.grade(task, n, text), (task, n, text)


def test_score_on_hand_built_completions(book_chat):
    tokenizer, ids, _, _ = book_chat
    end = ids[END]
    rows = [tokenizer.encode("10").ids + [end],        # right and closed
            tokenizer.encode("10").ids,                 # right but truncated: no <|end|>
            tokenizer.encode("9").ids + [end],          # wrong and closed
            tokenizer.encode("10").ids + [end] + tokenizer.encode("9").ids]  # text after <|end|>
    width = max(map(len, rows))
    completions = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # padding with an ordinary token
    real = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    is_end = completions == end
    mask = real & ((is_end.long().cumsum(1) - is_end.long()) == 0)  # up to and including the first <|end|>
    assert not mask[3, -1] and mask[1].sum() == len(rows[1])
    scores = grpo.score(tokenizer, ids, [("sum", 307)] * 4, completions, mask)
    assert scores["correct"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert scores["format"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scores["contains"].tolist() == [1.0, 1.0, 0.0, 1.0]  # the lax grader takes the truncated answer
    with pytest.raises(ValueError, match="3 problems for 4 completions"):
        grpo.score(tokenizer, ids, [("sum", 307)] * 3, completions, mask)


def test_sample_groups_layout(book_chat):
    tokenizer, ids, model, _ = book_chat
    problems = [("sum", 47), ("words", 5), ("reverse", 123)]
    batch = grpo.sample_groups(model, tokenizer, ids, problems, 3, 8, generator=torch.Generator().manual_seed(0))
    prompts, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completions, mask = batch["completion_ids"], batch["completion_mask"]
    assert completions.shape == mask.shape == (9, 8) and prompts.shape == prompt_mask.shape and prompts.shape[0] == 9
    assert batch["problems"] == [p for p in problems for _ in range(3)]
    for row in range(9):  # left padding: the padding first, then <|user|> ... <|assistant|>
        real = prompt_mask[row]
        first = int(real.long().argmax())
        assert real[first:].all() and not real[:first].any()
        assert prompts[row, first] == ids["<|user|>"] and prompts[row, -1] == ids["<|assistant|>"]
        ends = (completions[row] == ids[END]).nonzero().flatten().tolist()
        cut = ends[0] + 1 if ends else 8  # True up to and including the first <|end|>, False after
        assert mask[row].tolist() == [True] * cut + [False] * (8 - cut)
    for group in range(3):  # a group's rows are consecutive and share their prompt
        assert (prompts[3 * group:3 * group + 3] == prompts[3 * group]).all()
    assert not (prompts[0] == prompts[3]).all()
    assert (~mask).any()  # some completion ended early: the False-after-<|end|> branch is exercised


# ---------------------------------------------------------------------------------------------
# 4. pass@k against every k-subset


def test_pass_at_k_equals_the_exhaustive_count():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert grpo.pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
            grpo.pass_at_k(n, c, k)


def test_planted_bug_pass_at_k_with_replacement_differs():
    def with_replacement(n, c, k):
        return 1 - (1 - c / n) ** k

    assert any(abs(with_replacement(5, 2, k) - grpo.pass_at_k(5, 2, k)) > 0.01 for k in (2, 3))


# ---------------------------------------------------------------------------------------------
# 5. Bad input


def test_bad_input_gets_a_clear_error():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="a group needs two"):
        grpo.group_advantages(r, 1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo.group_advantages(r, 4)
    with pytest.raises(ValueError, match="scale must be 'group', 'batch' or 'none'"):
        grpo.group_advantages(r, 3, "std")
    x = _synthetic()
    args = (x["logps"], x["old"], x["advantages"], x["mask"])
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        grpo.grpo_loss(*args, "ppo")
    with pytest.raises(ValueError, match="one shape"):
        grpo.grpo_loss(x["logps"], x["old"][:, :4], x["advantages"], x["mask"])
    with pytest.raises(ValueError, match="advantages"):
        grpo.grpo_loss(x["logps"], x["old"], x["advantages"][:3], x["mask"])
    with pytest.raises(ValueError, match="pass ref_logps"):
        grpo.grpo_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="pass max_completion_length"):
        grpo.grpo_loss(*args, "dr_grpo")


# ---------------------------------------------------------------------------------------------
# 6. train_grpo


def _train(book_chat, **kwargs):
    tokenizer, ids, model, _ = book_chat
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    problems = [("sum", 47), ("words", 5), ("reverse", 123), ("sort", 381)]
    history = grpo.train_grpo(policy, reference, tokenizer, ids, problems, 3, prompts_per_step=2, group_size=3,
                              max_new_tokens=8, **kwargs)
    return model, policy, reference, history


def test_train_grpo_moves_the_policy_and_not_the_reference(book_chat):
    model, policy, reference, history = _train(book_chat)
    before = model.state_dict()
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())
    assert all(p.grad is None for p in reference.parameters())
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert len(history) == 3
    keys = {"reward", "correct", "format", "contains", "length", "clipped", "kl"}
    for row in history:
        assert set(row) == keys and all(math.isfinite(v) for v in row.values())
        assert 0 <= row["correct"] <= row["format"] <= 1 and 1 <= row["length"] <= 8
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first batch: policy == reference
    assert history[-1]["kl"] > 0


def _reference_calls_without_grad(book_chat, monkeypatch) -> bool:
    calls, losses = [], []
    original_logprobs, original_loss = grpo.completion_logprobs, grpo.grpo_loss

    def logprobs(model, batch):
        out = original_logprobs(model, batch)
        calls.append((torch.is_grad_enabled(), out.requires_grad))
        return out

    def loss(logps, old, advantages, mask, loss_type, ref, *args):
        losses.append((old.requires_grad, ref.requires_grad))
        return original_loss(logps, old, advantages, mask, loss_type, ref, *args)

    monkeypatch.setattr(grpo, "completion_logprobs", logprobs)
    monkeypatch.setattr(grpo, "grpo_loss", loss)
    _train(book_chat)
    monkeypatch.undo()
    # per step: old and reference without gradients (no_grad), then the policy's with them
    return (len(calls) == 9 and all(c == (False, False) for i, c in enumerate(calls) if i % 3 < 2)
            and all(c == (True, True) for i, c in enumerate(calls) if i % 3 == 2)
            and losses == [(False, False)] * 3)


def test_train_grpo_takes_old_and_reference_logprobs_without_gradients(book_chat, monkeypatch):
    assert _reference_calls_without_grad(book_chat, monkeypatch)


def test_planted_bug_forgotten_no_grad_is_caught(book_chat, monkeypatch):
    import contextlib

    monkeypatch.setattr(torch, "no_grad", contextlib.nullcontext)  # train_grpo's `with torch.no_grad():` does nothing
    assert not _reference_calls_without_grad(book_chat, monkeypatch)


def _advantages_seen(book_chat, monkeypatch, **kwargs):
    seen, original = [], grpo.grpo_loss

    def loss(logps, old, advantages, *args):
        seen.append(advantages.clone())
        return original(logps, old, advantages, *args)

    monkeypatch.setattr(grpo, "grpo_loss", loss)
    history = _train(book_chat, **kwargs)[3]
    monkeypatch.undo()
    return seen, history


def test_the_interventions_of_chapter_26_change_what_they_name(book_chat, monkeypatch):
    """center=False uses the raw rewards; reward="contains" trains on the lax grader; iterations=k
    takes k loss steps per batch; an unknown reward is refused."""
    centred, _ = _advantages_seen(book_chat, monkeypatch)
    assert all(a.view(-1, 3).sum(dim=1).abs().max() < 1e-3 for a in centred)  # groups of 3 sum to zero
    raw, history = _advantages_seen(book_chat, monkeypatch, center=False)
    assert all((a >= 0).all() for a in raw)  # rewards, not centred: never negative
    assert [float(a.mean()) for a in raw] == pytest.approx([h["reward"] for h in history])
    _, lax = _advantages_seen(book_chat, monkeypatch, reward="contains")
    assert [h["reward"] for h in lax] == [h["contains"] for h in lax]
    repeated, _ = _advantages_seen(book_chat, monkeypatch, iterations=2)
    assert len(repeated) == 6 and all(torch.equal(repeated[i], repeated[i + 1]) for i in (0, 2, 4))
    with pytest.raises(ValueError, match="reward must be"):
        _train(book_chat, reward="format")


def test_planted_bug_centering_ignored_is_caught(book_chat, monkeypatch):
    """If train_grpo ignored center=False, the advantages would be centred: the check above fails."""
    original = grpo.train_grpo

    def ignores_center(*args, center=True, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "train_grpo", ignores_center)
    raw, _ = _advantages_seen(book_chat, monkeypatch, center=False)
    assert not all((a >= 0).all() for a in raw)
