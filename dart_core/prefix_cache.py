"""The prefix cache: a conversation's KV rows kept across turns, exact by construction.

A generation that ends leaves in its KV cache the rows of every token it committed: the prompt's and
those of the output but its last token. `PrefixStore` keeps a copy of them (with the target's captured
hidden states for those tokens, which the draft heads read, and the first token's logits), and the next
generation whose prompt ids start with some of those tokens (the longest common prefix: a re-tokenised
answer may differ from the generated ids at the seam) copies the rows into its own cache and prefills
only the rest. Each generation gets its own copy (a fork), so methods compared on one prompt each
decode from the prompt's cache without touching the others'.

Exact by construction: reuse happens only where every row in the cache has the bits its one-token step
gives, which a fresh prefill of the whole prompt would write too (Target.prefill_exact: the CPU kernels
with `model.kernel_prefill`, or a prompt the kernels or the fixed-shape forward take in chunks of their
rows; and Target.exact_verify for the generated rows). Then the rows copied in are bit for bit the rows
a fresh prefill would compute, and greedy outputs are the same with and without reuse. Elsewhere (the
eager torch path, an eager prefill of a long prompt) `generate` neither reuses nor keeps anything.

The drafters' state is rebuilt from the prefix: the kept hidden states of the reused rows go to the
new draft session with the new rows' (DraftSession.extend), as a fresh prefill's would, so the draft
heads' caches and the context n-gram are what they would have been without reuse.

Entries are scoped: an entry is reused only for the same owner (the app: one browser session) and
the same target (its name, weights path, KV dtype and device). The store is bounded by bytes; the
least recently used entries go first; an entry larger than the bound is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch

from .model import KVCache

DEFAULT_PREFIX_CACHE_MB = 512  # the app's and the bench's bound when none is given


def target_key(target) -> tuple:
    """What an entry's rows depend on besides the tokens: the target and its weights path."""
    return (target.name, target.weights, str(target.cache_dtype), str(target.device))


def common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class PrefixEntry:
    """The rows of one generation's context: tokens, their keys and values (L, 1, nkv, n, hd), their
    captured hidden states (n, 3H) where the generation captured them, and the logits after the
    first prompt_len tokens (the prompt's: its first token's distribution)."""

    tokens: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor | None
    prompt_len: int
    prompt_logits: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.hidden, self.prompt_logits]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + 8 * len(self.tokens)


@dataclass(frozen=True)
class PrefixHit:
    """What a generation reuses: the first `tokens` rows of `entry`; with `logits`, the prompt is
    entirely in the entry and no prefill runs (the logits after it are the entry's)."""

    entry: PrefixEntry
    tokens: int
    logits: torch.Tensor | None

    def load(self, cache: KVCache) -> None:
        """Copy the reused rows into an empty cache (its own copy: the fork) and commit them."""
        n = self.tokens
        cache.check_room(n)
        cache.k[:, :, :, :n].copy_(self.entry.k[:, :, :, :n])
        cache.v[:, :, :, :n].copy_(self.entry.v[:, :, :, :n])
        cache.commit(n)

    def hidden(self) -> torch.Tensor | None:
        return None if self.entry.hidden is None else self.entry.hidden[: self.tokens]


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    refused: int = 0  # entries larger than the bound, not kept


class PrefixStore:
    """Entries by (owner, target), least recently used first out, at most `max_bytes` in all. Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_MB << 20):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[tuple, PrefixEntry]] = OrderedDict()  # id -> (scope, entry), oldest first
        self._next = 0
        self.bytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner: Hashable, target, ids: list[int], need_hidden: bool) -> PrefixHit | None:
        """The owner's entry sharing the longest prefix with `ids`, for this target. At least one prompt
        token is left to prefill unless the entry's prompt is `ids` itself (then its logits come too).
        None when no entry shares a token (or the drafter needs hidden states the entry lacks)."""
        scope = (owner, target_key(target))
        with self._lock:
            best, best_n, best_id = None, 0, None
            for i, (s, e) in self._entries.items():
                if s != scope or (need_hidden and e.hidden is None):
                    continue
                n = common_prefix(e.tokens, ids)
                if n > best_n:
                    best, best_n, best_id = e, n, i
            if best is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(best_id)
            whole = best.prompt_len == len(ids) and best_n >= len(ids) and best.prompt_logits is not None
            n = len(ids) if whole else min(best_n, len(ids) - 1)
            if n == 0:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.reused_tokens += n
            return PrefixHit(best, n, best.prompt_logits if whole else None)

    def put(
        self,
        owner: Hashable,
        target,
        tokens: list[int],
        cache: KVCache,
        hidden: torch.Tensor | None,
        prompt_len: int,
        prompt_logits: torch.Tensor | None,
    ) -> bool:
        """Keep a copy of the cache's committed rows (`tokens`, one a row) for the owner. An entry of
        the same scope whose tokens this one extends is dropped (this one serves all it served).
        Returns whether it was kept (False: larger than the bound, or already held)."""
        n = len(tokens)
        if n == 0 or cache.length != n or (hidden is not None and hidden.shape[0] != n):
            raise ValueError(
                f"{n} tokens against {cache.length} committed rows and {None if hidden is None else hidden.shape[0]} hidden rows"
            )
        scope = (owner, target_key(target))
        tokens = tuple(tokens)
        with self._lock:
            for i, (s, e) in list(self._entries.items()):
                if s != scope:
                    continue
                if len(e.tokens) >= n and e.tokens[:n] == tokens and (e.hidden is not None or hidden is None):
                    self._entries.move_to_end(i)  # already held
                    return False
        entry = PrefixEntry(
            tokens,
            cache.k[:, :, :, :n].clone(),
            cache.v[:, :, :, :n].clone(),
            None if hidden is None else hidden.clone(),
            prompt_len,
            None if prompt_logits is None else prompt_logits.clone(),
        )
        size = entry.nbytes
        with self._lock:
            if size > self.max_bytes:
                self.stats.refused += 1
                return False
            for i, (s, e) in list(self._entries.items()):
                if s == scope and len(e.tokens) <= n and tokens[: len(e.tokens)] == e.tokens:
                    self._remove(i)
            while self.bytes + size > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.stats.evicted += 1
            self._entries[self._next] = (scope, entry)
            self._next += 1
            self.bytes += size
            self.stats.stored += 1
            return True

    def drop(self, owner: Hashable) -> int:
        """Forget every entry of `owner` (the app's Clear, a closed session); returns how many."""
        with self._lock:
            gone = [i for i, (s, _) in self._entries.items() if s[0] == owner]
            for i in gone:
                self._remove(i)
            return len(gone)

    def owners(self) -> set:
        with self._lock:
            return {s[0] for s, _ in self._entries.values()}

    def _remove(self, i: int) -> None:
        _, e = self._entries.pop(i)
        self.bytes -= e.nbytes

    def report(self) -> str:
        """One line on what the store holds: entries, tokens, memory against the bound, hits."""
        with self._lock:
            tokens = sum(len(e.tokens) for _, e in self._entries.values())
            s = self.stats
            return (
                f"prefix cache: {len(self._entries)} entries, {tokens} tokens, {self.bytes / 2**20:.1f} of "
                f"{self.max_bytes / 2**20:.0f} MiB; {s.hits} hits ({s.reused_tokens} tokens reused), {s.misses} misses"
            )


@dataclass(frozen=True)
class PrefixScope:
    """What `generate` is given to reuse and keep prefixes: the store and whose entries these are."""

    store: PrefixStore
    owner: Hashable = None
