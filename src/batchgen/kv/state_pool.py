"""The compressed-state pool of linear-attention (KDA) layers: slots, not pages.

A KDA layer keeps no per-token KV. Each running request owns one slot, the same index in
every KDA layer, holding that layer's

    recurrent state  [H, Dv, Dk]          float32 (rounding compounds over the recurrence;
                                          value-major, as layers/kda_ops.py holds it)
    conv window      [K - 1, conv_dim]    the last K - 1 inputs of the short convolution

The pool allocates both once, layer-major, so a slot is one block per layer:

    states   [L_kda, num_slots, H, Dv, Dk]          windows  [L_kda, num_slots, K - 1, C]
              ^ layer i's view: states[i]  (what ForwardContext.linear_states[i] holds)

`StateSlots` is the bookkeeping (no tensors; the scheduler's side): a slot is taken when
a request is admitted and released when it finishes, is aborted or is preempted. A new
request's slot is not wiped here: the layers zero `fresh_slots` on the compute stream at
the request's first step (LinearAttentionMetadata), so a released slot is reusable at once.

Host tier: `HostStatePool` (pinned, same slot geometry) holds the slots of swapped
requests; kv/state_tier.py moves them with the copy bodies of page_copies.py
(`device_to_host_state`, `host_to_device_state`), through `CopyEngine.submit`:
- swap-out (preemption): a request's slot -> a host slot; the device slot leaves the
  request at once (`detach`) but returns to the free list (`give_back`) only after the
  copy's completion event (contract rule 3).
- swap-in (resume): host slot -> a freshly taken device slot; the request's first step
  starts past token 0, so the layers do not zero it, and its forward waits on the load.
Planned, not built: checkpoints for prefix reuse (at page-aligned positions the slot is
copied to a host checkpoint keyed by the page hash of the prefix it summarises; a prefix
hit in a hybrid model would be usable only up to the longest hit whose checkpoint
exists). Until then hybrid models run with prefix caching off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kv.pinned import host_empty, pool_zeros


@dataclass(frozen=True)
class StateLayout:
    """Geometry of one slot: per KDA layer a [num_heads, head_k_dim, head_v_dim] float32
    state and a [conv_kernel - 1, conv_dim] window in `conv_dtype`."""

    num_layers: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dim: int
    conv_kernel: int
    conv_dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        state = self.num_heads * self.head_k_dim * self.head_v_dim * 4
        elem = torch.empty((), dtype=self.conv_dtype).element_size()
        window = (self.conv_kernel - 1) * self.conv_dim * elem
        return self.num_layers * (state + window)

    def states_shape(self, num_slots: int) -> tuple[int, ...]:
        return (self.num_layers, num_slots, self.num_heads, self.head_v_dim, self.head_k_dim)

    def windows_shape(self, num_slots: int) -> tuple[int, ...]:
        return (self.num_layers, num_slots, self.conv_kernel - 1, self.conv_dim)


class StatePool:
    """Owns the slot tensors on one device; layers get per-layer views through the
    ForwardContext (`layer_states()`, bound by the runner), never the pool itself."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        shape = layout.states_shape(num_slots)
        self.states = pool_zeros(shape, torch.float32, self.device)
        self.windows = pool_zeros(layout.windows_shape(num_slots), layout.conv_dtype, self.device)

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per KDA layer (states [slots, H, Dv, Dk], windows [slots, K - 1, C]), views."""
        return [(self.states[i], self.windows[i]) for i in range(self.layout.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.states, self.windows))


class HostStatePool:
    """Host slots with the device pool's slot geometry, pinned when `pin`: states
    [L, num_slots, H, Dv, Dk] float32 and windows [L, num_slots, K - 1, C], layer-major
    like HostPool (pinned.host_empty): a host slot is read only after a copy wrote it. Copies
    in and out are page_copies.device_to_host_state / host_to_device_state, run only
    inside closures handed to CopyEngine.submit."""

    def __init__(self, layout: StateLayout, num_slots: int, pin: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"the host state pool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        shape = layout.states_shape(num_slots)
        self.states = host_empty(shape, torch.float32, pin)
        self.windows = host_empty(layout.windows_shape(num_slots), layout.conv_dtype, pin)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.states, self.windows))


class StateSlots:
    """Which request holds which slot. take() at admission, release() at the end
    (finish, abort, preemption for recompute), detach() + give_back() around a swap-out's
    copy; a request holds at most one slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        return request_id in self._owner

    def slot(self, request_id: str) -> int:
        """The slot of a request that holds one (KeyError otherwise)."""
        return self._owner[request_id]

    def take(self, request_id: str) -> int:
        """A free slot for the request; RuntimeError when none is free or it holds one."""
        if request_id in self._owner:
            raise RuntimeError(
                f"request {request_id} already holds state slot {self._owner[request_id]}"
            )
        if not self._free:
            raise RuntimeError("no free state slot (admission must check num_free)")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Give the request's slot back, if it holds one."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def detach(self, request_id: str) -> int:
        """Take the request's slot from it without freeing it: a swap-out's copy still
        reads it. Whoever detaches gives it back (`give_back`) once the copy is done."""
        return self._owner.pop(request_id)

    def give_back(self, slot: int) -> None:
        """A detached slot is free again."""
        if slot in self._free or slot in self._owner.values():
            raise RuntimeError(f"state slot {slot} given back while free or owned")
        self._free.append(slot)
