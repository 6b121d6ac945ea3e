"""The parameter-server topology: workers push to and pull from sharded servers.

Split by side: ``worker`` (a package: ``PsGroup`` and the rest of a rank's side) and ``shards`` (a
package: the server processes and their shards). Both read ``plan`` (which shard owns which slice, in
pieces of what size), ``rows`` (sparse tables' rows: which shard holds a row, the wire's packing) and
``frames`` (every header either side sends, and the tags both name a frame by).
"""
