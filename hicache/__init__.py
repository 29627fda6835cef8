"""hicache: hierarchical KV-cache restore on the decode side of PD-disaggregated serving."""

__version__ = "0.1.0"
