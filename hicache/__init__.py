"""hicache: hierarchical KV-cache restore on the decode side of PD-disaggregated serving."""

from hicache import compiled as _compiled

__version__ = "0.1.0"

# The core and the simulator's loop run compiled when a build of these very sources exists
# (`hicache compile`); otherwise, or with HICACHE_PURE=1, as plain Python.
_compiled.install()
