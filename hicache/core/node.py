"""One node of the tiered radix tree: a run of pages with the tiers that hold them."""

from __future__ import annotations


class TreeNode:
    """A run of consecutive pages identified by their chained page keys.

    `device` / `host` hold one slot per page in L1 / L2, or None when the tier does not hold
    the run. `host_op` names the backup still writing the node's host slots (0 once the copy is
    valid as a source): a backup's end validates only the slots it wrote itself, never those a
    newer backup writes after the older one's slots were given up. `lock_ref` protects the L1
    slots of this node (every lock covers the path from its node to the root); `host_ref`
    protects the L2 slots the same way.

    Keys and slots are tuples of ints: the garbage collector stops scanning a tuple of ints
    after its first collection, where it would walk every element of a list on every one.
    """

    __slots__ = (
        "id",
        "keys",
        "parent",
        "children",
        "device",
        "host",
        "host_op",
        "in_l3",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "dev_children",
        "ops",
        "evict_after_backup",
        "write_back_failed",
        "l1_ver",
        "l2_ver",
        "l1_queued",
        "l2_queued",
        "detached",
    )

    def __init__(self, node_id: int, keys: tuple[int, ...], parent: TreeNode | None, created: int) -> None:
        self.id = node_id
        self.keys = keys
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.device: tuple[int, ...] | None = None
        self.host: tuple[int, ...] | None = None
        self.host_op = 0
        self.in_l3 = False
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = 0.0
        self.created = created
        self.priority = 0
        self.dev_children = 0  # children that hold device slots: a device leaf has none
        # In-flight backup/store operations covering this node: a tuple, since a set is one
        # more object for the garbage collector to scan per node, and a node has few.
        self.ops: tuple[int, ...] = ()
        self.evict_after_backup = False
        # Its write-back backup failed: evicted again, it is dropped instead of backed up anew,
        # so L2 copies that keep failing cost misses, never an L1 that cannot be freed.
        self.write_back_failed = False
        self.l1_ver = 0  # bumped on every L1 eviction-heap push; stale heap entries are skipped
        self.l2_ver = 0
        self.l1_queued = False  # the entry of version l1_ver is in the L1 heap, not yet popped
        self.l2_queued = False
        self.detached = False  # cut from the tree (bad L2 copy) while a pin or an op still held it

    @property
    def host_pending(self) -> bool:
        """Whether the host slots are still being written (not yet a valid source)."""
        return self.host_op != 0

    def __repr__(self) -> str:
        tiers = "".join(t for t, on in (("D", self.device), ("H", self.host)) if on is not None)
        return f"TreeNode(#{self.id}, pages={len(self.keys)}, tiers={tiers or '-'}, lock={self.lock_ref})"
