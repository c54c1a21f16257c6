"""A static-cache decoder for ``tfcore.GPT``: every decoding step has the same shapes (chapter 23).

``tfcore.generate`` runs the model's modules one step at a time: each step checks its input,
calls some 15 modules per layer and grows views of the cache. On a GPU, each of a step's few
hundred small kernels is launched by the CPU, and when the kernels are short the GPU waits for
the launches; a CUDA graph records the kernels once and launches them all with one call
(NVIDIA's "CUDA Graph" guide, docs.nvidia.com/dl-cuda-graph; PyTorch's notes, "CUDA Graphs",
docs.pytorch.org/docs/stable/notes/cuda.html). A recording replays fixed shapes and fixed
addresses, so the step needs three things, which ``StaticDecoder`` has:

- a cache of the final length, allocated once (``[B, heads, capacity, head_dim]`` per layer),
  written in place at the new positions (``index_copy_``);
- attention over all ``capacity`` slots, with a mask of the filled ones (``slot <= position``),
  instead of a cache that grows;
- positions held in a tensor, so that a replay reads the new position from memory instead of
  baking one number into the recording.

``cuda_graph_step`` records a step as a ``torch.cuda.CUDAGraph``; ``static_generate(...,
graph="compile")`` uses ``torch.compile(mode="reduce-overhead")``, which records CUDA graphs
itself. Neither has been run for this book (no GPU was at hand when it was written); the
recording's bookkeeping is tested on the CPU with a stand-in recorder.

The step is plain tensor code over weights prepared once: the query, key and value projections
of a layer fused into one ``[3 hidden, hidden]`` matrix (one matrix-vector product instead of
three), and no per-step checks. On the CPU it runs eagerly, and in float32, when PyTorch has
oneDNN, each weight is reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the pair that
``torch.compile``'s CPU back end emits for a bfloat16 or float16 linear layer,
``torch/_inductor/fx_passes/mkldnn_fusion.py``; for float32 on an MKL build it emits MKL's packed
pair, ``torch.ops.mkl._mkl_reorder_linear_weight`` and ``_mkl_linear``, not tried here). Why, measured (``benchmarks/decoding.py``,
rows ``"kernel"``, on the 2-core x86_64 machine of the committed run, each weight read from
memory): at one row, ``F.linear`` runs MKL's SGEMM, which read the 20M GPT's weights at 14-19
GB/s and no faster on two threads; the reordered weights at about 18-36 GB/s on one thread (the
larger the matrix, the faster) and 19-39 GB/s on two, at a larger fixed cost per call.

On the CPU, ``fixed_shape=False`` (its default there) reads only the filled slots: 256 tokens
of the 20M GPT after 16 took 3.9 ms a token against 4.2 ms with every slot masked (one thread,
thread CPU time, the two taking turns, busy machine). On CUDA the default is ``True``, which a
recording needs. Both give the same tokens as ``tfcore.generate`` (``tests/test_static_decoding.py``,
float32 and float64).

Scope: ``tfcore.GPT`` (GPT-2's wiring), greedy decoding, a batch of prompts of one length (for
prompts of different lengths, ``tfcore.generate(..., attention_mask=...)``). The decoder copies
the linear layers' weights when it is built (the norms and embeddings it shares): build a new
one after the weights change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT


def _onednn_packs(weight: torch.Tensor) -> bool:
    """True where the weight can be reordered for oneDNN: float32 on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """``x @ weight.T + bias`` with ``weight [out, in]`` prepared once for repeated products.

    On a CPU with oneDNN, in float32, the weight is reordered into oneDNN's blocked layout
    (an opaque tensor, ``weight.is_mkldnn``) and each call runs oneDNN's inner product; anywhere
    else it is kept as it is and each call runs ``F.linear``. Either way it holds a copy.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool | None = None):
        super().__init__()
        weight = weight.detach().contiguous()
        self.packed = _onednn_packs(weight) if pack is None else pack
        self.out_features = weight.shape[0]
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class _Block(nn.Module):
    """One pre-LN GPT block, rewired for decoding: fused QKV, and its own preallocated cache."""

    def __init__(self, block, batch: int, capacity: int, pack: bool | None):
        super().__init__()
        attention, feed_forward = block.attention, block.feed_forward
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.norm_1, self.norm_2 = block.layer_norm_1, block.layer_norm_2
        self.qkv = PackedLinear(torch.cat([attention.query.weight, attention.key.weight, attention.value.weight]),
                                torch.cat([attention.query.bias, attention.key.bias, attention.value.bias]), pack)
        self.output = PackedLinear(attention.output_linear.weight, attention.output_linear.bias, pack)
        self.up = PackedLinear(feed_forward.linear_1.weight, feed_forward.linear_1.bias, pack)
        self.activation = feed_forward.gelu
        self.down = PackedLinear(feed_forward.linear_2.weight, feed_forward.linear_2.bias, pack)
        weight = attention.query.weight
        # zeros, not empty: an unfilled slot is masked, and masking a finite score is exact
        shape = (batch, self.heads, capacity, self.head_dim)
        self.register_buffer("keys", torch.zeros(shape, dtype=weight.dtype, device=weight.device), persistent=False)
        self.register_buffer("values", torch.zeros(shape, dtype=weight.dtype, device=weight.device), persistent=False)

    def forward(self, x, positions, visible, mask):
        """``x [B, L, hidden]`` at ``positions [L]``; attends to the slots ``[:visible]`` under ``mask``."""
        batch, length, hidden = x.shape
        h = F.layer_norm(x, (hidden,), self.norm_1.weight, self.norm_1.bias, self.norm_1.eps)
        # [B, L, 3 x hidden] -> three [B, heads, L, head_dim]
        q, k, v = self.qkv(h).view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.keys.index_copy_(2, positions, k)  # in place, at the new positions: no new tensor
        self.values.index_copy_(2, positions, v)
        context = F.scaled_dot_product_attention(q, self.keys[:, :, :visible], self.values[:, :, :visible],
                                                 attn_mask=mask)
        x = x + self.output(context.transpose(1, 2).reshape(batch, length, hidden))
        h = F.layer_norm(x, (hidden,), self.norm_2.weight, self.norm_2.bias, self.norm_2.eps)
        return x + self.down(self.activation(self.up(h)))


class StaticDecoder(nn.Module):
    """``tfcore.GPT`` for decoding ``batch`` rows into a preallocated cache of ``capacity`` positions.

    ``forward(tokens [B, L], positions [L])`` -> logits ``[B, L, vocab]``: the tokens at
    ``positions`` (a long tensor, consecutive, continuing what the cache holds) are written into
    the cache and attend to every earlier position. ``L`` = the prompt's length for the first
    call, then 1 per step. With ``fixed_shape=True`` attention reads all ``capacity`` slots under
    a mask of the filled ones, so a step's shapes never change (a CUDA graph can record it);
    with ``False`` it reads the filled slots only (the position is read back to the host: no
    recording). Default: ``True`` on CUDA, ``False`` elsewhere. ``pack`` (default: where
    possible) reorders the weights for oneDNN on the CPU (see ``PackedLinear``).
    """

    def __init__(self, model: GPT, batch: int, capacity: int, fixed_shape: bool | None = None,
                 pack: bool | None = None):
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"StaticDecoder decodes a tfcore.GPT (GPT-2's wiring), got {type(model).__name__}; "
                            f"for another decoder use tfcore.generate")
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if capacity > model.max_positions:
            raise ValueError(f"capacity {capacity} exceeds the model's {model.max_positions} positions "
                             f"(max_position_embeddings): decode at most that many positions")
        weight = model.token_embeddings.weight
        self.capacity, self.batch = capacity, batch
        self.fixed_shape = weight.device.type == "cuda" if fixed_shape is None else fixed_shape
        self.token_embeddings, self.position_embeddings = model.token_embeddings, model.position_embeddings
        self.blocks = nn.ModuleList(_Block(block, batch, capacity, pack) for block in model.blocks)
        self.final_norm = model.final_layer_norm
        self.lm_head = PackedLinear(model.lm_head.weight, model.lm_head.bias, pack)
        self.register_buffer("slots", torch.arange(capacity, device=weight.device), persistent=False)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fixed_shape:  # every slot, masked: the same shapes at every step
            visible = self.capacity
            mask = self.slots <= positions[:, None]  # [L, capacity]: True = filled at or before the query
        else:  # the filled slots only; one new token may see all of them (no mask)
            visible = int(positions[-1]) + 1
            mask = None if tokens.shape[1] == 1 else self.slots[:visible] <= positions[:, None]
        x = self.token_embeddings(tokens) + self.position_embeddings(positions)
        for block in self.blocks:
            x = block(x, positions, visible, mask)
        x = F.layer_norm(x, x.shape[-1:], self.final_norm.weight, self.final_norm.bias, self.final_norm.eps)
        return self.lm_head(x)


def cuda_graph_step(decoder: StaticDecoder, record=None):
    """Record one decoding step of ``decoder`` (``fixed_shape=True``) as a CUDA graph; return
    ``step(tokens [B, 1], position [1]) -> logits [B, 1, vocab]``, which copies its inputs into the
    recording's own input tensors and replays it. The logits it returns are the recording's output
    tensor, overwritten by the next replay.

    The warm-up and the recording run real steps, which write position 0 of the cache: record
    before the prompt fills it. ``record(fn) -> (replay, output)`` (default ``record_cuda_graph``)
    is replaceable so that this bookkeeping can be tested on the CPU.
    """
    if not decoder.fixed_shape:
        raise ValueError("a CUDA graph records fixed shapes: build the StaticDecoder with fixed_shape=True")
    device = decoder.slots.device
    tokens = torch.zeros(decoder.batch, 1, dtype=torch.long, device=device)
    position = torch.zeros(1, dtype=torch.long, device=device)
    replay, logits = (record or record_cuda_graph)(lambda: decoder(tokens, position))

    def step(new_tokens: torch.Tensor, new_position: torch.Tensor) -> torch.Tensor:
        tokens.copy_(new_tokens)
        position.copy_(new_position)
        replay()
        return logits

    return step


def record_cuda_graph(fn, warmup: int = 3):
    """``fn()``'s kernels recorded as a ``torch.cuda.CUDAGraph``: returns ``(graph.replay, output)``.
    The warm-up runs on a side stream, as PyTorch's notes on CUDA graphs prescribe."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph.replay, output


@torch.no_grad()
def static_generate(model: GPT, input_ids: torch.Tensor, max_new_tokens: int, graph: str | None = None,
                    fixed_shape: bool | None = None, pack: bool | None = None) -> torch.Tensor:
    """Greedy decoding with a ``StaticDecoder``: returns ``[B, L + max_new_tokens]``, the same tokens
    as ``tfcore.generate(model, input_ids, max_new_tokens)``.

    ``graph``: None (eager steps), ``"cuda-graph"`` (each step a replay of ``cuda_graph_step``) or
    ``"compile"`` (the step compiled with ``torch.compile(mode="reduce-overhead")``, which records
    CUDA graphs itself). Both need CUDA and a fixed shape; neither has been run for this book.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0 \
            or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [B, L] tensor of token ids, got {shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if graph not in (None, "cuda-graph", "compile"):
        raise ValueError(f"graph must be None, 'cuda-graph' or 'compile', got {graph!r}")
    if graph is not None and input_ids.device.type != "cuda":
        raise ValueError(f"graph={graph!r} records CUDA graphs: move the model and input_ids to a GPU, "
                         f"or use graph=None on {input_ids.device.type}")
    if graph is not None and fixed_shape is False:
        raise ValueError(f"graph={graph!r} needs fixed shapes: leave fixed_shape at None or True")
    batch, prompt = input_ids.shape
    total = prompt + max_new_tokens
    if total > model.max_positions:
        raise ValueError(f"the prompt ({prompt} tokens) plus max_new_tokens ({max_new_tokens}) is {total} "
                         f"positions, but the model has {model.max_positions} (max_position_embeddings); "
                         f"ask for at most {model.max_positions - prompt} new tokens")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= model.config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {model.config.vocab_size}) (vocab_size)")
    was_training = model.training
    model.eval()
    # the last token is never fed back: total - 1 positions (at least 1)
    decoder = StaticDecoder(model, batch, max(total - 1, 1), True if graph else fixed_shape, pack)
    step = decoder
    if graph == "cuda-graph":
        step = cuda_graph_step(decoder)  # before the prompt: the recording writes position 0
    elif graph == "compile":
        step = torch.compile(decoder, mode="reduce-overhead", fullgraph=True)
    ids = decode(decoder, step, input_ids, max_new_tokens)
    model.train(was_training)
    return ids


@torch.no_grad()
def decode(decoder: StaticDecoder, step, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The greedy loop of ``static_generate``: the prompt through ``decoder`` (eagerly: its own
    shapes), then each new token through ``step`` (the decoder itself, or its recording). The new
    tokens are written into a preallocated ``[B, L + max_new_tokens]`` tensor on the device: the
    loop reads nothing back to the host (with ``fixed_shape``; without it, each step reads its
    position)."""
    batch, prompt = input_ids.shape
    total = prompt + max_new_tokens
    ids = torch.empty(batch, total, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :prompt] = input_ids
    positions = torch.arange(total, device=input_ids.device)
    if max_new_tokens:
        logits = decoder(input_ids, positions[:prompt])
        ids[:, prompt] = logits[:, -1].argmax(dim=-1)
    for i in range(prompt, total - 1):
        logits = step(ids[:, i:i + 1], positions[i:i + 1])
        ids[:, i + 1] = logits[:, -1].argmax(dim=-1)
    return ids
