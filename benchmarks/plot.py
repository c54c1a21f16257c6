"""The plot of a run, ``results.png``: four panels, ``attention``, ``memory``, ``layers`` with
``additive``, and ``encoder_parts``.

No chapter reads it; it is a picture of the committed run for the reader of ``benchmarks/``.
"""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ((left, right), (low_left, low_right)) = plt.subplots(2, 2, figsize=(12, 9))
    threads = results["machine"]["torch_threads"]
    for name in dict.fromkeys(r["what"] for r in results["attention"]):
        points = [(r["length"], r["seconds"] * 1e3) for r in results["attention"] if r["what"] == name]
        left.loglog(*zip(*points), marker="o", label=name)
    left.set_xlabel("sequence length")
    left.set_ylabel("milliseconds (median)")
    left.set_title(f"Attention, batch 1, 12 heads x 64, {threads} threads")
    left.legend(fontsize=7)
    for name in dict.fromkeys(r["what"] for r in results["memory"]):
        points = [(r["length"], r["peak_bytes"] / 2**20) for r in results["memory"] if r["what"] == name and r["peak_bytes"]]
        if points:
            right.loglog(*zip(*points), marker="o", label=f"peak rise: {name}")
    weights = sorted({(r["length"], r["weights_bytes"] / 2**20) for r in results["memory"]})
    right.loglog(*zip(*weights), "k--", label="size of the weights, 12 x L x L floats")
    right.set_xlabel("sequence length")
    right.set_ylabel("MiB")
    right.set_title("Memory of one forward pass")
    right.legend(fontsize=7)
    for part, style in (("layers", "-"), ("additive", ":")):
        for name in dict.fromkeys(r["what"] for r in results[part]):
            points = [(r["length"], r["seconds"] * 1e3) for r in results[part] if r["what"] == name]
            width = results[part][0]["width"]
            low_left.loglog(*zip(*points), style, marker="o", label=f"{name}, {width} wide")
    low_left.set_xlabel("sequence length")
    low_left.set_ylabel("milliseconds (median)")
    low_left.set_title(f"One layer, batch 1, {threads} threads")
    low_left.legend(fontsize=7)
    for model, style in zip(dict.fromkeys(r["model"] for r in results["encoder_parts"]), ("-", "--")):
        rows = [r for r in results["encoder_parts"] if r["model"] == model]
        for color, name in enumerate(dict.fromkeys(r["what"] for r in rows)):
            points = [(r["length"], r["seconds"] * 1e3) for r in rows if r["what"] == name]
            low_right.loglog(*zip(*points), style, color=f"C{color}", marker="o",
                             label=f"{model} ({rows[0]['hidden']} wide): {name}")
    low_right.set_xlabel("sequence length")
    low_right.set_ylabel("milliseconds (median)")
    low_right.set_title("One encoder layer and its parts, batch 1")
    low_right.legend(fontsize=7)
    for ax in (left, right, low_left, low_right):  # the measured lengths as plain numbers
        ax.set_xticks(sorted({x for line in ax.get_lines() for x in line.get_xdata()}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=64)
