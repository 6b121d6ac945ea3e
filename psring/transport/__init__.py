"""Layer 2: moving frames between processes.

- ``connection``: an authenticated, heartbeating asyncio connection that moves frames
  (its parts are objects of their own, each naming what it needs of the connection: ``framereader``
  the receive path, ``handshake``, ``heartbeat``, ``slots`` payloads in shared memory); ``local``: an
  in-process pair; ``tcpsocket``: its TCP socket's send buffer and the round trip the kernel measured.
- ``listener``: one listening port per process, dialing out, TLS.
- ``mailbox``: tag-matched delivery of frames to posted receives.
- ``shmpool``: shared-memory pools whose slots carry payloads between processes on one host.
- ``shmboard``: same-host posting boards in shared memory, polled, for the smallest messages.
- ``unixmesh``: same-host Unix seqpacket links for small messages; ``samehost``: who counts as same-host.
- ``tcpmesh``: TCP links of their own for small messages between hosts, readable from any thread.
- ``mesh``: what the two small-message meshes (``unixmesh``, ``tcpmesh``) share.
- ``loop``: event loops (uvloop) and a portal to run coroutines from other threads.
- ``traffic``: the bulk bytes this process's links receive (a heartbeat tolerates a control connection's
  silence longer while they move: on a thin link its packets wait behind the bulk).
"""
