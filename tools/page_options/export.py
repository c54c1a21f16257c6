"""Export chapter 14's GPT (tfcore.load_book_gpt) to ONNX, float32 and float16, for onnxruntime-web; check
both against torch in float64 (issue 32). Needs the extras in <work>/pylib (README.md). Writes <work>/models/:
book_gpt.{fp32,fp16}.onnx, planted.{fp32,fp16}.onnx (one bias entry moved: every check must fail on them),
reference.json (prompts, torch float64 logits, 20 greedy tokens and tolerances, for the ONNX model and for the
page's own model, whose weights are rounded to 16 bits) and export.json (versions, errors, checks).

    OMP_NUM_THREADS=1 .venv/bin/python tools/page_options/export.py [--work /tmp/page_options]
"""
import argparse
import json
import sys
import warnings
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]


# tfcore's input checks stop torch.export. For the export only, each is replaced by what it returns on
# valid input (the page checks ids and length itself); the first helper found these three suffice:
PATCHES = {
    # `input_ids.min() < 0` depends on the data: torch.export cannot guard on it (GuardOnDataDependentSymNode)
    "tfcore.gpt.check_input_ids": lambda *a, **k: None,
    # operator.index() on the symbolic length L fixes L to the example's 8 ("specialized it to be a constant")
    "tfcore.attention._whole": lambda name, value, minimum: value,
    # _broadcast_shape puts sizes in a set, and a symbolic size is unhashable ("unhashable type: ... SymInt")
    "tfcore.attention._broadcast_mask": lambda mask, scores: (
        mask.unsqueeze(1) if scores.dim() == 4 and mask.dim() == 3 else mask).to(torch.bool),
}


def export(model, example, max_len, path, patched):
    with ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for target, replacement in PATCHES.items() if patched else ():
            stack.enter_context(mock.patch(target, replacement))
        torch.onnx.export(model, (example,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                          dynamic_shapes=({1: torch.export.Dim("L", min=1, max=max_len)},)).save(str(path))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/page_options", help="holds pylib/ (the extras); models/ is written")
    work = Path(parser.parse_args().work)
    if not (work / "pylib" / "onnxscript").is_dir():
        sys.exit(f"export.py: no extras in {work / 'pylib'}: install them first (README.md, step 1), or pass --work")
    sys.path.append(str(work / "pylib"))  # after the venv's own packages: its numpy, sympy, ... are used
    sys.path.insert(0, str(REPO))
    import onnx
    import onnxruntime as ort
    import onnxscript
    from onnxconverter_common import float16
    from tfcore import load_book_gpt
    from tfcore.browser import rounded_book_gpt

    out = work / "models"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, meta = load_book_gpt()
    V, T = meta["config"]["vocab_size"], meta["config"]["max_position_embeddings"]
    example = torch.randint(0, V, (1, 8))
    log = {"versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
                        "onnxruntime": ort.__version__}, "patched_out": list(PATCHES)}
    try:
        export(model.float().eval(), example, T, out / "unpatched.onnx", patched=False)
        log["unpatched_export"] = "worked"
    except Exception as exc:  # expected: record the innermost error's first line
        while exc.__cause__ is not None:
            exc = exc.__cause__
        log["unpatched_export"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    export(model.float().eval(), example, T, out / "exported.onnx", patched=True)
    m32 = onnx.load(str(out / "exported.onnx"))
    for node in m32.graph.node:  # drop the exporter's debug text (stack traces with local paths): ~120 KB
        del node.metadata_props[:]
    del m32.graph.value_info[:]
    m16 = float16.convert_float_to_float16(m32, keep_io_types=True)  # float16 weights and compute, io as before
    files = {}
    for name, m in (("fp32", m32), ("fp16", m16)):
        onnx.checker.check_model(m)
        onnx.save(m, str(out / f"book_gpt.{name}.onnx"))
        bias = next(i for i in m.graph.initializer if i.name == "blocks.0.attention.query.bias")
        arr = onnx.numpy_helper.to_array(bias).copy()
        arr[0] += {"fp32": 0.05, "fp16": 2.0}[name]  # fp16's tolerance is wider: 0.05 would pass it
        bias.CopyFrom(onnx.numpy_helper.from_array(arr, bias.name))
        onnx.save(m, str(out / f"planted.{name}.onnx"))
        files.update({name: out / f"book_gpt.{name}.onnx", f"planted_{name}": out / f"planted.{name}.onnx"})
    log["planted"] = "blocks.0.attention.query.bias[0] += 0.05 (fp32), += 2.0 (fp16)"

    # torch in float64 is the truth; torch in float32 (float16) gives the noise of a float32 (float16) forward
    nets = {"torch64": load_book_gpt()[0].double(), "torch32": load_book_gpt()[0].float(),
            "torch16": load_book_gpt()[0].half(), "page64": rounded_book_gpt(torch.float64),
            "page32": rounded_book_gpt(torch.float32)}
    compare = {"torch32": "torch64", "torch16": "torch64", "page32": "page64", **dict.fromkeys(files, "torch64")}
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    sessions = {k: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for k, p in files.items()}
    rng = np.random.default_rng(0)
    prompts = {**{f"L{L}": rng.integers(0, V, size=(1, L)) for L in (1, 2, 8, 33, 64)}, "same_L16": np.full((1, 16), 7)}
    worst, logits = dict.fromkeys(compare, 0.0), {}
    with torch.no_grad():
        for name, ids in prompts.items():
            got = {k: net.eval()(torch.from_numpy(ids))[0].double().numpy() for k, net in nets.items()}
            got.update({k: s.run(["logits"], {"input_ids": ids.astype(np.int64)})[0][0] for k, s in sessions.items()})
            logits[name] = got
            for key, truth in compare.items():
                worst[key] = max(worst[key], float(np.abs(got[key] - got[truth]).max()))
    # tolerances: 4 x the largest gap between torch at that precision and torch in float64, over the prompts
    tol = {"fp32": 4 * worst["torch32"], "fp16": 4 * worst["torch16"], "js": 4 * worst["page32"]}
    log["max_abs_vs_torch64"], log["tolerance"] = worst, tol
    log["checks"] = {k: worst[k] <= tol[k.split("_")[-1]] for k in files}

    ref = {"tolerance": tol, "prompts": {n: prompts[n][0].tolist() for n in ("L8", "L64")}}
    for key, truth in (("onnx", "torch64"), ("page", "page64")):
        ids = torch.from_numpy(prompts["L8"])
        with torch.no_grad():
            for _ in range(20):
                ids = torch.cat([ids, nets[truth](ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        ref[key] = {"greedy20": ids[0, 8:].tolist(),
                    **{n: np.round(logits[n][truth], 7).reshape(-1).tolist() for n in ("L8", "L64")}}
    (out / "reference.json").write_text(json.dumps(ref))
    log["sizes"] = {p.name: p.stat().st_size for p in files.values()}
    (out / "export.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(log, indent=1))
    if any(ok == k.startswith("planted") for k, ok in log["checks"].items()):
        sys.exit("export.py: a check did not behave (the real files must pass, the planted ones fail)")


if __name__ == "__main__":
    main()
