"""The node agent: the long-lived process on each node that joins rounds and runs workers.

Everything here runs in the ``elastic agent`` process (or a helper process it owns, such
as the fork template's server side). Nothing here runs inside a training worker.
"""
