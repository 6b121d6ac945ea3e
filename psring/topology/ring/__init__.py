"""The ring topology: peer-to-peer links between the ranks.

``group`` (``RingGroup``) is assembled from its paths: ``board`` (small all_reduces through
same-host shared memory, from the loop or the caller's thread), ``tcpnow`` (small all_reduces
between hosts from the caller's thread, over the TCP small-message links), ``twohop`` (medium
all_reduces between hosts in two hops over the same links), ``small`` (one-hop exchanges for small
tensors), ``pipeline`` (the pipelined ring on the event loop), ``fp16`` (float16 on the wire),
``plane`` (large all_reduces on the threaded data plane, whose threads, links and schedule are
``dataplane``) and ``hier`` (two levels across hosts);
``paths`` decides which one a reduction takes. ``net`` (``PeerNet``) is the rank's endpoint under
them: the listening port, the links, losses; ``constants`` the phases and bounds they share;
``host`` writes down, for type checkers, what the path mixins need from RingGroup and each other.
"""
