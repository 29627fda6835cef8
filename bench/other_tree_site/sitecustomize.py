"""Imported at start-up when this folder is on PYTHONPATH (see bench/other_tree.py): points this
virtualenv's editable install of hicache at the checkout named by HICACHE_SRC.

The editable install maps `hicache`, `hicache.runtime`, `hicache.sim` and `hicache.scenarios` to
this checkout's folders. Putting another checkout on PYTHONPATH alone finds its `hicache/` but not
its `runtime/` (which is not under `hicache/`): the editable finder would then hand this
checkout's runtime to the other tree's CLI, and a "before" figure would measure a mix. Here each
mapped package is moved to the same folder name under HICACHE_SRC."""

import os
import sys

_src = os.environ.get("HICACHE_SRC")
if _src:
    for _name, _module in list(sys.modules.items()):
        if _name.startswith("__editable___hicache") and isinstance(getattr(_module, "MAPPING", None), dict):
            for _pkg, _path in list(_module.MAPPING.items()):
                _module.MAPPING[_pkg] = os.path.join(_src, os.path.basename(_path))
