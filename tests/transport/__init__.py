"""Tests of psring/transport/: connections, shared memory, same-host links, faults on the wire."""
