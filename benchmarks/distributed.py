"""Training across processes (chapter 27): time per step against the number of processes. Key ``distributed``.

Strong scaling on the CPU: one global batch (a full run: 8 sequences of 64 tokens) of a ``tfcore.GPT``
(4096 tokens, 256 wide, 4 blocks of 4 heads, dropout 0, float32: about 4.2M parameters) trained with
AdamW by each of ``tfcore.distributed.SCHEMES`` (``train_worker``, as chapter 27's tests run it) on
p = 1, 2 and 4 processes, each process on its ``8 / p`` sequences with one thread, over gloo on the
loopback. ``scheme="single"`` is the reference without any process group: ``train_single``'s loop (the
whole batch, ``torch.optim.AdamW``), timed the same way in the p = 1 process. ``scheme="local"`` (p >= 2)
is the same loop in each of the p processes at once, each on its ``8 / p`` sequences with no collective
at all: data parallelism's computation without its communication (the copies drift apart: a timing,
not a training). ``"bucketed, no overlap"`` (p >= 2) is ``bucketed`` with each bucket waited for as soon
as it is launched: the same messages, nothing overlapped with backward. One ``launch`` per p runs every
scheme in turns (``rounds`` times), so that a change in the machine's load hits them alike.

A step's time is the wall clock of one rank from ``zero_grad`` to the end of ``optimizer.step``
(``train_worker``'s ``seconds``); ``seconds`` is the median, over the steps after the first 2 of each
run, of the slowest rank's time for that step. Wall clock, not CPU time: waiting for the other
processes is part of a step.

Communication alone (p >= 2, in the same processes after the training): ``all_reduce``, ``all_gather``
and ``reduce_scatter`` (``tfcore.distributed``'s, which the schemes call) of one flat float32 tensor
of the model's ``Psi`` parameters (padded to a multiple of p), every rank starting together after a
barrier; and ``"all_reduce per parameter"``: the same elements all-reduced as ``average_gradients``
sends them, one message per parameter tensor (``messages``), one after the other, and ``"all_reduce of
one element, per parameter"``: as many all-reduces of one element each. Rows with
``kind="collective"``, ``seconds`` = ``comm_seconds`` = the median over repeats of the slowest rank.
A step row of our schemes (``ddp``, ``bucketed``, ``zero1``, ``fsdp``) also gets
``comm_seconds``: its collectives in the last step, as counted by ``tfcore.distributed.traffic``, each
priced at the time of that collective on Psi elements alone (``comm_collectives``: how many
Psi-sized collectives of each kind that is: 1 all-reduce for DDP, a reduce-scatter and an all-gather
for ZeRO-1, 2 all-gathers and a reduce-scatter for FSDP, a little more when its units are padded).
The schemes send those elements in several messages (per parameter, per bucket, per unit), and
``bucketed`` overlaps some of them with the backward pass: ``comm_seconds`` is what the same elements
cost sent as one message per collective with nothing else running, not a part of ``seconds``.
PyTorch's schemes (``torch_ddp``, ``torch_fsdp``) are not counted: ``comm_seconds`` is None.

What processes on one CPU cannot show: with more processes than cores (``cpu_count`` in the machine
record; p = 4 on a 2-core machine) processes share cores, and gloo sends through the loopback, so
neither the compute nor the link resembles GPUs joined by a fast interconnect. What they do show: the
time of each scheme's step on ``1 / p`` of the batch, and of its collectives alone, on this machine.
``bucketed`` rows also hold ``buckets_done_before_wait``: for each timed step of rank 0, how many
buckets' all-reduces had finished when the backward pass ended (``BucketedDDP.done_before_wait``),
of ``buckets``, and ``timeline``: rank 0's last timed step of the last round (``train_worker``'s).

    .venv/bin/python benchmarks/run.py --only distributed --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WARMUP = 2  # steps (and collectives) of each run that are not counted
FULL = dict(sizes=dict(vocab_size=4096, max_position_embeddings=64, hidden_size=256, num_hidden_layers=4,
                       num_attention_heads=4), batch=8, length=64, processes=(1, 2, 4), rounds=5, steps=5,
            comm_repeats=15, bucket_bytes=2 ** 20, timeout=1800.0)
SMOKE = dict(sizes=dict(vocab_size=64, max_position_embeddings=8, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2), batch=4, length=8, processes=(1, 2), rounds=1, steps=3,
             comm_repeats=2, bucket_bytes=2 ** 10, timeout=300.0)
# the collectives each step's traffic is priced with (tfcore.distributed.traffic's names)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
PER_PARAMETER = "all_reduce per parameter"  # the collective rows' scheme for one all-reduce per parameter
NO_OVERLAP = "bucketed, no overlap"  # the control: the same buckets, each waited for as soon as it is launched
TINY = "all_reduce of one element, per parameter"  # as many all-reduces, of one element each: their fixed cost
OURS = ("ddp", "bucketed", "zero1", "fsdp")


def _config(sizes: dict):
    from tfcore import GPTConfig

    return GPTConfig(**sizes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _single_seconds(config, batches: torch.Tensor) -> list[float]:
    """``train_single``'s loop (one process, the whole batch, AdamW), each step timed as ``train_worker`` times it."""
    from tfcore import distributed as D

    model = D.make_model(config, torch.float32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **D.ADAMW)
    seconds = []
    for ids in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        D.lm_loss(model, ids).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def _collective_seconds(numel: int, repeats: int, sizes: list[int]) -> dict:
    """This rank's seconds for each collective on ``numel`` float32 elements (``numel`` a multiple of p),
    ``WARMUP + repeats`` times each, every call after a barrier; and for ``PER_PARAMETER``: one
    all-reduce per tensor of ``sizes`` (the model's parameters), one after the other, as
    ``average_gradients`` sends them: the same elements as one all-reduce, in ``len(sizes)`` messages;
    and for ``TINY``: as many all-reduces of one element each (what each call costs whatever its size)."""
    import torch.distributed as dist

    from tfcore import distributed as D

    world_size = dist.get_world_size()
    full, shard = torch.randn(numel), torch.randn(numel // world_size)
    pieces = [torch.randn(n) for n in sizes]
    tiny = [torch.randn(1) for _ in sizes]
    calls = {"all_reduce": lambda: D.all_reduce(full), "all_gather": lambda: D.all_gather(full, shard),
             "reduce_scatter": lambda: D.reduce_scatter(shard, full),
             PER_PARAMETER: lambda: [D.all_reduce(piece) for piece in pieces],
             TINY: lambda: [D.all_reduce(one) for one in tiny]}
    seconds = {name: [] for name in calls}
    for _ in range(WARMUP + repeats):
        for name, call in calls.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _bucketed_without_overlap(rank: int, world_size: int, config, batches: torch.Tensor, bucket_bytes: int) -> dict:
    """``train_worker``'s "bucketed" scheme with each bucket's all-reduce waited for as soon as it is
    launched: the same buckets and messages, nothing overlapped with backward."""
    from tfcore import distributed as D

    launch = D.BucketedDDP._launch

    def launch_and_wait(self, bucket):
        launch(self, bucket)
        bucket.handle.wait()

    D.BucketedDDP._launch = launch_and_wait
    try:
        return D.train_worker(rank, world_size, "bucketed", config, batches, dtype=torch.float32,
                              bucket_bytes=bucket_bytes)
    finally:
        D.BucketedDDP._launch = launch


def scaling_worker(rank: int, world_size: int, config, batches: torch.Tensor, rounds: int, comm_repeats: int,
                   bucket_bytes: int) -> dict:
    """Run in each of the ``world_size`` processes: every scheme ``rounds`` times in turns (and the
    one-process reference ``single`` when ``world_size == 1``, ``local`` and ``NO_OVERLAP`` otherwise),
    then the collectives alone (``world_size >= 2``).

    Returns ``{"steps": {scheme: [seconds of each step, one list per round]}, "traffic": {scheme: elements
    sent in the last step, by collective}, "done_before_wait": {scheme: train_worker's, last round},
    "buckets": how many buckets BucketedDDP makes, "comm": {collective: [seconds]}}`` for this rank.
    """
    from tfcore import distributed as D

    references = ("single",) if world_size == 1 else ("local",)
    steps = {scheme: [] for scheme in references + D.SCHEMES + ((NO_OVERLAP,) if world_size > 1 else ())}
    traffic, done, timeline = {}, {}, {}
    for _ in range(rounds):
        for scheme, runs in steps.items():
            if scheme == "single":
                runs.append(_single_seconds(config, batches))
                continue
            if scheme == "local":  # this rank's rows only, and no collective
                runs.append(_single_seconds(config, torch.stack([D.split_batch(ids, rank, world_size)
                                                                 for ids in batches])))
                continue
            if scheme == NO_OVERLAP:
                runs.append(_bucketed_without_overlap(rank, world_size, config, batches, bucket_bytes)["seconds"])
                continue
            out = D.train_worker(rank, world_size, scheme, config, batches, dtype=torch.float32,
                                 bucket_bytes=bucket_bytes)
            runs.append(out["seconds"])
            traffic[scheme] = out.get("traffic", {})
            done[scheme] = out["done_before_wait"]
            timeline[scheme] = out.get("timeline")
    model = D.make_model(config, torch.float32, 0)
    buckets = len(D.BucketedDDP(model, bucket_bytes).buckets)  # as train_worker buckets the same model
    numel = D.padded(sum(p.numel() for p in model.parameters()), world_size)
    sizes = [p.numel() for p in model.parameters()]
    comm = _collective_seconds(numel, comm_repeats, sizes) if world_size > 1 else {}
    return {"steps": steps, "traffic": traffic, "done_before_wait": done, "timeline": timeline, "buckets": buckets,
            "comm": comm}


def slowest_median(runs: list[list[list[float]]]) -> float:
    """``runs[k][rank][step]``: seconds of each step of each rank, in each run k. The median, over every
    run's steps after the first ``WARMUP``, of the slowest rank's time for that step."""
    return statistics.median(max(step) for run in runs for step in list(zip(*run))[WARMUP:])


def scaling(plan: dict, device) -> list[dict]:
    """The rows of key ``distributed`` (see the module's docstring); CPU only."""
    from tfcore import distributed as D

    if device != "cpu":
        return []
    config = _config(plan["sizes"])
    parameters = sum(p.numel() for p in D.make_model(config, torch.float32, 0).parameters())
    generator = torch.Generator().manual_seed(0)
    batches = torch.randint(config.vocab_size, (WARMUP + plan["steps"], plan["batch"], plan["length"] + 1),
                            generator=generator)
    common = {"global_batch": plan["batch"], "sequence_length": plan["length"], "parameters": parameters,
              "dtype": "float32", "threads_per_process": 1, "clock": "perf_counter", "backend": "gloo",
              **{k: v for k, v in plan["sizes"].items() if k != "max_position_embeddings"}}
    rows = []
    for p in plan["processes"]:
        ranks = D.launch(scaling_worker, p, config, batches, plan["rounds"], plan["comm_repeats"],
                         plan["bucket_bytes"], timeout=plan["timeout"])
        comm = {name: slowest_median([[r["comm"][name] for r in ranks]]) for name in ranks[0]["comm"]}
        numel = D.padded(parameters, p)
        messages = len(list(D.make_model(config, torch.float32, 0).parameters()))
        for name, seconds in comm.items():
            many = name in (PER_PARAMETER, TINY)
            elements = {PER_PARAMETER: parameters, TINY: messages}.get(name, numel)
            rows.append({"kind": "collective", "scheme": name, "processes": p, "seconds": seconds,
                         "comm_seconds": seconds, "elements": elements, "bytes": 4 * elements,
                         "messages": messages if many else 1, **common})
        for scheme in ranks[0]["steps"]:
            seconds = slowest_median([[r["steps"][scheme][k] for r in ranks] for k in range(plan["rounds"])])
            counts = comm_seconds = None
            if scheme in OURS and comm:
                sent = ranks[0]["traffic"][scheme]
                counts = {op: sent.get(op, 0.0) / D.ring_elements(op, numel, p) for op in COLLECTIVES}
                comm_seconds = sum(counts[op] * comm[op] for op in COLLECTIVES)
            rows.append({"kind": "step", "scheme": scheme, "processes": p, "seconds": seconds,
                         "comm_seconds": comm_seconds, "comm_collectives": counts,
                         "steps": plan["rounds"] * plan["steps"],
                         **({"bucket_bytes": plan["bucket_bytes"], "buckets": ranks[0]["buckets"],
                             "buckets_done_before_wait": ranks[0]["done_before_wait"][scheme][WARMUP:],
                             "timeline": ranks[0]["timeline"][scheme][-1]}
                            if scheme == "bucketed" else {}), **common})
    return rows


def measures(args: argparse.Namespace) -> dict:
    plan = SMOKE if args.smoke else FULL
    return {"distributed": lambda device: scaling(plan, device)}
