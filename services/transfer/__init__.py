"""KV transfer prefill -> decode over NIXL (docs/transfer.md). The only package importing nixl.

Modules (import what you need; this package __init__ deliberately imports nothing, so that the
pure modules stay free of torch and nixl):

- protocol     PROTOCOL_VERSION, MemoryLayout, AuxRow, KVNotification, errors (pure)
- descriptors  page-run coalescing into NIXL descriptors (pure)
- state        RoomState machine and RoomTable with time-in-state for watchdogs (pure)
- sender       KVSender: prefill side (no nixl import; drives a NixlAgent)
- receiver     KVReceiver: decode side (no nixl import; drives a NixlAgent)
- nixl_agent   NixlAgent: the process's one NIXL agent (imports nixl_cu12)
- poller       ProgressPoller: asyncio task polling NIXL only while work is in flight
- bootstrap    gRPC KVBootstrap servicer (prefill), client and KVReceiveCoordinator (decode)
"""
