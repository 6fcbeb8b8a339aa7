"""Runs model steps in this process, or across a tensor-parallel group of processes.

With tensor_parallel_size N, this process is rank 0 and N-1 worker processes hold the
other shards. Each call, rank 0 broadcasts what to run (`_RankSteps`' method and its
arguments) over a gloo group; every rank runs the same forward, and the layers'
collectives (NCCL on GPU, gloo on CPU) combine the shards. Only rank 0 samples. Under
speculative decoding the drafter's forwards are broadcast too, with the hidden states
they read (rank 0 picks them from its sequences' backlogs), and so is a hybrid model's
state rollback after a verify step. Tensor arguments (the drafter's hidden states, the
tokens an async step reads on the device) follow their message by `dist.broadcast` on the
TP group, so they never visit the host. With enable_expert_parallel the same group
splits the MoE experts whole (atom.expert_parallel): attention is tensor parallel, so
every rank holds every token and the experts' outputs meet in one all-reduce.

With data_parallel_size N (data-parallel attention, MLA models), the N ranks each hold
the whole model but their share of the experts, their own KV cache and their own batch:
the tensor-parallel group is each rank alone, the expert-parallel group is the world
with `GatheredTokens` or `AllToAllTokens` (all2all_backend). Rank 0 broadcasts every
rank's part of a step in one message (`RankStep`s, whose token counts `GatheredTokens`
needs before the forward); every rank runs a forward, one with nothing scheduled a zero-token one, since the MoE collectives
need all of them; each samples its own rows and rank 0 gathers the results. A step in
which every rank decodes replays every rank's decode graph of one shared size
(atom.engine.data_parallel_graphs).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from atom.all_to_all_tokens import AllToAllTokens
from atom.config import ConfigError, EngineConfig
from atom.distributed import SingleProcessGroup, TorchDistributedGroup, set_tp_group
from atom.engine.data_parallel_graphs import shared_decode_size
from atom.engine.kv_groups import num_pools, plan_kv_groups
from atom.engine.kv_layout import KVCacheLayout, KVPool, split_budget
from atom.engine.model_runner import (
    ModelRunner,
    StepInput,
    TokenFeed,
    allocate_kv_cache,
    build_model,
    check_fp8_kv_cache,
    graph_batch_size,
    kv_cache_bytes_per_block,
    kv_cache_page_parts,
)
from atom.engine.rank_sampling import RankResult, RankSampler, RankStep
from atom.engine.state_cache import allocate_state_cache, num_state_slots, state_bytes_per_slot
from atom.expert_parallel import (
    ExpertParallel,
    GatheredTokens,
    ReplicatedTokens,
    get_expert_parallel,
    set_expert_parallel,
)
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE
from atom.symmetric_all_reduce import SymmetricAllReduce


def _rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def _init_group(config: EngineConfig, rank: int, port: int) -> dist.ProcessGroup:
    """Joins the TP group (under DP attention: the EP group); returns a gloo group for
    broadcasting step inputs."""
    world = config.parallel.world_size
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = _rank_device(config.device, rank)
    group = TorchDistributedGroup(None, SymmetricAllReduce.create(dist.group.WORLD, device))
    if config.parallel.data_parallel_size > 1:
        # Attention, dense layers, embeddings and LM head whole on every rank.
        set_tp_group(SingleProcessGroup())
        all_to_all = config.parallel.all2all_backend == "all_to_all"
        exchange = AllToAllTokens(group) if all_to_all else GatheredTokens(group)
        set_expert_parallel(ExpertParallel(group, exchange))
    else:
        set_tp_group(group)
        if config.parallel.enable_expert_parallel:
            set_expert_parallel(ExpertParallel(group, ReplicatedTokens(group)))
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


class _Shard:
    """One rank's model, KV cache and runner."""

    def __init__(self, config: EngineConfig, rank: int, progress: bool):
        self.config = config
        self.device = _rank_device(config.device, rank)
        self.model = build_model(
            config.model,
            self.device,
            progress,
            config.speculative,
            config.cache.ssm_dtype(config.model),
        )
        self.cache_dtype = config.cache.cache_dtype(config.model.dtype)
        if self.cache_dtype == FP8_KV_CACHE_DTYPE:
            check_fp8_kv_cache(self.model, self.device, log=rank == 0)
        self.kv_groups = plan_kv_groups(
            self.model, config.model.max_model_len, config.cache.block_size,
            config.cache.window_only_kv,
        )  # fmt: skip
        self.state_slot_bytes = state_bytes_per_slot(self.model)

    @property
    def prefill_chunk(self) -> int:
        """The longest chunk a sequence prefills in: the pools are sized for it."""
        return min(self.config.model.max_model_len, self.config.max_num_batched_tokens)

    def page_bytes(self) -> list[int]:
        """One page's bytes in each pool of the grouped layout."""
        block_size = self.config.cache.block_size
        return [
            kv_cache_bytes_per_block(self.model, block_size, self.cache_dtype, self.kv_groups, p)
            for p in range(num_pools(self.kv_groups))
        ]

    def full_layout_page_bytes(self) -> int:
        """One page's bytes with every layer keeping every page."""
        return kv_cache_bytes_per_block(self.model, self.config.cache.block_size, self.cache_dtype)

    def blocks_from_memory(self) -> list[int]:
        """The pages of each pool that the KV-cache budget buys (kv_layout.split_budget)."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cache.gpu_memory_utilization) - (total - free)
        else:
            raise ConfigError(
                "on CPU, set kv_cache_memory_bytes (or num_blocks) to size the KV cache"
            )
        budget -= self.state_slot_bytes * num_state_slots(self.config.max_num_seqs)
        budget -= self.state_slot_bytes * self.verify_checkpoint_slots()
        page_bytes = self.page_bytes()
        blocks = split_budget(
            max(budget, 0), self.kv_groups, page_bytes, cache.block_size,
            self.config.model.max_model_len, self.prefill_chunk,
        )  # fmt: skip
        if min(blocks) < 1:
            raise ConfigError(
                f"KV cache budget of {budget} bytes is below one block of each pool "
                f"({' + '.join(map(str, page_bytes))} bytes)"
            )
        return blocks

    def verify_checkpoint_slots(self) -> int:
        """The sequences whose states a captured verify step keeps for the rollback, in
        buffers that live as long as the graphs (state_rollback.StaticCheckpoints): about
        one state slot each, for the largest verify batch. 0 without a hybrid model's
        speculative decoding in graphs."""
        config = self.config
        graphs = config.use_cuda_graphs or config.static_graph_inputs
        if not (self.state_slot_bytes and config.speculative and graphs):
            return 0
        query_len = config.speculative.num_speculative_tokens + 1
        return graph_batch_size(config.max_num_seqs, config.max_num_batched_tokens, query_len)

    def allocate(self, num_blocks: list[int]) -> ModelRunner:
        config, cache = self.config, self.config.cache
        allocate_kv_cache(
            self.model, num_blocks, cache.block_size, self.cache_dtype, self.device,
            self.kv_groups,
        )  # fmt: skip
        self.state_cache_bytes = allocate_state_cache(
            self.model, num_state_slots(config.max_num_seqs), self.device
        )
        runner = ModelRunner(self.model, cache.block_size, self.device, len(self.kv_groups))
        if not config.use_cuda_graphs and not config.static_graph_inputs:
            return runner
        data_parallel = config.parallel.data_parallel_size > 1
        if data_parallel and config.parallel.all2all_backend == "all_to_all":
            return runner  # its host syncs cannot be captured (LLMEngine logs it)
        if data_parallel:
            # Every rank captures the same sizes in the same order, so each runs as many
            # tokens as the others (atom.engine.data_parallel_graphs).
            get_expert_parallel().exchange.begin_uniform_steps()
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        runner.capture_cuda_graphs(
            config.max_num_seqs, config.model.max_model_len, config.max_num_batched_tokens, k,
            capture=config.use_cuda_graphs,
        )  # fmt: skip
        return runner


class _RankSteps:
    """What every rank runs on its shard, called alike on rank 0 and on the workers."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, rank: int, control=None):
        self.runner = runner
        self.rank = rank
        self.control = control
        self.rank_sampler = None
        if config.parallel.data_parallel_size > 1:
            self.rank_sampler = RankSampler(config.seed, compile=config.compile)

    def step_data_parallel(self, steps: list[RankStep]) -> list[RankResult] | None:
        """Data-parallel attention: this rank's part of the step, run and sampled; rank 0
        gets every rank's results (in rank order), the others None."""
        own = steps[self.rank]
        # Every rank replays the same decode-graph size, or every rank runs eagerly.
        graph_size = shared_decode_size(steps, self.runner.decode_graphs)
        if graph_size is None:
            counts = [step.num_tokens for step in steps]
        else:
            counts = [graph_size] * len(steps)
        get_expert_parallel().exchange.begin_step(counts)
        # A rank with no sequences still runs (zero tokens, or padding in a graph): the MoE
        # layers' collectives wait for every rank.
        logits = self.runner.execute_data_parallel(own.inputs, own.logit_rows, graph_size)
        result = self.rank_sampler.sample(logits, own)
        gathered = [None] * len(steps) if self.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=self.control)
        return gathered

    def execute(self, inputs: list[StepInput], logit_rows: list[int], feed=None):
        return self.runner.execute(inputs, logit_rows, feed)

    def verify(self, inputs: list[StepInput], logit_rows: list[int], verified_rows, feed=None):
        """A speculative step: logits and the drafter's features; verified_rows (slots, first rows,
        row counts of the verified sequences) for a hybrid model's state checkpoints."""
        return self.runner.verify(inputs, logit_rows, verified_rows, feed)

    def draft(self, inputs: list[StepInput], hidden: torch.Tensor, step: int, rows: list[int],
              feed: TokenFeed | None = None):  # fmt: skip
        return self.runner.draft(inputs, hidden, step, rows, feed)

    def roll_back(self, kept_rows: list[int]) -> None:
        self.runner.roll_back(kept_rows)


@dataclass(frozen=True)
class _Sent:
    """Stands in a step message for a device tensor, which follows by dist.broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _wire(arg) -> tuple[object, torch.Tensor | None]:
    """Rank 0: an argument's form in the message, and the tensor to broadcast after it."""
    if isinstance(arg, torch.Tensor):
        return _Sent(tuple(arg.shape), arg.dtype), arg.contiguous()
    if isinstance(arg, TokenFeed):
        sent, tensor = _wire(arg.tokens)
        return replace(arg, tokens=sent), tensor
    return arg, None


def _unwire(arg, device: torch.device):
    """A worker: the argument rank 0 passed, receiving the tensors it sent."""
    if isinstance(arg, _Sent):
        tensor = torch.empty(arg.shape, dtype=arg.dtype, device=device)
        dist.broadcast(tensor, src=0)
        return tensor
    if isinstance(arg, TokenFeed):
        return replace(arg, tokens=_unwire(arg.tokens, device))
    return arg


def _worker_main(config: EngineConfig, rank: int, port: int) -> None:
    if seconds := os.environ.get("ATOM_WORKER_STACK_DUMP_S"):
        # A stalled multi-GPU run: what each worker waits on, printed every `seconds`.
        faulthandler.dump_traceback_later(float(seconds), repeat=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.world_size))
    control = _init_group(config, rank, port)
    shard = _Shard(config, rank, progress=False)
    num_blocks = _agree_on_num_blocks(config, shard, rank, control)
    steps = _RankSteps(shard.allocate(num_blocks), config, rank, control)
    message = [None]
    while True:
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            break
        name, args = message[0]
        getattr(steps, name)(*(_unwire(arg, shard.device) for arg in args))
    dist.destroy_process_group()


def _agree_on_num_blocks(config: EngineConfig, shard: _Shard, rank: int, control) -> list[int]:
    """The KV pages of each pool every rank allocates: num_blocks (each pool) if given,
    else the fewest any rank's memory holds (each rank allocates its own cache; TP shards
    must agree, and DP ranks' schedulers each plan with the same pools)."""
    if config.cache.num_blocks:
        return [config.cache.num_blocks] * num_pools(shard.kv_groups)
    try:
        own = shard.blocks_from_memory()
    except ConfigError:
        if rank == 0 or control is None:
            raise
        own = [0] * num_pools(shard.kv_groups)  # rank 0 reports it below
    if control is None:
        return own
    fewest = torch.tensor(own, dtype=torch.int64)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=control)
    if fewest.min().item() < 1:
        raise ConfigError("a rank's KV cache budget is below one block of each pool")
    return fewest.tolist()


class Executor:
    def __init__(self, config: EngineConfig):
        self.world_size = config.parallel.world_size
        self.workers: list[mp.Process] = []
        if self.world_size > 1:
            port = _free_port()
            context = mp.get_context("spawn")
            self.workers = [
                context.Process(target=_worker_main, args=(config, rank, port), daemon=True)
                for rank in range(1, self.world_size)
            ]
            for worker in self.workers:
                worker.start()
            self.control = _init_group(config, 0, port)
        control = self.control if self.workers else None
        shard = _Shard(config, 0, progress=True)
        self.model = shard.model
        self.cache_dtype = shard.cache_dtype
        self.pool_blocks = _agree_on_num_blocks(config, shard, 0, control)
        self.num_blocks = sum(self.pool_blocks)
        block_size, groups = config.cache.block_size, shard.kv_groups
        pools = [
            KVPool(
                blocks,
                page_bytes,
                kv_cache_page_parts(shard.model, block_size, shard.cache_dtype, groups, pool),
            )
            for pool, (blocks, page_bytes) in enumerate(zip(self.pool_blocks, shard.page_bytes()))
        ]
        self.kv_layout = KVCacheLayout(
            groups, pools, block_size, shard.full_layout_page_bytes(), shard.prefill_chunk
        )
        self.runner = shard.allocate(self.pool_blocks)
        self.steps = _RankSteps(self.runner, config, 0, control)
        self.state_cache_bytes = shard.state_cache_bytes

    def _broadcast(self, message) -> None:
        if self.workers:
            dist.broadcast_object_list([message], src=0, group=self.control)

    def _call(self, name: str, *args):
        """Runs `_RankSteps.<name>` on every rank; returns rank 0's result."""
        if self.workers:
            wired = [_wire(arg) for arg in args]
            self._broadcast((name, tuple(form for form, _ in wired)))
            for _, tensor in wired:
                if tensor is not None:
                    dist.broadcast(tensor, src=0)
        return getattr(self.steps, name)(*args)

    def execute(
        self, inputs: list[StepInput], logit_rows: list[int], feed: TokenFeed | None = None
    ) -> torch.Tensor | None:
        return self._call("execute", inputs, logit_rows, feed)

    def verify(
        self,
        inputs: list[StepInput],
        logit_rows: list[int],
        verified_rows: tuple[list[int], list[int], list[int]] | None = None,
        feed: TokenFeed | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A speculative step's logits and the drafter's features of its tokens
        (`ModelRunner.verify`); `feed`: its drafts, still on the device."""
        return self._call("verify", inputs, logit_rows, verified_rows, feed)

    def draft(
        self,
        inputs: list[StepInput],
        hidden: torch.Tensor,
        step: int,
        rows: list[int],
        feed: TokenFeed | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One drafter forward and its draft tokens (ModelRunner.draft) over `hidden`, the
        hidden states rank 0 picked from its sequences' backlogs; `feed`: input tokens
        still on the device."""
        return self._call("draft", inputs, hidden, step, rows, feed)

    def step_data_parallel(self, steps: list[RankStep]) -> list[RankResult]:
        """Data-parallel attention: every rank runs and samples its `steps[rank]`; the
        ranks' results, in rank order."""
        return self._call("step_data_parallel", steps)

    def roll_back(self, kept_rows: list[int]) -> None:
        """After a hybrid model's verify step: its states after the rows that stand."""
        self._call("roll_back", kept_rows)

    def shutdown(self) -> None:
        if not self.workers:
            return
        self._broadcast(None)
        for worker in self.workers:
            worker.join(timeout=30)
        self.workers = []
        dist.destroy_process_group()
        set_tp_group(SingleProcessGroup())
        set_expert_parallel(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
