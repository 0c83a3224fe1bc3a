"""Which slice of the model one tensor-parallel rank holds (Megatron-style), as plain arithmetic.

q heads are split evenly, kv heads too while there are at least as many as ranks; with more ranks
than kv heads (GQA) each kv head is replicated on `size // num_kv_heads` consecutive ranks, each
rank keeping the one its q heads read (as vLLM and TensorRT-LLM do). FFN columns, every expert's
intermediate dimension and the vocabulary rows are split evenly (the router whole); the vocabulary
is zero-padded to a multiple of the size and the padded logits cut off after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass


def tp_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    """None when a model with these head counts can be split over `size` ranks, else why not."""
    if size < 1:
        return f"must be at least 1, got {size}"
    if num_heads % size:
        return f"{size} does not divide the model's {num_heads} attention heads"
    if num_kv_heads % size and size % num_kv_heads:
        return (f"{size} neither divides the model's {num_kv_heads} kv heads nor is a multiple of them "
                "(kv heads are split or replicated whole)")
    return None


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the global kv heads `rank` keeps (one replicated head when size > kv heads)."""
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // num_kv_heads)
    return head, head + 1


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    num_heads: int  # the model's (global) counts
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    other_ffn_sizes: tuple[tuple[str, int], ...] = ()  # (config key, width): a MoE model's experts, split too
    num_experts: int = 0  # a MoE model's routed experts
    expert_parallel: bool = False  # whole experts spread over the ranks instead of each one split

    def __post_init__(self) -> None:
        if self.expert_parallel and (not self.num_experts or self.num_experts % self.size):
            raise ValueError(f"expert_parallel_size: {self.size} does not divide the model's {self.num_experts} "
                             "routed experts")
        problem = tp_problem(self.num_heads, self.num_kv_heads, self.size)
        split = self.other_ffn_sizes[1:] if self.expert_parallel else self.other_ffn_sizes  # experts stay whole
        for key, width in (("intermediate_size", self.intermediate_size), *split):
            if problem is None and width % self.size:
                problem = f"{self.size} does not divide the model's {key} {width}"
        if problem is not None:
            raise ValueError(f"tensor_parallel_size: {problem}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside [0, {self.size})")

    def share(self, width: int) -> tuple[int, int]:
        """[start, end) of the rank's even share of `width` (heads, FFN columns, experts: checked to divide)."""
        per = width // self.size
        return self.rank * per, (self.rank + 1) * per

    @property
    def heads(self) -> tuple[int, int]:
        return self.share(self.num_heads)

    @property
    def kv_heads(self) -> tuple[int, int]:
        return kv_head_range(self.num_kv_heads, self.size, self.rank)

    @property
    def experts(self) -> tuple[int, int]:
        """[start, end) of the routed experts the rank holds whole (expert parallelism)."""
        return self.share(self.num_experts)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """Padded [start, end) of this rank's vocabulary rows (end may pass vocab_size)."""
        return self.rank * self.vocab_per_rank, (self.rank + 1) * self.vocab_per_rank
