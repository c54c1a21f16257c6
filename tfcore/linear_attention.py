"""Linear attention, the delta rule and the gated delta rule (Gated DeltaNet): attention with a fixed-size state
(chapter 20).

Shapes: ``B`` batch, ``H`` heads, ``T`` positions, ``d_k`` width of a query/key, ``d_v`` width of a value.
Every function here takes ``q, k`` as ``[B, H, T, d_k]`` and ``v`` as ``[B, H, T, d_v]`` (tfcore's layout;
transformers' qwen3_next functions take ``[B, T, H, d]``: convert with ``x.transpose(1, 2)``), and per-position
scalars (``beta``, ``g``) as ``[B, H, T]``. The state is ``[B, H, d_k, d_v]``, the same layout as transformers'
``recurrent_state``: a query reads it as ``q @ S`` and a key writes ``k^T v`` into it. Its size does not depend on T.

Every function returns ``(output, final_state)``; passing ``final_state`` as ``initial_state`` continues the
sequence, so processing it in two pieces equals processing it at once (tests/test_linear_attention.py).

- Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax(q k^T) is replaced by
  phi(q) phi(k)^T, so causal attention becomes a running sum S_t = S_{t-1} + phi(k_t)^T v_t with the normaliser
  z_t = z_{t-1} + phi(k_t), and o_t = phi(q_t) S_t / (phi(q_t) . z_t).
- The delta rule (Schlag et al. 2021; Yang et al. 2024, DeltaNet): the write is a correction of what the state
  already returns for the key, S_t = S_{t-1} + beta_t k_t^T (v_t - k_t S_{t-1}).
- The gated delta rule (Yang et al. 2025, Gated DeltaNet), in the convention of transformers 5.23's qwen3_next
  (``torch_recurrent_gated_delta_rule``): first decay, then correct,
  S_t = alpha_t S_{t-1} + beta_t k_t^T (v_t - alpha_t k_t S_{t-1}), with alpha_t = exp(g_t), and o_t = q_t S_t.
  With ``use_qk_l2norm=True`` q and k are L2-normalised first; q is then always multiplied by ``scale``
  (default d_k ** -0.5), as the library does.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive everywhere, so the normaliser is never zero."""
    return F.elu(x) + 1


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis: the formula and eps of transformers' qwen3_next ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- input checks

def _check_qkv(q, k, v):
    """Return (B, H, T, d_k, d_v), or a clear TypeError/ValueError."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, d], got shape {tuple(t.shape)}; for one head add "
                             f"the axis with {name}.unsqueeze(1), and transformers' [B, T, H, d] needs .transpose(1, 2)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must hold floating-point numbers, got {t.dtype}; convert it, e.g. {name}.float()")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, H, T, d_k], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, H, T, d_v] with the B, H, T of k {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    B, H, T, d_k = k.shape
    return B, H, T, d_k, v.shape[-1]


def _check_per_position(name, t, B, H, T, dtype):
    """``beta`` or ``g``: one number per (batch, head, position)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, H, T], got {type(t).__name__}")
    if tuple(t.shape) != (B, H, T):
        raise ValueError(f"{name} must have shape [B, H, T] = {(B, H, T)} (one number per head and position), "
                         f"got {tuple(t.shape)}; transformers' [B, T, H] needs .transpose(1, 2)")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have the dtype of q, k, v ({dtype}), got {t.dtype}; cast it with .to({dtype})")


def _check_state(name, s, shape, dtype):
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(s).__name__}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(s.shape)}; pass the final_state that this "
                         f"module returned for the same B, H, d_k, d_v")
    if s.dtype != dtype:
        raise TypeError(f"{name} must have the dtype of q, k, v ({dtype}), got {s.dtype}; cast it with .to({dtype})")


def _check_log_decay(g):
    if (g > 0).any():
        raise ValueError("g is a log decay and must be <= 0 everywhere (alpha = exp(g) in (0, 1]); "
                         "Qwen3-Next computes it as -exp(A_log) * softplus(a + dt_bias)")


def _prepare_qk(q, k, d_k, scale, use_qk_l2norm):
    """transformers' order (qwen3_next): L2-normalise q and k if asked, then always multiply q by the scale."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (d_k ** -0.5 if scale is None else scale), k


# ----------------------------------------------------------------------------- linear attention

def _causal(scores: torch.Tensor) -> torch.Tensor:
    """Zero the entries j > i of [..., T, T] scores: position i sees keys 0..i only."""
    T = scores.shape[-1]
    return scores * torch.ones(T, T, dtype=scores.dtype, device=scores.device).tril()


def _linear_state(state, B, H, d_k, d_v, like):
    if state is None:
        return like.new_zeros(B, H, d_k, d_v), like.new_zeros(B, H, d_k)
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError("initial_state must be the tuple (S [B, H, d_k, d_v], z [B, H, d_k]) that linear attention "
                        f"returned, got {type(state).__name__}")
    _check_state("initial_state[0] (S)", state[0], (B, H, d_k, d_v), like.dtype)
    _check_state("initial_state[1] (z)", state[1], (B, H, d_k), like.dtype)
    return state


def linear_attention_parallel(q, k, v, *, feature_map=elu_feature_map, normalize=True, initial_state=None):
    """Causal linear attention in its parallel form: (causal(phi(q) phi(k)^T) v) / row sums.

    q, k: [B, H, T, d_k]; v: [B, H, T, d_v]; initial_state: None or (S [B, H, d_k, d_v], z [B, H, d_k]).
    With ``normalize=True`` (Katharopoulos et al.) o_i = sum_{j<=i} (phi_i . phi_j) v_j / sum_{j<=i} phi_i . phi_j,
    which needs a feature map whose dot products are positive (elu + 1 is); with ``normalize=False`` the
    division is skipped. Costs O(T^2) time and memory, as softmax attention does.
    Returns (output [B, H, T, d_v], (S, z)): the state after position T-1, as the recurrent form's.
    """
    B, H, _, d_k, d_v = _check_qkv(q, k, v)
    S0, z0 = _linear_state(initial_state, B, H, d_k, d_v, v)
    fq, fk = feature_map(q), feature_map(k)
    scores = _causal(fq @ fk.transpose(-1, -2))                     # [B, H, T, T]
    out = scores @ v + fq @ S0                                      # [B, H, T, d_v]
    if normalize:
        out = out / (scores.sum(-1) + (fq @ z0.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
    return out, (S0 + fk.transpose(-1, -2) @ v, z0 + fk.sum(dim=-2))


def linear_attention_recurrent(q, k, v, *, feature_map=elu_feature_map, normalize=True, initial_state=None):
    """Causal linear attention as a recurrence over positions, with a state whose size does not depend on T.

    S_t = S_{t-1} + phi(k_t)^T v_t  [B, H, d_k, d_v];  z_t = z_{t-1} + phi(k_t)  [B, H, d_k];
    o_t = phi(q_t) S_t / (phi(q_t) . z_t)   (or phi(q_t) S_t with ``normalize=False``).
    Shapes and preconditions as ``linear_attention_parallel``; returns (output [B, H, T, d_v], (S_T, z_T)).
    """
    B, H, T, d_k, d_v = _check_qkv(q, k, v)
    S, z = _linear_state(initial_state, B, H, d_k, d_v, v)
    fq, fk = feature_map(q), feature_map(k)
    out = []
    for t in range(T):
        S = S + fk[:, :, t, :, None] * v[:, :, t, None, :]           # write phi(k_t)^T v_t
        z = z + fk[:, :, t]
        o = (fq[:, :, t, None, :] @ S).squeeze(-2)                  # read phi(q_t) S_t: [B, H, d_v]
        if normalize:
            o = o / (fq[:, :, t] * z).sum(-1, keepdim=True)
        out.append(o)
    return torch.stack(out, dim=2) if out else v.new_zeros(B, H, 0, d_v), (S, z)


# ----------------------------------------------------------------------------- the delta rule

def _delta_state(initial_state, B, H, d_k, d_v, like):
    if initial_state is None:
        return like.new_zeros(B, H, d_k, d_v)
    _check_state("initial_state", initial_state, (B, H, d_k, d_v), like.dtype)
    return initial_state


def delta_step(q_t, k_t, v_t, beta_t, S):
    """One position of the delta rule on prepared q, k: correct the state's answer for k_t, then read.

    q_t, k_t: [B, H, d_k]; v_t: [B, H, d_v]; beta_t: [B, H]; S: [B, H, d_k, d_v]. Returns (o_t [B, H, d_v], S_t).
    """
    error = v_t - (k_t.unsqueeze(-2) @ S).squeeze(-2)                 # what k_t should return minus what it returns
    S = S + k_t.unsqueeze(-1) * (beta_t.unsqueeze(-1) * error).unsqueeze(-2)
    return (q_t.unsqueeze(-2) @ S).squeeze(-2), S


def delta_rule_recurrent(q, k, v, beta, *, initial_state=None, scale=None, use_qk_l2norm=False):
    """The delta rule (DeltaNet), one position at a time: no decay, the write corrects the state's own answer.

    q, k: [B, H, T, d_k]; v: [B, H, T, d_v]; beta: [B, H, T] (the write strength, usually in (0, 1));
    initial_state: None (zeros) or [B, H, d_k, d_v]. For each t:
      error = v_t - k_t S_{t-1}   (what the key should return minus what it returns now)
      S_t = S_{t-1} + beta_t k_t^T error;   o_t = q_t S_t.
    q and k are prepared as in ``gated_delta_rule_recurrent``. Returns (output [B, H, T, d_v], S_T).
    """
    B, H, T, d_k, d_v = _check_qkv(q, k, v)
    _check_per_position("beta", beta, B, H, T, v.dtype)
    S = _delta_state(initial_state, B, H, d_k, d_v, v)
    q, k = _prepare_qk(q, k, d_k, scale, use_qk_l2norm)
    out = []
    for t in range(T):
        o, S = delta_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], S)
        out.append(o)
    return torch.stack(out, dim=2) if out else v.new_zeros(B, H, 0, d_v), S


# ----------------------------------------------------------------------------- the gated delta rule

def _gated_inputs(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    """The gated rule's checks, its initial state and its prepared q, k: (q, k, S, (B, H, T, d_v))."""
    B, H, T, d_k, d_v = _check_qkv(q, k, v)
    _check_per_position("g", g, B, H, T, v.dtype)
    _check_per_position("beta", beta, B, H, T, v.dtype)
    _check_log_decay(g)
    S = _delta_state(initial_state, B, H, d_k, d_v, v)
    q, k = _prepare_qk(q, k, d_k, scale, use_qk_l2norm)
    return q, k, S, (B, H, T, d_v)


def gated_delta_step(q_t, k_t, v_t, g_t, beta_t, S):
    """One position of the gated delta rule on prepared q, k (scaled, normalised): decay, then correct, then read.

    q_t, k_t: [B, H, d_k]; v_t: [B, H, d_v]; g_t, beta_t: [B, H]; S: [B, H, d_k, d_v].
    Returns (o_t [B, H, d_v], S_t [B, H, d_k, d_v]).
    """
    S = g_t.exp()[..., None, None] * S                               # alpha_t S_{t-1}
    error = v_t - (k_t.unsqueeze(-2) @ S).squeeze(-2)                 # v_t - k_t (alpha_t S_{t-1})
    S = S + k_t.unsqueeze(-1) * (beta_t.unsqueeze(-1) * error).unsqueeze(-2)
    return (q_t.unsqueeze(-2) @ S).squeeze(-2), S


def gated_delta_rule_recurrent(q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=False):
    """The gated delta rule (Gated DeltaNet), one position at a time: O(T) steps, a [B, H, d_k, d_v] state.

    q, k: [B, H, T, d_k]; v: [B, H, T, d_v]; g: [B, H, T], the log decay (<= 0, alpha = exp(g));
    beta: [B, H, T]; initial_state: None (zeros) or [B, H, d_k, d_v].
    S_t = alpha_t S_{t-1} + beta_t k_t^T (v_t - alpha_t k_t S_{t-1}),  o_t = q_t S_t, where q and k are first
    L2-normalised if ``use_qk_l2norm`` and q is then multiplied by ``scale`` (None: d_k ** -0.5), as in
    transformers' ``torch_recurrent_gated_delta_rule``. Unlike it, this computes in the inputs' dtype
    (it casts to float32). Returns (output [B, H, T, d_v], S_T [B, H, d_k, d_v]).
    """
    q, k, S, (B, H, T, d_v) = _gated_inputs(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    out = []
    for t in range(T):
        o, S = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], S)
        out.append(o)
    return torch.stack(out, dim=2) if out else v.new_zeros(B, H, 0, d_v), S


def _gated_delta_chunk(q, k, v, g, beta, S):
    """One chunk of L positions at once, given the state S [B, H, d_k, d_v] before it.

    q, k: [B, H, L, d_k] (prepared); v: [B, H, L, d_v]; g, beta: [B, H, L]. Returns (out [B, H, L, d_v], S_L).
    With gamma_i = g_1 + ... + g_i (the log decay from the chunk's start through i), unrolling the recurrence gives
      S_i = e^{gamma_i} S + sum_{j<=i} e^{gamma_i - gamma_j} k_j^T u_j,  u_i = beta_i (v_i - alpha_i k_i S_{i-1}),
    so the writes u solve the unit lower-triangular system (the UT transform of the WY representation)
      u_i + beta_i sum_{j<i} e^{gamma_i - gamma_j} (k_i . k_j) u_j = beta_i (v_i - e^{gamma_i} k_i S),
    and o_i = q_i S_i follows with matrix products.
    """
    L = q.shape[2]
    gamma = g.cumsum(dim=-1)                                        # [B, H, L]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = e^{gamma_i - gamma_j} for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    system = torch.eye(L, dtype=q.dtype, device=q.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * decay.tril(-1)
    rhs = beta[..., None] * (v - gamma.exp()[..., None] * (k @ S))     # [B, H, L, d_v]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = gamma.exp()[..., None] * (q @ S) + ((q @ k.transpose(-1, -2)) * decay) @ u
    to_end = (gamma[..., -1:] - gamma).exp()[..., None]               # e^{gamma_L - gamma_j}: [B, H, L, 1]
    S = gamma[..., -1:].exp()[..., None] * S + (to_end * k).transpose(-1, -2) @ u
    return out, S


def gated_delta_rule_chunked(q, k, v, g, beta, *, chunk_size=64, initial_state=None, scale=None,
                             use_qk_l2norm=False):
    """The gated delta rule in chunks of ``chunk_size`` positions: matrix products within a chunk, the state
    carried from one chunk to the next. Equal to ``gated_delta_rule_recurrent`` (same arguments, same returns).

    chunk_size: a whole number >= 1. When T is not a multiple of it, the last chunk is simply shorter: nothing
    is padded, so no padded position can decay or write the state (a bug a chunked path can have; transformers 5.23
    pads with k = 0, beta = 0 and g = 0, which is harmless too).
    """
    try:
        ok = not isinstance(chunk_size, bool) and operator.index(chunk_size) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"chunk_size must be a whole number >= 1, got {chunk_size!r}")
    q, k, S, (B, H, T, d_v) = _gated_inputs(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    out = []
    for s in range(0, T, chunk_size):
        c = slice(s, min(s + chunk_size, T))
        o, S = _gated_delta_chunk(q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c], S)
        out.append(o)
    return torch.cat(out, dim=2) if out else v.new_zeros(B, H, 0, d_v), S
