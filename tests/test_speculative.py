"""tfcore.speculative: greedy speculative decoding returns the target's greedy tokens, and
speculative sampling draws from the target's distribution; each check shown to catch a planted bug."""

import itertools

import pytest
import torch

import tfcore
import tfcore.speculative as spec

CONFIG = dict(vocab_size=24, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _spread(model, seed):
    """Re-draw the weights so that the logits vary widely (greedy then does not repeat one token)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embeddings" in name else p.shape[1] ** -0.5))
    return model.eval()


@pytest.fixture(scope="module")
def models():
    target = _spread(tfcore.GPT(tfcore.GPTConfig(**CONFIG, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)), 0)
    near = _spread(tfcore.GPT(tfcore.GPTConfig(**CONFIG, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)), 0)
    with torch.no_grad():  # a draft that mostly agrees with the target: its weights, slightly moved
        for p in near.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * p.std())
    far = _spread(tfcore.GPT(tfcore.GPTConfig(**CONFIG, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)), 2)
    prompts = torch.randint(0, CONFIG["vocab_size"], (6, 5), generator=torch.Generator().manual_seed(3))
    return target, {"near": near, "far": far, "same": target}, prompts


def _all_equal(target, drafts, prompts, ks=(1, 2, 3, 5)):
    for draft, k, i in itertools.product(drafts.values(), ks, range(len(prompts))):
        ids = prompts[i:i + 1]
        if not torch.equal(spec.speculative_generate(target, draft, ids, 30, k=k), tfcore.generate(target, ids, 30)):
            return False
    return True


def test_greedy_returns_the_targets_tokens(models):
    target, drafts, prompts = models
    assert _all_equal(target, drafts, prompts)
    _, stats = spec.speculative_generate(target, drafts["same"], prompts[:1], 30, k=4, return_stats=True)
    assert sum(stats["accepted"]) == sum(stats["proposed"])  # a draft equal to the target: all accepted
    _, stats = spec.speculative_generate(target, drafts["near"], prompts[:1], 30, k=4, return_stats=True)
    assert 0 < sum(stats["accepted"]) < sum(stats["proposed"])  # some rejections: the rollback is exercised


def test_planted_bug_accepting_a_draft_token_after_a_rejection_is_caught(models, monkeypatch):
    target, drafts, prompts = models
    monkeypatch.setattr(spec, "accepted_prefix_length", lambda d, t: int((d == t).sum()))  # every match, not the prefix
    assert not _all_equal(target, {"near": drafts["near"]}, prompts)


def test_planted_bug_cache_not_rolled_back_is_caught(models, monkeypatch):
    target, drafts, prompts = models
    monkeypatch.setattr(spec, "truncate_cache", lambda cache, length: cache)  # keeps the rejected positions
    try:
        caught = not _all_equal(target, {"near": drafts["near"]}, prompts, ks=(3,))
    except (ValueError, IndexError, RuntimeError):  # the stale positions break the bookkeeping
        caught = True
    assert caught


def test_truncate_cache_and_clear_errors():
    cache = tfcore.KVCache(2, capacity=8)
    for layer in cache.layers:
        layer.append(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4))
    spec.truncate_cache(cache, 3)
    assert cache.length == 3 and cache[1].values.shape == (1, 2, 3, 4)
    cache[0].append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # writes position 3 in place
    assert len(cache[0]) == 4 and cache[0].keys[0, 0, 3].eq(0).all()
    with pytest.raises(ValueError, match="truncate"):
        spec.truncate_cache(cache, 9)
    target = tfcore.GPT(tfcore.GPTConfig(**CONFIG, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="batch 1"):
        spec.speculative_generate(target, target, torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="k"):
        spec.speculative_generate(target, target, torch.zeros(1, 3, dtype=torch.long), 4, k=0)


MLA_SIZES = dict(vocab_size=16, max_position_embeddings=40, hidden_size=8, num_hidden_layers=2,
                 num_attention_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                 v_head_dim=2, intermediate_size=8)


def _latent_model(seed, moved=0.0):
    """A small DeepseekV3 (latent attention, a LatentCache) with widely spread random weights;
    ``moved`` > 0 then moves each weight by that much noise (a draft that mostly agrees)."""
    torch.manual_seed(seed)
    model = tfcore.DeepseekV3(tfcore.DeepseekV3Config(**MLA_SIZES))
    g, noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7 + moved * torch.randn(p.shape, generator=noise))
    return model.eval()


def _latent_runs(target, draft, prompts, ks=(1, 4)):
    """Whether speculative decoding gave the target's greedy tokens for every prompt and k; the
    proposals accepted and made over all runs."""
    equal, accepted, proposed = True, 0, 0
    for k, i in itertools.product(ks, range(len(prompts))):
        ids = prompts[i:i + 1]
        out, stats = spec.speculative_generate(target, draft, ids, 30, k=k, return_stats=True)
        equal &= torch.equal(out, tfcore.generate(target, ids, 30))
        accepted, proposed = accepted + sum(stats["accepted"]), proposed + sum(stats["proposed"])
    return equal, accepted, proposed


def test_latent_cache_rolls_back_exactly():
    """DeepseekV3's LatentCache is cut along its positions: the target's greedy tokens, with both
    accepted and rejected proposals; a roll-back that skips the latent caches is caught."""
    target, draft = _latent_model(0), _latent_model(0, moved=0.2)
    prompts = torch.randint(0, MLA_SIZES["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(3))
    equal, accepted, proposed = _latent_runs(target, draft, prompts)
    assert equal and 0 < accepted < proposed
    assert _latent_runs(target, target, prompts[:1])[0]
    original = spec.truncate_cache

    def skips_latents(cache, length):
        return cache if isinstance(cache, tfcore.LatentCache) else original(cache, length)

    spec.truncate_cache = skips_latents
    try:
        caught = not _latent_runs(target, draft, prompts, ks=(3,))[0]
    except (ValueError, RuntimeError):  # the stale positions break the bookkeeping
        caught = True
    finally:
        spec.truncate_cache = original
    assert caught
    cache = tfcore.LatentCache(2)  # a cache that grows (no capacity)
    for layer in cache.layers:
        layer.append(torch.ones(1, 5, 4), torch.ones(1, 5, 2))
    spec.truncate_cache(cache, 2)
    assert cache.length == 2 and cache[1].k_rope.shape == (1, 2, 2)


def exact_round_distribution(p, q):
    """The exact distribution of the first token a speculative round emits, for one draft token:
    accept x ~ q with min(1, p/q), else draw from the residual."""
    vocab = p.shape[-1]
    out = torch.zeros(vocab, dtype=p.dtype)
    for x in range(vocab):
        accept = spec.acceptance_probability(p, q, torch.tensor(x))
        out[x] += q[x] * accept
        out += q[x] * (1 - accept) * spec.residual_distribution(p, q)
    return out


def _random_pair(seed, vocab=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g, dtype=torch.float64) * 2).softmax(-1), \
           (torch.randn(vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)


def test_speculative_sampling_is_exactly_the_target_distribution():
    for seed in range(20):
        p, q = _random_pair(seed)
        assert torch.allclose(exact_round_distribution(p, q), p, atol=1e-12, rtol=0)


def test_planted_bug_residual_not_renormalised_is_caught(monkeypatch):
    monkeypatch.setattr(spec, "residual_distribution", lambda p, q: torch.clamp(p - q, min=0.0))
    p, q = _random_pair(0)
    assert not torch.allclose(exact_round_distribution(p, q), p, atol=1e-3, rtol=0)


def _chi_square_p_value(residual, trials=6000):
    from scipy.stats import chisquare

    p, q = (x.float() for x in _random_pair(7, vocab=4))
    p2 = torch.stack([p, p.roll(1)])  # the target after each prefix (k = 1)
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(4)
    for _ in range(trials):
        drafted = spec.sample(q, torch.rand(1, generator=g))
        m, token = spec.verify_samples(p2, q.unsqueeze(0), drafted, torch.rand(3, generator=g))
        counts[int(drafted[0]) if m == 1 else int(token)] += 1
    return chisquare(counts.numpy(), (p * trials).numpy()).pvalue


def test_sampled_tokens_pass_a_chi_square_test_and_a_wrong_residual_fails(monkeypatch):
    assert _chi_square_p_value(spec.residual_distribution) > 1e-3
    monkeypatch.setattr(spec, "residual_distribution", lambda p, q: p)  # the target itself, not max(0, p - q)
    assert _chi_square_p_value(None) < 1e-6


def test_speculative_sampling_runs_and_the_same_generator_gives_the_same_tokens(models):
    target, drafts, prompts = models
    runs = [spec.speculative_generate(target, drafts["near"], prompts[:1], 20, k=3, temperature=1.0,
                                      generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0].shape == (1, 25) and torch.equal(runs[0], runs[1])
