"""Penalty statistics on the device: each penalised row's output-token counts and
prompt-token presence, [rows, V], built from token lists (`token_stats`) or kept from
step to step per request (`PenaltyCounts`)."""

from __future__ import annotations

import itertools

import torch

from batchgen.forward_context import to_device


class PenaltyCounts:
    """The penalised requests' output-token counts [slots, V] int32 and prompt-token
    presence [slots, V] bool, kept on the device from step to step, a slot a request.

    A request's slot is filled from its host token lists once (when first sampled, or
    when its count of recorded tokens is not its step: it was released and scheduled
    again); after that each step's sampled tokens are added on the device (`record`),
    so no [rows, V] tensor is rebuilt from Python lists and a pipelined step, whose last
    token is not on the host yet, reads counts that hold it. `release(ids)` frees the
    slots of requests that finished, were preempted or aborted. Slots grow by doubling.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._slot: dict[str, int] = {}
        self._recorded: dict[str, int] = {}  # tokens counted so far, per request
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slot)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._recorded.pop(rid)
                self._free.append(slot)

    def slots(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        outputs: list[list[int]],
        steps: list[int],
    ) -> list[int]:
        """Each request's slot; a request not held, or held at another step, is filled
        from its token lists, which must then hold every token it has generated."""
        out, fill = [], []
        for rid, prompt, output, step in zip(request_ids, prompts, outputs, steps):
            slot = self._slot.get(rid)
            if slot is None or self._recorded[rid] != step:
                if step != len(output):
                    raise RuntimeError(
                        f"request {rid}: penalty counts at {self._recorded.get(rid)} tokens, "
                        f"step {step}, but only {len(output)} tokens on the host"
                    )
                if slot is None:
                    slot = self._slot[rid] = self._take()
                self._recorded[rid] = step
                fill.append((slot, prompt, output))
            out.append(slot)
        if fill:
            self._fill(fill)
        return out

    def record(self, request_ids: list[str], slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add one sampled token [P] (on the device) to the requests' slots [P]."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.counts.index_put_((slots, token_ids), ones, accumulate=True)
        self.counted(request_ids)

    def counted(self, request_ids: list[str]) -> None:
        """Note that one more token of each request is in its counts (`record` does; a
        decode graph that adds its tokens on the device calls it alone)."""
        for rid in request_ids:
            if rid in self._recorded:
                self._recorded[rid] += 1

    def reserve(self, slots: int) -> None:
        """Hold at least ``slots`` slots now, the counts kept: a decode graph bakes in
        the counts' address, and growing by doubling as requests arrive would capture
        its graphs again at each growth."""
        have = self.counts.shape[0]
        if have < slots:
            self.counts = torch.cat(
                [self.counts, self.counts.new_zeros(slots - have, self.vocab_size)]
            )
            self.prompt = torch.cat(
                [self.prompt, self.prompt.new_zeros(slots - have, self.vocab_size)]
            )
            self._free = list(range(slots - 1, have - 1, -1)) + self._free

    def _take(self) -> int:
        if not self._free:
            have = self.counts.shape[0]
            grow = max(have, 8)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab_size)])
            self._free = list(range(have + grow - 1, have - 1, -1))
        return self._free.pop()

    def _fill(self, fill: list[tuple[int, list[int], list[int]]]) -> None:
        slots = [slot for slot, _, _ in fill]
        outs = [(slot, output) for slot, _, output in fill]
        prompts = [(slot, prompt) for slot, prompt, _ in fill]
        vocab = self.vocab_size
        out_idx, prompt_idx = _flat_index(outs, vocab), _flat_index(prompts, vocab)
        flat = to_device(torch.cat([torch.tensor(slots), out_idx, prompt_idx]), self.device)
        k, m = len(slots), out_idx.numel()
        self.counts.index_fill_(0, flat[:k], 0)
        self.prompt.index_fill_(0, flat[:k], False)
        out_flat, prompt_flat = flat[k : k + m], flat[k + m :]
        counts = self.counts.view(-1)
        counts.index_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.int32))
        self.prompt.view(-1).index_fill_(0, prompt_flat, True)


def token_stats(
    n: int,
    vocab_size: int,
    device: torch.device,
    outputs: list[tuple[int, list[int]]],
    prompts: list[tuple[int, list[int]]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-token counts [n, V] int32 and prompt-token mask [n, V] bool of the given
    (row, token ids) pairs. Only flat (row * V + token) indices cross to the device; the
    [n, V] tensors are filled there."""
    out_idx, prompt_idx = _flat_index(outputs, vocab_size), _flat_index(prompts, vocab_size)
    flat = to_device(torch.cat([out_idx, prompt_idx]), device)
    out_flat, prompt_flat = flat[: out_idx.numel()], flat[out_idx.numel() :]
    counts = torch.zeros(n * vocab_size, dtype=torch.int32, device=device)
    counts.index_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.int32))
    mask = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
    mask.index_fill_(0, prompt_flat, True)
    return counts.view(n, vocab_size), mask.view(n, vocab_size)


def _flat_index(pairs: list[tuple[int, list[int]]], vocab_size: int) -> torch.Tensor:
    tokens = torch.tensor(list(itertools.chain.from_iterable(t for _, t in pairs)))
    lengths = torch.tensor([len(t) for _, t in pairs], dtype=torch.int64)
    rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64)
    return torch.repeat_interleave(rows, lengths) * vocab_size + tokens.to(torch.int64)
