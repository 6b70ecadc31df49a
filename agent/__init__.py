"""Everything outside the training processes, one folder per process.

- ``node/``: the node agent (``elastic agent``), one long-lived process per node.
- ``worker/``: code the agent ships into its workers; it runs there before the script.
- ``rendezvous/``, ``etcd/``: the agent's side of the etcd rendezvous (torchrun's handler).
- ``tools/``: the operator's commands (``elastic kill``, ``top``, ``sd``, ``etcd``, ...).
- ``local/``: ``elastic local``, a whole cluster on one machine.
- ``cli.py``: the ``elastic`` command, which dispatches to all of the above.
"""

from elastic import old_paths

old_paths.install()  # ``agent.node_agent`` & co. from before 0.1.0's folder split
