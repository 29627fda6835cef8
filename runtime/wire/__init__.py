"""What crosses a connection (`hicache.runtime.wire`): the control frames and their limits
(`protocol`), the profile two nodes must agree on at connect (`compat`), the `sampling` field of
a `generate` message with its one set of limits (`sampling_fields`), where a decode node finds
its prefill node (`prefill_address`) and a client of a decode node (`client`). It may import `kv`
and `model` (a profile names the layout and the model), never a node, storage, transfer,
security, tp or serving."""
