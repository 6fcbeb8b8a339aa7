"""NCCL's all-reduce against the one-shot symmetric-memory one (atom.symmetric_all_reduce)
over message sizes, on the machine's GPUs: the size where NCCL starts to win is the
one-shot path's MAX_BYTES_BY_WORLD. Each rank captures 50 all-reduces in one CUDA graph, as
decode steps run them, and times its replays; every result is first checked against NCCL.

    python benchmarks/all_reduce.py [--gpus N]
"""

from __future__ import annotations

import argparse
import socket
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atom.symmetric_all_reduce import SymmetricAllReduce

SIZES_KB = [4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
CALLS_PER_GRAPH = 50
REPLAYS = 20


def _graph_us(fn) -> float:
    """One call's time in µs, from replays of a graph of CALLS_PER_GRAPH calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    for _ in range(3):
        graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH)


def _rank(rank: int, world: int, port: int, queue) -> None:
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=device,
    )  # fmt: skip
    one_shot = SymmetricAllReduce(dist.group.WORLD, device, max_bytes=max(SIZES_KB) * 1024)
    rows = []
    for size_kb in SIZES_KB:
        x = torch.randn(size_kb * 512, dtype=torch.bfloat16, device=device)
        expected = x.clone()
        dist.all_reduce(expected)
        torch.testing.assert_close(one_shot(x), expected, rtol=2e-2, atol=2e-2)
        nccl = _graph_us(partial(dist.all_reduce, x.clone()))
        symmetric = _graph_us(partial(one_shot, x))
        rows.append((size_kb, nccl, symmetric))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    world = parser.parse_args().gpus
    if world < 2:
        raise SystemExit(f"needs 2 or more GPUs, found {world}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in processes:
        p.start()
    rows = queue.get()
    for p in processes:
        p.join()
    print(f"all-reduce of bf16 on {world} x {torch.cuda.get_device_name(0)}, µs per call")
    print(f"{'size':>8} {'NCCL':>9} {'one-shot':>9} {'NCCL/one-shot':>14} {'one-shot GB/s':>14}")
    for size_kb, nccl, symmetric in rows:
        gb_s = size_kb * 1024 / symmetric / 1e3
        print(
            f"{size_kb:>6}KB {nccl:>9.1f} {symmetric:>9.1f} {nccl / symmetric:>14.2f} {gb_s:>14.1f}"
        )


if __name__ == "__main__":
    main()
