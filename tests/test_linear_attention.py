"""tfcore.linear_attention: linear attention, the delta rule and the gated delta rule.

Checked: each pair of forms equal (parallel/recurrent, recurrent/chunked), equal to transformers 5.23's qwen3_next
pure-PyTorch paths, a sequence in two pieces with the carried state equal to one pass, and every equality caught
failing on a planted bug. Gaps are relative: max |a - b| / max |b|.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F
import transformers.models.qwen3_next.modeling_qwen3_next as qn
from transformers.utils import logging as hf_logging

from tfcore import linear_attention as la

hf_logging.set_verbosity_error()  # the "falling back to its reference PyTorch implementation" notice

DTYPES = (torch.float32, torch.float64)
# float64: rounding only (the largest gap measured below: 3.1e-15). float32: the largest measured was 1.3e-6 relative
# (ours chunked against ours recurrent, strong decays), so 2e-5 leaves a margin of 15, while every planted bug
# moves a result by more than 0.6 (measured).
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
BUG = 1e-3  # a planted bug must move the result by at least this much (relative)
B, H, D_K, D_V = 2, 3, 5, 4  # d_k != d_v so that a transposed state cannot pass


def gap(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def draw(T, dtype, seed=0):
    """Random q, k, v, g (log decays <= 0), beta in (0, 1), an initial state and a query scale."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": r(B, H, T, D_K), "k": r(B, H, T, D_K), "v": r(B, H, T, D_V),
          "g": -F.softplus(r(B, H, T)), "beta": torch.sigmoid(r(B, H, T)), "state": r(B, H, D_K, D_V)}
    x = {name: t.to(dtype) for name, t in x.items()}
    x["scale"] = 0.3 + torch.rand((), generator=gen).item()
    return x


def tr(x):
    """[B, H, T, ...] <-> [B, T, H, ...] (transformers' qwen3_next layout)."""
    return x.transpose(1, 2)


def in_float64(fn, old=None, new=None):
    """transformers' own function with its hard-coded float32 cast turned into float64 (its source is otherwise
    unchanged), so that the comparison can be made near 1e-10 (see test_library_paths_compute_in_float32); with
    ``old`` and ``new``, also that one line of its source replaced (a planted bug)."""
    source = inspect.getsource(inspect.unwrap(fn))
    assert source.count("torch.float32") == 1
    source = source.replace("torch.float32", "torch.float64")
    if old is not None:
        assert source.count(old) == 1
        source = source.replace(old, new)
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    namespace = dict(vars(qn))
    exec(source, namespace)  # noqa: S102
    return namespace[fn.__name__]


LIB = {torch.float32: (qn.torch_recurrent_gated_delta_rule, qn.torch_chunk_gated_delta_rule),
       torch.float64: (in_float64(qn.torch_recurrent_gated_delta_rule), in_float64(qn.torch_chunk_gated_delta_rule))}


def library(x, dtype, *, chunk_size=None, initial_state=True, l2=False):
    recurrent, chunked = LIB[dtype]
    args = {"g": tr(x["g"]), "beta": tr(x["beta"]), "initial_state": x["state"] if initial_state else None,
                "output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    if chunk_size is None:
        o, s = recurrent(tr(x["q"]), tr(x["k"]), tr(x["v"]), **args)
    else:
        o, s = chunked(tr(x["q"]), tr(x["k"]), tr(x["v"]), chunk_size=chunk_size, **args)
    return tr(o), s


def ours(x, *, chunk_size=None, initial_state=True, l2=False, scale=None):
    kw = {"initial_state": x["state"] if initial_state else None, "use_qk_l2norm": l2, "scale": scale}
    if chunk_size is None:
        return la.gated_delta_rule_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return la.gated_delta_rule_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk_size, **kw)


def both_gaps(a, b):
    return max(gap(a[0], b[0]), gap(a[1], b[1]))


# ----------------------------------------------------------------------------- linear attention

def linear_gap(dtype, normalize=True, feature_map=la.elu_feature_map, T=9):
    x = draw(T, dtype)
    state = (x["state"], F.elu(x["state"][..., 0]) + 1)  # z must stay positive for the normaliser
    kw = {"normalize": normalize, "feature_map": feature_map, "initial_state": state}
    par = la.linear_attention_parallel(x["q"], x["k"], x["v"], **kw)
    rec = la.linear_attention_recurrent(x["q"], x["k"], x["v"], **kw)
    return max(gap(par[0], rec[0]), gap(par[1][0], rec[1][0]), gap(par[1][1], rec[1][1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature_map", [la.elu_feature_map, F.softplus])
def test_linear_attention_parallel_equals_recurrent(dtype, normalize, feature_map):
    assert linear_gap(dtype, normalize, feature_map) < TOL[dtype]


def test_planted_missing_causal_mask_is_caught(monkeypatch):
    monkeypatch.setattr(la, "_causal", lambda scores: scores)
    assert linear_gap(torch.float64) > BUG


def test_state_size_does_not_grow_with_length():
    for T in (1, 7, 40):
        x = draw(T, torch.float64)
        _, (S, z) = la.linear_attention_recurrent(x["q"], x["k"], x["v"])
        assert S.shape == (B, H, D_K, D_V) and z.shape == (B, H, D_K)
        assert ours(x, chunk_size=4)[1].shape == (B, H, D_K, D_V)


# ----------------------------------------------------------------------------- the gated delta rule: two forms

CHUNKS = [(13, 4), (16, 4), (3, 8), (1, 4), (12, 1), (17, 16)]  # T % C != 0, T % C == 0, T < C, T = 1, C = 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2", [False, True])
def test_gated_delta_rule_chunked_equals_recurrent(dtype, l2):
    for T, C in CHUNKS:
        x = draw(T, dtype, seed=T)
        for initial_state in (False, True):
            a = ours(x, initial_state=initial_state, l2=l2, scale=x["scale"])
            b = ours(x, chunk_size=C, initial_state=initial_state, l2=l2, scale=x["scale"])
            assert both_gaps(b, a) < TOL[dtype], (T, C, initial_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strong_decays_over_a_long_chunk(dtype):
    """Log decays g down to -32 a step (10 times the usual draw), over a chunk of 64 and a short one: equal, finite."""
    x = draw(70, dtype, seed=3)
    x["g"] = 10 * x["g"]
    a, b = ours(x, l2=True), ours(x, chunk_size=64, l2=True)
    assert torch.isfinite(b[0]).all() and both_gaps(b, a) < TOL[dtype]
    assert both_gaps(a, library(x, dtype, l2=True)) < TOL[dtype]


def test_planted_gate_after_the_write_is_caught(monkeypatch):
    def gate_after_write(q_t, k_t, v_t, g_t, beta_t, S):  # S = alpha (S + beta k^T (v - k S))
        error = v_t - (k_t.unsqueeze(-2) @ S).squeeze(-2)
        S = g_t.exp()[..., None, None] * (S + k_t.unsqueeze(-1) * (beta_t.unsqueeze(-1) * error).unsqueeze(-2))
        return (q_t.unsqueeze(-2) @ S).squeeze(-2), S

    x = draw(13, torch.float64)
    monkeypatch.setattr(la, "gated_delta_step", gate_after_write)
    assert both_gaps(ours(x), ours(x, chunk_size=4)) > BUG
    assert both_gaps(ours(x), library(x, torch.float64)) > BUG


def test_planted_carry_dropped_between_chunks_is_caught(monkeypatch):
    chunk = la._gated_delta_chunk
    monkeypatch.setattr(la, "_gated_delta_chunk", lambda q, k, v, g, b, S: chunk(q, k, v, g, b, torch.zeros_like(S)))
    x = draw(13, torch.float64)
    assert both_gaps(ours(x, chunk_size=4, initial_state=False), ours(x, initial_state=False)) > BUG


CHUNKED = la.gated_delta_rule_chunked


def padded_chunked(q, k, v, g, beta, *, chunk_size=64, **kw):
    """A plausible port bug: pad T up to a multiple of chunk_size, zeros everywhere but the decay, which repeats
    its last value, so that the padded positions decay the state; the output is cut back to T."""
    T = q.shape[2]
    pad = -T % chunk_size
    zeros = [F.pad(t, (0, 0, 0, pad)) for t in (q, k, v)]
    g = F.pad(g, (0, pad), mode="replicate")
    o, S = CHUNKED(*zeros, g, F.pad(beta, (0, pad)), chunk_size=chunk_size, **kw)
    return o[:, :, :T], S


def test_planted_padding_that_updates_the_state_is_caught(monkeypatch):
    monkeypatch.setattr(la, "gated_delta_rule_chunked", padded_chunked)
    x = draw(13, torch.float64)
    out, state = ours(x, chunk_size=4)
    ref_out, ref_state = ours(x)
    assert gap(out, ref_out) < TOL[torch.float64]  # the outputs at real positions are still right ...
    assert gap(state, ref_state) > BUG             # ... but the state a cache would continue from is not
    assert gap(state, library(x, torch.float64, chunk_size=4)[1]) > BUG


# ----------------------------------------------------------------------------- against transformers' qwen3_next

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2", [False, True])
def test_gated_delta_rule_equals_transformers(dtype, l2):
    for T, C in CHUNKS:
        x = draw(T, dtype, seed=100 + T)
        for initial_state in (False, True):
            kw = {"initial_state": initial_state, "l2": l2}
            ref = library(x, dtype, **kw)
            assert both_gaps(ours(x, **kw), ref) < TOL[dtype], (T, initial_state)
            assert both_gaps(ours(x, chunk_size=C, **kw), library(x, dtype, chunk_size=C, **kw)) < TOL[dtype]


def test_transformers_chunked_path_lets_no_padding_update_the_state():
    """A proposed fix for transformers #46190 (PR #46873, closed unmerged) blamed the padding of the last chunk for
    cached decoding's drift. In 5.23 the padded positions have beta = 0, k = 0 and g = 0: its chunked final state
    equals its recurrent one."""
    for T, C in [(13, 4), (3, 8), (17, 16), (5, 64)]:
        x = draw(T, torch.float64, seed=T)
        assert both_gaps(library(x, torch.float64, chunk_size=C), library(x, torch.float64)) < 1e-10


def test_planted_padding_in_the_library_is_caught(monkeypatch):
    """The check above can fail: the library's chunked path with its padded decays set to -1 instead of 0."""
    line = "beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))"
    mutant = in_float64(qn.torch_chunk_gated_delta_rule, line,
                        "beta, decay = F.pad(beta, (0, pad_size)), F.pad(decay, (0, pad_size), value=-1.0)")
    monkeypatch.setitem(LIB, torch.float64, (LIB[torch.float64][0], mutant))
    x = draw(13, torch.float64, seed=13)
    out, state = library(x, torch.float64, chunk_size=4)
    ref_out, ref_state = library(x, torch.float64)
    assert gap(out, ref_out) < 1e-10 and gap(state, ref_state) > BUG


def test_l2norm_equals_transformers():
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    assert torch.equal(la.l2norm(x), qn.l2norm(x))


def test_library_paths_compute_in_float32():
    """Why the float64 comparison uses in_float64: given float64 inputs, the library returns a float32 state."""
    x = draw(5, torch.float64)
    for fn in (qn.torch_recurrent_gated_delta_rule, qn.torch_chunk_gated_delta_rule):
        o, s = fn(tr(x["q"]), tr(x["k"]), tr(x["v"]), g=tr(x["g"]), beta=tr(x["beta"]), output_final_state=True)
        assert o.dtype == torch.float64 and s.dtype == torch.float32


# ----------------------------------------------------------------------------- continuing from a carried state

def split(x, t):
    first = {n: (v[:, :, :t] if n not in ("state", "scale") else v) for n, v in x.items()}
    second = {n: (v[:, :, t:] if n not in ("state", "scale") else v) for n, v in x.items()}
    return first, second


def continuation_gap(dtype, first_chunk, second_chunk, T=11, t=5):
    """One pass over T positions against t positions, then T - t from the carried state."""
    x = draw(T, dtype, seed=7)
    whole = ours(x, l2=True, scale=x["scale"])
    a, b = split(x, t)
    o1, s1 = ours(a, chunk_size=first_chunk, l2=True, scale=x["scale"])
    b["state"] = s1
    o2, s2 = ours(b, chunk_size=second_chunk, l2=True, scale=x["scale"])
    return both_gaps((torch.cat([o1, o2], dim=2), s2), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pieces_with_the_carried_state_equal_one_pass(dtype):
    for first_chunk, second_chunk in [(None, None), (4, 4), (3, None), (None, 2)]:  # None: the recurrent form
        assert continuation_gap(dtype, first_chunk, second_chunk) < TOL[dtype]
    x = draw(11, dtype, seed=8)
    whole = la.linear_attention_parallel(x["q"], x["k"], x["v"])
    a, b = split(x, 4)
    o1, s1 = la.linear_attention_parallel(a["q"], a["k"], a["v"])
    o2, s2 = la.linear_attention_recurrent(b["q"], b["k"], b["v"], initial_state=s1)
    assert gap(torch.cat([o1, o2], dim=2), whole[0]) < TOL[dtype]
    assert max(gap(s2[0], whole[1][0]), gap(s2[1], whole[1][1])) < TOL[dtype]


def test_planted_padding_breaks_continuation(monkeypatch):
    monkeypatch.setattr(la, "gated_delta_rule_chunked", padded_chunked)
    assert continuation_gap(torch.float64, 4, 4) > BUG


# ----------------------------------------------------------------------------- the delta rule

def delta_gap(dtype):
    x = draw(9, dtype)
    kw = {"initial_state": x["state"], "scale": x["scale"], "use_qk_l2norm": True}
    plain = la.delta_rule_recurrent(x["q"], x["k"], x["v"], x["beta"], **kw)
    gated = la.gated_delta_rule_recurrent(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), x["beta"], **kw)
    return both_gaps(plain, gated)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_is_the_gated_rule_with_g_zero(dtype):
    assert delta_gap(dtype) < TOL[dtype]


def test_planted_delta_rule_without_the_correction_is_caught(monkeypatch):
    def write_without_correction(q_t, k_t, v_t, beta_t, S):  # linear attention's write: S + beta k^T v
        S = S + k_t.unsqueeze(-1) * (beta_t.unsqueeze(-1) * v_t).unsqueeze(-2)
        return (q_t.unsqueeze(-2) @ S).squeeze(-2), S

    monkeypatch.setattr(la, "delta_step", write_without_correction)
    assert delta_gap(torch.float64) > BUG


# ----------------------------------------------------------------------------- bad input

def bad_calls():
    x = draw(6, torch.float32)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    rec, chunked = la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked
    return [
        (lambda: rec(q, k[:, :, :5], v, g, beta), ValueError, "q and k must have the same shape"),
        (lambda: rec(q, k, v[:, :, :5], g, beta), ValueError, "v must be"),
        (lambda: rec(q[0], k, v, g, beta), ValueError, "must be 4-D"),
        (lambda: rec(q, k, v, tr(g), beta), ValueError, "g must have shape"),
        (lambda: chunked(q, k, v, g, beta[..., :5]), ValueError, "beta must have shape"),
        (lambda: rec(q, k, v, g, beta.double()), TypeError, "beta must have the dtype"),
        (lambda: rec(q, k, v, -g, beta), ValueError, "g is a log decay"),
        (lambda: chunked(q, k, v, g, beta, chunk_size=0), ValueError, "chunk_size must be a whole number"),
        (lambda: chunked(q, k, v, g, beta, chunk_size=2.5), ValueError, "chunk_size must be a whole number"),
        (lambda: rec(q, k, v, g, beta, initial_state=x["state"].transpose(-1, -2)), ValueError,
         "initial_state must have shape"),
        (lambda: rec(q.long(), k, v, g, beta), TypeError, "floating-point"),
        (lambda: la.delta_rule_recurrent(q, k, v, g[..., None]), ValueError, "beta must have shape"),
        (lambda: la.linear_attention_parallel(q, k.double(), v), TypeError, "share one dtype"),
        (lambda: la.linear_attention_recurrent(q, k, v, initial_state=x["state"]), TypeError, "tuple"),
        (lambda: la.linear_attention_parallel(q, k, v, initial_state=(x["state"], x["state"])), ValueError,
         "initial_state\\[1\\] \\(z\\) must have shape"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_input_is_refused_clearly(case):
    call, error, message = bad_calls()[case]
    with pytest.raises(error, match=message):
        call()
