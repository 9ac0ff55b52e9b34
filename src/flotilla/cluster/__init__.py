"""Cluster (rank 2): one description of devices and links (``spec``) and the pure decisions about
membership: views, the rendezvous state machine, failure detection; plus speed emulation.

Everything here except ``emulation`` is pure: no I/O, no threads, a clock is passed in.
"""
