"""Stand-ins for a tokenizer: cheap, deterministic token counts, prefix hashes and words.

The simulator never loads a tokenizer. A prompt of text counts one token per 4 characters
(rounded up, at least 1), close to what BPE tokenizers give for English. Prefix caching
works on blocks of `block_size` such tokens, hashed as a chain the way vLLM hashes KV
blocks, so two prompts that share their first N characters share their first blocks.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4

WORDS = (
    "the", "model", "token", "cache", "region", "router", "batch", "prefill", "decode",
    "latency", "pool", "queue", "worker", "stream", "block", "prefix", "engine", "step",
    "global", "request", "serve", "fast", "simulated", "answer", "a", "of", "and", "to",
    "is", "in", "on", "with",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the engine needs to know about a prompt.

    `block_hashes` covers only full blocks (a partial last block is never cached, as in
    vLLM). `seed` makes a request's output words depend on its prompt and the server seed.
    """

    num_tokens: int
    block_hashes: tuple[int, ...]
    seed: int


def prompt_from_text(text: str, block_size: int, server_seed: int) -> Prompt:
    num_tokens = max(1, -(-len(text) // CHARS_PER_TOKEN))
    block_chars = block_size * CHARS_PER_TOKEN
    hashes: list[int] = []
    running = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        running = hash((running, text[start : start + block_chars]))
        hashes.append(running)
    return Prompt(num_tokens, tuple(hashes), _seed(server_seed, text.encode()))


def prompt_from_token_ids(token_ids: Sequence[int], block_size: int, server_seed: int) -> Prompt:
    """A prompt given as token ids (the completions API accepts those) counts exactly."""
    hashes: list[int] = []
    running = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        running = hash((running, tuple(token_ids[start : start + block_size])))
        hashes.append(running)
    return Prompt(
        max(1, len(token_ids)), tuple(hashes), _seed(server_seed, repr(token_ids).encode())
    )


def _seed(server_seed: int, content: bytes) -> int:
    return (server_seed * 1_000_003) ^ zlib.crc32(content)


class WordSource:
    """Pseudo-words for one sequence: the same prompt and server seed give the same words."""

    __slots__ = ("_count", "_rng")

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._count = 0

    def next_word(self) -> str:
        word = self._rng.choice(WORDS)
        self._count += 1
        return word if self._count == 1 else " " + word

    def natural_length(self, eos_probability: float, limit: int) -> int | None:
        """Tokens until the simulated EOS, or None if it would come after `limit`.

        Drawn once per request (a geometric distribution) so that the per-token path
        needs no random draw for EOS.
        """
        if eos_probability <= 0.0:
            return None
        if eos_probability >= 1.0:
            return 1
        draw = 1.0 - self._rng.random()  # in (0, 1], so the log is defined
        produced = 1 + int(math.log(draw) / math.log(1.0 - eos_probability))
        return produced if produced <= limit else None
