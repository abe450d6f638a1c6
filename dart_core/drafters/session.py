"""What a head drafter's session (DART's, EAGLE3's) shares: the head cache it leased from its drafter's
SpareCache, handed back when the generation is over, and the committed tokens with the target's hidden
states, pending until the head's next forward reads them."""

from __future__ import annotations

import torch


class HeadSession:
    needs = "a head"  # who needs the hidden states, as the error says it ("DART", "EAGLE3")

    def __init__(self, drafter):
        self.d = drafter
        self.cache = None  # the subclass leases it (drafter.spare.lease) with its captured forwards
        self._closed = False
        self.pending_ids: list[int] = []
        self.pending_aux: list[torch.Tensor] = []

    def close(self) -> None:
        """The generation is over: the head cache (and the forwards captured on it) to the drafter's next session."""
        if not self._closed:
            self._closed = True
            self.d.spare.give(self.cache)

    def extend(self, ids: list[int], hidden: torch.Tensor | None) -> None:
        """The tokens just committed and the target's hidden states at them, for the head's next forward."""
        if hidden is None or hidden.shape[0] != len(ids):
            raise ValueError(f"{self.needs} needs the target's captured hidden states for every committed token")
        self.pending_ids += ids
        self.pending_aux.append(hidden.to(self.d.head.fc.weight.dtype))
