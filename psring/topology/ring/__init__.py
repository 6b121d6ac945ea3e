"""The ring topology: peer-to-peer links between the ranks.

``group`` (``RingGroup``) holds the rank's endpoint and one object per algorithm, made by ``parts``
(``RingParts``) from the group's ``context`` (``RingContext``: what a part sees of the group -- never the
group itself), and ``chooser`` (``Chooser``, ``Algorithm``) picks an all_reduce's algorithm in one place, the same on
every rank, from the thresholds ``paths`` keeps (which ``psring advise`` predicts from). The
algorithms: ``board`` (same-host shared-memory boards, from the loop or the caller's thread),
``streamed`` (large same-host calls through the boards' slots, in C), ``onehop`` (DIRECT and ROOTED
one-hop calls for small tensors; between hosts ``tcpdirect`` runs the DIRECT one on the caller's
thread over the TCP small-message links), ``twohop`` (medium calls between hosts in two hops over
the same links), ``pipeline`` (the pipelined ring on the event loop), ``plane`` (a package: large calls
on the threaded data plane), ``hier`` (two levels across hosts) and ``coded`` (a codec on the wire:
psring.core.codec). What they share: ``shortways`` (``ShortWays``: numbering a call off the loop and
closing its books), ``exchange`` (the small-message exchange every one-hop phase
goes through). ``net`` (``PeerNet``) is the rank's endpoint under them: the listening port, the
links, losses; ``smalllinks`` (``SmallLinks``) its links for small messages, same-host Unix or TCP;
``agree`` what its ranks agree at set-up; ``constants`` the phases and bounds they share; ``frames`` the
headers a rank sends over its connections.
``quorum`` (``Quorum``) is an elastic ring's membership: the survivors' rounds after a loss (a group of
them over the same endpoint) and new workers' admission (a ring re-formed with them).
"""
