"""In-place recovery: survivors keep their processes and their state in memory.

When a peer is lost or a node joins, an ``ElasticRun`` worker is not restarted. Its agent
takes part in the new rendezvous round and hands the round over (:mod:`.channel`); the
worker reconfigures its process group to the new members (:mod:`.reconfigure`, over a
per-round store, :mod:`.round_store`), agrees with the others on the step to go on from
(:mod:`.agreement`) and heals any rank that stands elsewhere from one that holds it
(:mod:`.transfer`). :mod:`.membership` follows the agent's rounds;
:mod:`.in_place_world` ties these together as the trainer's world (:mod:`elastic.world`).

Only :mod:`.channel` and :mod:`.agreement` are free of torch: the agent imports them.
"""
