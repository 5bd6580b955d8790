"""What a batch job is given (JobOptions) and what it reports (JobSummary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class JobOptions:
    input: Path
    output: Path
    model_name: str
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword defaults
    seed: int = 0  # with each line's custom_id and sample index, the seed of unseeded lines
    max_in_flight: int = 64  # engine requests (a line of n samples counts n)
    progress: bool = True
    sync_every_s: float = 2.0
    grace_s: float = 10.0  # after a first SIGINT/SIGTERM, for the running requests


@dataclass
class JobSummary:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0  # answered by an earlier run (success)
    failed_earlier: int = 0  # answered by an earlier run (error record)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    # the engine's preemptions over the job: swapped (host tier) or recomputed, and the
    # prompt tokens the host tier served; empty when nothing was preempted or loaded
    kv: dict[str, int] = field(default_factory=dict)
    # answered_earlier: what it found when no line was left to run, said plainly ("the
    # input is empty", "3 lines, none runnable: ..."); "" when every line had its answer
    note: str = ""

    def describe(self, errors_path: Path) -> str:
        rate = self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0
        failed = f"{self.failed} failed"
        if self.failed_earlier:
            failed += f" (+{self.failed_earlier} in earlier runs)"
        text = (
            f"{self.succeeded} succeeded, {failed}, {self.skipped} skipped as already done;"
            f" tokens in {self.prompt_tokens}, out {self.completion_tokens};"
            f" {self.wall_s:.1f} s, {rate:.1f} output tok/s"
        )
        if self.kv:
            text += (
                f"; KV: {self.kv['preemptions']} preemptions ({self.kv['swaps_out']} swapped "
                f"to host, {self.kv['recomputes']} recomputed), "
                f"{self.kv['host_prefix_hit_tokens']} prompt tokens loaded from host"
            )
        if self.failed or self.failed_earlier:
            text += f"; error records in {errors_path}"
        return text
