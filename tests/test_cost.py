"""tfcore.cost (chapter 23): the FLOP formulas against PyTorch's FLOP counter, the byte formulas
against the sizes of real tensors, the published models' sizes, planted bugs and bad input."""

import pytest
import torch

import tfcore
from tfcore import cost

GPT_20M = tfcore.GPTConfig(vocab_size=8192, max_position_embeddings=1024, hidden_size=384, num_hidden_layers=10,
                           num_attention_heads=6)  # benchmarks' GENERATION_MODELS["20M"]


def llama_config(**changes):
    """A small Llama with its options off their defaults: grouped-query attention (8 heads, 2 key/value
    heads), a head_dim other than hidden / heads, biases, tied embeddings."""
    sizes = dict(vocab_size=100, max_position_embeddings=64, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=500.0)
    return tfcore.LlamaConfig(**(sizes | changes))


def small_gpt_config(**changes):
    sizes = dict(vocab_size=50, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=80, hidden_act="relu", tie_word_embeddings=False)
    return tfcore.GPTConfig(**(sizes | changes))


SHAPES = [(1, 1, 0), (2, 16, 0), (3, 1, 7), (2, 5, 4)]  # (batch, new, cached)


# --- FLOPs: the formula against FlopCounterMode ---------------------------------------------------

@pytest.mark.parametrize("config", [GPT_20M, llama_config(), llama_config(num_key_value_heads=1),
                                    small_gpt_config()], ids=["gpt-20M", "llama-gqa", "llama-mqa", "gpt-untied"])
@pytest.mark.parametrize("batch, new, cached", SHAPES)
def test_counted_matmul_flops_equal_the_formula(config, batch, new, cached):
    counted = cost.counted_flops(config, batch, new, cached)
    assert counted == cost.matmul_flops_by_op(config, batch, new, cached)
    assert counted["total"] == cost.forward_cost(config, batch, new, cached)["matmul_flops"]


def test_the_counter_sees_matrix_products_only():
    """What FlopCounterMode counts in torch 2.13: a bias, a softmax, a norm, an activation count 0;
    the CPU's fused attention kernel counts 0 too, unless the math backend runs it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b = torch.randn(3, 5), torch.randn(7, 5), torch.randn(7)
    q = torch.randn(2, 3, 5, 8)
    cases = {"linear with bias": (lambda: torch.nn.functional.linear(x, w, b), 2 * 3 * 5 * 7),
             "softmax": (lambda: x.softmax(-1), 0), "layer norm": (lambda: torch.nn.functional.layer_norm(x, (5,)), 0),
             "gelu": (lambda: torch.nn.functional.gelu(x), 0),
             "fused attention (CPU)": (lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), 0)}
    for name, (fn, expected) in cases.items():
        with FlopCounterMode(display=False) as counter:
            fn()
        assert counter.get_total_flops() == expected, name
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert counter.get_total_flops() == 2 * (2 * 2 * 3 * 5 * 5 * 8)  # Q Kᵀ and P V


@pytest.mark.parametrize("config", [small_gpt_config(), llama_config()], ids=["gpt", "llama"])
def test_the_meta_walk_counts_what_the_real_forward_counts(config):
    """counted_flops runs the blocks on meta tensors without the model's forward (which checks the
    token ids' values); on the CPU, the real forward over real ids counts the same, cached or not."""
    torch.manual_seed(0)
    model = (tfcore.GPT if isinstance(config, tfcore.GPTConfig) else tfcore.Llama)(config).eval()
    for batch, new, cached in SHAPES:
        ids = torch.randint(0, config.vocab_size, (batch, cached + new))
        cache = model.new_cache()
        with torch.no_grad():
            if cached:
                model(ids[:, :cached], cache=cache)
        real = cost.count_matmul_flops(lambda: model(ids[:, cached:], cache=cache if cached else None), model)
        assert real == cost.counted_flops(config, batch, new, cached), (batch, new, cached)


def test_mixtral_counted_on_the_cpu_equals_the_formula():
    """Experts pick rows by value, so they run on the CPU: k experts per token whatever the routing."""
    config = tfcore.MixtralConfig(vocab_size=50, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                                  num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = tfcore.Mixtral(config).eval()
    ids = torch.randint(0, 50, (3, 5))
    counted = cost.count_matmul_flops(lambda: model(ids), model)
    assert counted == cost.matmul_flops_by_op(config, 3, 5, 0)
    assert counted["router"] == 2 * 15 * 32 * 4 * 2  # tokens x hidden x experts, 2 layers
    with pytest.raises(TypeError, match="meta device"):
        cost.counted_flops(config, 1, 1)


def test_kaplan_counts_one_of_the_two_attention_products():
    """Exact matrix FLOPs minus Kaplan et al.'s 2N + 2 n_layer S d_attn per token: the second
    attention product (2 n_layer S d_attn per token), less the 2 FLOPs per token that N gives
    each bias and norm parameter, which multiply no matrix."""
    for config in (GPT_20M, small_gpt_config(), llama_config(tie_word_embeddings=False)):
        matrices = sum(p.numel() for name, p in _meta_model(config).named_parameters()
                       if p.dim() == 2 and "embed" not in name)  # every weight matrix but the tables
        not_multiplying = cost.parameter_counts(config)["non_embedding"] - matrices
        heads, _, head_dim = cost._attention_sizes(config)
        for batch, new, cached in SHAPES:
            tokens, keys = batch * new, cached + new
            exact = cost.forward_cost(config, batch, new, cached)["matmul_flops"]
            second_product = 2 * config.num_hidden_layers * keys * heads * head_dim * tokens
            assert exact - cost.kaplan_flops(config, batch, new, cached) == second_product - 2 * not_multiplying * tokens


def _meta_model(config):
    with torch.device("meta"):
        if isinstance(config, tfcore.GPTConfig):
            return tfcore.GPT(config)
        if isinstance(config, tfcore.MixtralConfig):
            return tfcore.Mixtral(config)
        if isinstance(config, tfcore.DeepseekV3MoEConfig):
            return tfcore.DeepseekV3WithExperts(config)
        if isinstance(config, tfcore.DeepseekV3Config):
            return tfcore.DeepseekV3(config)
        return tfcore.Llama(config)


@pytest.mark.parametrize("config", [GPT_20M, cost.published_configs()["Llama 2 7B"]], ids=["gpt-20M", "llama2-7B"])
@pytest.mark.parametrize("batch, new, cached", [(1, 1, 511), (1, 512, 0), (64, 1, 511), (8, 512, 0)])
def test_the_operations_a_counter_misses_are_a_few_percent(config, batch, new, cached):
    """Softmax, norms, activations, residuals, rotary: counted by ELEMENTWISE_FLOPS, under 2% of the total."""
    total = cost.forward_cost(config, batch, new, cached)
    assert 0 < total["elementwise_flops"] < 0.02 * total["flops"], total


# --- bytes: the formulas against real tensors ------------------------------------------------------

CONFIGS = {"gpt": small_gpt_config(), "gpt-tied": small_gpt_config(tie_word_embeddings=True),
           "llama-gqa": llama_config(), "llama-mqa": llama_config(num_key_value_heads=1),
           "llama-mha-untied": llama_config(num_key_value_heads=8, tie_word_embeddings=False),
           "mixtral": tfcore.MixtralConfig(vocab_size=50, max_position_embeddings=64, hidden_size=32,
                                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=24, num_local_experts=5, num_experts_per_tok=2),
           "deepseek-dense": tfcore.DeepseekV3Config(vocab_size=60, max_position_embeddings=64, hidden_size=48,
                                                     num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None,
                                                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                     v_head_dim=6, intermediate_size=40, attention_bias=True),
           "deepseek-moe": tfcore.DeepseekV3MoEConfig(vocab_size=60, max_position_embeddings=64, hidden_size=48,
                                                      num_hidden_layers=3, num_attention_heads=4, q_lora_rank=12,
                                                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                      v_head_dim=6, intermediate_size=40, n_routed_experts=8,
                                                      num_experts_per_tok=3, n_shared_experts=2,
                                                      moe_intermediate_size=10, n_group=2, topk_group=2,
                                                      first_k_dense_replace=1, tie_word_embeddings=True)}


def weights_match(config, dtype) -> bool:
    """The formulas' weight bytes and parameter count against the model built on the meta device."""
    model = _meta_model(config).to(dtype)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    return (cost.model_weight_bytes(config, dtype)["total"] == nbytes
            and cost.parameter_counts(config)["total"] == sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_equal_the_parameters_nbytes(name, dtype):
    assert weights_match(CONFIGS[name], dtype)


def test_active_parameters_leave_out_the_experts_not_chosen():
    for name in ("mixtral", "deepseek-moe"):
        config = CONFIGS[name]
        model = _meta_model(config)
        counts = cost.parameter_counts(config)
        experts = [b.experts for b in model.modules() if isinstance(b, tfcore.SparseMoeBlock)]
        one_expert = sum(p.numel() for p in experts[0][0].parameters())
        chosen = config.num_experts_per_tok
        idle = sum(len(e) - chosen for e in experts) * one_expert
        assert counts["active"] == counts["total"] - idle


def cache_problems(config, dtype) -> list[str]:
    """The formulas' cache bytes against a tfcore cache filled by a prompt and one decode step."""
    torch.manual_seed(0)
    model = (tfcore.GPT if isinstance(config, tfcore.GPTConfig) else tfcore.Llama)(config).eval().to(dtype)
    batch, cached = 3, 9
    ids = torch.randint(0, config.vocab_size, (batch, cached + 1))
    cache = model.new_cache()
    problems = []
    with torch.no_grad():
        model(ids[:, :cached], cache=cache)
        if cache.nbytes() != cost.kv_cache_bytes_per_token(config, dtype) * batch * cached:
            problems.append("bytes per token")
        before = cache.nbytes()
        model(ids[:, cached:], cache=cache)  # one decode step
    ops = cost.decoder_ops(config, batch, 1, cached, dtype)
    if sum(op["cache_write_bytes"] for op in ops) != cache.nbytes() - before:
        problems.append("written")
    if sum(op["cache_read_bytes"] for op in ops) != cache.nbytes():  # every key and value read once
        problems.append("read")
    return problems


# tfcore.Llama does not run in bfloat16 (its float32 rotary angles turn q and k to float32): float64 instead
@pytest.mark.parametrize("name, dtype", [(name, dtype) for name in ("gpt", "llama-gqa", "llama-mqa", "llama-mha-untied")
                                         for dtype in (torch.float32, torch.float64)] + [("gpt", torch.bfloat16)])
def test_cache_bytes_equal_a_filled_kv_cache(name, dtype):
    assert cache_problems(CONFIGS[name], dtype) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # tfcore's DeepseekV3 does not run in bfloat16
def test_latent_cache_bytes_equal_a_filled_latent_cache(dtype):
    config = CONFIGS["deepseek-dense"]
    torch.manual_seed(0)
    model = tfcore.DeepseekV3(config).eval().to(dtype)
    batch, cached = 2, 7
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (batch, cached)), cache=cache)
        assert cache.nbytes() == cost.kv_cache_bytes_per_token(config, dtype) * batch * cached
        from tfcore.mla import latent_cache_bytes_per_token
        assert cost.kv_cache_bytes_per_token(config, dtype) == latent_cache_bytes_per_token(config, dtype.itemsize)
        expanded = 0
        for layer, layer_cache in zip(model.layers, cache.layers):  # the keys and values MLA expands
            keys, values = layer.self_attn.expand(layer_cache.latent, layer_cache.k_rope)
            expanded += keys.numel() * keys.element_size() + values.numel() * values.element_size()
    assert cost.kv_cache_bytes_per_token(config, dtype, expanded=True) * batch * cached == expanded


def test_weight_bytes_of_a_pass_read_every_matrix_once_whatever_the_batch():
    """A pass reads every weight once (the embedding table only in the rows it looks up); the same
    bytes at batch 1 and 64 but the looked-up rows. int8: the int8 weights, their scales and biases."""
    from tfcore.quantization import quantize_linears

    for config in (small_gpt_config(), small_gpt_config(tie_word_embeddings=True), llama_config()):
        model = _meta_model(config)
        table = (model.token_embeddings if isinstance(model, tfcore.GPT) else model.embed_tokens).weight
        positions = getattr(model, "position_embeddings", None)
        every = sum(p.numel() * 4 for p in model.parameters())  # float32, a tied table once
        untied_table = 0 if config.tie_word_embeddings else table.numel() * 4  # a tied one is the output layer
        for batch, new in ((1, 1), (64, 1), (4, 7)):
            looked_up = (batch * new + (new if positions is not None else 0)) * config.hidden_size * 4
            expected = every - untied_table - (positions.weight.numel() * 4 if positions is not None else 0) + looked_up
            assert sum(op["weight_bytes"] for op in cost.decoder_ops(config, batch, new)) == expected
    torch.manual_seed(0)
    config = small_gpt_config()
    quantized = quantize_linears(tfcore.GPT(config).eval())  # the output layer stays float32
    blocks = sum(t.numel() * t.element_size() for t in list(quantized.blocks.parameters()) + list(quantized.blocks.buffers()))
    block_ops = [op for op in cost.decoder_ops(config, 2, 3, weights="int8") if op["name"] not in ("embedding", "final_norm", "lm_head")]
    assert sum(op["weight_bytes"] for op in block_ops) == blocks


# --- published models -----------------------------------------------------------------------------

def test_transformers_default_configs_hold_the_published_sizes():
    import transformers

    gpt2, llama, mixtral, deepseek = (transformers.GPT2Config(), transformers.LlamaConfig(),
                                      transformers.MixtralConfig(), transformers.DeepseekV3Config())
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size, gpt2.n_positions) == (768, 12, 12, 50257, 1024)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size) == (4096, 32, 32, 32, 11008, 32000)
    assert (mixtral.hidden_size, mixtral.num_hidden_layers, mixtral.num_attention_heads, mixtral.num_key_value_heads,
            mixtral.intermediate_size, mixtral.num_local_experts, mixtral.num_experts_per_tok,
            mixtral.vocab_size) == (4096, 32, 32, 8, 14336, 8, 2, 32000)
    assert (deepseek.hidden_size, deepseek.num_hidden_layers, deepseek.num_attention_heads, deepseek.q_lora_rank,
            deepseek.kv_lora_rank, deepseek.qk_nope_head_dim, deepseek.qk_rope_head_dim, deepseek.v_head_dim,
            deepseek.intermediate_size, deepseek.moe_intermediate_size, deepseek.n_routed_experts,
            deepseek.num_experts_per_tok, deepseek.n_shared_experts, deepseek.first_k_dense_replace,
            deepseek.vocab_size) == (7168, 61, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8, 1, 3, 129280)


def test_published_totals():
    configs = cost.published_configs()
    counts = {name: cost.parameter_counts(config) for name, config in configs.items()}
    assert counts["GPT-2 small"]["total"] == 124_439_808
    assert counts["Llama 2 7B"]["total"] == 6_738_415_616
    for name in ("GPT-2 small", "Llama 2 7B", "Llama 3 8B", "Mixtral 8x7B"):  # and the models built from them
        assert counts[name]["total"] == sum(p.numel() for p in _meta_model(configs[name]).parameters())
    within = {"Mixtral 8x7B": (0.001, 0.003), "DeepSeek-V3": (0.001, 0.02)}  # (total, active) relative gaps
    for name, (total_gap, active_gap) in within.items():
        published = cost.PUBLISHED[name]
        assert abs(counts[name]["total"] / published["total"] - 1) < total_gap, counts[name]
        assert abs(counts[name]["active"] / published["active"] - 1) < active_gap, counts[name]
    assert abs(counts["Llama 3 8B"]["total"] / 8.03e9 - 1) < 0.001  # 8,028,033,024 with the paper's 128,000 tokens


def test_cache_bytes_per_token_of_published_models():
    configs = cost.published_configs()
    per_token = {name: cost.kv_cache_bytes_per_token(config) for name, config in configs.items()}  # bfloat16
    assert per_token["Llama 2 7B"] == 2 * 32 * 4096 * 2 == 4 * per_token["Llama 3 8B"]  # 8 of 32 heads kept
    assert per_token["DeepSeek-V3"] == 61 * (512 + 64) * 2
    assert cost.kv_cache_bytes_per_token(configs["DeepSeek-V3"], expanded=True) == 61 * 128 * (192 + 128) * 2


# --- roofline ----------------------------------------------------------------------------------------

def test_roofline_takes_the_larger_term():
    memory = cost.roofline(1e9, 1e9, 1e11, 1e10)  # 0.01 s of compute, 0.1 s of traffic
    assert memory["binds"] == "memory" and memory["bound_seconds"] == memory["memory_seconds"] == 0.1
    compute = cost.roofline(1e12, 1e9, 1e11, 1e10)
    assert compute["binds"] == "compute" and compute["bound_seconds"] == 10.0
    assert compute["ridge_intensity"] == 10.0 and compute["intensity"] == 1000.0
    ops = cost.decoder_ops(GPT_20M, 1, 1, 511)
    per_op = cost.roofline_of_ops(ops, 1e11, 1e10)
    whole = cost.roofline(sum(o["flops"] for o in ops), sum(o["bytes"] for o in ops), 1e11, 1e10)
    assert per_op["bound_seconds"] >= whole["bound_seconds"]  # a sum of maxima is at least the max of sums
    assert per_op["bound_seconds"] == pytest.approx(per_op["compute_bound_seconds"] + per_op["memory_bound_seconds"])


def test_decoding_one_token_is_memory_bound_and_a_long_prompt_compute_bound():
    """On a machine whose ridge is 10 FLOPs per byte: one token reads every weight for 2 FLOPs
    per 4-byte parameter (intensity about 0.5), 512 tokens reuse them (intensity about 30)."""
    step, prompt = cost.forward_cost(GPT_20M, 1, 1, 511), cost.forward_cost(GPT_20M, 1, 512, 0)
    assert 0.4 < step["intensity"] < 0.6 and prompt["intensity"] > 20
    assert cost.roofline(step["flops"], step["bytes"], 1e11, 1e10)["binds"] == "memory"
    assert cost.roofline(prompt["flops"], prompt["bytes"], 1e11, 1e10)["binds"] == "compute"


# --- planted bugs: each check above catches a plausible mistake ---------------------------------------

def test_planted_gqa_formula_that_ignores_the_key_value_heads_is_caught(monkeypatch):
    config = llama_config()
    monkeypatch.setattr(cost, "_attention_sizes", lambda c: (c.num_attention_heads, c.num_attention_heads, c.head_dim))
    assert cost.counted_flops(config, 2, 5, 0) != cost.matmul_flops_by_op(config, 2, 5, 0)


def test_planted_attention_formula_off_by_two_is_caught(monkeypatch):
    real_op = cost._op
    monkeypatch.setattr(cost, "_op", lambda name, kind, flops=0, *rest: real_op(
        name, kind, flops // 2 if name == "weighted_sum" else flops, *rest))  # only one of the two products
    assert cost.counted_flops(GPT_20M, 1, 16, 0) != cost.matmul_flops_by_op(GPT_20M, 1, 16, 0)


def test_planted_missing_operation_in_the_model_is_caught(monkeypatch):
    config = llama_config()
    monkeypatch.setattr(tfcore.SwiGLU, "forward", lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x))))
    assert cost.counted_flops(config, 1, 4, 0) != cost.matmul_flops_by_op(config, 1, 4, 0)


def test_planted_walk_that_skips_the_output_layer_is_caught(monkeypatch):
    config = small_gpt_config()
    real_forward = cost._Walk.forward

    def no_head(self, x, cached):
        head = self.model.lm_head
        self.model.lm_head = torch.nn.Identity()
        try:
            return real_forward(self, x, cached)
        finally:
            self.model.lm_head = head
    torch.manual_seed(0)
    model = tfcore.GPT(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 5))
    real = cost.count_matmul_flops(lambda: model(ids), model)
    monkeypatch.setattr(cost._Walk, "forward", no_head)
    assert real != cost.counted_flops(config, 2, 5, 0)


def test_planted_cache_formula_with_every_head_is_caught(monkeypatch):
    config = CONFIGS["llama-gqa"]
    monkeypatch.setattr(cost, "_attention_sizes", lambda c: (c.num_attention_heads, c.num_attention_heads, c.head_dim))
    assert cache_problems(config, torch.float32) != []


def test_planted_bytes_per_number_is_caught(monkeypatch):
    monkeypatch.setattr(cost, "_dtype_bytes", lambda dtype, name="dtype": 4)  # every number stored as float32
    assert cache_problems(CONFIGS["gpt"], torch.bfloat16) != []
    assert not weights_match(CONFIGS["gpt"], torch.bfloat16)


def test_planted_parameter_count_without_a_latent_norm_is_caught(monkeypatch):
    config = CONFIGS["deepseek-dense"]
    real = cost._deepseek_counts

    def without_norm(c):  # forgets kv_a_layernorm's weight in every layer
        counts = real(c)
        return counts | dict(total=counts["total"] - c.num_hidden_layers * c.kv_lora_rank)
    monkeypatch.setattr(cost, "_deepseek_counts", without_norm)
    assert not weights_match(config, torch.float32)


# --- bad input -----------------------------------------------------------------------------------------

def test_bad_input_is_refused_with_the_fix():
    import transformers

    with pytest.raises(ValueError, match="batch"):
        cost.decoder_ops(GPT_20M, batch=0)
    with pytest.raises(ValueError, match="cached"):
        cost.forward_cost(GPT_20M, cached=-1)
    with pytest.raises(ValueError, match="new"):
        cost.counted_flops(GPT_20M, new=1.5)
    with pytest.raises(TypeError, match="weights='int8'"):
        cost.decoder_ops(GPT_20M, dtype=torch.int8)
    with pytest.raises(ValueError, match="'int8'"):
        cost.decoder_ops(GPT_20M, weights="int4")
    with pytest.raises(ValueError, match="use_cache=True"):
        cost.decoder_ops(GPT_20M, cached=3, use_cache=False)
    with pytest.raises(TypeError, match="from_transformers_config"):
        cost.decoder_ops(transformers.GPT2Config())
    with pytest.raises(TypeError, match="GPT2Config"):
        cost.from_transformers_config(transformers.BertConfig())
    with pytest.raises(ValueError, match="DeepSeek"):
        cost.kv_cache_bytes_per_token(GPT_20M, expanded=True)
    with pytest.raises(TypeError, match="torch.dtype"):
        cost.kv_cache_bytes_per_token(GPT_20M, dtype="bfloat16")
    with pytest.raises(ValueError, match="peak_flops_per_second"):
        cost.roofline(1, 1, 0, 1)
    with pytest.raises(ValueError, match="bytes_moved"):
        cost.arithmetic_intensity(1, 0)
    with pytest.raises(TypeError, match="DeepseekV3Config"):
        cost.decoder_ops(CONFIGS["deepseek-dense"])
    assert cost.forward_cost(GPT_20M, 1, 1, 0)["flops"] > 0  # the good call still runs


# --- Qwen3.5's hybrid (chapter 20) ------------------------------------------------------------------

QWEN35_TOY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
                  tie_word_embeddings=True, linear_conv_kernel_dim=3, linear_key_head_dim=12,
                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                               "linear_attention", "linear_attention"])


@pytest.mark.parametrize("config", [tfcore.Qwen35Config(**QWEN35_TOY), tfcore.Qwen35Config()], ids=["toy", "9B"])
def test_qwen35_parameter_count_is_the_models(config):
    with torch.device("meta"):
        model = tfcore.Qwen35(config)
    assert cost.parameter_counts(config)["total"] == sum(p.numel() for p in model.parameters())


def test_a_qwen35_count_without_the_attention_output_gate_is_caught(monkeypatch):
    """The check above can fail: a count that forgets the gate half of q_proj (H x head_dim x hidden)."""
    config = tfcore.Qwen35Config(**QWEN35_TOY)
    right = cost._qwen35_counts
    gate = config.num_attention_heads * config.head_dim * (config.hidden_size + 1)  # weights and biases
    monkeypatch.setattr(cost, "_qwen35_counts", lambda c: {k: v - 2 * gate for k, v in right(c).items()})
    with torch.device("meta"):
        model = tfcore.Qwen35(config)
    assert cost.parameter_counts(config)["total"] != sum(p.numel() for p in model.parameters())


def test_qwen35_cache_bytes_per_token_are_the_attention_layers_keys_and_values():
    config = tfcore.Qwen35Config(**QWEN35_TOY)
    torch.manual_seed(0)
    model = tfcore.Qwen35(config).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 101, (2, 23)), cache=cache)
    per_token = cost.kv_cache_bytes_per_token(config, torch.float32)
    assert cache.kv_nbytes() == 2 * 23 * per_token  # 2 rows of 23 positions
    assert per_token == 2 * 2 * 2 * 16 * 4  # 2 attention layers x (key, value) x H_kv x head_dim x float32
    with pytest.raises(ValueError, match="expanded=True"):
        cost.kv_cache_bytes_per_token(config, expanded=True)


def test_published_qwen35_is_transformers_default_text_config():
    import dataclasses

    import transformers

    ours, theirs = cost.published_configs()["Qwen3.5 (9B)"], transformers.Qwen3_5TextConfig()
    rope = theirs.rope_parameters
    for field in dataclasses.fields(ours):
        expected = rope[field.name] if field.name in ("rope_theta", "partial_rotary_factor") else getattr(theirs, field.name)
        assert getattr(ours, field.name) == expected, field.name
    total = cost.parameter_counts(ours)["total"]
    assert abs(total / cost.PUBLISHED["Qwen3.5 (9B)"]["total"] - 1) < 0.01, total  # 8,953,803,264
    assert cost.kv_cache_bytes_per_token(ours) == 8 * 2 * 4 * 256 * 2  # 8 attention layers, bfloat16
