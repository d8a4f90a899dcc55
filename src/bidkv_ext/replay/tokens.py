"""Deterministic fake prompt token ids.

Azure rows carry no content, so each request gets its own pseudo-random prompt (no
accidental prefix sharing). Mooncake rows carry ``hash_ids``: each id expands to the same
512 token ids wherever it appears, the blocks are concatenated in order and cut to
``input_length``, so vLLM's block hashing reproduces the trace's prefix sharing.
"""

from __future__ import annotations

import numpy as np

from bidkv_ext.replay.trace import MOONCAKE_HASH_BLOCK_TOKENS, TraceRequest

__all__ = ["PromptFactory"]

# Stay inside the bundled host model config's vocabulary and clear of its special ids (0..3).
_LOW_ID = 4
_HIGH_ID = 32000


class PromptFactory:
    """Makes prompt token ids for trace requests; same seed -> same ids."""

    __slots__ = ("_blocks", "_seed")

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._blocks: dict[int, list[int]] = {}

    def prompt(self, request: TraceRequest) -> list[int]:
        if request.hash_ids is None:
            rng = np.random.default_rng([self._seed, 0, request.index])
            ids: list[int] = rng.integers(_LOW_ID, _HIGH_ID, request.input_length).tolist()
            return ids
        out: list[int] = []
        for hash_id in request.hash_ids:
            out.extend(self._block(hash_id))
        del out[request.input_length :]
        return out

    def fake_output_token(self, request: TraceRequest) -> int:
        """One constant sampled id per request: cheap, and distinct between requests."""
        return _LOW_ID + (request.index * 7919 + self._seed) % (_HIGH_ID - _LOW_ID)

    def _block(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self._seed, 1, hash_id])
            block = rng.integers(_LOW_ID, _HIGH_ID, MOONCAKE_HASH_BLOCK_TOKENS).tolist()
            self._blocks[hash_id] = block
        return block
