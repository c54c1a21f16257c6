"""tfcore.setup: seeds, silence, device."""

import logging
import random
import sys

import huggingface_hub.utils
import numpy as np
import pytest
import torch
import transformers

import tfcore


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_setup_seeds_random_numpy_and_torch():
    tfcore.setup(seed=0)
    first = _draws()
    tfcore.setup(seed=0)
    assert _draws() == first
    tfcore.setup(seed=1)
    other = _draws()
    assert all(a != b for a, b in zip(other, first))


def test_setup_returns_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tfcore.setup() == torch.device("cpu")


def test_setup_returns_cuda_when_a_gpu_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = tfcore.setup()
    assert isinstance(device, torch.device) and device.type == "cuda"


def test_setup_silences_hugging_face(monkeypatch):
    # Pretend the environment variable is unset (the test run sets it), so enabling is honoured.
    monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", None)
    transformers.utils.logging.enable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()
    transformers.utils.logging.set_verbosity_info()
    assert not huggingface_hub.utils.are_progress_bars_disabled()
    tfcore.setup()
    assert not transformers.utils.logging.is_progress_bar_enabled()
    assert huggingface_hub.utils.are_progress_bars_disabled()
    assert transformers.utils.logging.get_verbosity() == logging.ERROR


def test_loading_after_setup_prints_nothing(capfd):
    tfcore.setup()
    capfd.readouterr()
    tfcore.load_tokenizer()
    tfcore.load_pretrained()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_setup_rounds_printed_tensors():
    tfcore.setup()
    assert str(torch.tensor([1 / 3])) == "tensor([0.3333])"
    assert str(torch.tensor([1e-7])) == "tensor([0.0000])"


@pytest.fixture(autouse=True)
def _restore_print_options():
    yield
    torch.set_printoptions(profile="default")


def test_tfcore_seed_shifts_every_seed(monkeypatch):
    tfcore.setup(seed=1)
    seed_1 = _draws()
    monkeypatch.setenv("TFCORE_SEED", "1")
    tfcore.setup(seed=0)
    assert _draws() == seed_1  # seed 0 shifted by 1
    tfcore.setup(seed=0)
    assert _draws() == seed_1  # reseeding still gives the same draws
    monkeypatch.setenv("TFCORE_SEED", "one")
    with pytest.raises(ValueError, match=r"TFCORE_SEED must be an integer.*'one'"):
        tfcore.setup()
