"""Files on this machine: the one atomic write (``atomic``) and the directory of derived,
rebuildable files (``cachedir``). Standard library only."""
