"""What attention costs: time and memory of attention and of the encoder, measured in one process.

    .venv/bin/python benchmarks/run.py                 # full run (about a minute on 2 CPU cores)
    .venv/bin/python benchmarks/run.py --smoke         # seconds: tiny sizes, for the test suite
    .venv/bin/python benchmarks/run.py --out DIR       # where results.json and results.png go

Every timing is the median of several repeats after warm-up, with ``torch.no_grad()`` and a
fixed thread count. Memory is measured in a fresh subprocess per point: after a warm-up pass,
the peak resident memory is reset (Linux's /proc/self/clear_refs) and we record how far one more
pass raises it above the memory in use (VmHWM - VmRSS), on the CPU, or
``torch.cuda.max_memory_allocated`` on a GPU. Chapter 13 reads the committed results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent


class PerHeadAttention(nn.Module):
    """Chapter 4's teaching version: one AttentionHead module per head, concatenated."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        import tfcore

        self.heads = nn.ModuleList(tfcore.AttentionHead(hidden, hidden // heads) for _ in range(heads))
        self.output_linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.output_linear(torch.cat([head(x) for head in self.heads], dim=-1))


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_alone(lengths, repeats, device) -> list[dict]:
    """Batch 1, 12 heads of 64: the kernels on q, k, v, and whole multi-head modules on x."""
    import tfcore
    from transformers import BertConfig

    heads, d = 12, 64
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, length, d, device=device) for _ in range(3))
        x = torch.randn(1, length, heads * d, device=device)
        config = BertConfig(hidden_size=heads * d, num_attention_heads=heads, attention_probs_dropout_prob=0.0)
        fused = tfcore.MultiHeadAttention(config).to(device).eval()
        per_head = PerHeadAttention(heads * d, heads).to(device).eval()
        torch_mha = nn.MultiheadAttention(heads * d, heads, batch_first=True).to(device).eval()

        def sdpa_math():
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v)

        cases = {
            "tfcore, no weights": lambda: tfcore.scaled_dot_product_attention(q, k, v, need_weights=False),
            "tfcore, with weights": lambda: tfcore.scaled_dot_product_attention(q, k, v),
            "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
            "torch sdpa, math backend": sdpa_math,
            "module: per-head (chapter 4)": lambda: per_head(x),
            "module: tfcore fused": lambda: fused(x),
            "module: tfcore fused, with weights": lambda: fused(x, return_weights=True),
            "module: torch MultiheadAttention": lambda: torch_mha(x, x, x, need_weights=False),
        }
        for name, fn in cases.items():
            rows.append({"what": name, "length": length, "seconds": median_time(fn, repeats)})
    return rows


def encoder(shapes, repeats, device) -> list[dict]:
    """The pretrained encoder: tfcore against transformers' BertModel, eager and sdpa, same weights."""
    import tfcore
    from transformers import AutoModel

    from tfcore.checkpoint import resolve

    ours = tfcore.TransformerEncoder.from_pretrained().to(device)
    path, _ = resolve(None)
    theirs = {impl: AutoModel.from_pretrained(path, attn_implementation=impl, local_files_only=True).to(device).eval()
              for impl in ("eager", "sdpa")}
    rows = []
    for batch, length in shapes:
        torch.manual_seed(0)
        ids = torch.randint(1000, 30000, (batch, length), device=device)
        mask = torch.ones_like(ids)
        with torch.no_grad():  # same weights, same outputs
            difference = (ours(ids, mask) - theirs["sdpa"](input_ids=ids, attention_mask=mask).last_hidden_state).abs().max()
        cases = {"tfcore encoder": lambda: ours(ids, mask)}
        for impl, model in theirs.items():
            cases[f"BertModel ({impl})"] = lambda model=model: model(input_ids=ids, attention_mask=mask)
        for name, fn in cases.items():
            rows.append({"what": name, "batch": batch, "length": length, "seconds": median_time(fn, repeats),
                         "max_abs_difference_to_sdpa": float(difference)})
    return rows


def _status_bytes(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _memory_point(kind: str, length: int, device: str) -> dict:
    """One forward pass in this (fresh) process; the rise of its peak memory."""
    import tfcore

    tfcore.setup(seed=0)
    heads, d = 12, 64
    if kind == "encoder":
        model = tfcore.TransformerEncoder.from_pretrained().to(device)
        ids = torch.randint(1000, 30000, (1, length), device=device)
        run = lambda: model(ids)  # noqa: E731
    else:
        q, k, v = (torch.randn(1, heads, length, d, device=device) for _ in range(3))
        need = kind == "attention, with weights"
        run = lambda: tfcore.scaled_dot_product_attention(q, k, v, need_weights=need)  # noqa: E731
    with torch.no_grad():
        run()  # warm-up: allocator pools and one-time buffers
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            peak = torch.cuda.max_memory_allocated() - base
        else:  # Linux: reset the peak resident memory (VmHWM), then read how far one pass raises it
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_bytes("VmRSS")
            run()
            peak = _status_bytes("VmHWM") - base
    return {"what": kind, "length": length, "peak_bytes": max(int(peak), 0),
            "weights_bytes": heads * length * length * 4}


def memory(lengths, device) -> list[dict]:
    rows = []
    for kind in ("attention, with weights", "attention, no weights", "encoder"):
        for length in lengths:
            if kind == "encoder" and length > 512:
                continue  # BERT has 512 positions
            out = subprocess.run([sys.executable, __file__, "--memory-point", kind, str(length), device],
                                 capture_output=True, text=True, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def machine(threads: int) -> dict:
    import transformers

    return {"date": datetime.date.today().isoformat(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in dict.fromkeys(r["what"] for r in results["attention"]):
        points = [(r["length"], r["seconds"] * 1e3) for r in results["attention"] if r["what"] == name]
        left.loglog(*zip(*points), marker="o", label=name)
    left.set_xlabel("sequence length")
    left.set_ylabel("milliseconds (median)")
    left.set_title(f"Attention, batch 1, 12 heads x 64, {results['machine']['torch_threads']} threads")
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and repeats, for the tests")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for results.json and results.png")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-point", nargs=3, metavar=("KIND", "LENGTH", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_point:
        kind, length, device = args.memory_point
        print(json.dumps(_memory_point(kind, int(length), device)))
        return

    import tfcore

    tfcore.setup(seed=0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lengths = [16, 32] if args.smoke else [64, 128, 256, 512, 1024, 2048]
    repeats = 2 if args.smoke else 7
    shapes = [(1, 16)] if args.smoke else [(8, 128), (1, 512)]
    results = {"machine": machine(args.threads), "attention": [], "encoder": [], "memory": []}
    for device in devices:
        for key, rows in (("attention", attention_alone(lengths, repeats, device)),
                          ("encoder", encoder(shapes, repeats, device)),
                          ("memory", memory(lengths, device))):
            results[key] += [r | {"device": device} for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "results.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.png'}")


if __name__ == "__main__":
    main()
