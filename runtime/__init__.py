"""The trio runtime driver (installed as `hicache.runtime`): real tensors, storage and transfers.

It never imports `hicache.sim`.
"""
