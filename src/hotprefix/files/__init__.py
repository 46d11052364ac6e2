"""Files on this machine: the one atomic write (``atomic``), the directory of derived,
rebuildable files (``cachedir``) and a model's remembered fingerprint (``fingerprint``). Standard
library only."""
