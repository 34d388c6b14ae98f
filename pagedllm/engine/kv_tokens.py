"""BlockTokens: which tokens each KV block holds, remembered for the /kv page's hover.

A block in use can be read from its holder's token ids, but a free block that still holds a cached prefix
has no holder left, and the pool keeps only its hash. So each snapshot records the tokens of the blocks the
requests hold, and a cached free block shows what was recorded while it had the hash it still has.

Recording is incremental, so that a snapshot of thousands of long requests stays cheap: per request, the
full blocks already recorded are skipped as long as its table still starts with them (copy-on-write or a
preemption changes the table and it is recorded afresh); only its new full blocks and its partial tail
block are read each time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.block_pool import Block
    from pagedllm.core.request import Request


class BlockTokens:
    """block id -> (its hash when recorded, its token ids). Engine thread only."""

    def __init__(self, blocks: list[Block], block_size: int):
        self._blocks = blocks
        self._bs = block_size
        self._tokens: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self._recorded: dict[str, list[int]] = {}  # request id -> its leading full blocks already recorded

    def update(self, requests: list[Request]) -> None:
        """Record what the requests' blocks hold now; forget the requests that are gone."""
        live = {}
        for request in requests:
            live[request.request_id] = self._record(request)
        self._recorded = live

    def _record(self, request: Request) -> list[int]:
        bs, table, computed = self._bs, request.block_ids, request.num_computed_tokens
        full = min(computed // bs, len(table))
        done = self._recorded.get(request.request_id, [])
        start = len(done) if len(done) <= full and table[: len(done)] == done else 0
        end = min(len(table), -(-computed // bs))  # the partial tail block too, if any token is in it
        if start < end:
            tokens = request.token_ids_slice(start * bs, computed)
            for i in range(start, end):
                block_id = table[i]
                if block_id >= 0:  # a negative entry was freed out of a sliding window
                    chunk = tuple(tokens[(i - start) * bs : (i - start + 1) * bs])
                    self._tokens[block_id] = (self._blocks[block_id].block_hash, chunk)
        return table[:full]

    def get(self, block_id: int, held: bool) -> list[int] | None:
        """The block's token ids: a held block's as last recorded, a free one's only while it keeps the
        hash it had then (else its contents are not what was recorded); None when unknown."""
        known = self._tokens.get(block_id)
        if known is None:
            return None
        block_hash = self._blocks[block_id].block_hash
        if held or (block_hash is not None and known[0] == block_hash):
            return list(known[1])
        return None
