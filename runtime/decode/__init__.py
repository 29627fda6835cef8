"""The decode node (`hicache.runtime.decode`): the trio service that runs the core and executes
its commands for real (`decode_node`, which composes the parts: `feed`, `live`, `clients`,
`prefill_link`, `transfers`, `restores`, `batch`, `status`), and the faults it injects into its
own operations with the page checks that catch them (`faults`, `injected`). Its tensor-parallel
ranks run in lockstep rounds (`hicache.runtime.tp.tp_rounds`). It may import `kv`, `model`,
`wire`, `security`, `storage`, `transfer` and `tp`; never `prefill` or `serving` (the two nodes
meet only over the wire).
"""
