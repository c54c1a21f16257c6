"""tfcore.check: a claim is printed with a check mark when it holds, and stops the notebook when not."""

import pytest
import torch

import tfcore
from tfcore import claims
from tfcore.claims import ClaimError


def test_a_claim_that_holds_is_printed_with_its_value(capsys):
    assert tfcore.check("held-out accuracy at least 0.98", 0.992 >= 0.98, measured=0.992) is None
    assert capsys.readouterr().out == "✓ held-out accuracy at least 0.98  [this run: 0.992]\n"


def test_measured_values_can_be_named_and_tensors_are_accepted(capsys):
    tfcore.check("beam is never less probable", torch.tensor(True), measured={"more": 1, "same": 299})
    assert capsys.readouterr().out == "✓ beam is never less probable  [this run: more 1, same 299]\n"


def test_a_claim_that_fails_raises_and_names_itself(capsys):
    with pytest.raises(ClaimError, match=r"✗ loss below 0.01  \[this run: 0.05\]: this claim of the book"):
        tfcore.check("loss below 0.01", 0.05 < 0.01, measured=0.05)
    assert capsys.readouterr().out == ""


def test_a_claim_needs_a_sentence():
    with pytest.raises(ValueError, match="needs the claim as a sentence"):
        tfcore.check("", True)


def test_claims_about_the_embedded_checkpoint_are_checked_only_there(monkeypatch, capsys, tmp_path):
    with pytest.raises(ClaimError):  # the embedded checkpoint: checked
        tfcore.check("the pretrained head reaches 0.90", False, embedded_only=True)
    monkeypatch.setenv("TFCORE_CHECKPOINT", str(tmp_path))
    tfcore.check("the pretrained head reaches 0.90", False, measured=0.4, embedded_only=True)
    out = capsys.readouterr().out
    assert out.startswith("– the pretrained head reaches 0.90  [this run: 0.4]  (a claim about")
    assert " ".join(out.split()).startswith("– the pretrained head reaches 0.90 [this run: 0.4] (a claim about "
                                            "the embedded checkpoint; not checked on")
    assert str(tmp_path) in out
    with pytest.raises(ClaimError):  # a claim about any checkpoint is still checked
        tfcore.check("shapes agree", False)


def test_the_embedded_checkpoint_is_recognised_by_name_and_by_path(monkeypatch):
    from tfcore.checkpoint import embedded_path

    assert tfcore.is_embedded() and tfcore.is_embedded("sentence-transformers/all-MiniLM-L6-v2")
    assert tfcore.is_embedded(str(embedded_path()))
    assert not tfcore.is_embedded("bert-base-uncased")
    monkeypatch.setenv("TFCORE_CHECKPOINT", "bert-base-uncased")
    assert not tfcore.is_embedded()


def test_nbval_masks_what_this_run_measured_and_nothing_else():
    import re
    from pathlib import Path

    rules = Path(__file__).with_name("sanitize.cfg").read_text()
    pattern = re.search(r"\[this-run\]\nregex: (.*)\n", rules).group(1)
    line = "✓ loss below 0.01  [this run: 0.0042]\nstep  250/1500  [this run: loss 0.053]\nshape [2, 5]\n"
    assert re.sub(pattern, "X", line) == "✓ loss below 0.01  X\nstep  250/1500  X\nshape [2, 5]\n"


def test_a_long_claim_wraps_to_the_code_column_and_keeps_its_value_whole(capsys):
    claim = ("the validation accuracy ends well above chance (1/6) and well below 1: between 0.35 "
             "and 0.85, on every seed tried")
    tfcore.check(claim, True, measured={"first": 2.972, "last": 0.347, "falls": 3})
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) > 1 and all(len(line) <= claims.WIDTH for line in lines), out
    assert lines[0].startswith("✓ the validation") and all(line.startswith("  ") for line in lines[1:])
    assert "[this run: first 2.972, last 0.347, falls 3]" in lines[-1]
    assert " ".join(line.strip() for line in lines).startswith("✓ " + claim)
    tfcore.check("short", True, measured=0.5)
    assert capsys.readouterr().out == "✓ short  [this run: 0.5]\n"
