"""The one-shot symmetric-memory all-reduce (atom.symmetric_all_reduce) sums like NCCL,
eagerly and replayed from a CUDA graph, for the dtypes and shapes the layers reduce; the
TP group routes only messages up to max_bytes to it. On the lent 2-GPU machine:
`pytest -m gpu tests/test_gpu_symmetric_all_reduce.py`."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom.distributed import TorchDistributedGroup
from atom.symmetric_all_reduce import SymmetricAllReduce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

SHAPES = [(1, 4096), (3, 5120), (64, 4096), (7, 1000)]


def _check_rank(rank: int, world: int, port: int) -> None:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=device,
    )  # fmt: skip
    one_shot = SymmetricAllReduce.create(dist.group.WORLD, device, max_bytes=64 * 4096 * 4)
    assert one_shot is not None, "the GPUs of this machine should reach each other's memory"
    group = TorchDistributedGroup(None, one_shot)
    generator = torch.Generator(device).manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in SHAPES:
            x = torch.randn(shape, dtype=dtype, device=device, generator=generator)
            expected = x.clone()
            dist.all_reduce(expected)
            assert one_shot.takes(x)
            torch.testing.assert_close(group.all_reduce(x), expected, rtol=1e-2, atol=1e-2)

            graph = torch.cuda.CUDAGraph()
            static_in = x.clone()
            with torch.cuda.graph(graph):
                static_out = group.all_reduce(static_in)
            static_in.copy_(x * 2)
            graph.replay()
            torch.testing.assert_close(static_out, expected * 2, rtol=1e-2, atol=1e-2)
    too_big = torch.ones(128, 4096, dtype=torch.float32, device=device)
    assert not one_shot.takes(too_big)
    assert torch.equal(group.all_reduce(too_big), torch.full_like(too_big, world))
    dist.destroy_process_group()


def test_one_shot_all_reduce_sums_like_nccl():
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_check_rank, args=(rank, world, port)) for rank in range(world)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=300)
    assert [p.exitcode for p in processes] == [0] * world
