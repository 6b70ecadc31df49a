"""Replica consistency checks: silent data corruption caught by comparing live replicas.

:mod:`.fingerprint` hashes a rank's state, :mod:`.vote` decides from the ranks' digests
who is the outlier (pure), :mod:`.check` runs it every N steps inside ``ElasticRun`` and
returns every replica to the last state they all agreed on, and :mod:`.inject` flips one
bit of a live worker's state so that users can rehearse it. See docs/reliability.md.
"""
