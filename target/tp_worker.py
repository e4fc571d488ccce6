"""Tensor-parallel process layout: rank 0 drives, ranks 1..N-1 only run their shard of the target.

Rank 0 is the serving process: scheduler, drafters, verifier and gateway live there and nowhere else.
``TensorParallelTarget`` stands in for the ``Transformer`` the engine holds, and ``TPKVCache`` for its
``KVCache``; the engine uses both unchanged. Each forward, rank 0 broadcasts ONE packed int64 tensor
(a fixed header, then the ``ForwardBatch`` fields) and every rank runs ``ShardedTransformer.forward`` on
it; the collectives inside pair up. This is vLLM's driver-worker broadcast, cut down to one flat tensor:
no pickling and no RPC by method name on the hot path.

KV bookkeeping (block tables, the pool, prefix sharing) stays on rank 0. Workers hold K/V tensors with the
same blocks and pages, their own KV heads only, and replay rank 0's two KV mutations: copy-on-write block
copies and post-acceptance compaction. Those ride on the next message rather than costing a broadcast of
their own; ``TPKVCache.compact`` flushes first when ops are already pending, so replay order is exact.

Failure: a dead worker must fail a step, not hang the server. Rank 0 checks that every worker is alive
before each broadcast, and its process group carries ``step_timeout_s``, so a collective with a peer that
died mid-step raises (gloo drops the connection at once; NCCL aborts the communicator at the timeout).
Any failure marks the target unhealthy for good: the ranks have lost step with each other.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from target.batch import ForwardBatch
from target.kv_cache import KVCache
from target.model import Transformer
from target.parallel import ShardedTransformer, check_shardable

FORWARD, COMPACT, NEW_CACHE, RESIZE, SHUTDOWN = 1, 2, 3, 4, 5
# Header slots: op, then sizes T B max_blocks R, flags has_mask is_decode, counts moves copies, two op args.
HEADER = 11
WORKER_TIMEOUT = timedelta(days=365)  # a worker waits for rank 0's next message however long the server idles


@dataclass(frozen=True, slots=True)
class TPConfig:
    world_size: int
    device_type: str = "cpu"  # "cuda": NCCL, rank r on cuda:r; "cpu": gloo
    step_timeout_s: float = 60.0  # rank 0's bound on one collective: covers the first call's kernel tuning
    startup_timeout_s: float = 1800.0  # every worker loads the checkpoint, then keeps its shard
    capacity: int = 1 << 14  # int64s in the message buffer; grows by a RESIZE message when a batch needs more

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"tensor parallel needs world_size >= 2, got {self.world_size}")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallel runs on cpu (gloo) or cuda (NCCL), got {self.device_type!r}")

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device_type == "cuda" else torch.device("cpu")


class WorkerLost(RuntimeError):
    """A tensor-parallel rank died or a collective failed: this target cannot run another step."""


# --- the message ------------------------------------------------------------------------------------


def pack(op: int, device: torch.device, batch: ForwardBatch | None = None, moves: tuple[torch.Tensor, ...] = (),
         copies: tuple[list[int], list[int]] = ([], []), args: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """One flat int64 tensor: header, then the batch fields, then KV moves (src, dst) and block copies (src, dst)."""
    src, dst = moves if moves else (torch.empty(0, dtype=torch.int64, device=device),) * 2
    parts: list[torch.Tensor] = []
    sizes = [0, 0, 0, 0, 0, 0]
    if batch is not None:
        B, MB = batch.block_tables.shape
        has_mask = batch.mask_bits is not None
        sizes = [batch.num_tokens, B, MB, batch.logits_indices.shape[0], int(has_mask), int(batch.is_decode)]
        parts = [batch.tokens, batch.positions, batch.slot_mapping, batch.block_tables.flatten(), batch.context_lens,
                 batch.query_start] + ([batch.mask_bits] if has_mask else []) + [batch.logits_indices]
    header = torch.tensor([op, *sizes, src.shape[0], len(copies[0]), *args], dtype=torch.int64)
    tail = torch.tensor(copies[0] + copies[1], dtype=torch.int64)
    return torch.cat([header.to(device, non_blocking=True)] + [p.to(torch.int64) for p in parts]
                     + [src, dst, tail.to(device, non_blocking=True)])


@dataclass(slots=True)
class Message:
    op: int
    batch: ForwardBatch | None
    moves: tuple[torch.Tensor, torch.Tensor]  # [M] src, [M] dst flat slots
    copies: tuple[torch.Tensor, torch.Tensor]  # [C] src, [C] dst blocks
    args: tuple[int, int]


def unpack(buf: torch.Tensor) -> Message:
    """The inverse of ``pack``; reads the header on the host (a worker-side sync, off rank 0's path)."""
    op, T, B, MB, R, has_mask, is_decode, M, C, a0, a1 = buf[:HEADER].tolist()
    at = HEADER

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return buf[at - n : at]

    batch = None
    if op == FORWARD:
        tokens, positions, slots = take(T), take(T), take(T)
        tables = take(B * MB).view(B, MB).to(torch.int32)
        ctx, qs = take(B).to(torch.int32), take(B + 1).to(torch.int32)
        bits = take(T) if has_mask else None
        batch = ForwardBatch(tokens, positions, slots, tables, ctx, qs, bits, take(R), [], bool(is_decode))
    moves = (take(M), take(M))
    return Message(op, batch, moves, (take(C), take(C)), (a0, a1))


# --- workers ----------------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives a SIGKILLed server otherwise (daemon children are only ended on a clean exit)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def worker_main(rank: int, cfg: TPConfig, init_method: str, build: Callable[[], Transformer],
                ready: "mp.Queue[tuple[int, str | None]]", parent_pid: int) -> None:
    """A worker process: join the group, build and shard the target, then serve rank 0's messages until SHUTDOWN."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = cfg.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share one host's cores: oversubscribed threads would spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=cfg.world_size,
                            timeout=WORKER_TIMEOUT)
    try:
        model = ShardedTransformer(build(), rank, cfg.world_size, device)
    except Exception as exc:  # noqa: BLE001 -- reported to rank 0, which raises it
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, None))
    try:
        serve(model, cfg, device)
    except Exception:  # noqa: BLE001 -- exit so rank 0's collective fails now instead of at its timeout
        traceback.print_exc(file=sys.stderr)
        os._exit(1)
    dist.destroy_process_group()


@torch.inference_mode()
def serve(model: ShardedTransformer, cfg: TPConfig, device: torch.device) -> None:
    """The worker loop: receive, replay KV ops, run the shard's forward (its output is dropped: rank 0 has it)."""
    buf = torch.empty(cfg.capacity, dtype=torch.int64, device=device)
    cache: KVCache | None = None
    while True:
        dist.broadcast(buf, src=0)
        msg = unpack(buf)
        if msg.op == SHUTDOWN:
            return
        if msg.op == RESIZE:
            buf = torch.empty(msg.args[0], dtype=torch.int64, device=device)
            continue
        if msg.op == NEW_CACHE:
            cache = model.new_cache(*msg.args)
            continue
        assert cache is not None, "rank 0 sent a forward before NEW_CACHE"
        if msg.moves[0].numel():
            cache.compact(*msg.moves)
        for src, dst in zip(msg.copies[0].tolist(), msg.copies[1].tolist()):  # in rank 0's order
            cache.copy_block(src, dst)
        if msg.batch is not None:
            model.forward(msg.batch, cache)


# --- rank 0 -----------------------------------------------------------------------------------------


class TPKVCache(KVCache):
    """Rank 0's KV (its own KV heads) plus the block copies and compactions the workers have yet to replay."""

    def __init__(self, target: "TensorParallelTarget", num_blocks: int, page_size: int) -> None:
        shard = target.shard
        super().__init__(shard.num_layers, num_blocks, page_size, shard.num_kv_heads, shard.config.head_dim,
                         shard.dtype, shard.device)
        self.target = target
        self.moves: tuple[torch.Tensor, ...] = ()
        self.copies: tuple[list[int], list[int]] = ([], [])

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.copies[0].append(src)
        self.copies[1].append(dst)

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        super().compact(src_slots, dst_slots)
        if self.moves or self.copies[0]:  # workers replay moves before copies: keep that order true
            self.target.send(COMPACT)
        self.moves = (src_slots, dst_slots)

    def take_pending(self) -> tuple[tuple[torch.Tensor, ...], tuple[list[int], list[int]]]:
        out = self.moves, self.copies
        self.moves, self.copies = (), ([], [])
        return out


class TensorParallelTarget:
    """What the engine holds as its target on rank 0: ``forward`` and ``new_cache`` fan out to every rank.

    Not thread-safe, like the engine: one thread drives it. ``healthy`` turns False for good on the first
    failure (a dead worker, a failed collective); every later ``forward`` raises ``WorkerLost`` at once.
    """

    def __init__(self, shard: ShardedTransformer, cfg: TPConfig, workers: list[mp.Process]) -> None:
        self.shard, self.cfg, self.workers = shard, cfg, workers
        self.config, self.device, self.dtype = shard.config, shard.device, shard.dtype
        self.healthy = True
        self.error: str | None = None
        self.cache: TPKVCache | None = None
        self._capacity = cfg.capacity
        self._buf = torch.empty(cfg.capacity, dtype=torch.int64, device=shard.device)

    @property
    def num_layers(self) -> int:
        return self.shard.num_layers

    def new_cache(self, num_blocks: int, page_size: int) -> TPKVCache:
        """The engine's cache; every worker allocates its own part. One cache per target (workers hold one)."""
        self.cache = TPKVCache(self, num_blocks, page_size)
        self.send(NEW_CACHE, args=(num_blocks, page_size))
        return self.cache

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Broadcast the batch (with pending KV ops), run rank 0's shard, return logits ``[R, V]`` float32."""
        if cache is not self.cache:
            raise ValueError("a tensor-parallel target runs on the cache its new_cache returned")
        self.send(FORWARD, batch)
        try:
            return self.shard.forward(batch, cache)
        except Exception as exc:
            raise self._lost(exc) from exc

    def send(self, op: int, batch: ForwardBatch | None = None, args: tuple[int, int] = (0, 0)) -> None:
        """Broadcast one message; raises ``WorkerLost`` (and marks the target unhealthy) when a rank is gone."""
        self.check_alive()
        moves, copies = self.cache.take_pending() if self.cache is not None else ((), ([], []))
        msg = pack(op, self.device, batch, moves, copies, args)
        try:
            if msg.shape[0] > self._capacity:
                self._resize(2 * msg.shape[0])
            self._buf[: msg.shape[0]].copy_(msg)
            dist.broadcast(self._buf, src=0)
        except Exception as exc:
            raise self._lost(exc) from exc

    def _resize(self, capacity: int) -> None:
        self._buf[:HEADER].copy_(pack(RESIZE, self.device, args=(capacity, 0)))
        dist.broadcast(self._buf, src=0)
        self._capacity = capacity
        self._buf = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def check_alive(self) -> None:
        """Cheap (a waitpid per worker): catches a dead worker before rank 0 blocks in a collective with it."""
        if not self.healthy:
            raise WorkerLost(self.error or "tensor-parallel group is down")
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.workers, 1) if not p.is_alive()]
        if dead:
            raise self._lost(RuntimeError(f"worker {', '.join(dead)} is gone"))

    def _lost(self, exc: BaseException) -> WorkerLost:
        self.healthy = False
        self.error = f"tensor-parallel group is down: {type(exc).__name__}: {exc}"
        return WorkerLost(self.error)

    def close(self) -> None:
        """Stop the workers and leave the process group; safe to call twice, healthy or not."""
        grace = 0.0  # a group that failed may have workers stuck in a collective: end them at once
        if self.healthy:
            try:
                self.send(SHUTDOWN)
                grace = 5.0
            except WorkerLost:
                pass
            self.healthy, self.error = False, "tensor-parallel group was closed"
        for p in self.workers:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            _reset_group_names()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(build: Callable[[], Transformer], cfg: TPConfig,
                          full: Transformer | None = None) -> TensorParallelTarget:
    """Spawn ranks 1..N-1, join them as rank 0, and return the engine's target.

    ``build`` must be picklable (a module-level function or a ``functools.partial`` of one): each worker
    calls it to get the full model, then keeps its shard. ``full`` is rank 0's copy when the caller already
    has it. Shape errors (head counts, INT4 groups) raise here, before any process starts.
    """
    if cfg.device_type == "cuda" and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(f"tensor_parallel {cfg.world_size} needs {cfg.world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    full = full if full is not None else build()
    check_shardable(full.config, cfg.world_size)
    shard = ShardedTransformer(full, 0, cfg.world_size, cfg.device(0))
    del full
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running in this process")
    _reset_group_names()
    if cfg.backend == "nccl":
        # Abort the communicator on a timeout instead of killing the process: rank 0 is the server and must
        # live to fail its requests and report unhealthy. Set before the group exists; read by the watchdog.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(cfg.device(0))
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    workers = [ctx.Process(target=worker_main, args=(r, cfg, init_method, build, ready, os.getpid()), daemon=True,
                           name=f"tp-rank-{r}") for r in range(1, cfg.world_size)]
    for p in workers:
        p.start()
    target = TensorParallelTarget(shard, cfg, workers)
    try:
        # Joining waits for every worker to start and import torch, which can take far longer than one step
        # on a loaded host: join under the startup bound, then narrow the group to the step bound.
        dist.init_process_group(cfg.backend, init_method=init_method, rank=0, world_size=cfg.world_size,
                                timeout=timedelta(seconds=cfg.startup_timeout_s))
        _set_group_timeout(timedelta(seconds=cfg.step_timeout_s))
        _wait_ready(target, ready, cfg.startup_timeout_s)
    except BaseException:
        target.healthy = False
        target.close()
        raise
    return target


def _reset_group_names() -> None:
    """Undo what a failed join leaves behind while no group runs.

    ``init_process_group`` counts groups before it joins, and only a successful group's destruction resets
    the count. After a failed join, this process would name its next default group "1" while fresh workers
    name theirs "0"; the name is part of every rendezvous key, so the ranks would wait on each other forever.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def _set_group_timeout(timeout: timedelta) -> None:
    """Bound every later collective of the default group (torch has no public setter; 2.11 and 2.13 have this)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise RuntimeError("this torch cannot change a process group's timeout; tensor parallel needs torch >= 2.3")
    setter(timeout)


def _wait_ready(target: TensorParallelTarget, ready: "mp.Queue[tuple[int, str | None]]", timeout_s: float) -> None:
    """Wait for every worker's shard, watching for deaths; the wait is not a collective, so slow loads are fine."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, target.cfg.world_size))
    while pending:
        target.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel ranks {sorted(pending)} not ready after {timeout_s:.0f}s")
        try:
            rank, error = ready.get(timeout=0.5)
        except queue.Empty:  # look at the workers again
            continue
        if error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {error}")
        pending.discard(rank)
