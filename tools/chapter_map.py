"""Draw the chapter map on the landing page: book/chapter_map.svg (committed).

    .venv/bin/python tools/chapter_map.py

Run it again when the table of contents changes; tests/test_book.py checks that every chapter
title in _toc.yml appears in the map.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

PARTS = [  # (part, colour, [(number, short title, what you build)]), read left to right, top row first
    ("Inputs", "#d9ead3", [(1, "From text to tensors", "tokens, batches, embeddings")]),
    ("Attention", "#cfe2f3", [(2, "Dot-product attention", "softmax(QKᵀ/√d) V"),
                              (3, "Masking", "causal and padding masks"),
                              (4, "Multi-head attention", "heads, fused, bertviz")]),
    ("The encoder", "#fce5cd", [(5, "Feed-forward, layer norm", "residuals, pre-LN, post-LN"),
                                (6, "Positions, the encoder", "learned and sinusoidal"),
                                (7, "Our encoder is BERT", "same numbers as BERT"),
                                (8, "A classification head", "pretrained beats baselines")]),
    ("The decoder", "#ead1dc", [(9, "The decoder", "cross-attention, causality"),
                                (10, "Training and inference", "greedy and beam search"),
                                (11, "Number words", "BLEU, chrF, label smoothing")]),
    ("Family and cost", "#d9d2e9", [(12, "The family tree", "three branches, 2017 to 2026"),
                                    (13, "What attention costs", "costs and what they buy")]),
    ("The modern decoder", "#fff2cc", [(14, "A GPT from our parts", "equal to GPT-2, sampling"),
                                       (15, "The KV cache", "same tokens, speed, memory"),
                                       (16, "The Llama block", "RMSNorm, RoPE, SwiGLU, GQA")]),
    ("Attention at scale", "#d0e0e3", [(17, "FlashAttention", "tiles, online softmax"),
                                       (18, "Local and global", "windows, Gemma 3, sinks"),
                                       (19, "Latent attention", "DeepSeek-V3, absorption"),
                                       (20, "Linear attention", "Gated DeltaNet, Qwen3.5")]),
    ("Experts, fast decoding", "#f4cccc", [(21, "Mixture of experts", "Mixtral, DeepSeek, balancing"),
                                            (22, "Decoding faster", "speculative decoding, int8"),
                                            (23, "The cost of a token", "roofline, batched decoding")]),
    ("From text to assistant", "#e6f0d0", [(24, "Tokenizer from scratch", "byte-level BPE, as tokenizers"),
                                           (25, "From LM to assistant", "chat template, LoRA, DPO"),
                                           (26, "RL from a grader", "GRPO, verifiable rewards")]),
    ("Training at scale", "#e8dcc8", [(27, "Distributed training", "DDP, ZeRO, FSDP, as PyTorch's")]),
    ("Appendix", "#eeeeee", [(28, "The model in Keras", "checked equal, model.fit")]),
]
COLUMNS = 4  # parts per row: short rows keep the text legible at the book's column width
# The reading order inside a part: each chapter builds on the last (27 and 28 are parts of their own).
EDGES = [(n, n + 1) for n in range(1, 26)]


def main():
    plt.rcParams["svg.hashsalt"] = "chapter-map"  # stable ids, so the file only changes with the map
    width, height, step, gap = 3.95, 0.9, 1.08, 4.45
    tallest = [max(len(c) for _, _, c in PARTS[r:r + COLUMNS]) for r in range(0, len(PARTS), COLUMNS)]
    row_tops, top = [], 0.0
    for rows in tallest:
        row_tops.append(top)
        top -= 0.8 + rows * step + 0.4
    fig, ax = plt.subplots(figsize=(COLUMNS * gap - 0.4, -top))
    centres = {}
    for index, (part, colour, chapters) in enumerate(PARTS):
        x, y0 = (index % COLUMNS) * gap, row_tops[index // COLUMNS]
        ax.text(x + width / 2, y0 - 0.3, part, ha="center", va="center", fontsize=16, weight="bold")
        if index % COLUMNS:  # the reading order from part to part, along the row
            ax.annotate("", xy=(x - 0.05, y0 - 0.3), xytext=(x - gap + width + 0.05, y0 - 0.3),
                        arrowprops=dict(arrowstyle="-|>", color="0.4", lw=1.3))
        for row, (number, title, built) in enumerate(chapters):
            y = y0 - 0.8 - height / 2 - row * step
            ax.add_patch(FancyBboxPatch((x, y - height / 2), width, height, boxstyle="round,pad=0.04",
                                        fc=colour, ec="0.35", lw=1.2))
            ax.text(x + 0.1, y + 0.17, f"{number}. {title}", va="center", fontsize=13.5, weight="bold")
            ax.text(x + 0.1, y - 0.22, built, va="center", fontsize=13, color="0.2")
            centres[number] = (x, y)
    for a, b in EDGES:  # the reading order inside a part: straight down
        (xa, ya), (xb, yb) = centres[a], centres[b]
        if xa == xb:
            ax.annotate("", xy=(xb + width / 2, yb + height / 2 + 0.04), xytext=(xa + width / 2, ya - height / 2 - 0.04),
                        arrowprops=dict(arrowstyle="-|>", color="0.4", lw=1.1))
    ax.set_xlim(-0.1, (COLUMNS - 1) * gap + width + 0.1)
    ax.set_ylim(top, 0.1)
    ax.axis("off")
    fig.savefig(ROOT / "book" / "chapter_map.svg", bbox_inches="tight", metadata={"Date": None})
    return fig


if __name__ == "__main__":
    main()
