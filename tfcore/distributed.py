"""Training across processes: collectives, data parallelism, ZeRO-1 and FSDP, built on torch.distributed.

Everything here runs on CPUs over the gloo backend, ``world_size`` processes on one machine:

- ``launch(worker, world_size, *args)`` spawns the processes, runs ``worker(rank, world_size, *args)``
  in each and returns their results, rank by rank; a worker's exception is raised in the parent.
- ``broadcast``, ``all_reduce``, ``all_gather``, ``reduce_scatter``: torch.distributed's collectives,
  each also adding to ``traffic`` the elements one rank sends under the ring algorithm
  (``ring_elements``).
- ``average_gradients`` (all-reduce after backward), ``BucketedDDP`` (buckets reduced during
  backward), ``ZeroAdamW`` (AdamW's state sharded, ZeRO-1) and ``ShardedModel`` (parameters sharded
  per layer, FSDP / ZeRO-3): data parallelism from scratch.
- ``train_worker`` trains ``tfcore.GPT`` with one of ``SCHEMES`` (ours, and PyTorch's
  ``DistributedDataParallel`` and ``fully_shard``); ``train`` runs it from the parent, for one
  scheme or several in the same processes (``train_many_worker``), and ``train_single`` is the
  one-process reference on the whole batch.
- Memory: ``train(..., measure_memory=True)`` measures each rank's peak resident memory
  (``peak_rss_bytes``) against ``memory_formula``, the bytes per rank of parameters, gradients,
  optimizer state and gathered units that each scheme holds.
- Tensor parallelism (Megatron-LM): ``f`` and ``g``, the conjugate identity / all-reduce pair, and
  ``TensorParallelFeedForward``, the feed-forward layer split over ranks; ``tensor_parallel_worker``
  compares it with the whole layer.

The workers live in this module so that spawned processes can import them (a function defined in a
notebook cannot be sent to a spawned process). Tensors are flat 1-D unless a shape is given.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

SCHEMES = ("ddp", "bucketed", "zero1", "fsdp", "torch_ddp", "torch_fsdp")
# AdamW as chapter 14 trains the GPT (lr 3e-3, betas (0.9, 0.95), weight decay 0.1 on every parameter)
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}

# ---------------------------------------------------------------------------------------------- launching


class WorkerError(RuntimeError):
    """A worker raised: ``rank`` is the process, the message holds its exception and traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port that was free a moment ago: the operating system's answer to binding port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> int:
    """``port`` if nothing listens on it, else a ValueError that names the fix."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be a whole number in 1..65535, got {port!r}; pass port=None to pick a free one")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as error:
            raise ValueError(f"port {port} is in use ({error.strerror}); pass port=None to pick a free one, "
                             f"or another port") from None
    return port


def _run_rank(worker, rank, world_size, port, timeout, results, args):
    """The body of each spawned process: one thread, the process group, the worker, its result sent back."""
    torch.set_num_threads(1)
    # The processes meet on the loopback, so gloo is told to use it: left to itself it detects an
    # interface, which PyTorch's distributed docs say may not be the right one, to be overridden with
    # GLOO_SOCKET_IFNAME. A value the reader set is kept.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        result = worker(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(result)))  # bytes: no shared memory outlives the process
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent
        text = "".join(traceback.format_exception(error))
        results.put((rank, False, f"{type(error).__name__}: {error}\n\n{text}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(worker, world_size: int, *args, timeout: float = 120.0, port: int | None = None) -> list:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` new processes; return their results.

    Each process is spawned (``torch.multiprocessing``, start method "spawn", so it works from a
    notebook), runs one thread, and joins a gloo process group that meets on ``127.0.0.1:port``
    (``port=None``: a free port, found by binding port 0; a given port in use is refused with a
    ValueError, not retried). ``worker`` must be importable by name (defined in a module, such as
    this one) and return something picklable. Returns ``[result of rank 0, ..., rank world_size - 1]``.

    If a worker raises, the parent raises ``WorkerError`` with its rank, exception and traceback; if
    a process dies without a word, or ``timeout`` seconds pass, a RuntimeError / TimeoutError. In every
    case each process is joined, or killed, before ``launch`` returns or raises.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if not callable(worker):
        raise TypeError(f"worker must be a function worker(rank, world_size, *args), got {type(worker).__name__}")
    in_notebook = getattr(worker, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__")
    if in_notebook or "<locals>" in getattr(worker, "__qualname__", ""):
        raise TypeError(f"worker {getattr(worker, '__qualname__', worker)!r} cannot be imported by a spawned "
                        f"process: define it at the top level of a module (a .py file), not in a notebook or "
                        f"inside a function")
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        raise RuntimeError(f"a spawned process re-imports the main script, and {main_file!r} is not a file (a script "
                           f"piped to python?); save it to a .py file and run that, or call launch from a notebook")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    port = free_port() if port is None else check_port_free(port)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_run_rank, args=(worker, rank, world_size, port, timeout, results, args),
                                 daemon=True) for rank in range(world_size)]
    collected, started = {}, []
    try:
        for process in processes:
            process.start()
            started.append(process)
        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue_module.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the workers did not finish within timeout={timeout} s; every process "
                                       f"was killed; raise the timeout or shrink the work") from None
                for rank, process in enumerate(processes):
                    if rank not in collected and process.exitcode not in (None, 0):
                        raise RuntimeError(f"rank {rank} died (exit code {process.exitcode}) before sending its "
                                           f"result; every process was killed")
                continue
            if not ok:
                raise WorkerError(rank, f"rank {rank} raised {payload}")
            collected[rank] = pickle.loads(payload)
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in started:  # a process whose start() raised cannot be joined
            if process.is_alive():
                process.kill()
            process.join()
        results.close()
    return [collected[rank] for rank in range(world_size)]


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes.

    On Linux, ``VmHWM`` of ``/proc/self/status`` (kB): the high-water mark of this process's own memory.
    Not ``getrusage``'s ``ru_maxrss`` there: a spawned process is forked from its parent before it
    executes a fresh Python, and ``ru_maxrss`` keeps the forked image's peak, the parent's resident
    memory (measured: two children of a 527 MiB parent gave ru_maxrss 527 MiB, VmHWM 227 MiB). Elsewhere
    ``ru_maxrss`` (bytes on macOS, KiB on other systems; ``man getrusage``).
    """
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource  # Unix only: imported here so that the module still imports elsewhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ------------------------------------------------------------------------------- counted collectives

traffic: Counter = Counter()  # {collective: elements sent by this rank under the ring algorithm}
calls: Counter = Counter()  # {collective: how many times this rank called it}


def ring_elements(op: str, numel: int, world_size: int) -> float:
    """Elements one rank sends in a ring collective over ``p = world_size`` ranks.

    ``numel`` is the size of the whole tensor: the all-reduced one, the gathered output of an
    all-gather, the input of a reduce-scatter. Ring all-reduce = reduce-scatter then all-gather,
    ``2 (p - 1) / p x N``; all-gather and reduce-scatter ``(p - 1) / p x N`` (each rank passes on
    ``p - 1`` chunks of ``N / p``); a broadcast along a chain sends ``N`` from every rank but the
    last, ``(p - 1) / p x N`` on average.
    """
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
    if op not in factor:
        raise ValueError(f"op must be one of {sorted(factor)}, got {op!r}")
    return factor[op] * (world_size - 1) * numel / world_size


def _count(op: str, numel: int):
    traffic[op] += ring_elements(op, numel, dist.get_world_size())
    calls[op] += 1


def broadcast(tensor: torch.Tensor, src: int = 0):
    """Every rank's ``tensor`` becomes rank ``src``'s (in place)."""
    _count("broadcast", tensor.numel())
    dist.broadcast(tensor, src)


def all_reduce(tensor: torch.Tensor, async_op: bool = False):
    """Every rank's ``tensor`` becomes the sum over ranks (in place); ``async_op=True`` returns a handle
    whose ``wait()`` must return before the tensor is read."""
    _count("all_reduce", tensor.numel())
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)


def all_gather(output: torch.Tensor, shard: torch.Tensor):
    """``output [p x n]`` = the ``shard [n]`` of rank 0, then rank 1, ... (the same on every rank)."""
    if output.numel() != shard.numel() * dist.get_world_size():
        raise ValueError(f"all_gather needs output of world_size x {shard.numel()} elements, got {output.numel()}")
    _count("all_gather", output.numel())
    dist.all_gather_single(output, shard)


def reduce_scatter(shard: torch.Tensor, tensor: torch.Tensor):
    """``shard [n]`` of rank r = chunk r of the sum over ranks of ``tensor [p x n]``."""
    if tensor.numel() != shard.numel() * dist.get_world_size():
        raise ValueError(f"reduce_scatter needs input of world_size x {shard.numel()} elements, got {tensor.numel()}")
    _count("reduce_scatter", tensor.numel())
    dist.reduce_scatter_single(shard, tensor, op=dist.ReduceOp.SUM)


def collectives_worker(rank: int, world_size: int) -> dict:
    """The four collectives on small tensors: what each rank holds after each, and what it sent.

    Rank r starts from ``x = [10r + 1, 10r + 2, ..., 10r + 2p]`` (``2p`` integers, exact in float32).
    """
    traffic.clear()
    x = torch.arange(1.0, 2 * world_size + 1) + 10 * rank
    out = {"x": x.clone()}
    out["broadcast"] = x.clone()
    broadcast(out["broadcast"], src=0)
    out["all_reduce"] = x.clone()
    all_reduce(out["all_reduce"])
    out["all_gather"] = x.new_empty(world_size * x.numel())
    all_gather(out["all_gather"], x)
    out["reduce_scatter"] = x.new_empty(x.numel() // world_size)
    reduce_scatter(out["reduce_scatter"], x)
    out["traffic"] = dict(traffic)
    return out


# ---------------------------------------------------------------------------------- data parallelism


def split_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``batch [B, ...]``: rows ``rank x B/p`` to ``(rank + 1) x B/p``.

    ``B`` must be a multiple of ``p = world_size`` (a ValueError otherwise): with equal slices, the
    mean of the ranks' mean losses is the mean loss of the whole batch.
    """
    if batch.shape[0] % world_size:
        raise ValueError(f"a batch of {batch.shape[0]} rows cannot be split evenly over {world_size} processes; "
                         f"use a batch size that is a multiple of world_size")
    size = batch.shape[0] // world_size
    return batch[rank * size:(rank + 1) * size]


def broadcast_parameters(model: nn.Module, src: int = 0):
    """Every rank's parameters become rank ``src``'s: the same starting point everywhere."""
    with torch.no_grad():
        for p in model.parameters():
            broadcast(p.data, src)


def average_gradients(model: nn.Module):
    """After ``loss.backward()``: each gradient becomes its mean over ranks (all-reduce, then / p)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(p.grad)
            p.grad.div_(world_size)


class Bucket:
    """Consecutive parameters whose gradients are all-reduced together, as one flat tensor."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0  # how many of the parameters have their gradient for this step
        self.flat = None  # the flat gradients [sum of numels] while being reduced
        self.handle = None  # the async all-reduce's handle
        self.launched = None  # when the all-reduce started (perf_counter seconds)


class BucketedDDP:
    """Gradients all-reduced in buckets of about ``bucket_bytes``, launched during backward.

    Parameters go into buckets in reverse order (``model.parameters()`` reversed: the order their
    gradients tend to arrive). A hook (``register_post_accumulate_grad_hook``) fires when a
    gradient is complete; when a bucket's last one arrives, its gradients are copied into one
    flat tensor and an asynchronous all-reduce starts, while backward goes on. ``finish()``, after
    ``loss.backward()`` and before ``optimizer.step()``, waits on each handle, divides by ``p``
    and copies the means back into ``.grad``. Every parameter must get a gradient each step.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int = 2 ** 14):
        self.world_size = dist.get_world_size()
        self.buckets, current, size = [], [], 0
        for p in reversed([p for p in model.parameters() if p.requires_grad]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current))
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.done_before_wait = []  # per step: buckets whose all-reduce had finished when finish() began
        # per step, in perf_counter seconds: each bucket's launch, the end of backward (finish() called),
        # whether each bucket was done then, and when each bucket's wait() returned (an upper bound on
        # when its all-reduce finished: the waits run one after the other)
        self.timeline = []
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: torch.Tensor):
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket):
        if bucket.handle is not None:
            raise RuntimeError("a bucket was launched twice in one step; call finish() after each backward")
        bucket.flat = torch.cat([p.grad.flatten() for p in bucket.params])
        bucket.launched = time.perf_counter()
        bucket.handle = all_reduce(bucket.flat, async_op=True)

    def _wait(self, bucket: Bucket):
        bucket.handle.wait()

    def finish(self):
        """Wait for every bucket's all-reduce, then set each ``.grad`` to its mean over ranks."""
        backward_end = time.perf_counter()
        done = [b.handle is not None and b.handle.is_completed() for b in self.buckets]
        self.done_before_wait.append(sum(done))
        step = {"launched": [b.launched for b in self.buckets], "backward_end": backward_end,
                "done_at_end": done, "waited": []}
        for bucket in self.buckets:
            if bucket.handle is None:
                raise RuntimeError(f"{len(bucket.params) - bucket.ready} parameter(s) of a bucket got no gradient "
                                   f"in this backward; every parameter must take part in the loss")
            self._wait(bucket)
            step["waited"].append(time.perf_counter())
            bucket.flat.div_(self.world_size)
            offset = 0
            for p in bucket.params:
                p.grad.copy_(bucket.flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            bucket.ready, bucket.flat, bucket.handle = 0, None, None
        self.timeline.append(step)


# -------------------------------------------------------------------------------------------- ZeRO-1


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s shard of a flat tensor of ``numel`` elements (a multiple of p)."""
    size = numel // world_size
    return rank * size, (rank + 1) * size


def padded(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``, so that every shard has the same size."""
    return math.ceil(numel / world_size) * world_size


def flatten(tensors, numel: int) -> torch.Tensor:
    """The tensors one after the other, flat, zero-padded to ``numel`` elements."""
    flat = torch.cat([t.flatten() for t in tensors])
    return F.pad(flat, (0, numel - flat.numel()))


PIECE_NUMEL = 2 ** 16  # ZeroAdamW's default piece: 256 KiB of float32


class ZeroAdamW:
    """AdamW whose state lives in shards: each rank keeps the moments of its ``1/p`` of the parameters (ZeRO-1).

    The parameters are moved into one flat buffer ``flat [Psi_pad]`` (one after the other, zero-padded
    to a multiple of ``p``; each parameter becomes a view of it), cut into ``p`` shards of
    ``S = Psi_pad / p``. Rank r steps its shard only, in place, as ``pieces``: views of ``flat``
    of at most ``piece_numel`` elements each, one ``torch.optim.AdamW`` over them. ``step()``, after
    ``loss.backward()``: the gradients are copied into one flat tensor (each ``.grad`` freed once
    copied, so they are never held twice); piece by piece, the gradients are reduce-scattered (rank
    r receives the sum over ranks of its piece, then / p), AdamW steps the pieces, and they are
    all-gathered back into ``flat``, that is, into every rank's parameters. AdamW acts on each
    element alone, so stepping shards gives what one AdamW over all parameters gives. Pieces keep
    each temporary small: AdamW's, and the copy of the whole input (reduce-scatter) or output
    (all-gather) that gloo makes (measured, torch 2.13).
    """

    def __init__(self, params, piece_numel: int | None = None, **adamw):
        piece_numel = piece_numel or PIECE_NUMEL
        self.params = [p for p in params if p.requires_grad]
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = padded(sum(p.numel() for p in self.params), self.world_size)
        self.flat = flatten([p.detach() for p in self.params], self.numel)
        offset = 0
        for p in self.params:
            p.data = self.flat[offset:offset + p.numel()].view_as(p)  # the parameter now lives in flat
            offset += p.numel()
        self.start, end = shard_range(self.numel, self.rank, self.world_size)
        self.bounds = [(a, min(a + piece_numel, end - self.start)) for a in range(0, end - self.start, piece_numel)]
        self.pieces = [nn.Parameter(self.flat[self.start + a:self.start + b]) for a, b in self.bounds]  # views
        self.optimizer = torch.optim.AdamW(self.pieces, **adamw)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if any(p.grad is None for p in self.params):
            raise ValueError("a parameter has no gradient: call loss.backward() before step(), and use every "
                             "parameter in the loss (ZeroAdamW shards all of them)")
        p, size = self.world_size, self.numel // self.world_size
        grads, offset = self.flat.new_empty(self.numel), 0
        for param in self.params:
            grads[offset:offset + param.numel()] = param.grad.flatten()
            param.grad = None  # copied: freed now, so that the gradients are never held twice
            offset += param.numel()
        grads[offset:] = 0
        for (a, b), piece in zip(self.bounds, self.pieces):
            chunks = grads.view(p, size)[:, a:b].contiguous().flatten()  # piece (a, b) of every rank's shard
            piece.grad = grads[self.start + a:self.start + b]  # the sum lands in this rank's own place
            reduce_scatter(piece.grad, chunks)
            piece.grad.div_(p)
        self.optimizer.step()
        for (a, b), piece in zip(self.bounds, self.pieces):
            piece.grad = None
            gathered = piece.new_empty(p * (b - a))
            all_gather(gathered, piece.detach())
            self.flat.view(p, size)[:, a:b] = gathered.view(p, b - a)

    def state_bytes(self) -> int:
        """Bytes of AdamW's two moments on this rank (``exp_avg`` and ``exp_avg_sq``; not its step counter)."""
        return sum(s[k].numel() * s[k].element_size() for s in self.optimizer.state.values()
                   for k in ("exp_avg", "exp_avg_sq"))


# ---------------------------------------------------------------------------------------------- FSDP


class _Gather(torch.autograd.Function):
    """Forward: all-gather a unit's shards into its full flat parameters. Backward: reduce-scatter the
    gradient of the full parameters, so each rank gets the mean gradient of its shard."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        full = shard.new_empty(shard.numel() * unit.world_size)
        all_gather(full, shard)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        unit = ctx.unit
        grad_shard = grad_full.new_empty(grad_full.numel() // unit.world_size)
        reduce_scatter(grad_shard, grad_full.contiguous())
        unit.free()  # the last use of the gathered parameters in this step
        return grad_shard.div_(unit.world_size), None


class FlatUnit:
    """One unit of ``ShardedModel``: some parameters of a module, flattened, padded and sharded.

    ``places`` lists where each parameter lives, ``[(module, attribute name), ...]`` per parameter
    (a tied parameter has two places). ``shard`` (``[Psi_unit_pad / p]``) is the only copy this
    rank keeps between steps. ``gather()`` builds the full flat parameters (``_Gather``) and points
    every place at a view of them; ``free()`` releases their memory (``untyped_storage().resize_(0)``:
    the views stay, empty); ``regather()`` refills the same memory, in backward, before the unit's
    gradients are computed.
    """

    def __init__(self, params: list[nn.Parameter], places: list[list[tuple[nn.Module, str]]], rank: int,
                 world_size: int, stats: dict):
        self.places, self.world_size, self.stats = places, world_size, stats
        self.shapes = [p.shape for p in params]
        self.numel = padded(sum(p.numel() for p in params), world_size)
        start, end = shard_range(self.numel, rank, world_size)
        self.shard = nn.Parameter(flatten([p.detach() for p in params], self.numel)[start:end].clone())
        self.full = None
        for where in places:
            for module, name in where:
                del module._parameters[name]  # from now on a plain attribute, set by gather()

    def gather(self):
        self.full = _Gather.apply(self.shard, self)
        self._held(+1)
        offset = 0
        for shape, where in zip(self.shapes, self.places):
            view = self.full[offset:offset + shape.numel()].view(shape)
            for module, name in where:
                setattr(module, name, view)
            offset += shape.numel()

    def free(self):
        if self.full is not None and self.full.untyped_storage().size() > 0:
            self.full.untyped_storage().resize_(0)
            self._held(-1)

    def regather(self, grad=None):
        if self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.numel * self.full.element_size())
            all_gather(self.full.data, self.shard.detach())  # .data: saved views keep their version
            self._held(+1)

    def _held(self, sign: int):
        self.stats["held"] += sign * self.numel * self.shard.element_size()
        self.stats["peak"] = max(self.stats["peak"], self.stats["held"])
        self.stats["history"].append(self.stats["held"])


class ShardedModel(nn.Module):
    """FSDP from scratch (ZeRO-3): ``model``'s parameters sharded per unit, gathered only when needed.

    The units are each module in ``layers`` (``model.blocks`` for the GPT) and the rest of
    ``model`` (embeddings, final norm, output layer, tied or not). A unit is all-gathered just before
    its forward and freed just after; in backward it is gathered again (a hook on its output's
    gradient) and, after its gradients are computed, they are reduce-scattered to the shards and
    the full parameters freed. The rest of the model is gathered for the whole forward (the output
    layer runs last). ``parameters()`` are the shards: give them to ``torch.optim.AdamW``.
    Preconditions: the same parameters on every rank (``broadcast_parameters`` first), and every
    parameter used in each forward.
    ``forward(*args)`` is ``model``'s; ``full_parameters()`` gathers ``{name: full tensor}``.
    """

    def __init__(self, model: nn.Module, layers):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.model_ = [model]  # a list: not a sub-module, so parameters() are the shards only
        self.stats = {"held": 0, "peak": 0, "history": []}  # history: held after each gather or free
        self.names = {id(p): name for name, p in model.named_parameters()}
        taken, plan = set(), []  # plan: (layer, its parameters, their places), before any is replaced
        for layer in list(layers) + [model]:
            found = {}  # id -> (parameter, places): a tied parameter has one entry and two places
            for module in layer.modules():
                for name, p in module._parameters.items():
                    if p is not None and id(p) not in taken:
                        found.setdefault(id(p), (p, []))[1].append((module, name))
            taken |= set(found)
            plan.append((layer, [p for p, _ in found.values()], [where for _, where in found.values()]))
        self.order = [[self.names[id(p)] for p in params] for _, params, _ in plan]
        self.units = []
        for layer, params, places in plan:
            unit = FlatUnit(params, places, rank, world_size, self.stats)
            layer.register_forward_pre_hook(lambda module, args, unit=unit: unit.gather())
            layer.register_forward_hook(lambda module, args, output, unit=unit: self._after(unit, output))
            self.units.append(unit)
        self.shards = nn.ParameterList([unit.shard for unit in self.units])

    @staticmethod
    def _after(unit: FlatUnit, output: torch.Tensor):
        unit.free()
        if output.requires_grad:
            output.register_hook(unit.regather)

    def forward(self, *args, **kwargs):
        return self.model_[0](*args, **kwargs)

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """``{name: tensor}`` of the whole model, gathered from the shards (a collective: call on every rank)."""
        out = {}
        for unit, names in zip(self.units, self.order):
            full = unit.shard.new_empty(unit.numel)
            all_gather(full, unit.shard.detach())
            offset = 0
            for name, shape in zip(names, unit.shapes):
                out[name] = full[offset:offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        return out


# ------------------------------------------------------------------------------- tensor parallelism


class CopyToParallel(torch.autograd.Function):
    """Megatron-LM's ``f`` (Shoeybi et al. 2019, Figure 3): the identity in forward, an all-reduce of
    the gradient in backward (each rank's input feeds only its slice of the layer, so the gradient
    of the input is the sum of the ranks' parts)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron-LM's ``g`` (Figure 3): an all-reduce in forward (the sum of the ranks' partial
    outputs), the identity in backward (every rank's output gets the same whole gradient)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def f(x: torch.Tensor) -> torch.Tensor:
    """``CopyToParallel``: forward ``x`` as is; backward, all-reduce its gradient."""
    return CopyToParallel.apply(x)


def g(x: torch.Tensor) -> torch.Tensor:
    """``ReduceFromParallel``: forward, the all-reduced sum of ``x`` over ranks; backward as is."""
    return ReduceFromParallel.apply(x)


class TensorParallelFeedForward(nn.Module):
    """A ``tfcore.layers.FeedForward`` split over ``world_size`` ranks (Megatron-LM, section 3).

    With ``linear_1.weight`` ``[d_ff, d]`` and ``linear_2.weight`` ``[d, d_ff]``, rank r keeps rows
    ``r d_ff/p`` to ``(r+1) d_ff/p`` of ``linear_1`` (and of its bias): the paper's column split of
    ``A``, since ``linear_1`` computes ``x A`` with ``A`` its weight transposed; and the same columns
    of ``linear_2``: the row split of ``B``. The activation acts on each of its own ``d_ff/p``
    features, so no exchange is needed between the two layers: ``f`` before, ``g`` after, one
    all-reduce of ``[B, L, d]`` each way. ``linear_2``'s bias is added once, after the all-reduce,
    on every rank (each rank keeps it whole; its gradient is the whole one on every rank).
    ``forward(x [B, L, d]) -> [B, L, d]``, the same on every rank (a collective: call on every rank).
    Preconditions: ``d_ff`` a multiple of ``world_size`` and no dropout (each rank would draw its own).
    """

    def __init__(self, feed_forward: nn.Module, rank: int, world_size: int):
        super().__init__()
        d_ff, d = feed_forward.linear_1.weight.shape
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
        if d_ff % world_size:
            raise ValueError(f"the feed-forward width d_ff={d_ff} cannot be split evenly over {world_size} ranks; "
                             f"use an intermediate_size that is a multiple of world_size")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if feed_forward.dropout.p > 0:
            raise ValueError(f"dropout p={feed_forward.dropout.p} after the all-reduce would draw a different mask "
                             f"on each rank; build the layer with hidden_dropout_prob=0")
        rows = slice(rank * d_ff // world_size, (rank + 1) * d_ff // world_size)
        one, two = feed_forward.linear_1, feed_forward.linear_2
        self.linear_1 = nn.Linear(d, d_ff // world_size, dtype=one.weight.dtype)  # column split of A
        self.linear_2 = nn.Linear(d_ff // world_size, d, bias=False, dtype=two.weight.dtype)  # row split of B
        with torch.no_grad():
            self.linear_1.weight.copy_(one.weight[rows])
            self.linear_1.bias.copy_(one.bias[rows])
            self.linear_2.weight.copy_(two.weight[:, rows])
        self.bias_2 = nn.Parameter(two.bias.detach().clone())  # whole on every rank, added once
        self.activation = copy.deepcopy(feed_forward.gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear_2(self.activation(self.linear_1(f(x))))  # [B, L, d]: this rank's share
        return g(partial) + self.bias_2


def tensor_parallel_worker(rank: int, world_size: int, config, dtype=torch.float64, seed: int = 0,
                           batch: int = 2, length: int = 5) -> dict:
    """``TensorParallelFeedForward`` against the whole layer, on one random input, forward and backward.

    ``config`` needs ``hidden_size`` (d), ``intermediate_size`` (d_ff) and ``hidden_act`` (a name
    ``tfcore.gpt.activation`` knows). Every rank draws the same layer (``seed``: weights and biases
    from ``nn.Linear``'s random init), the same ``x [batch, length, d]`` (requires_grad) and upstream
    gradient. Returns ``output``, ``grad_x`` and ``grads`` (``{name: full gradient}``: the shards'
    gradients gathered back to ``linear_1.weight [d_ff, d]``, ``linear_1.bias``, ``linear_2.weight
    [d, d_ff]``, ``linear_2.bias``) of the split layer, ``reference``: the same three of the whole
    layer, ``traffic`` ``{"forward": {...}, "backward": {...}}`` (elements this rank sent, by
    collective) and ``parameters`` / ``reference_parameters`` (elements held on this rank / whole).
    """
    from types import SimpleNamespace

    from .gpt import activation
    from .layers import FeedForward

    torch.manual_seed(seed)
    sizes = SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act="gelu", hidden_dropout_prob=0.0)
    whole = FeedForward(sizes).to(dtype)
    whole.gelu = activation(getattr(config, "hidden_act", "gelu"))
    x = torch.randn(batch, length, config.hidden_size, dtype=dtype)
    upstream = torch.randn(batch, length, config.hidden_size, dtype=dtype)
    split = TensorParallelFeedForward(whole, rank, world_size)
    out = {"traffic": {}}
    x_split = x.clone().requires_grad_()
    traffic.clear()
    output = split(x_split)
    out["traffic"]["forward"] = dict(traffic)
    traffic.clear()
    output.backward(upstream)
    out["traffic"]["backward"] = dict(traffic)
    out["output"], out["grad_x"] = output.detach(), x_split.grad

    def gathered(shard: torch.Tensor) -> torch.Tensor:  # the ranks' shards along dim 0, one after the other
        full = shard.new_empty(world_size * shard.numel())
        all_gather(full, shard.contiguous().flatten())
        return full.view(world_size * shard.shape[0], *shard.shape[1:])

    out["grads"] = {"linear_1.weight": gathered(split.linear_1.weight.grad),
                    "linear_1.bias": gathered(split.linear_1.bias.grad),
                    "linear_2.weight": gathered(split.linear_2.weight.grad.t()).t(),
                    "linear_2.bias": split.bias_2.grad}
    x_whole = x.clone().requires_grad_()
    reference = whole(x_whole)
    reference.backward(upstream)
    out["reference"] = {"output": reference.detach(), "grad_x": x_whole.grad,
                        "grads": {name: p.grad for name, p in whole.named_parameters()}}
    out["parameters"] = sum(p.numel() for p in split.parameters())
    out["reference_parameters"] = sum(p.numel() for p in whole.parameters())
    return out


# -------------------------------------------------------------------------------------- training GPT


def make_model(config, dtype: torch.dtype, seed: int, random_norms: bool = False) -> nn.Module:
    """``tfcore.GPT(config)`` in ``dtype``, its weights drawn with ``seed``; ``random_norms=True`` also
    draws every LayerNorm weight (1 + normal(0, 0.1)) and bias (normal(0, 0.1)), so none is trivially equal."""
    from .gpt import GPT

    torch.manual_seed(seed)
    model = GPT(config).to(dtype)
    if random_norms:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.normal_(1.0, 0.1)
                    module.bias.normal_(0.0, 0.1)
    return model


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The book's loss (chapter 14): mean cross-entropy of each next token of ``ids [B, L + 1]``."""
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def check_batches(batches: torch.Tensor, world_size: int):
    """``batches [steps, B, L + 1]`` of token ids, ``B`` a multiple of ``world_size``: a ValueError otherwise."""
    if not isinstance(batches, torch.Tensor) or batches.dim() != 3 or batches.is_floating_point():
        got = tuple(batches.shape) if isinstance(batches, torch.Tensor) else type(batches).__name__
        raise ValueError(f"batches must be token ids [steps, B, L + 1], got {got}")
    if batches.shape[1] % world_size:
        raise ValueError(f"a batch of {batches.shape[1]} rows cannot be split evenly over {world_size} processes; "
                         f"use a batch size that is a multiple of world_size")


def train_single(config, batches: torch.Tensor, dtype=torch.float64, seed: int = 0, random_norms: bool = False,
                 adamw: dict | None = None) -> dict:
    """The reference: one process, the whole batch, ``torch.optim.AdamW``. Returns ``{name: parameter}``."""
    model = make_model(config, dtype, seed, random_norms)
    optimizer = torch.optim.AdamW(model.parameters(), **(adamw or ADAMW))
    for ids in batches:
        optimizer.zero_grad()
        lm_loss(model, ids).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def memory_formula(config, scheme: str, world_size: int, dtype: torch.dtype = torch.float32) -> dict:
    """Bytes per rank that ``scheme`` holds at its peak, by part, from the counts the code uses.

    ``Psi`` parameters (the tied output layer counted once), ``b`` bytes each, ``p = world_size``:

    - ``ddp``: ``parameters`` b Psi, ``gradients`` b Psi, ``optimizer`` (AdamW's two moments) 2 b Psi.
    - ``zero1``: ``parameters`` b Psi_pad (``ZeroAdamW.flat``), ``gradients`` b Psi_pad (the ``.grad``
      of backward, or the flat copy that replaces them in ``step``), ``optimizer`` 2 b Psi_pad / p.
    - ``fsdp``: per unit (each block, and the rest of the model) padded to a multiple of p, ``Psi_u``
      in all: ``parameters`` b Psi_u / p (the shards), ``gradients`` b Psi_u / p, ``optimizer``
      2 b Psi_u / p, ``gathered`` the most parameter bytes gathered at once (the rest of the model and
      one block: ``ShardedModel.stats["peak"]``) and ``gathered_gradients``, as much again (their full
      gradients, before the reduce-scatter).

    ``total`` is the sum. Not counted: activations, and the temporaries of AdamW, autograd and gloo.
    """
    from .gpt import GPT

    if scheme not in ("ddp", "zero1", "fsdp"):
        raise ValueError(f"memory_formula covers ddp, zero1 and fsdp, got {scheme!r}")
    with torch.device("meta"):
        model = GPT(config)
    b, p = torch.empty(0, dtype=dtype).element_size(), world_size
    psi = sum(t.numel() for t in model.parameters())
    if scheme == "ddp":
        parts = {"parameters": b * psi, "gradients": b * psi, "optimizer": 2 * b * psi}
    elif scheme == "zero1":
        pad = padded(psi, p)
        parts = {"parameters": b * pad, "gradients": b * pad, "optimizer": 2 * b * pad // p}
    else:
        blocks = [padded(sum(t.numel() for t in block.parameters()), p) for block in model.blocks]
        rest = padded(psi - sum(t.numel() for t in model.blocks.parameters()), p)
        units = sum(blocks) + rest
        parts = {"parameters": b * units // p, "gradients": b * units // p, "optimizer": 2 * b * units // p,
                 "gathered": b * (rest + max(blocks)), "gathered_gradients": b * (rest + max(blocks))}
    return {**parts, "total": sum(parts.values())}


def train_worker(rank: int, world_size: int, scheme: str, config, batches: torch.Tensor, dtype=torch.float64,
                 seed: int = 0, random_norms: bool = False, adamw: dict | None = None,
                 bucket_bytes: int = 2 ** 14, measure_memory: bool = False) -> dict:
    """Train ``tfcore.GPT(config)`` on ``batches [steps, B, L + 1]`` with ``scheme``, this rank on its ``B/p`` rows.

    Each rank draws its own weights (seed ``seed + rank``), so the broadcast from rank 0 is what makes
    them equal. Returns ``params`` ``{name: tensor}`` after the last step, ``traffic`` (elements this
    rank sent in the last step, by collective; our schemes only), ``calls`` (how many times it called
    each collective in the last step), ``state_bytes`` (AdamW's moments
    on this rank), ``param_bytes`` (parameters kept between steps on this rank; zero1: its flat
    buffer, padded), ``peak_param_bytes``
    (the most parameter bytes alive at once, FSDP), ``held_history`` (FSDP: the bytes of whole
    parameters after each gather and free of the last step, starting from the step's start),
    ``buckets`` (bucketed: the parameter names of each bucket, in the order they are reduced),
    ``done_before_wait`` (bucketed: per step, the buckets already reduced when ``finish()`` began),
    ``timeline`` (bucketed: per step, seconds from the step's start: each bucket's ``launched``, the
    ``backward_end``, ``done_at_end`` per bucket, and when each bucket's wait returned, ``waited``)
    and ``seconds`` (wall time of each step).

    ``measure_memory=True`` adds ``rss_before`` (this process's resident bytes just before the model is
    built) and ``peak_rss`` (its peak resident bytes after the last step, ``peak_rss_bytes()``):
    ``peak_rss - rss_before`` is what the scheme added at its worst moment. The peak never falls, so
    it means something only for the first model a process trains. Before measuring, one step runs
    on a tiny model (``_warm_up``), so that the figure does not count the code the first step maps
    in; ``malloc_pinned`` says whether glibc's mmap threshold was fixed (``MALLOC_ENV``, which
    ``train`` sets for its processes): without it, the figure also counts memory freed but kept.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    adamw = adamw or ADAMW
    out = {"peak_param_bytes": None, "done_before_wait": None}
    if measure_memory:
        import psutil

        out["malloc_pinned"] = "MALLOC_MMAP_THRESHOLD_" in os.environ
        _warm_up(rank, world_size, scheme, config, batches, dtype)
        out["rss_before"] = psutil.Process().memory_info().rss
    model = make_model(config, dtype, seed + rank, random_norms)
    broadcast_parameters(model)
    if scheme == "torch_ddp":
        net = DistributedDataParallel(model)
    elif scheme == "torch_fsdp":
        for block in model.blocks:
            fully_shard(block)
        net = fully_shard(model)
    elif scheme == "fsdp":
        net = ShardedModel(model, model.blocks)
    else:
        net = model
    if scheme == "zero1":
        optimizer = ZeroAdamW(model.parameters(), **adamw)
    else:
        optimizer = torch.optim.AdamW(net.parameters(), **adamw)
    ddp = BucketedDDP(model, bucket_bytes) if scheme == "bucketed" else None
    seconds, starts = [], []
    for ids in batches:
        start = time.perf_counter()
        starts.append(start)
        traffic.clear()
        calls.clear()
        if scheme == "fsdp":
            net.stats["history"] = [net.stats["held"]]
        optimizer.zero_grad()
        lm_loss(net, split_batch(ids, rank, world_size)).backward()
        if scheme == "ddp":
            average_gradients(model)
        elif scheme == "bucketed":
            ddp.finish()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        out["traffic"] = dict(traffic)
        out["calls"] = dict(calls)
    if measure_memory:
        out["peak_rss"] = peak_rss_bytes()
    if scheme == "fsdp":
        out["params"] = net.full_parameters()
        out["param_bytes"] = sum(u.shard.numel() * u.shard.element_size() for u in net.units)
        out["peak_param_bytes"] = net.stats["peak"]
        out["held_history"] = net.stats["history"]
    elif scheme == "torch_fsdp":
        out["params"] = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
        out["param_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    elif scheme == "zero1":  # the parameters live in one flat buffer, padded
        out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        out["param_bytes"] = optimizer.flat.numel() * optimizer.flat.element_size()
    else:
        out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if scheme == "zero1":
        out["state_bytes"] = optimizer.state_bytes()
    else:
        out["state_bytes"] = sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values()
                                 for k in ("exp_avg", "exp_avg_sq"))
        if scheme == "torch_fsdp":  # DTensor moments: this rank's local shards
            out["state_bytes"] = sum(s[k].to_local().numel() * s[k].element_size()
                                     for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    if ddp is not None:
        out["done_before_wait"] = ddp.done_before_wait
        names = {id(p): name for name, p in model.named_parameters()}
        out["buckets"] = [[names[id(p)] for p in bucket.params] for bucket in ddp.buckets]
        out["timeline"] = [{"launched": [t - start for t in step["launched"]],
                            "backward_end": step["backward_end"] - start, "done_at_end": step["done_at_end"],
                            "waited": [t - start for t in step["waited"]]}
                           for start, step in zip(starts, ddp.timeline)]
    out["seconds"] = seconds
    return out


# glibc's malloc serves a block of at least its mmap threshold with its own mmap, returned to the system when
# freed; but each such free raises the threshold to the block's size (up to 32 MiB, ``man mallopt``), so later
# tensors of up to that size come from heaps, which keep freed memory: resident memory then tells the
# allocator's history, not the tensors alive (measured: FSDP's peak 22 bytes per parameter instead of 11).
# Fixing the threshold, here at its starting value, turns the raising off. glibc reads it from the
# environment when a process starts; mallopt() from inside the worker came too late (FSDP still 21).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _warm_up(rank: int, world_size: int, scheme: str, config, batches: torch.Tensor, dtype: torch.dtype):
    """One step of ``scheme`` on a tiny GPT of ``config``'s kind (1 block, width 2 per head, vocabulary <= 64):
    the first use of each kernel and collective maps its code and buffers into the process (about 45 MB
    here, the same for any model size), which a memory measurement should not charge to the model."""
    from dataclasses import replace

    width = 2 * config.num_attention_heads
    tiny = replace(config, vocab_size=min(config.vocab_size, 64), hidden_size=width, intermediate_size=4 * width,
                   num_hidden_layers=1)
    train_worker(rank, world_size, scheme, tiny, batches[:1] % tiny.vocab_size, dtype)


def train_many_worker(rank: int, world_size: int, schemes, config, batches: torch.Tensor, *options) -> dict:
    """``train_worker`` for each of ``schemes`` in turn, in the same processes: ``{scheme: this rank's dict}``.
    ``options`` are ``train_worker``'s, after ``batches``, in its order."""
    return {scheme: train_worker(rank, world_size, scheme, config, batches, *options) for scheme in schemes}


def train(schemes, config, batches: torch.Tensor, world_size: int = 2, timeout: float = 120.0, **options):
    """``train_worker`` in ``world_size`` processes (``launch``), for one scheme or several.

    ``schemes`` one name: returns ``[rank 0's dict, rank 1's dict, ...]``. A tuple or list of names:
    every scheme runs in the same processes, one after the other (spawning costs seconds), and
    ``{scheme: [rank 0's dict, ...]}`` comes back. ``options``: ``dtype``, ``seed``, ``random_norms``,
    ``adamw``, ``bucket_bytes``, ``measure_memory`` (one scheme per launch then: a process's peak
    memory never falls, so a second scheme would inherit the first one's peak; glibc's mmap threshold
    is then fixed in the processes, ``MALLOC_ENV``). The schemes, the
    options and the batch size are checked before any process starts.
    """
    names = [schemes] if isinstance(schemes, str) else list(schemes) if isinstance(schemes, (tuple, list)) else None
    if not names:
        raise ValueError(f"schemes must be a scheme name or a non-empty tuple/list of them, got {schemes!r}")
    for scheme in names:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"schemes {names} name one scheme twice; give each once")
    args = _options(options)
    if options.get("measure_memory") and len(names) > 1:
        raise ValueError(f"one scheme per launch when measuring memory: a process's peak resident memory never "
                         f"falls, so the schemes after the first would inherit its peak; call train once per "
                         f"scheme, got {names}")
    check_batches(batches, world_size)
    saved = dict(os.environ)
    if options.get("measure_memory"):  # the spawned processes inherit the environment (MALLOC_ENV)
        os.environ.update({k: v for k, v in MALLOC_ENV.items() if k not in os.environ})
    try:
        if isinstance(schemes, str):
            return launch(train_worker, world_size, schemes, config, batches, *args, timeout=timeout)
        results = launch(train_many_worker, world_size, tuple(names), config, batches, *args, timeout=timeout)
    finally:
        for key in MALLOC_ENV:
            if key not in saved:
                os.environ.pop(key, None)
    return {scheme: [result[scheme] for result in results] for scheme in names}


def _options(options: dict) -> tuple:
    names = ("dtype", "seed", "random_norms", "adamw", "bucket_bytes", "measure_memory")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; train takes {', '.join(names)}")
    defaults = {"dtype": torch.float64, "seed": 0, "random_norms": False, "adamw": None, "bucket_bytes": 2 ** 14,
                "measure_memory": False}
    defaults.update(options)
    return tuple(defaults[n] for n in names)
