"""CUDA graphs under data-parallel attention: every rank replays one captured size.

A data-parallel step's MoE layers exchange tokens between the ranks (`GatheredTokens`:
an all-gather in, a reduce-scatter out), so a graph captured on one rank holds
collectives whose sizes every other rank's replay must match. The decode graphs are
captured with every rank running the same count (`GatheredTokens.begin_uniform_steps`),
and a step replays them only where all ranks can replay the same size:

- every rank's sequences are decodes (one new token each; a rank with none qualifies),
  and the largest rank's count fits the largest captured size;
- the size is the smallest captured one that holds the largest rank's batch; every rank,
  an idle one included, pads its own sequences up to it (padding sequences write nowhere,
  atom.engine.cuda_graphs), so the exchange moves that many rows from each rank.

Any other step (a rank prefills, or has more sequences than the largest graph) runs
eagerly on every rank. Each rank decides from the list of every rank's step that rank 0
broadcasts, so they agree without a collective of their own: a rank replaying while
another runs eagerly would leave their collectives mismatched.

`AllToAllTokens` reads each MoE layer's split sizes on the host, which a graph cannot
hold: under it, data-parallel steps are never captured.
"""

from __future__ import annotations

from atom.engine.cuda_graphs import StepGraphs
from atom.engine.rank_sampling import RankStep


def shared_decode_size(steps: list[RankStep], graphs: StepGraphs | None) -> int | None:
    """The decode-graph size every rank replays this step (`steps`: every rank's part),
    or None where every rank runs it eagerly."""
    if graphs is None:
        return None
    if any(len(item.token_ids) != 1 for step in steps for item in step.inputs):
        return None
    largest = max(len(step.inputs) for step in steps)
    if not 0 < largest <= graphs.max_batch_size:
        return None
    return graphs.padded_size(largest)
