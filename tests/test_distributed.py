"""tfcore.distributed: two processes over gloo. Collectives, our DDP (plain and bucketed), ZeRO-1 and FSDP
against one process on the whole batch and against PyTorch's DistributedDataParallel and fully_shard,
the bytes each sends, the memory each holds (measured against the formula), the tensor-parallel
feed-forward against the whole layer, planted bugs, and faults (a worker that raises, a timeout, a port
in use, a batch that does not split).

Spawning costs seconds, so each spawn runs many checks: one for every correct run (module fixture
``runs``), one for every planted bug (``planted``). The workers that plant bugs live here: spawned
processes import this module by name (its folder is on the parent's sys.path, which spawn passes on).
"""

import time
from types import SimpleNamespace

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
PIECE_NUMEL = 500  # ZeroAdamW's pieces in the runs with small pieces: several per shard
# Tensor parallelism: exact GELU (GPT's default is the tanh one), odd width d, d_ff a multiple of P but odd / P
TP_CONFIG = SimpleNamespace(hidden_size=9, intermediate_size=14, hidden_act="gelu")
TP_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
# Memory: parameters, gradients and AdamW's moments (~100 MiB at 16 bytes per parameter) far above the
# activations (B/p = 2 rows of 16 tokens); no vocabulary so large that one tensor's temporaries dominate
MEMORY_CONFIG = GPTConfig(vocab_size=2048, max_position_embeddings=16, hidden_size=256, num_hidden_layers=8,
                          num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MEMORY_BATCHES = torch.randint(0, 2048, (2, 4, 17), generator=torch.Generator().manual_seed(1))  # 2 steps


def run(scheme, dtype):
    return D.train_worker(dist.get_rank(), P, scheme, CONFIG, BATCHES, dtype, 0, True, None, BUCKET_BYTES)


def gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------------------ workers


def correct_worker(rank, world_size):
    """Every correct run, in one spawn: the collectives, then each scheme in both precisions, several
    schemes through train_many_worker, ZeRO-1 in small pieces, and the tensor-parallel feed-forward."""
    out = {"collectives": D.collectives_worker(rank, world_size)}
    for dtype in DTYPES:
        for scheme in D.SCHEMES:
            out[scheme, dtype] = run(scheme, dtype)
        out["tp", dtype] = D.tensor_parallel_worker(rank, world_size, TP_CONFIG, dtype, 1)
    out["many"] = D.train_many_worker(rank, world_size, ("fsdp", "ddp"), CONFIG, BATCHES, torch.float64, 0, True,
                                      None, BUCKET_BYTES)
    patch = pytest.MonkeyPatch()
    patch.setattr(D, "PIECE_NUMEL", PIECE_NUMEL)
    try:
        out["zero1 pieces"] = run("zero1", torch.float64)
    finally:
        patch.undo()
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

    def bias_on_every_rank(self, x):  # linear_2's bias added before the all-reduce: p times
        return D.g(self.linear_2(self.activation(self.linear_1(D.f(x)))) + self.bias_2)

    for name, patches in (("tp bias twice", [(D.TensorParallelFeedForward, "forward", bias_on_every_rank)]),
                          ("tp f no reduce", [(D.CopyToParallel, "backward", staticmethod(lambda ctx, grad: grad))])):
        for target, attribute, value in patches:
            patch.setattr(target, attribute, value)
        try:
            out[name] = D.tensor_parallel_worker(rank, world_size, TP_CONFIG, torch.float64, 1)
        finally:
            patch.undo()

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


def never_free_worker(rank, world_size, *args):
    """FSDP that never frees a gathered unit (planted): measured like a correct run."""
    D.FlatUnit.free = lambda self: None
    return D.train_worker(rank, world_size, *args)


def raising_worker(rank, world_size):
    """Rank 1 raises; rank 0 waits in a collective for it, forever, until the parent kills it."""
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def gloo_events_worker(rank, world_size):
    """The profiler's names of what the pinned gloo runs for our reduce-scatter and all-gather."""
    from torch.profiler import ProfilerActivity, profile

    full, shard = torch.randn(world_size * 8), torch.empty(8)
    names = {}
    for op, call in (("reduce_scatter", lambda: D.reduce_scatter(shard, full)),
                     ("all_gather", lambda: D.all_gather(full, shard))):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        names[op] = {e.name for e in prof.events() if e.name.startswith("gloo:")}
    return names


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
def memory():
    """Peak memory added per rank, one launch per scheme (a process's peak never falls), and FSDP that never
    frees a unit; float32, glibc's mmap threshold fixed (D.MALLOC_ENV) as train sets it."""
    out = {s: D.train(s, MEMORY_CONFIG, MEMORY_BATCHES, dtype=torch.float32, measure_memory=True, timeout=300)
           for s in ("ddp", "zero1", "fsdp")}
    args = ("fsdp", MEMORY_CONFIG, MEMORY_BATCHES, torch.float32, 0, False, None, 2 ** 14, True)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in D.MALLOC_ENV.items():
            patch.setenv(key, value)
        out["fsdp never frees"] = D.launch(never_free_worker, P, *args, timeout=300)
    return out


def added(result: dict) -> int:
    return result["peak_rss"] - result["rss_before"]


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
    # and the messages: one all-reduce per parameter, one per bucket, one per unit and pass
    model = D.make_model(CONFIG, dtype, 0)
    assert runs[0]["ddp", dtype]["calls"] == {"all_reduce": len(list(model.parameters()))}
    assert runs[0]["bucketed", dtype]["calls"] == {"all_reduce": len(runs[0]["bucketed", dtype]["buckets"])}
    units = CONFIG.num_hidden_layers + 1
    assert runs[0]["fsdp", dtype]["calls"] == {"all_gather": 2 * units, "reduce_scatter": units}
    pieces = -(-D.padded(psi(), P) // P // D.PIECE_NUMEL)  # ZeroAdamW's pieces per shard
    assert runs[0]["zero1", dtype]["calls"] == {"reduce_scatter": pieces, "all_gather": pieces}


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
        # the step starts and ends with nothing whole, and its highest point is the peak
        history = r["fsdp", dtype]["held_history"]
        assert history[0] == history[-1] == 0 and max(history) == r["fsdp", dtype]["peak_param_bytes"]
        # each unit gathered twice (forward, backward) and freed twice: 4 events per unit
        assert len(history) == 1 + 4 * (CONFIG.num_hidden_layers + 1)
        names = [n for n, _ in D.make_model(CONFIG, dtype, 0).named_parameters()]
        assert [n for b in r["bucketed", dtype]["buckets"] for n in b] == names[::-1]
        # the timeline of each step: every bucket launched during backward, its wait returning after
        bucketed = r["bucketed", dtype]
        assert len(bucketed["timeline"]) == len(BATCHES)
        for step, done in zip(bucketed["timeline"], bucketed["done_before_wait"]):
            assert len(step["launched"]) == len(step["waited"]) == len(bucketed["buckets"]) == len(step["done_at_end"])
            assert 0 < min(step["launched"]) and max(step["launched"]) <= step["backward_end"] <= min(step["waited"])
            assert step["waited"] == sorted(step["waited"]) and sum(step["done_at_end"]) == done


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


def test_the_pinned_gloo_reduce_scatters_by_all_reducing():
    """Chapter 27 says so: in torch 2.13, gloo's reduce-scatter runs an all-reduce of the whole input (the
    profiler shows a gloo all_reduce inside it) and keeps its chunk; its all-gather does not all-reduce."""
    events = D.launch(gloo_events_worker, P, timeout=120)[0]
    assert "gloo:all_reduce" in events["reduce_scatter"]
    assert events["all_gather"] and "gloo:all_reduce" not in events["all_gather"]


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
    before = children()
    with pytest.raises(Exception, match="pickle") as error:  # an argument a spawned process cannot receive
        D.launch(sleeping_worker, P, lambda: 0)
    assert "can only join a started process" not in str(error.value)  # the real error, not the cleanup's
    assert children() <= before


# ------------------------------------------------------------------------------- several schemes at once


def test_several_schemes_in_one_launch(runs, monkeypatch):
    for r in runs:  # train_many_worker runs each scheme as train_worker does, one after the other
        for scheme in ("fsdp", "ddp"):
            assert bit_equal(r["many"][scheme]["params"], r[scheme, torch.float64]["params"]), scheme
            assert r["many"][scheme]["traffic"] == r[scheme, torch.float64]["traffic"]
    calls = []

    def fake_launch(worker, world_size, *args, timeout):
        calls.append((worker, args))
        return [{s: (s, rank) for s in args[0]} for rank in range(world_size)]

    monkeypatch.setattr(D, "launch", fake_launch)
    assert D.train(("zero1", "ddp"), CONFIG, BATCHES) == {"zero1": [("zero1", 0), ("zero1", 1)],
                                                         "ddp": [("ddp", 0), ("ddp", 1)]}
    assert calls[0][0] is D.train_many_worker and len(calls) == 1  # one launch for both


def test_train_refuses_bad_scheme_lists_before_spawning(monkeypatch):
    monkeypatch.setattr(D, "launch", lambda *a, **k: pytest.fail("spawned processes for bad input"))
    with pytest.raises(ValueError, match="one scheme per launch when measuring memory"):
        D.train(("ddp", "zero1"), CONFIG, BATCHES, measure_memory=True)
    with pytest.raises(ValueError, match="scheme must be one of"):
        D.train(("ddp", "zero2"), CONFIG, BATCHES)
    with pytest.raises(ValueError, match="name one scheme twice"):
        D.train(("ddp", "ddp"), CONFIG, BATCHES)
    with pytest.raises(ValueError, match="non-empty tuple/list"):
        D.train((), CONFIG, BATCHES)
    with pytest.raises(TypeError, match="unknown option"):
        D.train("ddp", CONFIG, BATCHES, measure=True)


def test_zero1_in_small_pieces_is_the_same_optimizer(runs):
    """Several pieces per shard (500 elements each) step, reduce and gather exactly as one piece does."""
    for r in runs:
        whole, pieces = r["zero1", torch.float64], r["zero1 pieces"]
        assert bit_equal(pieces["params"], whole["params"])
        assert pieces["traffic"] == whole["traffic"] and pieces["state_bytes"] == whole["state_bytes"]
    assert D.padded(psi(), P) // P > 3 * PIECE_NUMEL  # several pieces indeed


# ------------------------------------------------------------------------------------ memory per rank


@pytest.mark.parametrize("dtype", DTYPES)
def test_memory_formula_counts_what_the_code_holds(runs, dtype):
    for r in runs:
        ddp, zero1, fsdp = (D.memory_formula(CONFIG, s, P, dtype) for s in ("ddp", "zero1", "fsdp"))
        assert ddp["parameters"] == ddp["gradients"] == r["ddp", dtype]["param_bytes"]
        assert ddp["optimizer"] == r["ddp", dtype]["state_bytes"]
        assert zero1["parameters"] == r["zero1", dtype]["param_bytes"]  # the flat buffer, padded
        assert zero1["optimizer"] == r["zero1", dtype]["state_bytes"]
        assert fsdp["parameters"] == fsdp["gradients"] == r["fsdp", dtype]["param_bytes"]
        assert fsdp["optimizer"] == r["fsdp", dtype]["state_bytes"]
        assert fsdp["gathered"] == fsdp["gathered_gradients"] == r["fsdp", dtype]["peak_param_bytes"]
        for f in (ddp, zero1, fsdp):
            assert f["total"] == sum(v for k, v in f.items() if k != "total")
    with pytest.raises(ValueError, match="memory_formula covers"):
        D.memory_formula(CONFIG, "bucketed", P)


def test_measured_memory_follows_the_formula_and_the_order(memory):
    """The peak resident memory each rank added: above the formula (which leaves out activations and
    temporaries), within 30% of it, and DDP > ZeRO-1 > FSDP with room."""
    per_rank = {s: [added(r) for r in memory[s]] for s in ("ddp", "zero1", "fsdp")}
    for scheme, measured in per_rank.items():
        formula = D.memory_formula(MEMORY_CONFIG, scheme, P)["total"]
        for m in measured:
            assert formula < m < 1.3 * formula, (scheme, m / formula)
    assert max(per_rank["zero1"]) < 0.85 * min(per_rank["ddp"])
    assert max(per_rank["fsdp"]) < 0.9 * min(per_rank["zero1"])
    assert all(r["malloc_pinned"] for s in per_rank for r in memory[s])


def test_fsdp_that_never_frees_a_unit_is_caught_by_memory(memory):
    correct, planted = memory["fsdp"], memory["fsdp never frees"]
    assert all(bit_equal(a["params"], b["params"]) for a, b in zip(correct, planted))  # equality alone misses it
    formula = D.memory_formula(MEMORY_CONFIG, "fsdp", P)["total"]
    for r in planted:
        assert added(r) > 1.3 * formula
        assert r["peak_param_bytes"] > 2 * correct[0]["peak_param_bytes"]


# ------------------------------------------------------------------------------------ tensor parallelism


def tp_gaps(r: dict) -> dict:
    ref = r["reference"]
    return {"output": (r["output"] - ref["output"]).abs().max().item(),
            "grad_x": (r["grad_x"] - ref["grad_x"]).abs().max().item(),
            **{n: (r["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"]}}


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_parallel_feed_forward_equals_the_whole_layer(runs, dtype):
    rank0, rank1 = (r["tp", dtype] for r in runs)
    assert torch.equal(rank0["output"], rank1["output"]) and torch.equal(rank0["grad_x"], rank1["grad_x"])
    for r in (rank0, rank1):
        assert r["grads"].keys() == {"linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"}
        assert max(tp_gaps(r).values()) < TP_TOLERANCE[dtype], tp_gaps(r)
        assert r["reference"]["output"].abs().max() > 0.1 and r["reference"]["grad_x"].abs().max() > 0.1
        d, d_ff = TP_CONFIG.hidden_size, TP_CONFIG.intermediate_size
        assert r["parameters"] == (d_ff // P) * (2 * d + 1) + d  # half of each weight and of bias 1; all of bias 2
        assert r["reference_parameters"] == d_ff * (2 * d + 1) + d


def test_tensor_parallel_sends_one_all_reduce_each_way(runs):
    """Megatron-LM section 3: the feed-forward needs one all-reduce of the activations [B, L, d] in forward (g)
    and one in backward (f); ring elements 2 (p - 1) / p x B L d."""
    b_l_d = 2 * 5 * TP_CONFIG.hidden_size
    for r in runs:
        assert r["tp", torch.float64]["traffic"] == {"forward": {"all_reduce": 2 * (P - 1) / P * b_l_d},
                                                   "backward": {"all_reduce": 2 * (P - 1) / P * b_l_d}}


def test_tensor_parallel_planted_bugs_are_caught(planted):
    bias = tp_gaps(planted[0]["tp bias twice"])
    assert bias["output"] > 1e-3 and bias["grad_x"] < 1e-12  # the output is off by one bias; gradients are not
    no_reduce = tp_gaps(planted[0]["tp f no reduce"])
    assert no_reduce["grad_x"] > 1e-3 and no_reduce["output"] < 1e-12  # forward is right, x's gradient is not


def test_tensor_parallel_refuses_bad_splits():
    from tfcore.layers import FeedForward

    layer = FeedForward(SimpleNamespace(hidden_size=9, intermediate_size=15, hidden_act="gelu",
                                        hidden_dropout_prob=0.0))
    with pytest.raises(ValueError, match="d_ff=15 cannot be split evenly over 2 ranks"):
        D.TensorParallelFeedForward(layer, 0, 2)
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        D.TensorParallelFeedForward(layer, 3, 3)
    layer.dropout.p = 0.1
    with pytest.raises(ValueError, match="dropout"):
        D.TensorParallelFeedForward(layer, 0, 3)
