"""Tensor parallelism's shared parts (`hicache.runtime.tp`): the process group of a
tensor-parallel decode node and the watchdog around its collectives (`tp_group`), and the slices
of KV heads a prefill node stages for each rank (`tp_kv`). The model's shard is
`hicache.runtime.model.tp_model`; the decode node's lockstep rounds are
`hicache.runtime.decode.tp_rounds`. It may import `kv`, `wire` and `transfer`, never a node or
serving."""
