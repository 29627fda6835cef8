"""The trio runtime driver (installed as `hicache.runtime`): real tensors, storage and transfers.

It never imports `hicache.sim`. Its packages, each importing only those listed before it that its
own docstring names: `kv` (pages in memory), `model` (the forward pass, checkpoints, tokenizers,
sampling), `wire` (control frames, the connect-time profile, the client), `security` (cluster
secret, peer and client authentication, limits), `storage` (L3 page stores), `transfer` (the
engines that move pages between nodes), `tp` (the tensor-parallel group and KV head slices),
`prefill` and `decode` (the two nodes, which never import each other) and `serving` (the HTTP
front door). The modules at this level wire them into processes and commands (`nodes`, `launch`,
`serve`, `runner`, `replay`, `verify`, `cache_flags`, `malloc_tuning`): they may import any
package, and no package imports them (`tests/test_layers.py` enforces both).
"""
