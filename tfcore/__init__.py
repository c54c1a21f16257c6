"""tfcore: the final version of each piece that Transformer Anatomy builds, chapter by chapter.

Each module holds one idea. The notebooks write the code in front of the reader; this package
keeps the version later chapters import, and a test keeps the two in agreement.

- ``runtime``: ``setup`` (seeds, quiet libraries, device; ``$TFCORE_SEED`` shifts every seed through
  ``shifted``), and ``load_benchmark_results``, the committed benchmark run
- ``claims``: ``check``, the book's claims asserted under the code that proves them
- ``checkpoint``: the pretrained checkpoint, offline by default (chapter 1)
- ``attention``: scaled dot-product attention, masks, heads (chapters 2-4)
- ``layers``: feed-forward and the encoder layer, pre-LN or post-LN (chapter 5)
- ``encoder``: positions, embeddings and the encoder stack, loadable with BERT's weights (6-7)
- ``heads``: the sequence-classification head; ``training``: its training loop (chapter 8)
- ``decoder``: the decoder, the encoder-decoder, greedy and beam search (chapters 9-11)
- ``translation``: German number words into English, vocabularies, BLEU and chrF (chapter 11)
- ``gpt``: a decoder-only model wired as GPT-2, portable from transformers (chapter 14)
- ``generation``: greedy decoding and sampling (temperature, top-k, top-p) (chapters 14-15)
- ``cache``: the KV cache of incremental decoding (chapter 15)
- ``llama``: RMSNorm, rotary positions, SwiGLU, grouped-query attention, Llama (chapter 16)
- ``flash``: the online softmax and tiled attention with its recomputing backward, FlashAttention (chapter 17)
- ``sliding``: the sliding-window mask and the rolling KV cache of local layers (chapter 18)
- ``gemma``: Gemma 3's text model, local and global layers, QK-norm, portable from transformers (chapter 18)
- ``mla``: multi-head latent attention, its latent cache and absorbed form, a dense DeepSeek-V3 (chapter 19)
- ``linear_attention``: linear attention, the delta rule and the gated delta rule, recurrent and chunked (chapter 20)
- ``hybrid``: Qwen3.5's hybrid text model, Gated DeltaNet and gated attention layers, its cache (chapter 20)
- ``moe``: routers, gates and experts, Mixtral and DeepSeek-V3 with experts, load balancing (chapter 21)
- ``speculative``: speculative decoding, greedy and sampled, with a draft model (chapter 22)
- ``quantization``: per-channel symmetric int8 weights for linear layers (chapter 22)
- ``cost``: FLOPs and bytes of each operation of a decoder, arithmetic intensity, the roofline (chapter 23)
- ``bpe``: byte-level BPE from scratch, trained and applied as the ``tokenizers`` library does (chapter 24)
- ``instruct``: chapter 14's GPT as shipped, a chat template, an instruction set, the answer-only loss (chapter 25)
- ``lora``: low-rank adapters beside frozen linear layers, and merging them (chapter 25)
- ``dpo``: sequence log-probabilities and the DPO loss, with its implicit rewards (chapter 25)
- ``stats``: the Wilson interval and the exact McNemar test (chapters 8 and 25)
- ``distributed``: processes over gloo, the collectives, data parallelism, ZeRO-1 and fully sharded
  parameters, checked equal to PyTorch's DDP and FSDP, and tensor parallelism of the feed-forward layer
  (chapter 27; import ``tfcore.distributed``)
- ``browser``: chapter 14's GPT in a page of the book: its 16-bit weights and tokenizer tables, and the
  reference the page's browser test compares with (import ``tfcore.browser``)
- ``viz``: bertviz's neuron, head and model views (import ``tfcore.viz``)
- ``diagrams``: schematic figures of attention, heads and layers, drawn with matplotlib (import ``tfcore.diagrams``)
"""

from .attention import (AttentionHead, MultiHeadAttention, causal_mask, padding_mask,
                        scaled_dot_product_attention)
from .bpe import ByteLevelBPE, bytes_to_unicode
from .cache import KVCache, LayerCache
from .checkpoint import CheckpointError, is_embedded, load_config, load_pretrained, load_tokenizer
from .claims import ClaimError, check
from .cost import (arithmetic_intensity, counted_flops, decoder_ops, forward_cost, kaplan_flops,
                   kv_cache_bytes_per_token, model_weight_bytes, parameter_counts, published_configs, roofline)
from .decoder import (EncoderDecoder, TransformerDecoder, TransformerDecoderLayer, beam_search,
                      cross_attention_weights, greedy_decode, length_penalty, make_model, sequence_log_prob)
from .dpo import dpo_loss, kl_from_reference, reference_logprobs, sequence_logprobs
from .encoder import Embeddings, TransformerEncoder, sinusoidal_positions
from .flash import FlashAttentionFunction, flash_attention, flash_attention_backward, flash_attention_forward, online_softmax
from .gemma import Gemma, GemmaConfig, GemmaRMSNorm
from .generation import generate, next_token_probs
from .gpt import GPT, GPTConfig
from .heads import TransformerForSequenceClassification
from .hybrid import GatedAttention, GatedDeltaNet, HybridCache, Qwen35, Qwen35Config, state_bytes
from .instruct import add_chat_tokens, exact_match, load_book_gpt, masked_loss
from .layers import FeedForward, TransformerEncoderLayer
from .llama import (GroupedQueryAttention, Llama, LlamaConfig, RMSNorm, SwiGLU, apply_rotary, rotary_cos_sin,
                    rotary_frequencies, rotate_half)
from .lora import LoRALinear, add_lora, merge_lora
from .mla import (DeepseekV3, DeepseekV3Config, DeepseekV3DecoderLayer, LatentCache, LatentLayerCache,
                  MultiHeadLatentAttention, deinterleave)
from .moe import (DeepseekV3MoEConfig, DeepseekV3WithExperts, Experts, Mixtral, MixtralConfig, SparseMoeBlock,
                  load_balancing_loss, sigmoid_topk, softmax_topk, update_choice_bias)
from .quantization import Int8Linear, quantize_linears, quantize_per_channel
from .runtime import load_benchmark_results, setup, shifted
from .sliding import RingBuffer, RollingKVCache, position_mask, sliding_window_mask
from .speculative import load_decoding_model, speculative_generate, truncate_cache
from .stats import mcnemar_exact, wilson_interval
from .training import (accuracy, digit_reversal, label_smoothed_nll, load_book_prose, load_word_senses, lr_factor,
                       train_classifier, train_seq2seq)

__all__ = [
    "AttentionHead",
    "ByteLevelBPE",
    "CheckpointError",
    "ClaimError",
    "DeepseekV3",
    "DeepseekV3Config",
    "DeepseekV3DecoderLayer",
    "DeepseekV3MoEConfig",
    "DeepseekV3WithExperts",
    "Embeddings",
    "EncoderDecoder",
    "Experts",
    "FeedForward",
    "FlashAttentionFunction",
    "GPT",
    "GPTConfig",
    "GatedAttention",
    "GatedDeltaNet",
    "Gemma",
    "GemmaConfig",
    "GemmaRMSNorm",
    "GroupedQueryAttention",
    "HybridCache",
    "Int8Linear",
    "KVCache",
    "LatentCache",
    "LatentLayerCache",
    "LayerCache",
    "Llama",
    "LlamaConfig",
    "LoRALinear",
    "Mixtral",
    "MixtralConfig",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "Qwen35",
    "Qwen35Config",
    "RMSNorm",
    "RingBuffer",
    "RollingKVCache",
    "SparseMoeBlock",
    "SwiGLU",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "TransformerForSequenceClassification",
    "accuracy",
    "add_chat_tokens",
    "add_lora",
    "apply_rotary",
    "beam_search",
    "bytes_to_unicode",
    "causal_mask",
    "check",
    "cross_attention_weights",
    "deinterleave",
    "digit_reversal",
    "dpo_loss",
    "exact_match",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "generate",
    "greedy_decode",
    "is_embedded",
    "kl_from_reference",
    "label_smoothed_nll",
    "length_penalty",
    "load_balancing_loss",
    "load_benchmark_results",
    "load_book_gpt",
    "load_book_prose",
    "load_config",
    "load_decoding_model",
    "load_pretrained",
    "load_tokenizer",
    "load_word_senses",
    "lr_factor",
    "make_model",
    "masked_loss",
    "mcnemar_exact",
    "merge_lora",
    "next_token_probs",
    "online_softmax",
    "padding_mask",
    "position_mask",
    "quantize_linears",
    "quantize_per_channel",
    "reference_logprobs",
    "rotary_cos_sin",
    "rotary_frequencies",
    "rotate_half",
    "scaled_dot_product_attention",
    "sequence_log_prob",
    "sequence_logprobs",
    "setup",
    "shifted",
    "sigmoid_topk",
    "sinusoidal_positions",
    "sliding_window_mask",
    "softmax_topk",
    "speculative_generate",
    "state_bytes",
    "train_classifier",
    "train_seq2seq",
    "truncate_cache",
    "update_choice_bias",
    "wilson_interval",
    # tfcore.cost (chapter 23)
    "arithmetic_intensity",
    "counted_flops",
    "decoder_ops",
    "forward_cost",
    "kaplan_flops",
    "kv_cache_bytes_per_token",
    "model_weight_bytes",
    "parameter_counts",
    "published_configs",
    "roofline",
]
