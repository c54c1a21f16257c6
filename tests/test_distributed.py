"""tfcore.distributed: two processes over gloo. Collectives, our DDP (plain and bucketed), ZeRO-1 and FSDP
against one process on the whole batch and against PyTorch's DistributedDataParallel and fully_shard,
the bytes each sends, planted bugs, and faults (a worker that raises, a timeout, a port in use, a batch
that does not split).

Spawning costs seconds, so each spawn runs many checks: one for every correct run (module fixture
``runs``), one for every planted bug (``planted``). The workers that plant bugs live here: spawned
processes import this module by name (its folder is on the parent's sys.path, which spawn passes on).
"""

import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tfcore import GPTConfig
from tfcore import distributed as D

P = 2  # world size everywhere: CI has 2 cores
# Options off their defaults: exact GELU, eps, an odd intermediate size (so the flat shards need padding),
# norms drawn at random (random_norms). Dropout is off: each process would draw its own masks.
CONFIG = GPTConfig(vocab_size=61, max_position_embeddings=16, hidden_size=18, num_hidden_layers=2,
                   num_attention_heads=2, intermediate_size=25, hidden_act="gelu", layer_norm_eps=1e-6,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
BATCHES = torch.randint(0, CONFIG.vocab_size, (3, 4, 9), generator=torch.Generator().manual_seed(0))  # 3 steps
DTYPES = (torch.float64, torch.float32)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}  # against one process: the backward's sum order differs
OURS = ("ddp", "bucketed", "zero1", "fsdp")
BUCKET_BYTES = 2000


def run(scheme, dtype):
    return D.train_worker(dist.get_rank(), P, scheme, CONFIG, BATCHES, dtype, 0, True, None, BUCKET_BYTES)


def gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------------------ workers


def correct_worker(rank, world_size):
    """Every correct run, in one spawn: the collectives, then each scheme in both precisions."""
    out = {"collectives": D.collectives_worker(rank, world_size)}
    for dtype in DTYPES:
        for scheme in D.SCHEMES:
            out[scheme, dtype] = run(scheme, dtype)
    return out


class DelayedWork:
    """An async all-reduce whose result lands in the tensor only at wait(), as a slow network's would."""

    def __init__(self, tensor):
        self.tensor, self.result = tensor, tensor.clone()
        dist.all_reduce(self.result)

    def is_completed(self):
        return False

    def wait(self):
        self.tensor.copy_(self.result)


def planted_worker(rank, world_size):
    """Each planted bug, in one spawn, in float64; the module is restored after each."""
    patch = pytest.MonkeyPatch()
    out = {}

    def summed(model):  # gradients summed, not averaged
        for p in model.parameters():
            D.all_reduce(p.grad)

    launch = D.BucketedDDP._launch

    def twice(self, bucket):  # a bucket reduced twice
        launch(self, bucket)
        bucket.handle.wait()
        bucket.handle = D.all_reduce(bucket.flat, async_op=True)

    def off_by_one(numel, rank, world_size):  # rank r's shard starts r elements early
        size = numel // world_size
        return rank * size - rank, (rank + 1) * size - rank

    delayed = D.all_reduce

    def slow_network(tensor, async_op=False):
        if not async_op:
            return delayed(tensor)
        D._count("all_reduce", tensor.numel())
        return DelayedWork(tensor)

    for name, scheme, patches in (
            ("summed", "ddp", [(D, "average_gradients", summed)]),
            ("twice", "bucketed", [(D.BucketedDDP, "_launch", twice)]),
            ("offset zero1", "zero1", [(D, "shard_range", off_by_one)]),
            ("offset fsdp", "fsdp", [(D, "shard_range", off_by_one)]),
            ("slow network", "bucketed", [(D, "all_reduce", slow_network)]),  # the control: waits, so correct
            ("no wait", "bucketed", [(D, "all_reduce", slow_network), (D.BucketedDDP, "_wait", lambda s, b: None)]),
    ):
        for target, attribute, value in patches:
            patch.setattr(target, attribute, value)
        try:
            out[name] = run(scheme, torch.float64)
        finally:
            patch.undo()
    return out


def raising_worker(rank, world_size):
    """Rank 1 raises; rank 0 waits in a collective for it, forever, until the parent kills it."""
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def sleeping_worker(rank, world_size):
    time.sleep(600)


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs():
    return D.launch(correct_worker, P, timeout=300)


@pytest.fixture(scope="module")
def planted():
    return D.launch(planted_worker, P, timeout=300)


@pytest.fixture(scope="module")
def single():
    return {dtype: D.train_single(CONFIG, BATCHES, dtype, random_norms=True) for dtype in DTYPES}


def psi(pad_per_unit: bool = False) -> int:
    """Parameters of CONFIG's GPT (the tied output layer counted once); padded as ZeRO-1 or FSDP pad them."""
    model = D.make_model(CONFIG, torch.float32, 0)
    if not pad_per_unit:
        return sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return sum(D.padded(sum(p.numel() for p in b.parameters()), P) for b in model.blocks) + D.padded(rest, P)


# ---------------------------------------------------------------------------------------- collectives


def test_collectives_on_small_tensors(runs):
    rank0, rank1 = (r["collectives"] for r in runs)
    x0, x1 = torch.tensor([1.0, 2, 3, 4]), torch.tensor([11.0, 12, 13, 14])
    assert torch.equal(rank0["x"], x0) and torch.equal(rank1["x"], x1)
    for r in (rank0, rank1):
        assert torch.equal(r["broadcast"], x0)
        assert torch.equal(r["all_reduce"], x0 + x1)
        assert torch.equal(r["all_gather"], torch.cat([x0, x1]))
    assert torch.equal(rank0["reduce_scatter"], (x0 + x1)[:2])
    assert torch.equal(rank1["reduce_scatter"], (x0 + x1)[2:])


def test_ring_bytes_per_collective(runs):
    n = 4  # elements of x; all_gather's output has 2n, reduce_scatter's input n
    expected = {"broadcast": (P - 1) / P * n, "all_reduce": 2 * (P - 1) / P * n,
                "all_gather": (P - 1) / P * (P * n), "reduce_scatter": (P - 1) / P * n}
    for r in runs:
        assert r["collectives"]["traffic"] == expected
    assert D.ring_elements("all_reduce", 1000, 8) == 1750  # 2 (p - 1) / p x N
    with pytest.raises(ValueError, match="op must be one of"):
        D.ring_elements("gather", 10, 2)


# ------------------------------------------------------------------------------------------ equality


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_scheme_equals_one_process(runs, single, dtype):
    for scheme in D.SCHEMES:
        rank0, rank1 = (r[scheme, dtype]["params"] for r in runs)
        assert bit_equal(rank0, rank1), scheme  # the ranks hold one model
        assert gap(rank0, single[dtype]) < TOLERANCE[dtype], scheme
    # the three steps moved the weights far more than the tolerance: the comparison can fail
    start = {n: p.detach() for n, p in D.make_model(CONFIG, dtype, 0, random_norms=True).named_parameters()}
    assert gap(start, single[dtype]) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_ours_bit_equal_to_each_other_and_to_pytorch(runs, dtype):
    """Every scheme sums the two ranks' gradients (a + b, the same on both ranks) and halves them (exact in
    binary), and AdamW acts element by element, so ours, DistributedDataParallel and fully_shard (FSDP2)
    agree to the last bit (measured: torch 2.13, gloo, two processes)."""
    reference = runs[0]["torch_ddp", dtype]["params"]
    for scheme in OURS + ("torch_fsdp",):
        assert bit_equal(runs[0][scheme, dtype]["params"], reference), scheme


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gap_to_one_process_is_the_batch_split(runs, single, dtype):
    """Not bit for bit: one backward over 4 rows sums in another order than two backwards over 2 rows.
    The intervention: one process that averages the gradients of the two halves lands on DDP's weights
    to the last bit. In float64 the gap to one process is rounding (measured 5.2e-15)."""
    model = D.make_model(CONFIG, dtype, 0, random_norms=True)
    optimizer = torch.optim.AdamW(model.parameters(), **D.ADAMW)
    for ids in BATCHES:
        halves = []
        for rank in range(P):
            model.zero_grad()
            D.lm_loss(model, D.split_batch(ids, rank, P)).backward()
            halves.append([p.grad.clone() for p in model.parameters()])
        for p, *grads in zip(model.parameters(), *halves):
            p.grad = sum(grads) / P
        optimizer.step()
    ddp = runs[0]["ddp", dtype]["params"]
    assert bit_equal({n: p.detach() for n, p in model.named_parameters()}, ddp)
    if dtype == torch.float64:
        assert 0 < gap(ddp, single[dtype]) < 1e-13


# ------------------------------------------------------------------------------------ bytes and memory


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_sent_per_step_follow_the_zero_paper(runs, dtype):
    """Rajbhandari et al. 2020: DDP and ZeRO-1 move 2 Psi per rank per step, ZeRO-3 (FSDP) 3 Psi; with
    the ring's (p - 1) / p factor, exactly 2 (p - 1) / p Psi and 3 (p - 1) / p Psi (padded shards)."""
    f = (P - 1) / P
    for scheme in ("ddp", "bucketed"):
        assert runs[0][scheme, dtype]["traffic"] == {"all_reduce": 2 * f * psi()}
    assert runs[0]["zero1", dtype]["traffic"] == {"reduce_scatter": f * D.padded(psi(), P),
                                                  "all_gather": f * D.padded(psi(), P)}
    fsdp = psi(pad_per_unit=True)
    assert fsdp > psi()  # the odd intermediate size makes the blocks' flat parameters need padding
    assert runs[0]["fsdp", dtype]["traffic"] == {"all_gather": 2 * f * fsdp, "reduce_scatter": f * fsdp}


@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_state_and_parameter_bytes_per_rank(runs, dtype):
    size = torch.empty(0, dtype=dtype).element_size()
    for r in runs:
        assert r["ddp", dtype]["state_bytes"] == 2 * size * psi()  # two moments per parameter
        assert r["zero1", dtype]["state_bytes"] == 2 * size * D.padded(psi(), P) // P
        assert r["fsdp", dtype]["state_bytes"] == 2 * size * psi(pad_per_unit=True) // P
        assert r["fsdp", dtype]["param_bytes"] == size * psi(pad_per_unit=True) // P
        # at most the rest (embeddings, final norm, output layer: gathered for the whole forward) and one block
        model = D.make_model(CONFIG, dtype, 0)
        rest = psi() - sum(p.numel() for p in model.blocks.parameters())
        block = D.padded(sum(p.numel() for p in model.blocks[0].parameters()), P)
        assert r["fsdp", dtype]["peak_param_bytes"] == size * (D.padded(rest, P) + block) < size * psi()


# ------------------------------------------------------------------------------------------ planted


def test_planted_bugs_are_caught(runs, planted):
    correct = runs[0]["ddp", torch.float64]["params"]
    assert bit_equal(planted[0]["slow network"]["params"], correct)  # the harness alone changes nothing
    for name in ("summed", "twice", "offset zero1", "offset fsdp", "no wait"):
        assert gap(planted[0][name]["params"], correct) > 1e-6, name
    # a bucket reduced twice also shows in the bytes: one more all-reduce per bucket
    assert planted[0]["twice"]["traffic"]["all_reduce"] == 2 * runs[0]["bucketed", torch.float64]["traffic"]["all_reduce"]


def test_buckets_reversed_and_sized(monkeypatch):
    model = D.make_model(CONFIG, torch.float32, 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: P)  # all BucketedDDP asks of the process group
    ddp = D.BucketedDDP(model, BUCKET_BYTES)
    order = [p for b in ddp.buckets for p in b.params]
    assert order == list(model.parameters())[::-1]
    assert all(sum(p.numel() * 4 for p in b.params) >= BUCKET_BYTES for b in ddp.buckets[:-1])
    assert all(sum(p.numel() * 4 for p in b.params[:-1]) < BUCKET_BYTES for b in ddp.buckets)


# ------------------------------------------------------------------------------------ faults and input


def children() -> set:
    return {c.pid for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())}


def test_worker_that_raises_stops_every_process():
    before = children()
    with pytest.raises(D.WorkerError, match="rank 1 raised ValueError: planted failure on rank 1") as error:
        D.launch(raising_worker, P, timeout=60)
    assert error.value.rank == 1 and "Traceback" in str(error.value)
    assert children() <= before  # rank 0, stuck in its barrier, was killed


def test_timeout_kills_every_process():
    before = children()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=6"):
        D.launch(sleeping_worker, P, timeout=6)
    assert time.monotonic() - start < 30
    assert children() <= before


def test_port_in_use_is_refused():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ValueError, match=f"port {busy.getsockname()[1]} is in use"):
            D.launch(sleeping_worker, P, port=busy.getsockname()[1])


def test_batch_that_does_not_split_is_refused_before_spawning(monkeypatch):
    monkeypatch.setattr(D, "launch", lambda *a, **k: pytest.fail("spawned processes for a bad batch"))
    with pytest.raises(ValueError, match="3 rows cannot be split evenly over 2 processes"):
        D.train("ddp", CONFIG, BATCHES[:, :3], world_size=2)
    with pytest.raises(ValueError, match="scheme must be one of"):
        D.train("zero2", CONFIG, BATCHES)
    with pytest.raises(ValueError, match="batches must be token ids"):
        D.train("ddp", CONFIG, BATCHES.float())
    with pytest.raises(ValueError, match="cannot be split evenly"):
        D.split_batch(torch.zeros(5, 3), 0, 2)


def test_bad_launch_arguments():
    def local(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="cannot be imported by a spawned process"):
        D.launch(local, P)
    with pytest.raises(ValueError, match="world_size must be a whole number"):
        D.launch(sleeping_worker, 0)
    with pytest.raises(TypeError, match="worker must be a function"):
        D.launch(3, P)
    with pytest.raises(ValueError, match="timeout must be"):
        D.launch(sleeping_worker, P, timeout=-1)
