"""The KV data plane: Put and Get with raw chunk payloads over a plain or TLS 1.3 socket.

Why a second socket next to gRPC: gRPC Python copies every payload byte about three
times on the way in and out (bench_transfer measured 0.36-0.49x of iperf3 with every
channel option tried). Here a chunk is received straight into its own buffer with
``recv_into`` and sent from the caller's memory with ``sendmsg``: the kernel's copy is
the only one. Framing, kinds and message types are specified in
``contracts/kv_transfer.proto`` (section "Bulk data plane"); the rules (TTL, budget,
checksums, resume, errors, audit) are the same as over gRPC because every store action
runs in the gRPC service's own coroutines (:meth:`KVService.data_put`,
:meth:`KVService.data_get`) on the store's event loop. Sockets are blocking and each
lives in one thread (connection threads on the store, worker threads on the client):
``recv_into``, ``sendmsg``, TLS and xxHash all release the interpreter lock.

Modules: :mod:`.framing` (frames, connections, TLS on memory buffers, deadlines, receive
buffers), :mod:`.server` (the store's listener), :mod:`.handoff` (between a connection
thread and the event loop), :mod:`.client` (dialing, pooling, one Put or Get stream).
"""

__all__ = ["client", "framing", "handoff", "server"]
