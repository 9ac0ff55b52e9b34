"""Parameter server (SPEC §1, §2): pure planning (``sharding``, ``consistency``, ``wsp``) and the
runtime (``store``, ``snapshot``, ``server``, ``client``).  See ``docs/ps.md``."""
