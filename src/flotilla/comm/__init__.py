"""Communication (rank 1): the only package that touches ``torch.distributed`` or ``zmq``.

The collective plane (per-epoch process groups and their store), the message plane (authenticated
msgpack + tensor frames over ZeroMQ, or in-process queues for tests), the wire codec and schemas.
"""
