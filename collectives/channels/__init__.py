"""How bytes move between ranks: channels, one module each.

A channel is set up once per communicator (collectively; ``create(comm)``
returns None where it cannot work) and runs the schedules whose shape it
serves (:mod:`collectives.schedule`):

* :mod:`~collectives.channels.shm_pair`: two ranks on one node, rounds of
  one exchange with the peer, through a shared window;
* :mod:`~collectives.channels.shm_group`: three or more ranks on one node,
  ring-shaped rounds, through a node-wide shared window;
* :mod:`~collectives.channels.p2p`: MPI point-to-point messages, any schedule.

A plan runs its schedule over the first channel of :data:`KINDS` that the
communicator has and that serves the schedule. A channel provides:

* ``name`` and ``host_only`` (its plans need host memory: device buffers
  are staged), ``sleep`` (waiting ranks sleep rather than spin);
* ``serves(schedule) -> bool`` and ``plan(ctx, schedule_of) -> bind``, where
  ``schedule_of(n)`` is the algorithm's schedule for ``n`` elements (a
  channel may run the schedule segment by segment) and ``bind(view) ->
  run`` binds the plan to a buffer;
* ``blind_calls`` (this rank's blind-call words in shared memory, or None)
  and ``peer_blind(peer)`` (a peer's, read with plain loads, or None), see
  :mod:`collectives.core.consistency`;
* ``free()`` (collective).

Adding a channel means a module here and an entry in :data:`KINDS`; no
algorithm changes.
"""
from __future__ import annotations

from collectives.channels.p2p import PointToPoint
from collectives.channels.shm_group import SharedGroup
from collectives.channels.shm_pair import SharedPair

#: Channel kinds in order of preference (the last serves every schedule).
KINDS = (SharedPair, SharedGroup, PointToPoint)

__all__ = ["KINDS", "PointToPoint", "SharedGroup", "SharedPair"]
