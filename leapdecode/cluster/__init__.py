"""Serving beyond one engine: engine instances on Ray, a proxy in front of them (replicas with a prefix-aware
router, or prefill/decode disaggregation with KV transfer), and the simulator and planner that size them.

Nothing is imported here, so a module of this package pulls in only what it needs (Ray only where it is used).
"""
