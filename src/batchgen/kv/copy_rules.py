"""The copy-ordering rules of the host tier: the one numbered table.

Copies between device and host run on non-blocking copy streams, issued by a worker
thread or inline by the asking thread, while the compute stream keeps running. A
non-blocking stream is ordered behind no other stream, the default stream included, so
each rule below closes one way for a copy to race the computation. Rules 1-6 are the
design's copy-ordering contract (DESIGN.md); a lettered line is one way the code keeps
its rule. The code, docs/architecture.md and the static check cite these numbers: the
check (scripts/hygiene/copy_contract.py, a blocking rule of scripts/check_hygiene.py)
reports a finding as `copy-<line>`, e.g. `copy-3a`; lines marked "tests" are kept by
tests, not by the check.

1  Record the producer at call time, on the issuing thread: every copy goes through
   `CopyEngine.submit`, which records an event on `torch.cuda.current_stream()` right
   then (the default stream too: its handle 0 is a stream like any other).
   1a A copy body (kv/page_copies.py, named for its direction: device_to_host* or
      host_to_device*) runs only inside a closure that its caller hands to submit and
      uses nowhere else: `CopyLedger.store` / `.load` (kv/copy_ledger.py), the one
      executor of the copy records the tiers emit, on rank 0 and the workers. A gather (gather_*) reads device pages into staging on the
      calling stream and copies nothing itself; its staging reaches the host only
      through a submitted copy body.
   1b Nothing outside page_copies.py writes into a pool tensor (the device and host
      pools of pages and state slots, their views); the tier's own modules make no copy
      at all; a blocking read of a pool tensor (batchgen_debug's readback) comes after
      a synchronize.
   1c submit records the producer on every path, then queues the task with it.
2  Wait for it inside the copy task: the copy stream's first action is
   `wait_event(producer)`; only then does the copy body run.
   2a CopyEngine's worker (or the inline issue) waits on the task's producer,
      unconditionally, before it runs the body on that stream. Nothing in the package
      subclasses CopyEngine or replaces its methods (the unordered engine of the GPU
      regression tests lives under tests/).
   2b Work under `with torch.cuda.stream(S):` anywhere in the package is preceded by
      S.wait_event(...) or S.wait_stream(...); torch.cuda.set_stream is not used.
3  Consumers wait for completion.
   3a A load (of pages or of a state slot) waits on its copy stream for the whole of
      every store in flight that writes its host pages or slots: each store is recorded
      in its ledger's writing map under every host page or slot it writes
      (`CopyLedger.store` -> `record_store`), and a load's body first waits for the
      stores that map holds for its own host pages (`CopyLedger.load` -> `stores_of`).
   3b The forward waits for the step's copies (`StepCopies.wait_for`): all of them
      before a graph replay; in an eager forward each layer calls
      `ForwardContext.before_layer`, which waits for that layer's gate, before it reads
      its KV.
   3c A tensor-parallel worker's forward waits for the copies its `TierMirror` replays
      (the handles `issue` returns are the step's `wait_for`).
   3d (tests) A device page or slot a store reads is neither freed nor written before
      it is read: held by the copy until completion, or read on the compute stream at
      submission (a gather) before anything queued later can write it; a host page or
      slot is not reused before the store writing it and the loads reading it complete.
4  (tests) Memsets are producers: a pool re-created with torch.zeros after a
   re-configure is written on the compute stream, so the producer event of a later load
   orders the load behind the memset.
5  (tests) Tensors shared across streams stay alive until the copy completes: a handle
   keeps what its body returns (staging, indices) and its ledger entry holds the pages
   and slots it reads or writes, released only at completion (poll / drain), whatever
   fails in between.
6  No copy overlaps a CUDA-graph capture (a capture in global mode fails when another
   thread issues CUDA work).
   6a A capture runs only under the capture guard its class takes from its constructor,
      every construction passes a CopyEngine's `paused` there, and no task issues CUDA
      work while it is up.
"""
