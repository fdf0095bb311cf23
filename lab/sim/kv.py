"""KV-cache accounting for the engine model: block counts and a prefix-cache LRU.

No memory is simulated, only numbers: a running sequence holds
ceil(tokens / block_size) blocks, and admission or growth fails when the pool has too
few free. The prefix cache remembers the hashes of recently computed prompt blocks (as
vLLM keeps freed blocks reusable until evicted); a prompt whose leading blocks are
remembered skips their prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KvBlockPool:
    """How many of `total_blocks` blocks of `block_size` tokens are in use."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.used_blocks = 0

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return self.used_blocks / self.total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> None:
        if num_blocks > self.free_blocks:
            raise RuntimeError(f"KV pool over-allocated: {num_blocks} > {self.free_blocks} free")
        self.used_blocks += num_blocks

    def release(self, num_blocks: int) -> None:
        self.used_blocks -= num_blocks


class PrefixCache:
    """An LRU set of prompt-block hashes, at most `capacity_blocks` of them.

    Hashes are chained (each covers its whole prefix), so a match is the longest run of
    leading hashes that are all present.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks present; marks them recently used."""
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            matched += 1
        return matched

    def peek(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks present, without marking them used (a look that
        must not change what is evicted next)."""
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
