"""Tensor parallelism: this process is rank 0 (the driver, beside the one scheduler); ranks
1..N-1 are worker processes, spawned here or launched by torchrun (`env://`).

Every step the driver broadcasts the same control message (the `SchedulerOutput`) to every rank
over torch.distributed, and all ranks run the same step; the layers' all-reduces and the
logits gather happen inside the model. Workers make no memory-management decisions: they hold
the same block ids as the driver and only the KV cache of their own heads.

A worker that dies breaks the next collective at once (gloo reports the closed connection), or
where gloo does not notice, the driver's wait times out (`DRIVER_CONTROL_TIMEOUT`, 5 minutes);
the executor then raises `WorkerDiedError`, which the engine turns into failed requests. So does
any other error in a step: once one rank has left a step partway (the driver's own forward
raising, say), the others wait in a collective it will never join, and the group cannot run
another step.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed import TensorParallelGroup
from pagedllm.distributed.init import free_port, init_tensor_parallel, set_cpu_threads
from pagedllm.executor.base import Executor, WorkerDiedError

logger = logging.getLogger("pagedllm")

_SHUTDOWN = "shutdown"
# How often the driver checks its spawned workers while the group is starting.
_STARTUP_POLL_S = 0.2
# After a step fails, how long to wait for a worker's exit to show, to name it as the cause.
_EXIT_GRACE_S = 1.0


@dataclass
class _GroupHealth:
    """Why the group can run no more steps (None while it can); shared with the finalizer, which
    must not send a broken group its polite shutdown message: a worker left waiting in a step's
    collective would take it for that collective's data, and both sides could wait forever."""

    dead: str | None = None


def _watch_parent() -> None:
    """Exit if the driver disappears (a spawned worker must not outlive it)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="pagedllm-parent-watch").start()


def run_worker_loop(config: EngineConfig, max_model_len: int, rank: int, init_method: str) -> None:
    """The life of a non-driver rank: join the group, build its shard, then run what the driver
    broadcasts until told to stop."""
    from pagedllm.worker.worker import Worker, resolve_device

    tp_size = config.parallel.tensor_parallel_size
    set_cpu_threads(tp_size)
    group = init_tensor_parallel(rank, tp_size, init_method, resolve_device(config.model.device))
    worker = Worker(config, max_model_len, group)
    while True:
        method, args, gather = group.broadcast_object()
        if method == _SHUTDOWN:
            break
        result = getattr(worker, method)(*args)
        if gather:
            group.gather_objects(result)
    group.close()


def _spawned_worker(config: EngineConfig, max_model_len: int, rank: int, init_method: str) -> None:
    _watch_parent()
    logging.basicConfig(level=logging.WARNING)
    run_worker_loop(config, max_model_len, rank, init_method)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        from pagedllm.worker.worker import Worker, resolve_device

        tp_size = config.parallel.tensor_parallel_size
        init_method = config.parallel.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        self._processes: list[multiprocessing.Process] = []
        self._health = _GroupHealth()
        if init_method != "env://":  # torchrun starts the other ranks itself
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, tp_size):
                proc = ctx.Process(
                    target=_spawned_worker,
                    args=(config, max_model_len, rank, init_method),
                    name=f"pagedllm-tp-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                self._processes.append(proc)
        previous_threads = set_cpu_threads(tp_size)
        self.group = self._join_group(tp_size, init_method, resolve_device(config.model.device))
        self.worker = Worker(config, max_model_len, self.group)
        self.block_bytes = self.worker.block_bytes
        self.kv_cache_groups = self.worker.kv_cache_groups
        logger.info("Tensor parallelism: %d ranks, driver is rank 0", tp_size)
        self._finalizer = weakref.finalize(
            self, MultiprocExecutor._stop, self.group, self._processes, previous_threads, self._health
        )

    def _join_group(self, tp_size: int, init_method: str, device) -> TensorParallelGroup:
        """Join the group while watching the spawned workers: one that dies while starting fails
        the start at once, saying why, instead of the rendezvous timing out with no cause."""
        if not self._processes:
            return init_tensor_parallel(0, tp_size, init_method, device)
        joined: dict[str, object] = {}

        def join() -> None:
            try:
                joined["group"] = init_tensor_parallel(0, tp_size, init_method, device)
            except BaseException as exc:  # handed to the caller below
                joined["error"] = exc

        thread = threading.Thread(target=join, daemon=True, name="pagedllm-tp-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(_STARTUP_POLL_S)
            dead = [proc for proc in self._processes if not proc.is_alive()]
            if dead and thread.is_alive():
                for proc in self._processes:
                    proc.kill()
                raise RuntimeError(
                    f"Tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}) while the group was "
                    "starting; its own error is printed above. The workers are started with multiprocessing's "
                    "'spawn', which imports your main module again in each of them: if a script of yours creates "
                    'the LLM or engine, put that code under `if __name__ == "__main__":`.'
                )
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    # --- remote calls ---------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args, gather: bool = True) -> list | None:
        """Run `Worker.<method>(*args)` on every rank; with `gather`, every rank's result in
        rank order."""
        self.check_health()
        try:
            self.group.broadcast_object((method, args, gather))
            result = getattr(self.worker, method)(*args)
            return self.group.gather_objects(result) if gather else [result]
        except Exception as exc:  # a peer is gone, or this rank left the step partway: out of step for good
            self._health.dead = self._cause_of_failure(exc)
            raise WorkerDiedError(self._health.dead) from exc

    def _cause_of_failure(self, exc: Exception) -> str:
        """Name what broke a step: a worker that exited (the connection may close a moment
        before its exit is visible, hence the short wait), else the error itself."""
        deadline = time.monotonic() + _EXIT_GRACE_S
        while True:
            dead = [proc for proc in self._processes if not proc.is_alive()]
            if dead:
                return f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}) during a step"
            if time.monotonic() >= deadline:
                return f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); the ranks are out of step"
            time.sleep(0.05)

    def determine_num_blocks(self) -> tuple[int, int]:
        counts = self.collective_rpc("determine_num_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.collective_rpc("init_cache", num_device_blocks, num_cpu_blocks)

    def profile_preemption_costs(self) -> tuple[float, float]:
        return self.collective_rpc("profile_preemption_costs")[0]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute", output, gather=False)[0]

    def check_health(self) -> None:
        if self._health.dead is None:
            for proc in self._processes:
                if not proc.is_alive():
                    self._health.dead = f"tensor-parallel worker {proc.name} exited (code {proc.exitcode})"
        if self._health.dead is not None:
            raise WorkerDiedError(self._health.dead)

    def shutdown(self) -> None:
        self._finalizer()

    @staticmethod
    def _stop(group: TensorParallelGroup, processes: list[multiprocessing.Process], threads: int,
              health: _GroupHealth) -> None:
        import torch

        torch.set_num_threads(threads)
        if health.dead is None and all(p.is_alive() for p in processes):
            try:
                group.broadcast_object((_SHUTDOWN, (), False))
            except RuntimeError:
                pass
        for proc in processes:
            if health.dead is not None and proc.is_alive():  # stuck in a collective: it would never return
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        group.close()
