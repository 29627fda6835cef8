"""The decode node (`hicache.runtime.decode`): the trio service that runs the core and executes
its commands for real (`decode_node`), the lockstep rounds of its tensor-parallel ranks
(`tp_rounds`), and the faults it injects into its own operations with the page checks that catch
them (`faults`). It may import `kv`, `model`, `wire`, `security`, `storage`, `transfer` and `tp`;
never `prefill` or `serving` (the two nodes meet only over the wire)."""
