"""The user's commands that talk to a running job: ``elastic kill``, ``top``, ``sd``, ...

Each runs in its own short-lived process on an operator's machine; none of them is part of
a node agent.
"""
