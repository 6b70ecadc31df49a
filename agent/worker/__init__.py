"""Code the agent ships into its worker processes: it runs there, before the user's script.

``worker_boot`` is the first code of every worker; ``fork_template`` and ``warm_worker`` are
the pre-imported processes warm workers come from. They import only what a worker may.
"""
