"""Core: ids, clocks, errors, logging and atomic file I/O.  Imports nothing else of flotilla."""
