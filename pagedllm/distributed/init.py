"""Joining the tensor-parallel group with torch.distributed."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from pagedllm.distributed.group import TensorParallelGroup

# Joining the group: a rank that never shows up (it crashed while starting) fails the others.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)
# Collectives inside a step are short; a peer that dies makes gloo fail at once, and this
# timeout is only the last resort against a peer that hangs.
STEP_TIMEOUT = datetime.timedelta(minutes=5)
# Workers wait on the control group between steps, however long the engine stays idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# The driver never waits for long there: it sends each step's message and gathers the replies
# of work that every rank runs alike. A peer that stops answering (killed at a moment when gloo
# did not notice its closed connection: seen once, driver stuck in a broadcast) then fails the
# step after this long instead of holding the engine forever. Each rank's timeout is its own.
DRIVER_CONTROL_TIMEOUT = STEP_TIMEOUT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallelGroup:
    """Join the group: a gloo control group for the driver's messages, and a tensor group
    (nccl on GPU, gloo on CPU) for the layers' collectives."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=RENDEZVOUS_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=DRIVER_CONTROL_TIMEOUT if rank == 0 else IDLE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    tensors = dist.new_group(backend=backend, timeout=STEP_TIMEOUT)
    return TensorParallelGroup(rank=rank, size=world_size, group=tensors, control_group=control)


def env_rank() -> int:
    """This process's rank when launched by torchrun (env:// rendezvous)."""
    return int(os.environ.get("RANK", "0"))


def set_cpu_threads(tensor_parallel_size: int) -> int:
    """Split the cores between the ranks of one machine, unless the user chose (OMP_NUM_THREADS).
    Returns the previous thread count, to restore when the group ends."""
    previous = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return previous
