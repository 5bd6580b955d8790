"""What linear-attention layers need of a step: each request's rows and state slot."""

from __future__ import annotations

import torch

from batchgen.forward_context import LinearAttentionMetadata, LinearSeq
from batchgen.layers.kda_ops import prepare_step
from batchgen.runner.input_batch import StepRow


def linear_metadata(requests: list[StepRow], device: torch.device | str) -> LinearAttentionMetadata:
    """Rows in scheduled order (as `ModelRunner.prepare` packs them); a request with
    tokens computed before this step (`start > 0`) continues from its slot, one without
    starts from a zeroed slot. Every request must carry a `state_slot`."""
    seqs, row = [], 0
    for req in requests:
        if req.state_slot is None:
            raise ValueError(f"request {req.request_id} has no state slot (model has KDA layers)")
        n = len(req.new_token_ids)
        seqs.append(LinearSeq(q_start=row, q_len=n, slot=req.state_slot, has_state=req.start > 0))
        row += n
    meta = LinearAttentionMetadata.build(seqs, device)
    prepare_step(meta)  # what the KDA kernels derive on the host, before any is queued
    return meta
