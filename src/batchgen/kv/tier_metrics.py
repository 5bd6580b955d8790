"""Counters of the host tier's traffic, by why it moved."""

from __future__ import annotations

from dataclasses import dataclass, field

# TierMetrics reasons by direction
_OFFLOADS = ("write_through", "write_back", "swap_out", "decode_append", "state_swap_out")
_LOADS = ("swap_in", "prefix_load", "state_swap_in")


@dataclass
class TierMetrics:
    pages_offloaded: int = 0
    pages_loaded: int = 0
    copy_seconds: float = 0.0
    appends: int = 0
    host_prefix_hit_pages: int = 0
    host_prefix_query_pages: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    state_swaps_out: int = 0  # compressed-state slots stored (kv/state_tier.py)
    state_swaps_in: int = 0
    recomputes: int = 0
    readback_checks: int = 0
    # page transfers submitted (stores and loads) and their runs of consecutive host
    # pages: a run crosses as one block a layer, and issuing each block costs the issuing
    # thread a few microseconds
    transfers: int = 0
    host_runs: int = 0
    # bytes and copy-stream seconds by why they moved: write_through (full pages as they
    # fill, decode_append="batched"), decode_append (per layer, decode_append="layer"),
    # write_back (an evicted page others still want), swap_out (an evicted page of a
    # swapped request, or any page of a swapped request with a compressed state), swap_in
    # and prefix_load (loads), state_swap_out and state_swap_in (compressed-state slots)
    bytes_by_reason: dict[str, int] = field(default_factory=dict)
    seconds_by_reason: dict[str, float] = field(default_factory=dict)

    def count(self, reason: str, nbytes: int) -> None:
        self.bytes_by_reason[reason] = self.bytes_by_reason.get(reason, 0) + nbytes

    @property
    def bytes_offloaded(self) -> int:
        """Device -> host bytes: stores and decode appends."""
        return sum(self.bytes_by_reason.get(r, 0) for r in _OFFLOADS)

    @property
    def bytes_loaded(self) -> int:
        """Host -> device bytes."""
        return sum(self.bytes_by_reason.get(r, 0) for r in _LOADS)

    @property
    def gb_per_s(self) -> float:
        moved = self.bytes_offloaded + self.bytes_loaded
        return moved / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def host_prefix_hit_rate(self) -> float:
        q = self.host_prefix_query_pages
        return self.host_prefix_hit_pages / q if q else 0.0

    def summary(self) -> dict:
        """The counters engine.metrics() reports, traffic by reason as bytes_<reason> and
        copy_seconds_<reason>."""
        out = dict(
            swaps_out=self.swaps_out,
            swaps_in=self.swaps_in,
            state_swaps_out=self.state_swaps_out,
            state_swaps_in=self.state_swaps_in,
            pages_offloaded=self.pages_offloaded,
            pages_loaded=self.pages_loaded,
            bytes_offloaded=self.bytes_offloaded,
            bytes_loaded=self.bytes_loaded,
            copy_gb_per_s=self.gb_per_s,
            host_prefix_hit_pages=self.host_prefix_hit_pages,
            host_prefix_hit_rate=self.host_prefix_hit_rate,
            readback_checks=self.readback_checks,
            tier_transfers=self.transfers,
            host_runs=self.host_runs,
        )
        for reason, nbytes in self.bytes_by_reason.items():
            out[f"bytes_{reason}"] = nbytes
            out[f"copy_seconds_{reason}"] = self.seconds_by_reason.get(reason, 0.0)
        return out
