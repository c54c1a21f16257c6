"""The book's claims hold on another trajectory and on another checkpoint.

Another CPU, an Apple laptop or a Colab GPU changes the last digits of anything computed by a
long float chain, and after a training run those differences grow. Such values are never
compared digit for digit: every claim the prose makes about them is a ``tfcore.check`` with a
margin. Here every chapter runs again under another seed (``TFCORE_SEED=1`` shifts every seed:
initial weights, batch order, random inputs), which moves each trajectory much further than
another CPU does, comparing no output (``notebook_checks.execute``, nbval's lax mode in this
process): a claim that fails stops the run. Chapters 1-8 also run against a small random BERT of other sizes saved to a folder, as a
reader's ``TFCORE_CHECKPOINT`` would name one: nothing may assume the embedded model's sizes.

Each of the two runs is shown to fail on a planted problem: a claim whose margin is too tight,
and a width typed in.
"""

from __future__ import annotations

import contextlib
import io
import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from notebook_checks import ROOT, execute

NOTEBOOKS = sorted(ROOT.glob("notebooks/*.ipynb"))
ENCODER_CHAPTERS = [p for p in NOTEBOOKS if int(p.name[:2]) <= 8]


# --- another seed -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_keeps_its_claims_under_another_seed(path):
    error = execute(path, env={"TFCORE_SEED": "1"})
    assert error is None, error[-8000:]


def _notebook(path, *sources):
    cells = [new_markdown_cell("# A planted chapter")] + [new_code_cell(s) for s in sources]
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.write(nb, path)
    return path


TRAINING = """
import torch, tfcore
device = tfcore.setup(seed=0)
model = torch.nn.Linear(4, 1)
x = torch.linspace(-1, 1, 32).reshape(8, 4)
y = x.sum(dim=1, keepdim=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
loss = loss.item()
"""


def test_a_claim_with_too_tight_a_margin_fails_under_another_seed(tmp_path):
    namespace = {}
    exec(TRAINING, namespace)  # the value this run of seed 0 gives
    seed_0 = namespace["loss"]
    honest = f'tfcore.check("the loss falls below 0.5", loss < 0.5, measured=loss)'
    tight = f'tfcore.check("the loss is {seed_0!r}", abs(loss - {seed_0!r}) < 1e-7, measured=loss)'
    path = _notebook(tmp_path / "planted.ipynb", TRAINING, honest, tight)
    assert execute(path) is None  # seed 0: both claims hold
    failed = execute(path, env={"TFCORE_SEED": "1"})
    # the run stops at the tight claim: the honest one, before it, held
    assert failed is not None and f"ClaimError: ✗ the loss is {seed_0!r}" in failed, failed
    assert "the loss falls below 0.5" not in failed, failed


# --- another checkpoint --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def other_bert(tmp_path_factory):
    """A small random BERT, of other sizes than the embedded one, with the embedded tokenizer.

    3 layers, 4 heads of width 24 (hidden 96), feed-forward 192, 128 positions: every number
    differs from all-MiniLM-L6-v2 (6, 12, 32, 384, 1536, 512) and from bert-base-uncased.
    """
    import torch
    from transformers import BertConfig, BertModel

    import tfcore

    folder = tmp_path_factory.mktemp("other_bert")
    tokenizer = tfcore.load_tokenizer()
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=96, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=192, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = json.loads((folder / "config.json").read_text())
    assert (loaded["hidden_size"], loaded["num_hidden_layers"], loaded["num_attention_heads"]) == (96, 3, 4)
    return folder


@pytest.mark.parametrize("path", ENCODER_CHAPTERS, ids=lambda p: p.name)
def test_chapter_runs_on_another_bert_checkpoint(path, other_bert):
    error = execute(path, env={"TFCORE_CHECKPOINT": str(other_bert)})
    assert error is None, error[-8000:]


HARD_CODED = """
import torch, tfcore
device = tfcore.setup(seed=0)
encoder = tfcore.TransformerEncoder.from_pretrained()
ids = tfcore.load_tokenizer()("time flies like an arrow", return_tensors="pt").input_ids
"""


def _printed(*sources) -> str:
    """What the cells print, run one after the other in this process (an exec of their source)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec("\n".join(sources), {})
    return out.getvalue()


def test_a_hard_coded_width_fails_on_another_checkpoint(tmp_path, other_bert, monkeypatch):
    """A width typed in (384, the embedded model's) fails on the other checkpoint, in a kernel, as
    the run of chapters 1-8 on it would show. The controls run in this process, an exec of the same
    cells' source with the same TFCORE_CHECKPOINT (a kernel costs about 6 s of CPU time to start and
    import transformers' BERT): on the embedded checkpoint both versions run, and the version that
    takes the width from the config runs on the other checkpoint too, so the failure comes from the
    typed-in width alone."""
    from_config = "print(torch.nn.Linear(encoder.config.hidden_size, 6)(encoder(ids)[:, 0]).shape)"
    typed_in = "print(torch.nn.Linear(384, 6)(encoder(ids)[:, 0]).shape)"
    monkeypatch.delenv("TFCORE_CHECKPOINT", raising=False)
    for cell in (from_config, typed_in):  # the embedded checkpoint: both run
        assert _printed(HARD_CODED, cell) == "torch.Size([1, 6])\n", cell
    monkeypatch.setenv("TFCORE_CHECKPOINT", str(other_bert))
    assert _printed(HARD_CODED, from_config) == "torch.Size([1, 6])\n"
    monkeypatch.delenv("TFCORE_CHECKPOINT")
    bad = _notebook(tmp_path / "typed_in.ipynb", HARD_CODED, typed_in)
    failed = execute(bad, env={"TFCORE_CHECKPOINT": str(other_bert)})
    assert failed is not None and "mat1 and mat2 shapes cannot be multiplied" in failed, failed
