"""Core (rank 0): ids, clocks, events, errors, checks, dtypes, logging and atomic file I/O.
Imports nothing else of flotilla."""
