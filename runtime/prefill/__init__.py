"""The prefill node (`hicache.runtime.prefill`): the service that computes a prompt's KV and
writes the pages a decode node asks for into that node's L1 (`prefill_node`), and its own tiered
cache over L1, L2 and the shared L3 (`prefill_cache`). It may import `kv`, `model`, `wire`,
`security`, `storage`, `transfer` and `tp`; never `decode` or `serving` (the two nodes meet only
over the wire)."""
