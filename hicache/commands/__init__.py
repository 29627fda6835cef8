"""The `hicache` command's parts, owned by `hicache/cli.py` (the CLI layer: only it and this
package import the drivers, and nothing imports them):

- `parser.py`: the types a command is described with, and the loop that makes argparse of them;
- `table.py`: every subcommand and its arguments, as data (the decode node's settings come from
  their descriptions in the core, through `hicache.runtime.cache_flags`);
- `sim_commands.py`: what `demo`, `sim ...` and `trace stats` do (the simulator);
- `runtime_commands.py`: what `node ...`, `run --runtime` and `serve` do (the runtime).
"""
