"""Tensor parallelism's shared parts (`hicache.runtime.tp`): the process group of a
tensor-parallel decode node and the watchdog around its collectives (`tp_group`), the lockstep
rounds in which its ranks feed their cores the same events (`tp_rounds`: it reaches the decode
node only through the feed, table and step it is handed), and the slices of KV heads a prefill
node stages for each rank (`tp_kv`). The model's shard is `hicache.runtime.model.tp_model`. It
may import `kv`, `wire` and `transfer`, never a node or serving."""
