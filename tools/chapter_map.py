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

PARTS = [  # (part, colour, [(number, short title, what you build)])
    ("Inputs", "#d9ead3", [(1, "From text to tensors", "tokens, batches, embeddings")]),
    ("Attention", "#cfe2f3", [(2, "Scaled dot-product attention", "softmax(QKᵀ/√d) V"),
                              (3, "Masking", "causal and padding masks"),
                              (4, "Multi-head attention", "heads, fused, bertviz")]),
    ("The encoder", "#fce5cd", [(5, "Feed-forward and layer norm", "residuals, pre-LN and post-LN"),
                                (6, "Positions and the full encoder", "learned and sinusoidal"),
                                (7, "Our encoder is BERT", "same numbers as transformers"),
                                (8, "A classification head, trained", "pretrained beats both baselines")]),
    ("The decoder", "#ead1dc", [(9, "The decoder", "cross-attention, causality"),
                                (10, "Training and inference", "greedy and beam search"),
                                (11, "Translating number words", "BLEU, label smoothing, length penalty")]),
    ("Family and cost", "#d9d2e9", [(12, "The Transformer family tree", "three branches, 2017 to 2026"),
                                    (13, "What attention costs", "costs measured, and what they buy")]),
    ("The modern decoder", "#fff2cc", [(14, "A GPT from our parts", "equal to GPT-2, BPE, sampling"),
                                       (15, "Generating fast: the KV cache", "exact, measured, its memory"),
                                       (16, "The Llama block", "RMSNorm, RoPE, SwiGLU, GQA")]),
    ("Appendix", "#eeeeee", [(20, "The same model in Keras", "proven equal, model.fit, the map")]),
]
EDGES = [(n, n + 1) for n in range(1, 16)]  # the reading order; each chapter builds on the last (20 is an appendix)


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "chapter-map"  # stable ids, so the file only changes with the map
    fig, ax = plt.subplots(figsize=(24.5, 5.2))
    width, height, centres = 3.55, 0.8, {}
    for column, (part, colour, chapters) in enumerate(PARTS):
        x = column * 4.0
        ax.text(x + width / 2, 4.45, part, ha="center", va="center", fontsize=13, weight="bold")
        for row, (number, title, built) in enumerate(chapters):
            y = 3.6 - row * 1.05
            ax.add_patch(FancyBboxPatch((x, y - height / 2), width, height, boxstyle="round,pad=0.04",
                                        fc=colour, ec="0.35", lw=1.2))
            ax.text(x + 0.12, y + 0.13, f"{number}. {title}", va="center", fontsize=9, weight="bold")
            ax.text(x + 0.12, y - 0.2, built, va="center", fontsize=8.5, color="0.25")
            centres[number] = (x, y)
    for a, b in EDGES:
        (xa, ya), (xb, yb) = centres[a], centres[b]
        if xa == xb:  # same part: straight down
            start, end = (xa + width / 2, ya - height / 2 - 0.04), (xb + width / 2, yb + height / 2 + 0.04)
        else:
            start, end = (xa + width + 0.04, ya), (xb - 0.04, yb)
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color="0.4", lw=1.1,
                                                              connectionstyle="arc3,rad=0.0"))
    ax.set_xlim(-0.2, (len(PARTS) - 1) * 4.0 + width + 0.2)
    ax.set_ylim(0, 4.8)
    ax.axis("off")
    fig.savefig(ROOT / "book" / "chapter_map.svg", bbox_inches="tight", metadata={"Date": None})


if __name__ == "__main__":
    main()
